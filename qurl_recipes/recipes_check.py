"""Check the recipes on any machine, and write their data: compose `main_ppo`'s config the way a
user types it (`+qurl_recipe=<recipe> +qurl=<preset> [overrides]`) and run the driver's checks.

    python -m qurl_recipes.recipes_check                              # every recipe x every preset
    python -m qurl_recipes.recipes_check --recipe dapo_32b --preset fp8
    python -m qurl_recipes.recipes_check --dry-run -- <Hydra overrides>       # what `run.sh --dry-run` runs
    python -m qurl_recipes.recipes_check --write-data -- <Hydra overrides>    # what `run.sh` runs before main_ppo

For each recipe with a `recipes/<recipe>/run.sh`, the command line is that script's own
(`--print-overrides`), so what is checked is what would run: `+qurl_recipe=<recipe>`, the preset,
and the preset's keys the recipe needs on the command line (`qurl.uaq.enable=false` for gsm8k_ppo,
a UAQ cache folder for dapo). A recipe without a script (tiny_cpu, whose run.sh is the CPU demo)
is checked as `+qurl_recipe=<recipe> +qurl=<preset>`.

The config is composed from verl's `ppo_trainer` as `main_ppo` composes it, then goes through what
`main_ppo`'s driver runs before Ray starts: verl's `validate_config` with qurl-verl's checks first.
`QURL_DRY_RUN=1` is set meanwhile: a hub model id is accepted without being fetched and the UAQ
conversion only says what it would do. A critic is the exception: verl's check builds its model
config, which reads the checkpoint's config and tokenizer (a few MB, no weights; from the Hugging
Face cache with HF_HUB_OFFLINE=1). The data files named in the config must exist;
`--write-data` writes the recipe's data there first (once; `--source hub` for the full sets where
the recipe has them).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from omegaconf import DictConfig, ListConfig, OmegaConf

from qurl_verl.settings import DRY_RUN_ENV

REPO = Path(__file__).resolve().parents[1]
STOCK_ROLLOUT = "none"  # PRESET=none: verl's own vLLM rollout, no qurl preset
STOCK_ROLLOUT_OVERRIDE = "actor_rollout_ref.rollout.name=vllm"
DATA_DIR_ENV = "QURL_DATA_DIR"  # read by every recipe's config: the folder holding each recipe's data
SOURCE_RECORD = "written_from.txt"  # beside the parquet files: `shipped` or `hub`

# recipe -> (script relative to the repository root, environment that selects the recipe in it)
RECIPE_SCRIPTS: dict[str, tuple[str, dict[str, str]]] = {
    "deepscaler": ("recipes/deepscaler/run.sh", {}),
    "dapo": ("recipes/dapo/run.sh", {"SIZE": "7b"}),
    "dapo_1node": ("recipes/dapo/run.sh", {"SIZE": "7b_1node"}),
    "dapo_32b": ("recipes/dapo/run.sh", {"SIZE": "32b"}),
    "gsm8k_ppo": ("recipes/gsm8k_ppo/run.sh", {}),
}


class RecipeCheckError(ValueError):
    """A recipe that would not start; the message says what to change."""


def _configs_in(group: str) -> list[str]:
    """The options of one of qurl-verl's Hydra config groups (files starting with `_` are shared parts)."""
    from importlib.resources import files

    folder = files("qurl_verl.hydra_configs") / group
    return sorted(p.name[: -len(".yaml")] for p in folder.iterdir() if p.name.endswith(".yaml") and not p.name.startswith("_"))


def available_presets() -> list[str]:
    """The `+qurl=<name>` presets shipped in qurl_verl.hydra_configs."""
    return _configs_in("qurl")


def available_recipes() -> list[str]:
    """The `+qurl_recipe=<name>` recipes shipped in qurl_verl.hydra_configs."""
    return _configs_in("qurl_recipe")


def check_preset(preset: str) -> None:
    if preset != STOCK_ROLLOUT and preset not in available_presets():
        raise RecipeCheckError(
            f"unknown preset {preset!r}; choose one of {', '.join(available_presets())}, "
            f"or {STOCK_ROLLOUT} (verl's stock vLLM rollout)"
        )


def check_recipe_name(recipe: str) -> None:
    if recipe not in available_recipes():
        raise RecipeCheckError(f"unknown recipe {recipe!r}; choose one of {', '.join(available_recipes())}")


