"""`+qurl_recipe=<name>`: every recipe resolves from any directory, composes with every preset in either
order to the same config, passes main_ppo's driver checks, and reads its machine-dependent values
from the environment."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from importlib.resources import files
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from qurl_recipes import recipes_check as rc
from qurl_recipes.compose import compose_ppo_config

RECIPES = ["dapo", "dapo_1node", "dapo_32b", "deepscaler", "gsm8k_ppo", "tiny_cpu"]
PRESETS = ["bf16", "fp8", "fp8_fp8kv", "int8", "int8_fp8kv", "naive_int8", "tis_fp8", "tis_int8"]
EXPECTED = {  # preset -> (rollout.name, rollout.quantization, loss_mode, UAQ)
    "bf16": ("qurl_vllm", "bf16", "vanilla", False),
    "naive_int8": ("qurl_vllm", "int8", "vanilla", False),
    "tis_int8": ("qurl_vllm", "int8", "qurl_tis", False),
    "tis_fp8": ("qurl_vllm", "fp8", "qurl_tis", False),
    "int8": ("qurl_vllm", "int8", "qurl_acr", True),
    "fp8": ("qurl_vllm", "fp8", "qurl_acr", True),
    "int8_fp8kv": ("qurl_vllm", "int8", "qurl_acr", True),
    "fp8_fp8kv": ("qurl_vllm", "fp8", "qurl_acr", True),
    "none": ("vllm", None, "vanilla", False),
}
RECIPE_MODEL = {"deepscaler": "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B", "dapo": "Qwen/Qwen2.5-Math-7B",
                "dapo_1node": "Qwen/Qwen2.5-Math-7B",
                "dapo_32b": "Qwen/Qwen2.5-32B", "gsm8k_ppo": "Qwen/Qwen2.5-0.5B-Instruct"}
MACHINE_VARIABLES = ("QURL_DATA_DIR", "QURL_OUTPUT_DIR", "MODEL_PATH", "NNODES", "NGPUS_PER_NODE")


def config_leaves(group: str) -> dict[str, set[str]]:
    """Every key path each YAML file of a config group sets (its defaults list aside)."""
    def leaves(node, prefix=""):
        for key, value in node.items():
            path = f"{prefix}{key}"
            if isinstance(value, dict) and value:
                yield from leaves(value, path + ".")
            else:
                yield path

    found = {}
    for f in (files("qurl_verl.hydra_configs") / group).iterdir():
        if f.name.endswith(".yaml"):
            raw = OmegaConf.to_container(OmegaConf.create(f.read_text()), resolve=False)
            raw.pop("defaults", None)
            found[f.name] = set(leaves(raw))
    return found


@pytest.fixture(autouse=True)
def machine_defaults(monkeypatch):
    for name in MACHINE_VARIABLES:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    """Every recipe's data (and the tiny model), written where the recipes read it with QURL_DATA_DIR=<root>."""
    root = tmp_path_factory.mktemp("qurl_data")
    saved = {name: os.environ.pop(name, None) for name in MACHINE_VARIABLES}
    try:
        with rc.environment(rc.DATA_DIR_ENV, str(root)):
            for recipe in RECIPES:
                rc.write_data(compose_ppo_config([f"+qurl_recipe={recipe}"]))
    finally:
        os.environ.update({k: v for k, v in saved.items() if v is not None})
    return root


def test_shipped_recipes_and_their_data_writers():
    assert rc.available_recipes() == RECIPES
    assert sorted(rc.DATA_WRITERS) == RECIPES
    assert set(rc.RECIPE_SCRIPTS) <= set(RECIPES)


def test_recipes_set_no_key_a_preset_sets():
    """What makes the order of `+qurl_recipe=` and `+qurl=` irrelevant: no key path in common."""
    presets = config_leaves("qurl")
    recipes = config_leaves("qurl_recipe")
    assert set(presets) >= {f"{p}.yaml" for p in PRESETS} and set(recipes) >= {f"{r}.yaml" for r in RECIPES}
    clashes = [
        (recipe_file, key, preset_file, owned)
        for recipe_file, keys in recipes.items() for key in keys
        for preset_file, owned_keys in presets.items() for owned in owned_keys
        if key == owned or key.startswith(owned + ".") or owned.startswith(key + ".")
    ]
    assert clashes == []
    assert not any(key.split(".")[0] == "qurl" for keys in recipes.values() for key in keys)


