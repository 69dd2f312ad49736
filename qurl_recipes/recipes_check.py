"""Check the GPU recipes on any machine: compose each recipe's `main_ppo` config and run the driver's checks.

    python -m qurl_recipes.recipes_check                              # every recipe x every preset
    python -m qurl_recipes.recipes_check --recipe dapo_32b --preset fp8
    python -m qurl_recipes.recipes_check --overrides -- <Hydra overrides>   # what `run.sh --dry-run` runs

For each recipe and preset, the overrides come from the recipe's own `run.sh` (its
`--print-overrides` mode), so what is checked is what would run. The config is composed from
verl's `ppo_trainer` as `main_ppo` composes it, then goes through what `main_ppo`'s driver runs
before Ray starts: verl's `validate_config` with qurl-verl's checks first. `QURL_DRY_RUN=1` is set
meanwhile: a hub model id is accepted without being fetched and the UAQ conversion only says what
it would do. The data files named in the config must exist.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import subprocess
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

from omegaconf import DictConfig, ListConfig, OmegaConf

from qurl_verl.settings import DRY_RUN_ENV

REPO = Path(__file__).resolve().parents[1]
STOCK_ROLLOUT = "none"  # PRESET=none: verl's own vLLM rollout, no qurl preset


class RecipeCheckError(ValueError):
    """A recipe that would not start; the message says what to change."""


@dataclass(frozen=True)
class Recipe:
    name: str
    script: str  # relative to the repository root
    data: str  # qurl_recipes.data.math_datasets recipe that writes its parquet files
    env: dict[str, str] = field(default_factory=dict)


RECIPES: dict[str, Recipe] = {
    "deepscaler": Recipe("deepscaler", "recipes/deepscaler/run.sh", "deepscaler"),
    "dapo": Recipe("dapo", "recipes/dapo/run.sh", "dapo", {"SIZE": "7b"}),
    "dapo_32b": Recipe("dapo_32b", "recipes/dapo/run.sh", "dapo", {"SIZE": "32b"}),
}


def available_presets() -> list[str]:
    """The `+qurl=<name>` presets shipped in qurl_verl.hydra_configs (files starting with `_` are shared parts)."""
    from importlib.resources import files

    folder = files("qurl_verl.hydra_configs") / "qurl"
    return sorted(p.name[: -len(".yaml")] for p in folder.iterdir() if p.name.endswith(".yaml") and not p.name.startswith("_"))


def check_preset(preset: str) -> None:
    if preset != STOCK_ROLLOUT and preset not in available_presets():
        raise RecipeCheckError(
            f"unknown preset {preset!r}; choose one of {', '.join(available_presets())}, "
            f"or {STOCK_ROLLOUT} (verl's stock vLLM rollout)"
        )


def recipe_overrides(recipe: str, preset: str, data_dir: str | Path | None = None,
                     extra: Sequence[str] = (), env: dict[str, str] | None = None) -> list[str]:
    """The Hydra overrides `recipes/<recipe>/run.sh` passes to main_ppo for this preset."""
    if recipe not in RECIPES:
        raise RecipeCheckError(f"unknown recipe {recipe!r}; choose one of {', '.join(RECIPES)}")
    check_preset(preset)
    spec = RECIPES[recipe]
    script = REPO / spec.script
    if not script.is_file():
        raise RecipeCheckError(f"{script} is missing: the recipes live in the qurl-verl repository, not in the installed package")
    run_env = {**os.environ, **spec.env, **(env or {}), "PRESET": preset}
    if data_dir is not None:
        run_env["DATA_DIR"] = str(data_dir)
    p = subprocess.run(["bash", str(script), "--print-overrides", *extra], env=run_env, capture_output=True, timeout=60)
    if p.returncode != 0:
        raise RecipeCheckError(p.stderr.decode().strip() or f"{script} --print-overrides failed with exit code {p.returncode}")
    return [a for a in p.stdout.decode().split("\0") if a]


@contextlib.contextmanager
def dry_run_env() -> Iterator[None]:
    old = os.environ.get(DRY_RUN_ENV)
    os.environ[DRY_RUN_ENV] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(DRY_RUN_ENV, None)
        else:
            os.environ[DRY_RUN_ENV] = old


def check_data_files(cfg: DictConfig) -> None:
    for key in ("data.train_files", "data.val_files"):
        value = OmegaConf.select(cfg, key)
        paths = list(value) if isinstance(value, (ListConfig, list, tuple)) else [value]
        for path in paths:
            if path is None or not Path(os.path.expanduser(str(path))).is_file():
                raise RecipeCheckError(
                    f"{key}={path}: no such file. The recipes write their data before starting "
                    "(`python -m qurl_recipes.data.math_datasets --recipe deepscaler|dapo --out <dir>`); "
                    "point DATA_DIR or the override at that folder."
                )


def _preset_of(overrides: Sequence[str]) -> str | None:
    for o in overrides:
        if o.startswith("+qurl="):
            return o.split("=", 1)[1]
    return None


def check_overrides(overrides: Sequence[str]) -> DictConfig:
    """Compose main_ppo's config from `overrides` and run its driver-side checks in dry-run mode."""
    from qurl_recipes.compose import compose_ppo_config, validate_like_main_ppo

    preset = _preset_of(overrides)
    if preset is not None:
        check_preset(preset)
    with dry_run_env(), warnings.catch_warnings():
        # expected for GRPO/DAPO (no critic); verl warns about it on every validation
        warnings.filterwarnings("ignore", message="Disabled critic as algorithm.adv_estimator")
        cfg = compose_ppo_config(overrides)
        check_data_files(cfg)
        validate_like_main_ppo(cfg)
    return cfg


