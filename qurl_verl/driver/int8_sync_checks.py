"""``checkpoint_engine.backend=qurl_int8``: the 8-bit sync of the disaggregated modes, checked in the driver.

The engine quantizes on the trainer side and the rollout loads the codes as they arrive, so it needs the
``qurl_vllm`` rollout in a quantized format, verl's plugin import of the engine, and the rollout's settings
in ``engine_kwargs.qurl_int8`` (verl hands an engine nothing else of the config). The code-change tracker
observes only weights the worker quantizes itself, so it is off with this engine; the sync features that need
the colocated sync stay refused by their own rows (``rollout.features``).
"""
from __future__ import annotations

from typing import Any

from qurl_verl.checkpoint_engine.engine_settings import ENGINE_MODULE, engine_kwargs_for, settings_of
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


def check_int8_sync(cfg: Any, rollout: RolloutSettings | None) -> None:
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
            f"+{KWARGS_KEY}.rest_dtype={dtype}, or remove it (sent as the trainer holds it)"
        )
    if rollout.code_change_row_stride:
        raise QurlConfigError(
            f"{ENGINE} with {ROLLOUT_CUSTOM_KEY}.code_change_row_stride={rollout.code_change_row_stride}: the code-change "
            "tracker observes the weights the rollout worker quantizes, and with this engine the codes arrive "
            f"quantized. Set {override_text(cfg, f'{ROLLOUT_CUSTOM_KEY}.code_change_row_stride', 0)}"
        )


INT8_SYNC_CHECKS = (
    Check(f"{INT8_SYNC_BACKEND} sends what a quantized {ROLLOUT_NAME} rollout loads",
          lambda r: selects_int8_sync(r.cfg), lambda r: check_int8_sync(r.cfg, r.rollout), "Set "),
)
