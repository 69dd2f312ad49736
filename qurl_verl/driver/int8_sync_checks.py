"""``checkpoint_engine.backend=qurl_int8``: the 8-bit sync of the disaggregated modes, checked in the driver.

The engine quantizes on the trainer side and the rollout loads the codes as they arrive, so it needs the
``qurl_vllm`` rollout in a quantized format, verl's plugin import of the engine, and the rollout's settings
in ``engine_kwargs.qurl_int8`` (verl hands an engine nothing else of the config); the driver fills what the
run's config and model say (``prepare_int8_sync``: the rollout's dtype for the rest, whether the model ties its
lm_head to the embedding). The code-change tracker
observes only weights the worker quantizes itself, so it is off with this engine; the sync features that need
the colocated sync stay refused by their own rows (``rollout.features``).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from qurl_verl.checkpoint_engine.engine_settings import (
    DELTA_KWARGS,
    ENGINE_MODULE,
    SETTINGS_KWARGS,
    TRANSPORT_KWARGS,
    delta_settings_error,
    engine_kwargs_for,
    settings_of,
)
from qurl_verl.settings import QurlConfigError, RolloutSettings, select
from qurl_verl.settings.errors import Check
from qurl_verl.settings.keys import (
    CHECKPOINT_ENGINE_KEY,
    CHECKPOINT_ENGINE_NODE,
    INT8_SYNC_BACKEND,
    QUANTIZATION_KEY,
    ROLLOUT_CUSTOM_KEY,
    ROLLOUT_DTYPE_KEY,
    ROLLOUT_NAME,
    ROLLOUT_NAME_KEY,
    override_text,
    show,
)

MODULE_KEY = f"{CHECKPOINT_ENGINE_NODE}.custom_backend_module"
KWARGS_KEY = f"{CHECKPOINT_ENGINE_NODE}.engine_kwargs.{INT8_SYNC_BACKEND}"
ENGINE = f"{CHECKPOINT_ENGINE_KEY}={INT8_SYNC_BACKEND}"


def selects_int8_sync(cfg: Any) -> bool:
    return select(cfg, CHECKPOINT_ENGINE_KEY) == INT8_SYNC_BACKEND


def ties_word_embeddings(hf_config: Mapping | None) -> bool:
    """Whether the model's ``config.json`` says lm_head is the input embedding (absent: False, so the engine
    sends lm_head, which is right for any model)."""
    hf = hf_config or {}
    return bool(hf.get("tie_word_embeddings", hf.get("text_config", {}).get("tie_word_embeddings", False)))


def check_int8_sync(cfg: Any, rollout: RolloutSettings | None, hf_config: Mapping | None = None) -> None:
    name = select(cfg, ROLLOUT_NAME_KEY)
    if rollout is None or name != ROLLOUT_NAME:
        raise QurlConfigError(
            f"{ENGINE} with {ROLLOUT_NAME_KEY}={show(name)}: the engine sends 8-bit codes and scales, which only the "
            f"{ROLLOUT_NAME} rollout loads as they are. Set {ROLLOUT_NAME_KEY}={ROLLOUT_NAME} with {QUANTIZATION_KEY}=int8 "
            f"or fp8, or {CHECKPOINT_ENGINE_KEY}=nccl for a full-precision sync"
        )
    if not rollout.quantized:
        raise QurlConfigError(
            f"{ENGINE} with {QUANTIZATION_KEY}={rollout.format.value}: a bf16 rollout has no codes to send. Set "
            f"{QUANTIZATION_KEY}=int8 or fp8, or {CHECKPOINT_ENGINE_KEY}=nccl"
        )
    module = select(cfg, MODULE_KEY)
    if module != ENGINE_MODULE:
        raise QurlConfigError(
            f"{ENGINE} with {MODULE_KEY}={show(module)}: verl registers the engine by importing it in every process "
            f"that builds one. Set {MODULE_KEY}={ENGINE_MODULE}"
        )
    kwargs = select(cfg, KWARGS_KEY) or {}
    unknown = sorted(set(kwargs) - set(SETTINGS_KWARGS) - set(TRANSPORT_KWARGS) - set(DELTA_KWARGS))
    if unknown:
        raise QurlConfigError(
            f"{KWARGS_KEY} has {', '.join(unknown)}, which the engine does not take (it takes "
            f"{', '.join(SETTINGS_KWARGS + TRANSPORT_KWARGS + DELTA_KWARGS)}). Remove "
            + " ".join(f"~{KWARGS_KEY}.{k}" for k in unknown)
        )
    problem = delta_settings_error(kwargs.get("delta", False), kwargs.get("full_sync_every", 0))
    if problem:
        raise QurlConfigError(
            f"{KWARGS_KEY}.{problem}. Set +{KWARGS_KEY}.delta=true to send only what changed (with "
            f"+{KWARGS_KEY}.full_sync_every=K for a full sync every K syncs), or remove both"
        )
    try:
        sent = settings_of(kwargs)
    except (TypeError, QurlConfigError) as exc:
        raise QurlConfigError(f"{KWARGS_KEY}={show(kwargs)}: {exc}") from None
    want = engine_kwargs_for(rollout)
    if engine_kwargs_for(sent) != want or sent.ignore_patterns != rollout.ignore_patterns:
        overrides = " ".join(f"+{KWARGS_KEY}.{k}={v!r}".replace("'", "") for k, v in want.items())
        raise QurlConfigError(
            f"{KWARGS_KEY}={show(kwargs)} differs from the rollout's quantization ({show(want)}): the trainer side "
            f"would send codes the engine was not built for. Set {overrides}"
        )
    rest, dtype = kwargs.get("rest_dtype"), select(cfg, ROLLOUT_DTYPE_KEY, "bfloat16")
    if rest not in (None, dtype):
        raise QurlConfigError(
            f"{KWARGS_KEY}.rest_dtype={show(rest)} with {ROLLOUT_DTYPE_KEY}={show(dtype)}: the full-precision rest is "
            f"loaded in the rollout's dtype, so it can travel in that one and no other. Set "
            f"+{KWARGS_KEY}.rest_dtype={dtype}, or remove it (the driver sets the rollout's)"
        )
    tied = kwargs.get("tie_word_embeddings")
    if tied and hf_config is not None and not ties_word_embeddings(hf_config):
        raise QurlConfigError(
            f"{KWARGS_KEY}.tie_word_embeddings={tied} for a model whose config.json does not tie its lm_head to "
            f"the embedding: the rollout would never receive lm_head.weight. Set ~{KWARGS_KEY}.tie_word_embeddings (the driver "
            "reads the model's)"
        )
    if rollout.code_change_row_stride:
        raise QurlConfigError(
            f"{ENGINE} with {ROLLOUT_CUSTOM_KEY}.code_change_row_stride={rollout.code_change_row_stride}: the code-change "
            "tracker observes the weights the rollout worker quantizes, and with this engine the codes arrive "
            f"quantized. Set {override_text(cfg, f'{ROLLOUT_CUSTOM_KEY}.code_change_row_stride', 0)}"
        )


INT8_SYNC_CHECKS = (
    Check(f"{INT8_SYNC_BACKEND} sends what a quantized {ROLLOUT_NAME} rollout loads",
          lambda r: selects_int8_sync(r.cfg), lambda r: check_int8_sync(r.cfg, r.rollout, r.model.config), "Set "),
)


def prepare_int8_sync(cfg: Any, hf_config: Mapping | None) -> dict[str, Any]:
    """Fill the ``engine_kwargs.qurl_int8`` entries a checked config leaves out, from what the engine cannot see:
    ``rest_dtype`` (the rollout's dtype, in which the rest is loaded anyway) and ``tie_word_embeddings`` (the
    model's: a tied lm_head is not sent). Returns what it set. Without this step the engine's defaults hold
    (bf16, verl's default rollout dtype; lm_head sent)."""
    if not selects_int8_sync(cfg):
        return {}
    kwargs = select(cfg, KWARGS_KEY) or {}
    filled = {}
    if kwargs.get("rest_dtype") is None:
        filled["rest_dtype"] = str(select(cfg, ROLLOUT_DTYPE_KEY, "bfloat16"))
    if kwargs.get("tie_word_embeddings") is None:
        filled["tie_word_embeddings"] = ties_word_embeddings(hf_config)
    for key, value in filled.items():
        set_key(cfg, f"{KWARGS_KEY}.{key}", value)
    return filled


def set_key(cfg: Any, dotted: str, value: Any) -> None:
    """``cfg.<dotted> = value``, adding the missing parts (a struct DictConfig included)."""
    from omegaconf import DictConfig, OmegaConf

    if isinstance(cfg, DictConfig):
        OmegaConf.update(cfg, dotted, value, force_add=True)
        return
    *parents, last = dotted.split(".")
    node = cfg
    for part in parents:
        node = node.setdefault(part, {}) if isinstance(node, dict) else getattr(node, part)
    node[last] = value
