"""The documentation stays true: every relative link and anchor resolves, every preset, recipe, make target,
script path and module a page names exists, and every `main_ppo` command line a page shows composes with verl's
config as verl's CLI would compose it (the qurl search path included)."""
from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path

import pytest

from qurl_recipes import recipes_check as rc

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"), BENCH / "README.md", BENCH / "gpu" / "README.md",
                ROOT / "tests" / "README.md"])
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)
INLINE_CODE = re.compile(r"`([^`\n]+)`")
MAKE = re.compile(r"(?:^|[\s;&|(])make\s+([a-z][\w-]*)")
SCRIPT = re.compile(r"(?<![\w./<>*$-])([\w.-][\w./-]*/[\w.-]+\.(?:py|sh))\b")
MODULE = re.compile(r"python3? -m ((?:qurl_verl|qurl_recipes|verl)[\w.]*)")
PRESET = re.compile(r"\+qurl=([\w,]+)")
RECIPE = re.compile(r"\+qurl_recipe=(\w+)")
PRESET_ENV = re.compile(r"\bPRESET=(\w+)")
MAIN_PPO = "verl.trainer.main_ppo"


def rel(page: Path) -> str:
    return str(page.relative_to(ROOT))


def prose(text: str) -> str:
    """The page without its fenced blocks (a link or heading inside one is an example, not a link)."""
    return FENCE.sub("", text)


def code(text: str) -> str:
    """What a page shows as code: its fenced blocks and inline spans, one per line."""
    return "\n".join(FENCE.findall(text) + INLINE_CODE.findall(prose(text)))


def anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every anchor of a page; a repeated heading gets `-1`, `-2`, ... as on GitHub."""
    found, counts = set(), {}
    for heading in HEADING.findall(prose(page.read_text())):
        slug = anchor(heading)
        counts[slug] = counts.get(slug, 0) + 1
        found.add(slug if counts[slug] == 1 else f"{slug}-{counts[slug] - 1}")
    return found


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in LINK.findall(prose(page.read_text())):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{rel(page)}: {target} (no such file)")
        elif fragment and (resolved.suffix != ".md" or fragment not in anchors(resolved)):
            broken.append(f"{rel(page)}: {target} (no such heading)")
    return broken


def make_targets() -> set[str]:
    return set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))


def script_exists(page: Path, path: str) -> bool:
    """A path relative to the page, to the repository, or, for `verl/...`, to the installed verl."""
    candidates = [page.parent / path, ROOT / path]
    if path.startswith("verl/"):
        verl_spec = importlib.util.find_spec("verl")
        candidates.append(Path(verl_spec.origin).parents[1] / path)
    return any(c.exists() for c in candidates)


def main_ppo_commands(page: Path) -> list[list[str]]:
    """The overrides of every `main_ppo` command line in a page's fenced blocks (continuation lines joined,
    comments, options and placeholders such as `<your usual overrides>` left out)."""
    commands = []
    for block in FENCE.findall(page.read_text()):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.split(r"\s#", line, maxsplit=1)[0]
            if MAIN_PPO not in line:
                continue
            words = shlex.split(line.split(MAIN_PPO, 1)[1])
            if "-m" in words or "--multirun" in words:  # a sweep composes one config per job
                continue
            commands.append([w for w in words if "=" in w and not w.startswith("-") and not re.search(r"[<$]", w)])
    return commands


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_every_relative_link_and_anchor_resolves(page):
    assert broken_links(page) == []


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_every_preset_recipe_make_target_script_and_module_named_exists(page):
    text = page.read_text()
    shown = code(text)
    presets, recipes, targets = set(rc.available_presets()), set(rc.available_recipes()), make_targets()
    missing = [f"+qurl={p}" for group in PRESET.findall(text) for p in group.split(",") if p not in presets]
    missing += [f"+qurl_recipe={r}" for r in RECIPE.findall(text) if r not in recipes]
    missing += [f"PRESET={p}" for p in PRESET_ENV.findall(shown) if p not in presets | {"none"}]
    missing += [f"make {t}" for t in MAKE.findall(shown) if t not in targets]
    missing += [p for p in SCRIPT.findall(shown) if not script_exists(page, p.split(":")[0])]
    missing += [f"python -m {m}" for m in MODULE.findall(shown) if importlib.util.find_spec(m) is None]
    assert missing == []


def test_the_readme_presets_table_lists_the_shipped_presets():
    section = (ROOT / "README.md").read_text().split("\n## Presets\n", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `")][1:]  # after the header
    assert sorted(n for row in rows for n in INLINE_CODE.findall(row)) == rc.available_presets()


def test_the_readme_opens_with_the_two_commands_ci_runs():
    """The first block of the README is `make demo` and `make test`; `.ci/run` runs that same `make test`."""
    first_block = FENCE.search((ROOT / "README.md").read_text()).group(1)
    assert [line.split("#")[0].strip() for line in first_block.splitlines()] == ["make demo", "make test"]
    assert "make test" in [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert {"demo", "test"} <= make_targets()


def test_every_main_ppo_command_shown_composes_with_verl_config():
    """Composed in one process, as `main_ppo` composes: verl's `ppo_trainer` with the qurl search path."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from qurl_recipes.compose import compose_ppo_config

    commands = [(rel(page), c) for page in PAGES for c in main_ppo_commands(page)]
    assert len(commands) >= 5, commands  # the command blocks were found and read
    failed = []
    for page, overrides in commands:
        try:
            compose_ppo_config(overrides)
        except (HydraException, OmegaConfBaseException) as error:
            failed.append(f"{page}: {' '.join(overrides)}: {type(error).__name__}: {str(error)[:200]}")
    assert failed == []


def test_every_bench_script_is_listed_in_the_bench_readme():
    """Each script and module of bench/ and bench/gpu/ is named in bench/README.md (the question table for
    what one runs, the modules table for the parts), as its path from bench/."""
    text = (BENCH / "README.md").read_text()
    named = set(INLINE_CODE.findall(text))
    scripts = [p for p in [*BENCH.glob("*.py"), *BENCH.glob("*.sh"), *(BENCH / "gpu").glob("*.py")]]
    assert len(scripts) > 30
    assert [rel(p) for p in scripts if str(p.relative_to(BENCH)) not in named] == []


def test_every_script_the_bench_questions_name_exists():
    section = (BENCH / "README.md").read_text().split("\n## Questions\n", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|") for line in section.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert len(rows) >= 8
    scripts = [s for row in rows for s in INLINE_CODE.findall(row[2]) if s.endswith((".py", ".sh"))]
    assert scripts and [s for s in scripts if not (BENCH / s.split()[0]).exists()] == []