def preset_overrides(preset: str) -> list[str]:
    """`+qurl=<preset>`, or for `none` verl's stock vLLM rollout (the name a preset would otherwise set)."""
    check_preset(preset)
    return [STOCK_ROLLOUT_OVERRIDE] if preset == STOCK_ROLLOUT else [f"+qurl={preset}"]


def recipe_overrides(recipe: str, preset: str, extra: Sequence[str] = (), env: dict[str, str] | None = None) -> list[str]:
    """The Hydra overrides that run `recipe` with `preset`: its run.sh's command line where it has one."""
    check_recipe_name(recipe)
    check_preset(preset)
    if recipe not in RECIPE_SCRIPTS:
        return [f"+qurl_recipe={recipe}", *preset_overrides(preset), *extra]
    script_path, script_env = RECIPE_SCRIPTS[recipe]
    script = REPO / script_path
    if not script.is_file():
        raise RecipeCheckError(f"{script} is missing: the recipe scripts live in the qurl-verl repository, not in the installed package")
    run_env = {**os.environ, **script_env, **(env or {}), "PRESET": preset}
    p = subprocess.run(["bash", str(script), "--print-overrides", *extra], env=run_env, capture_output=True, timeout=60)
    if p.returncode != 0:
        raise RecipeCheckError(p.stderr.decode().strip() or f"{script} --print-overrides failed with exit code {p.returncode}")
    return [a for a in p.stdout.decode().split("\0") if a]


@contextlib.contextmanager
def environment(name: str, value: str | None) -> Iterator[None]:
    """Set (or, with None, leave) one environment variable for the duration of the block."""
    if value is None:
        yield
        return
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def dry_run_env() -> contextlib.AbstractContextManager:
    return environment(DRY_RUN_ENV, "1")


def _preset_of(overrides: Sequence[str]) -> str | None:
    for o in overrides:
        if o.startswith("+qurl="):
            return o.split("=", 1)[1]
    return None


def compose_recipe(overrides: Sequence[str]) -> DictConfig:
    """main_ppo's config for `overrides`, refusing an unknown preset and a recipe Hydra did not find."""
    from qurl_recipes.compose import compose_ppo_config

    preset = _preset_of(overrides)
    if preset is not None:
        check_preset(preset)
    cfg = compose_ppo_config(overrides)
    recipe = cfg.get("qurl_recipe")
    if isinstance(recipe, str):
        raise RecipeCheckError(
            f"`+qurl_recipe={recipe}` was taken as a plain value, not a recipe: Hydra cannot see qurl-verl's "
            "config groups. Reinstall qurl-verl (it ships the hydra_plugins search-path plugin) or add "
            "'hydra.searchpath=[pkg://qurl_verl.hydra_configs]' to the command."
        )
    return cfg


def recipe_name(cfg: DictConfig) -> str | None:
    """The `+qurl_recipe=<name>` the config was composed with (None without one)."""
    return OmegaConf.select(cfg, "qurl_recipe.name")


# ---------------------------------------------------------------- recipe data

def _write_math(recipe: str) -> Callable[[DictConfig, Path, str], None]:
    def write(cfg: DictConfig, folder: Path, source: str) -> None:
        from qurl_recipes.data.math_datasets import write_recipe_data

        write_recipe_data(recipe, folder, source)
    return write


def _write_gsm8k(cfg: DictConfig, folder: Path, source: str) -> None:
    from qurl_recipes.data.gsm8k import write_gsm8k_data

    if source != "shipped":
        raise RecipeCheckError("gsm8k_ppo has no hub source: data/gsm8k/ ships the complete GSM8K train and test sets")
    write_gsm8k_data(folder)


def _write_tiny(cfg: DictConfig, folder: Path, source: str) -> None:
    """The arithmetic task's data and, when model.path is the recipe's own `<data folder>/model`, the tiny model."""
    from qurl_recipes.data.arithmetic import write_parquet
    from qurl_recipes.tiny_model import build_tiny_model

    if source != "shipped":
        raise RecipeCheckError("tiny_cpu builds its data; it has no hub source")
    write_parquet(folder)
    model = Path(os.path.expanduser(str(OmegaConf.select(cfg, "actor_rollout_ref.model.path"))))
    if model == folder / "model" and not (model / "config.json").is_file():
        build_tiny_model(model)