def describe(cfg: DictConfig) -> str:
    """One line: what the checked config would run."""
    sel = lambda key: OmegaConf.select(cfg, key)  # noqa: E731
    uaq = sel("qurl.uaq.enable")
    return (
        f"model={sel('actor_rollout_ref.model.path')} rollout={sel('actor_rollout_ref.rollout.name')}"
        f"/{sel('actor_rollout_ref.rollout.quantization') or 'unquantized'} "
        f"loss={sel('actor_rollout_ref.actor.policy_loss.loss_mode')} uaq={'on' if uaq else 'off'} "
        f"n={sel('actor_rollout_ref.rollout.n')} batch={sel('data.train_batch_size')} "
        f"response={sel('data.max_response_length')} gpus={sel('trainer.nnodes')}x{sel('trainer.n_gpus_per_node')}"
    )


def ensure_data(data: str, data_root: Path) -> Path:
    """The parquet folder run.sh would use for shipped data, written here when absent."""
    from qurl_recipes.data.math_datasets import write_recipe_data

    folder = data_root / f"{data}-shipped"
    if not ((folder / "train.parquet").is_file() and (folder / "val.parquet").is_file()):
        write_recipe_data(data, folder)
    return folder


def check_recipe(recipe: str, preset: str, data_root: str | Path | None = None) -> DictConfig:
    """Check one recipe with one preset, writing its shipped data under `data_root` if needed."""
    root = Path(data_root) if data_root is not None else REPO / "outputs" / "data"
    data_dir = ensure_data(RECIPES[recipe].data, root) if recipe in RECIPES else None
    return check_overrides(recipe_overrides(recipe, preset, data_dir))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    overrides = None
    if "--overrides" in argv:
        i = argv.index("--overrides")
        overrides = argv[i + 1:]
        if overrides[:1] == ["--"]:
            overrides = overrides[1:]
        argv = argv[:i]
    ap = argparse.ArgumentParser(description="Compose and validate the GPU recipes (no GPU, no download).")
    ap.add_argument("--recipe", action="append", choices=sorted(RECIPES), help="default: all")
    ap.add_argument("--preset", action="append", help=f"default: all presets and {STOCK_ROLLOUT}")
    ap.add_argument("--data-root", help="where shipped data is written (default outputs/data, as run.sh)")
    a = ap.parse_args(argv)

    if overrides is not None:
        try:
            cfg = check_overrides(overrides)
        except Exception as e:  # noqa: BLE001 - the user sees why the run would not start
            print(f"dry run FAILED: {type(e).__name__}: {e}", file=sys.stderr)
            return 1
        print(f"dry run ok: {describe(cfg)}")
        return 0

    recipes = a.recipe or list(RECIPES)
    presets = a.preset or [*available_presets(), STOCK_ROLLOUT]
    failed = 0
    for recipe in recipes:
        for preset in presets:
            try:
                with contextlib.redirect_stdout(io.StringIO()):  # verl's and the UAQ step's progress lines
                    cfg = check_recipe(recipe, preset, a.data_root)
                print(f"ok    {recipe:<11} {preset:<10} {describe(cfg)}")
            except Exception as e:  # noqa: BLE001
                failed += 1
                print(f"FAIL  {recipe:<11} {preset:<10} {type(e).__name__}: {e}")
    print(f"{len(recipes) * len(presets) - failed}/{len(recipes) * len(presets)} recipe x preset configs pass")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
