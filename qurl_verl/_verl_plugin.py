"""verl 0.9.1 `verl.plugins` entry point: imported by every process that imports verl.

Registrations here are cheap and lazy (no vLLM import). verl swallows plugin import errors at
DEBUG level, so every failure is logged here at WARNING with its reason, and recorded so that a
later lookup of a `qurl` name can say why it is missing (`qurl_verl.plugin_status()`).
"""
from __future__ import annotations

import logging
import os
import sys
import traceback

logger = logging.getLogger("qurl_verl")

# name -> "ok" or the error text; read by qurl_verl.plugin_status()
STATUS: dict[str, str] = {}


def _step(name: str, fn) -> None:
    try:
        result = fn()
        STATUS[name] = "ok" if result is None or result is True else f"ok ({result})"
    except Exception as e:  # noqa: BLE001 - reported, never swallowed silently
        STATUS[name] = f"failed: {type(e).__name__}: {e}"
        logger.warning("qurl-verl: %s failed: %s: %s\n%s", name, type(e).__name__, e, traceback.format_exc(limit=3))


def _register_cpu_platform():
    from qurl_verl.platform import cpu  # noqa: F401 - registers PlatformCPU on import

    if not cpu.cpu_platform_selected():
        return "registered, not selected"
    from qurl_verl.patches.cpu_platform import cpu_engine_lookup, gloo_backend_dedup

    gloo_backend_dedup.apply()
    cpu_engine_lookup.apply()
    # Inside a vLLM worker of verl's stock rollout, its weight sync needs the weights kept; the
    # qurl_vllm server marks its workers, whose layerwise reload re-packs them instead.
    if "vllm" in sys.modules and os.environ.get("QURL_VLLM_LAYERWISE_RELOAD") != "1":
        from qurl_verl.patches.cpu_platform import vllm_cpu_unquantized_gemm

        vllm_cpu_unquantized_gemm.apply()
    return "selected"


def _hook_config_checks():
    from qurl_verl.config import check_and_prepare
    from qurl_verl.patches.always import validate_config_hook

    validate_config_hook.apply(check_and_prepare)


def _register_losses():
    from qurl_verl.losses.registration import register

    register()


def _register_rollout():
    from qurl_verl.rollout.registration import register

    register()


def load() -> None:
    if STATUS:
        return
    _step("cpu platform", _register_cpu_platform)
    _step("config checks", _hook_config_checks)
    _step("losses", _register_losses)
    _step("rollout", _register_rollout)
    if os.environ.get("QURL_VERBOSE_PLUGIN") == "1":
        logger.warning("qurl-verl plugin loaded in pid %d: %s", os.getpid(), STATUS)


load()
