"""The decode roofline of each recipe: its model, batch, GPUs and lengths read from the recipe's YAML
(verl's defaults where it sets none), then counted at its mean context and at fixed ones.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import asdict
from pathlib import Path

from roofline_bytes import capacity_bound, compare_setups, kv_bytes_per_token, stored_weight_bytes
from roofline_shapes import ACCELERATORS, RECIPE_MODEL_OVERRIDES, SETUPS, TINY_MODEL, model_shape

REPO = Path(__file__).resolve().parents[1]
RECIPE_DIR = REPO / "qurl_verl" / "hydra_configs" / "qurl_recipe"

RECIPE_KEYS = {
    "model_path": "actor_rollout_ref.model.path",
    "train_batch_size": "data.train_batch_size",
    "rollout_n": "actor_rollout_ref.rollout.n",
    "n_gpus_per_node": "trainer.n_gpus_per_node",
    "nnodes": "trainer.nnodes",
    "max_prompt_length": "data.max_prompt_length",
    "max_response_length": "data.max_response_length",
    "tensor_model_parallel_size": "actor_rollout_ref.rollout.tensor_model_parallel_size",
    "gpu_memory_utilization": "actor_rollout_ref.rollout.gpu_memory_utilization",
    "max_num_seqs": "actor_rollout_ref.rollout.max_num_seqs",
}
# verl 0.9.1's defaults for a key a recipe leaves out (verl/trainer/config/_generated_ppo_trainer.yaml)
VERL_DEFAULTS = {
    "train_batch_size": 1024, "rollout_n": 1, "n_gpus_per_node": 8, "nnodes": 1, "max_prompt_length": 512,
    "max_response_length": 512, "tensor_model_parallel_size": 2, "gpu_memory_utilization": 0.5, "max_num_seqs": 256,
}
# environment variables the recipes read; unset while resolving, so the defaults after the comma apply
RECIPE_ENV = ("QURL_DATA_DIR", "QURL_OUTPUT_DIR", "MODEL_PATH", "NNODES", "NGPUS_PER_NODE")


@contextlib.contextmanager
def recipe_defaults_environment():
    """Resolve a recipe as written: its ``${oc.env:VAR,default}`` take the default, not this shell's value."""
    saved = {k: os.environ.pop(k) for k in RECIPE_ENV if k in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def load_recipe(path: Path):
    """The recipe merged over its Hydra ``defaults`` (sibling files, ``_self_`` where listed, else last)."""
    from omegaconf import OmegaConf

    own = OmegaConf.load(path)
    defaults = list(own.pop("defaults", []) or [])
    if "_self_" not in defaults:
        defaults.append("_self_")
    parts = [own if d == "_self_" else load_recipe(path.parent / f"{d}.yaml") for d in defaults]
    return OmegaConf.merge(*parts)


def home_relative(value):
    """A local path under the home directory written as ``~/...``: the result files name no machine's home."""
    home = str(Path.home())
    if isinstance(value, str) and (value == home or value.startswith(home + os.sep)):
        return "~" + value[len(home):]
    return value


def recipe_inputs(path: Path) -> dict:
    """What the roofline needs from one recipe, and which values came from verl's defaults."""
    from omegaconf import OmegaConf

    cfg = load_recipe(path)
    values, defaults_taken = {}, []
    with recipe_defaults_environment():
        for key, dotted in RECIPE_KEYS.items():
            value = OmegaConf.select(cfg, dotted, default=None)
            if value is None:
                value = VERL_DEFAULTS.get(key)
                defaults_taken.append(f"{dotted} = {value} (verl default)")
            values[key] = value
    values["model_path"] = home_relative(values["model_path"])
    name = OmegaConf.select(cfg, "qurl_recipe.name", default=path.stem)
    values["model"] = RECIPE_MODEL_OVERRIDES.get(name, values["model_path"])
    values["num_gpus"] = values["n_gpus_per_node"] * values["nnodes"]
    values["sequences_per_step"] = values["train_batch_size"] * values["rollout_n"]
    values["seqs_per_gpu"] = values["sequences_per_step"] / values["num_gpus"]
    values["seqs_per_engine"] = values["seqs_per_gpu"] * values["tensor_model_parallel_size"]
    values["recipe_mean_context"] = values["max_prompt_length"] + values["max_response_length"] / 2
    return {"name": name, "file": str(path.relative_to(REPO)), "inputs": values, "defaults_taken": defaults_taken}


def recipe_roofline(recipe: dict, fixed_contexts: list[int], fixed_seqs: int) -> dict:
    """Rows of (context, concurrency) for one recipe, and the capacity-bound view at its mean context."""
    v = recipe["inputs"]
    m, tp = model_shape(v["model"]), v["tensor_model_parallel_size"]
    max_len = v["max_prompt_length"] + v["max_response_length"]
    contexts = [("recipe mean", v["recipe_mean_context"])] + [("fixed", c) for c in fixed_contexts if c <= max_len]
    skipped = [c for c in fixed_contexts if c > max_len]
    concurrencies = [("all at once", v["seqs_per_engine"]), ("fixed", fixed_seqs)]
    rows = []
    for ctx_label, ctx in contexts:
        for conc_label, seqs in concurrencies:
            rows.append({"context_label": ctx_label, "mean_context": ctx, "concurrency_label": conc_label,
                         "seqs_per_engine": seqs, "setups": compare_setups(m, tp, seqs, ctx)})
    capacity = {a.name: capacity_bound(m, tp, a, v["seqs_per_engine"], v["max_num_seqs"], v["recipe_mean_context"],
                                       v["gpu_memory_utilization"]) for a in ACCELERATORS}
    recipe.update({
        "model_shape": asdict(m),
        "kv_bytes_per_token_per_rank": {s.name: kv_bytes_per_token(m, s, tp) for s in SETUPS},
        "stored_weight_bytes_per_rank": {s.name: stored_weight_bytes(m, s, tp) for s in SETUPS},
        "contexts_beyond_max_length": skipped, "rows": rows, "capacity_bound": capacity,
        "cpu_toy": v["model"] == TINY_MODEL,
    })
    return recipe
