"""The rewards the shipped recipes name are in the wheel: built from a copy of the packaging files, unzipped
into a folder, and loaded the way verl's reward worker loads them (`load_extern_object("pkg://...")`), from
another directory and with no repository on `sys.path`. The same wheel, built with the `setup.py` shim beside
`pyproject.toml`, carries pyproject's metadata and nothing else."""
from __future__ import annotations

import email
import json
import re
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

import qurl_verl

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
RECIPE_CONFIGS = ROOT / "qurl_verl" / "hydra_configs" / "qurl_recipe"
PKG = re.compile(r"pkg://([A-Za-z0-9_.]+)")
# one response per reward module, with the score it must get: (data_source, response, ground truth, score)
EXAMPLES = {
    "qurl_verl.recipe_rewards.arithmetic": ("arithmetic", "The answer is 12", "12", 1.0),
    "qurl_verl.recipe_rewards.chain_arithmetic": ("chain_arithmetic", "3*4 = 12\nAnswer: 12", "12", 1.0),
    "qurl_verl.recipe_rewards.boxed_math": ("deepscaler_math500", "<think>\nhalf\n</think>\n$\\boxed{0.5}$", "\\frac{1}{2}", 1.0),
}
PACKAGING = ("setup.py", "pyproject.toml", "setup.cfg", "MANIFEST.in", "README.md", "LICENSE")


def named_reward_modules() -> set[str]:
    """Every `pkg://` module a shipped recipe config, tiny_cpu's run.sh (per TASK) or a recipe's data names."""
    from qurl_recipes.data.math_datasets import RECIPES

    found = {m for f in RECIPE_CONFIGS.glob("*.yaml") for m in PKG.findall(f.read_text())}
    run_sh = (ROOT / "recipes" / "tiny_cpu" / "run.sh").read_text()
    tasks = re.search(r'case "\$task" in(.*?)esac', run_sh, re.S).group(1)
    prefix = PKG.search(run_sh).group(1)  # pkg://qurl_verl.recipe_rewards.$task
    found |= {prefix + task for task in re.findall(r"^\s*(\w+)\)", tasks, re.M)}
    found |= {PKG.fullmatch(r.reward_function).group(1) for r in RECIPES.values() if r.reward_function}
    return found


def test_every_named_reward_has_an_example():
    assert named_reward_modules() == set(EXAMPLES)
    assert all(m.startswith("qurl_verl.") for m in EXAMPLES)  # the installed package, not the repository


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The wheel of a copy of the repository's packaging files, unzipped: what `pip install` puts in site-packages."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in PACKAGING:
        if (ROOT / name).is_file():
            shutil.copy2(ROOT / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for package in ("qurl_verl", "hydra_plugins"):
        shutil.copytree(ROOT / package, src / package, ignore=ignore)
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                        str(tmp / "dist"), str(src)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    (wheel,) = (tmp / "dist").glob("qurl_verl-*.whl")
    site = tmp / "site"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    return site


def test_recipe_rewards_load_from_the_installed_package_only(installed, tmp_path):
    # the shipped configs, as the wheel holds them, name exactly the modules checked here
    wheel_configs = installed / "qurl_verl" / "hydra_configs" / "qurl_recipe"
    assert sorted(f.name for f in wheel_configs.glob("*.yaml")) == sorted(f.name for f in RECIPE_CONFIGS.glob("*.yaml"))
    in_wheel = {m for f in wheel_configs.glob("*.yaml") for m in PKG.findall(f.read_text())}
    assert in_wheel <= set(EXAMPLES)
    code = textwrap.dedent("""
        import importlib.util, json, sys
        from pathlib import Path

        site = Path(sys.argv[1]).resolve()
        # no repository on the path: the venv's editable install and any checkout are dropped
        sys.path[:] = [p for p in sys.path if not (Path(p or ".").resolve() / "qurl_recipes").exists()]
        assert importlib.util.find_spec("qurl_recipes") is None, "the repository is still importable"
        from verl.utils.import_utils import load_extern_object

        out = {}
        for module, (source, response, truth, _) in json.loads(sys.argv[2]).items():
            fn = load_extern_object(module_path=f"pkg://{module}", object_name="compute_score")
            mod = sys.modules[module]
            assert Path(mod.__file__).resolve().is_relative_to(site), mod.__file__
            out[module] = fn(source, response, truth, None)["score"]
        assert "qurl_recipes" not in sys.modules
        print("SCORES", json.dumps(out))
    """)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(installed), "HOME": str(tmp_path)}
    p = subprocess.run([sys.executable, "-c", code, str(installed), json.dumps(EXAMPLES)], cwd=elsewhere, env=env,
                       capture_output=True, text=True, timeout=300)
    line = next((x for x in p.stdout.splitlines() if x.startswith("SCORES ")), None)
    assert line is not None, p.stderr[-3000:]
    assert json.loads(line[7:]) == {m: ex[3] for m, ex in EXAMPLES.items()}


def test_the_wheel_built_beside_the_setup_py_shim_has_pyproject_metadata(installed):
    """`setup.py` only calls `setup()`: the wheel's name, version, requirements, extras and entry point are
    pyproject.toml's [project] table, so the two files cannot disagree."""
    assert (ROOT / "setup.py").is_file() and "setup.py" in PACKAGING  # the wheel above was built with it
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (info,) = installed.glob("qurl_verl-*.dist-info")
    meta = email.message_from_string((info / "METADATA").read_text())
    assert (meta["Name"], meta["Version"]) == (project["name"], qurl_verl.__version__)
    assert (meta["Summary"], meta["Requires-Python"]) == (project["description"], project["requires-python"])
    assert meta["License-Expression"] == project["license"]
    extras = project["optional-dependencies"]
    assert sorted(meta.get_all("Provides-Extra")) == sorted(extras)
    expected = set(project["dependencies"]) | {f'{r}; extra == "{e}"' for e, rs in extras.items() for r in rs}
    assert {str(Requirement(r)) for r in meta.get_all("Requires-Dist")} == {str(Requirement(r)) for r in expected}
    entry_points = (info / "entry_points.txt").read_text()
    assert "[verl.plugins]\nqurl = qurl_verl._verl_plugin" in entry_points