# recipe -> writer(config, folder for train.parquet / val.parquet, source)
DATA_WRITERS: dict[str, Callable[[DictConfig, Path, str], None]] = {
    "deepscaler": _write_math("deepscaler"),
    "dapo": _write_math("dapo"),
    "dapo_1node": _write_math("dapo"),
    "dapo_32b": _write_math("dapo"),
    "gsm8k_ppo": _write_gsm8k,
    "tiny_cpu": _write_tiny,
}


def _data_files(cfg: DictConfig) -> tuple[Path, Path]:
    return tuple(Path(os.path.expanduser(str(OmegaConf.select(cfg, k)))) for k in ("data.train_files", "data.val_files"))


def data_folder(cfg: DictConfig) -> Path:
    """The folder of `data.train_files` / `data.val_files`, which the recipes write as train.parquet and
    val*.parquet (val.parquet: every benchmark; deepscaler's val_aime2024.parquet: the one it checks in training)."""
    train, val = _data_files(cfg)
    if train.name != "train.parquet" or not (val.name.startswith("val") and val.suffix == ".parquet") or train.parent != val.parent:
        raise RecipeCheckError(
            f"data.train_files={train}, data.val_files={val}: the recipe's data is written as train.parquet and "
            "val*.parquet in one folder; point both there, or write your own files and skip --write-data"
        )
    return train.parent


def write_data(cfg: DictConfig, source: str = "shipped") -> Path | None:
    """Write the recipe's data where the config reads it, unless it is there; None for a config without a recipe."""
    recipe = recipe_name(cfg)
    if recipe is None:
        return None
    folder = data_folder(cfg)
    record = folder / SOURCE_RECORD
    if all(f.is_file() for f in (*_data_files(cfg), folder / "val.parquet")):
        written_from = record.read_text().strip() if record.is_file() else source
        if written_from != source:
            raise RecipeCheckError(
                f"{folder} holds the {written_from} data, not the {source} data; point {DATA_DIR_ENV} at another "
                "folder for it (or delete that one)"
            )
        return folder
    DATA_WRITERS[recipe](cfg, folder, source)
    record.write_text(source + "\n")
    return folder


# ---------------------------------------------------------------- checks

def check_data_files(cfg: DictConfig) -> None:
    for key in ("data.train_files", "data.val_files"):
        value = OmegaConf.select(cfg, key)
        paths = list(value) if isinstance(value, (ListConfig, list, tuple)) else [value]
        for path in paths:
            if path is None or not Path(os.path.expanduser(str(path))).is_file():
                raise RecipeCheckError(
                    f"{key}={path}: no such file. The recipes write their data before starting "
                    "(`python -m qurl_recipes.recipes_check --write-data -- +qurl_recipe=<recipe>`, as run.sh does); "
                    f"set {DATA_DIR_ENV} or the override to the folder holding it."
                )


def check_critic_model_readable(cfg: DictConfig) -> None:
    """verl validates a critic by building its model config, which loads the checkpoint's config and
    tokenizer: with HF_HUB_OFFLINE=1 a hub id must be in the Hugging Face cache (no weights are read)."""
    from verl.trainer.ppo.utils import need_critic

    from qurl_verl.model_info import hub_id, hub_id_cached

    path = OmegaConf.select(cfg, "critic.model.path")
    repo = hub_id(path) if need_critic(cfg) else None
    if repo is not None and os.environ.get("HF_HUB_OFFLINE") == "1" and not hub_id_cached(repo):
        raise RecipeCheckError(
            f"critic.model.path={repo}: verl's config check loads the critic's config.json and tokenizer, which are "
            "not in the Hugging Face cache and HF_HUB_OFFLINE=1 forbids fetching them; download them first "
            f"(`huggingface-cli download {repo} --exclude '*.safetensors'`) or set MODEL_PATH to a local copy"
        )


def check_config(cfg: DictConfig) -> DictConfig:
    """Run main_ppo's driver-side checks on a composed config, in dry-run mode."""
    from qurl_recipes.compose import validate_like_main_ppo

    with dry_run_env(), warnings.catch_warnings():
        # expected for GRPO/DAPO (no critic); verl warns about it on every validation
        warnings.filterwarnings("ignore", message="Disabled critic as algorithm.adv_estimator")
        check_data_files(cfg)
        check_critic_model_readable(cfg)
        validate_like_main_ppo(cfg)
    return cfg