def test_every_recipe_with_every_preset_from_outside_the_repository(data_root, tmp_path):
    """Composed from another directory, as a user types it, it passes the driver's checks (dry run, no hub);
    both orders give one config (composed both ways for the int8 preset and for no preset on every recipe:
    each composition costs about 1 s of Hydra with each YAML file parsed once (``qurl_testkit.hydra_config_cache``,
    as in the test process), and ``test_recipes_set_no_key_a_preset_sets`` shows for every
    pair why the order cannot matter). gsm8k_ppo's critic reads its model's config and tokenizer, so it gets a
    local Qwen2 folder; dapo with UAQ on several nodes needs a shared cache folder."""
    code = textwrap.dedent("""
        import json, sys
        from omegaconf import OmegaConf
        from qurl_recipes import recipes_check as rc
        from qurl_recipes.compose import compose_ppo_config
        from qurl_testkit.hydra_config_cache import cache_config_sources

        cache_config_sources()  # each YAML file parsed once in this process, as in the test process
        tiny, cache = sys.argv[1], sys.argv[2]
        sel = OmegaConf.select
        for recipe in rc.available_recipes():
            for preset in [*rc.available_presets(), rc.STOCK_ROLLOUT]:
                group, qurl = f"+qurl_recipe={recipe}", rc.preset_overrides(preset)
                extra = [f"actor_rollout_ref.model.path={tiny}"] if recipe == "gsm8k_ppo" else []
                composed = rc.compose_recipe([group, *qurl, *extra])  # what check_overrides composes
                row = {"recipe": recipe, "preset": preset, "errors": []}
                if preset in ("int8", rc.STOCK_ROLLOUT):
                    one = OmegaConf.to_container(composed, resolve=True)
                    other = OmegaConf.to_container(compose_ppo_config([*qurl, group, *extra]), resolve=True)
                    row["same_either_order"] = one == other
                for attempt in ([], [f"qurl.uaq.cache_dir={cache}"]):
                    try:
                        cfg = rc.check_overrides([group, *qurl, *extra, *attempt]) if attempt else rc.check_config(composed)
                    except Exception as e:
                        row["errors"].append(f"{type(e).__name__}: {e}")
                        continue
                    row.update(checked_with=attempt, rollout=sel(cfg, "actor_rollout_ref.rollout.name"),
                               quantization=sel(cfg, "actor_rollout_ref.rollout.quantization"),
                               loss=sel(cfg, "actor_rollout_ref.actor.policy_loss.loss_mode"),
                               uaq=bool(sel(cfg, "qurl.uaq.enable", default=False)), has_qurl="qurl" in cfg,
                               adv=cfg.algorithm.adv_estimator, model=cfg.actor_rollout_ref.model.path,
                               critic=sel(cfg, "critic.model.path"), train=cfg.data.train_files,
                               gpus=[cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node])
                    break
                print("ROW", json.dumps(row), flush=True)
    """)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    env = {**{k: v for k, v in os.environ.items() if k not in MACHINE_VARIABLES}, "QURL_DATA_DIR": str(data_root),
           "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    tiny = data_root / "tiny_cpu" / "model"
    p = subprocess.run([sys.executable, "-c", code, str(tiny), str(tmp_path / "uaq")], capture_output=True, text=True,
                       timeout=900, cwd=outside, env=env)
    rows = [json.loads(line[4:]) for line in p.stdout.splitlines() if line.startswith("ROW ")]
    assert len(rows) == len(RECIPES) * (len(PRESETS) + 1), (p.stdout[-2000:], p.stderr[-3000:])
    fp8_kv_here = bool(torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported())
    for row in rows:
        recipe, preset = row["recipe"], row["preset"]
        if preset in ("int8", "none"):
            assert row["same_either_order"], (recipe, preset)
        if recipe == "tiny_cpu" and preset.endswith("_fp8kv") and not fp8_kv_here:  # the CPU recipe, on this CPU
            assert "checked_with" not in row and "AVX-512 or AMX only" in row["errors"][-1], (recipe, preset, row)
            continue
        assert "checked_with" in row, (recipe, preset, row["errors"])
        assert (row["rollout"], row["quantization"], row["loss"], row["uaq"]) == EXPECTED[preset], (recipe, preset)
        assert row["has_qurl"] == (preset != "none")
        assert row["train"] == str(data_root / {"dapo_32b": "dapo", "dapo_1node": "dapo", "gsm8k_ppo": "gsm8k"}.get(recipe, recipe) / "train.parquet")
        if recipe in ("dapo", "dapo_32b") and EXPECTED[preset][3]:
            assert row["checked_with"] and "storage all nodes share" in row["errors"][0], (recipe, preset, row["errors"])
        else:
            assert row["checked_with"] == [], (recipe, preset, row["errors"])
        if recipe == "gsm8k_ppo":
            assert (row["adv"], row["critic"]) == ("gae", str(tiny))  # the critic starts from the actor's model
        elif recipe == "tiny_cpu":
            assert (row["adv"], row["model"], row["gpus"]) == ("grpo", str(tiny), [1, 1])
        else:
            assert (row["adv"], row["model"]) == ("grpo", RECIPE_MODEL[recipe])
            assert row["gpus"] == {"deepscaler": [1, 8], "dapo": [8, 8], "dapo_1node": [1, 8], "dapo_32b": [16, 8]}[recipe]


def test_machine_values_come_from_the_environment(monkeypatch, tmp_path):
    cfg = compose_ppo_config(["+qurl_recipe=deepscaler", "+qurl=int8"])
    assert cfg.data.train_files == os.path.expanduser("~/data/qurl/deepscaler/train.parquet")
    assert cfg.trainer.default_local_dir == "outputs/qurl_deepscaler/r1_distill_1.5b_8192_int8/checkpoints"
    assert (cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node) == (1, 8)
    for name, value in {"QURL_DATA_DIR": str(tmp_path / "d"), "QURL_OUTPUT_DIR": str(tmp_path / "o"),
                        "MODEL_PATH": "org/model", "NNODES": "2", "NGPUS_PER_NODE": "4"}.items():
        monkeypatch.setenv(name, value)
    for recipe in ("deepscaler", "dapo", "gsm8k_ppo"):
        cfg = compose_ppo_config([f"+qurl_recipe={recipe}", "actor_rollout_ref.rollout.name=vllm"])
        assert cfg.data.val_files.startswith(str(tmp_path / "d")) and Path(cfg.data.val_files).name.startswith("val")
        assert cfg.trainer.validation_data_dir.startswith(str(tmp_path / "o" / cfg.trainer.project_name))
        assert cfg.actor_rollout_ref.model.path == "org/model"
        assert (cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node) == (2, 4)  # integers, as verl computes with them
        assert all(type(v) is int for v in (cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node))
    # a value given on the command line needs nothing from the environment
    cfg = compose_ppo_config(["+qurl_recipe=dapo", "+qurl=fp8", "trainer.nnodes=3", "data.max_response_length=4096"])
    assert cfg.trainer.nnodes == 3 and cfg.reward.reward_kwargs.max_resp_len == 4096
    assert cfg.trainer.experiment_name == "qwen2.5_math_7b_fp8"


def test_gsm8k_ppo_is_the_papers_table_1_setting():
    cfg = compose_ppo_config(["+qurl_recipe=gsm8k_ppo", "+qurl=int8"])
    actor, rollout = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    assert cfg.actor_rollout_ref.model.path == cfg.critic.model.path == "Qwen/Qwen2.5-0.5B-Instruct"
    assert (cfg.algorithm.adv_estimator, actor.optim.lr, cfg.critic.optim.lr) == ("gae", 1e-5, 1e-5)
    assert (rollout.val_kwargs.do_sample, rollout.val_kwargs.n, rollout.n) == (False, 1, 1)  # greedy test accuracy
    assert cfg.reward.custom_reward_function.path is None  # verl's own scorer, chosen by data_source openai/gsm8k
    assert cfg.qurl.uaq.enable  # the preset's UAQ: the recipe leaves it alone ...


@pytest.mark.parametrize("preset", PRESETS + ["none"])
def test_gsm8k_ppo_run_sh_turns_uaq_off_in_either_order(preset):
    """... and its run.sh turns it off on the command line, where it holds whatever the order of the groups."""
    overrides = rc.recipe_overrides("gsm8k_ppo", preset)
    groups = [o for o in overrides if o.startswith("+")]
    assert groups == (["+qurl_recipe=gsm8k_ppo"] + ([] if preset == "none" else [f"+qurl={preset}"]))
    assert ("qurl.uaq.enable=false" in overrides) == (preset != "none")
    rest = [o for o in overrides if o not in groups]
    for cfg in (compose_ppo_config(overrides), compose_ppo_config([*reversed(groups), *rest])):
        assert not OmegaConf.select(cfg, "qurl.uaq.enable", default=False)
        assert ("qurl" in cfg) == (preset != "none")


def test_data_of_another_source_is_not_taken_silently(tmp_path):
    with rc.environment(rc.DATA_DIR_ENV, str(tmp_path)):
        cfg = compose_ppo_config(["+qurl_recipe=dapo"])
        assert rc.write_data(cfg) == tmp_path / "dapo" and (tmp_path / "dapo" / rc.SOURCE_RECORD).read_text() == "shipped\n"
        assert rc.write_data(cfg) == tmp_path / "dapo"  # there already: kept
        with pytest.raises(rc.RecipeCheckError, match=r"holds the shipped data, not the hub data; point QURL_DATA_DIR"):
            rc.write_data(cfg, "hub")
        with pytest.raises(rc.RecipeCheckError, match="gsm8k_ppo has no hub source"):
            rc.write_data(compose_ppo_config(["+qurl_recipe=gsm8k_ppo"]), "hub")
    assert rc.write_data(compose_ppo_config(["actor_rollout_ref.rollout.name=vllm"])) is None  # no recipe, nothing to write


def test_critic_model_offline_is_named(data_root, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv(rc.DATA_DIR_ENV, str(data_root))
    with pytest.raises(rc.RecipeCheckError, match=r"critic.model.path=Qwen/Qwen2.5-0.5B-Instruct: verl's config check "
                                                  r"loads the critic's config.json and tokenizer.*set MODEL_PATH to a local copy"):
        rc.check_overrides(["+qurl_recipe=gsm8k_ppo", "+qurl=bf16"])