def check_overrides(overrides: Sequence[str]) -> DictConfig:
    """Compose main_ppo's config from `overrides` and run its driver-side checks in dry-run mode."""
    return check_config(compose_recipe(overrides))


def describe(cfg: DictConfig) -> str:
    """One line: what the checked config would run (the context override only where a recipe sets one)."""
    sel = lambda key: OmegaConf.select(cfg, key)  # noqa: E731
    uaq = sel("qurl.uaq.enable")
    context = ""
    trainer_len = sel("actor_rollout_ref.model.override_config.max_position_embeddings")
    engine_len = sel("actor_rollout_ref.rollout.engine_kwargs.vllm.hf_overrides.max_position_embeddings")
    if trainer_len is not None or engine_len is not None:
        context = f" max_position_embeddings=trainer:{trainer_len},vllm:{engine_len}"
    steps = sel("trainer.total_training_steps")
    validation = (f"val_only {Path(str(sel('data.val_files'))).name}" if sel("trainer.val_only") else
                  f"val={Path(str(sel('data.val_files'))).name}@{sel('actor_rollout_ref.rollout.val_kwargs.n')}"
                  f"/{sel('trainer.test_freq')}steps")
    return (
        f"model={sel('actor_rollout_ref.model.path')} rollout={sel('actor_rollout_ref.rollout.name')}"
        f"/{sel('actor_rollout_ref.rollout.quantization') or 'unquantized'} "
        f"loss={sel('actor_rollout_ref.actor.policy_loss.loss_mode')} uaq={'on' if uaq else 'off'} "
        f"adv={sel('algorithm.adv_estimator')} n={sel('actor_rollout_ref.rollout.n')} batch={sel('data.train_batch_size')} "
        f"response={sel('data.max_response_length')}{context} steps={steps if steps is not None else 'epochs'} "
        f"{validation} gpus={sel('trainer.nnodes')}x{sel('trainer.n_gpus_per_node')}"
    )


def check_recipe(recipe: str, preset: str, data_root: str | Path | None = None) -> DictConfig:
    """Check one recipe with one preset, writing its shipped data first where missing.

    `data_root` stands for QURL_DATA_DIR (default: the variable as set, else the recipes' own default).
    """
    with environment(DATA_DIR_ENV, None if data_root is None else str(data_root)):
        cfg = compose_recipe(recipe_overrides(recipe, preset))
        write_data(cfg)
        return check_config(cfg)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    overrides = None
    if "--" in argv:
        i = argv.index("--")
        argv, overrides = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description="Compose and validate the recipes (no GPU, no download); write their data.")
    ap.add_argument("--recipe", action="append", choices=available_recipes(), help="default: all")
    ap.add_argument("--preset", action="append", help=f"default: all presets and {STOCK_ROLLOUT}")
    ap.add_argument("--data-root", help=f"the recipes' data folder (default: ${DATA_DIR_ENV}, else ~/data/qurl)")
    ap.add_argument("--dry-run", action="store_true", help="with `-- <overrides>`: compose and run the driver's checks")
    ap.add_argument("--write-data", action="store_true", help="with `-- <overrides>`: write the recipe's data where the config reads it")
    ap.add_argument("--source", choices=["shipped", "hub"], default="shipped",
                    help="--write-data: the repository's data/ files (default) or the full sets from the hub")
    a = ap.parse_args(argv)

    if overrides is not None:
        if not (a.dry_run or a.write_data):
            ap.error("`-- <overrides>` needs --dry-run, --write-data or both")
        try:
            with environment(DATA_DIR_ENV, a.data_root):
                cfg = compose_recipe(overrides)
                if a.write_data:
                    folder = write_data(cfg, a.source)
                    if folder is not None:
                        print(f"{recipe_name(cfg)} data ({a.source}): {folder}")
                if a.dry_run:
                    check_config(cfg)
        except Exception as e:  # noqa: BLE001 - the user sees why the run would not start
            print(f"{'dry run' if a.dry_run else 'data'} FAILED: {type(e).__name__}: {e}", file=sys.stderr)
            return 1
        if a.dry_run:
            print(f"dry run ok: {describe(cfg)}")
        return 0

    recipes = a.recipe or available_recipes()
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
