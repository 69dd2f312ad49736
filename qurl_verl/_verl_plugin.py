"""verl 0.9.1 ``verl.plugins`` entry point: imported by every process that imports verl.

Cheap and lazy (no vLLM import). What it installs changes nothing for a run that does not use
qurl-verl: the policy losses and the rollout backend are new names in verl's registries, the
``cpu`` platform is registered but selected only by ``VERL_PLATFORM=cpu``, and the
``validate_config`` hook returns at once for a config without a qurl preset, a ``qurl_*`` loss,
the ``qurl_vllm`` rollout or the CPU platform. Patches are applied only where their condition
holds (see ``qurl_verl.patches``).

verl swallows plugin import errors at DEBUG level, so every failure is logged here at WARNING
and recorded; the driver then says why a configured qurl name is missing
(``qurl_verl.plugin_status()``).
"""
from __future__ import annotations

import logging
import os
import traceback

from qurl_verl.patches.contract import describe
from qurl_verl.settings import cpu_platform_selected

logger = logging.getLogger("qurl_verl")

# part -> "ok", "ok (detail)" or "failed: <error>"; read by qurl_verl.plugin_status()
STATUS: dict[str, str] = {}


def _step(name: str, fn) -> None:
    try:
        result = fn()
        STATUS[name] = f"ok ({result})" if result else "ok"
    except Exception as e:  # noqa: BLE001 - reported, never swallowed silently
        STATUS[name] = f"failed: {type(e).__name__}: {e}"
        logger.warning("qurl-verl: %s failed: %s: %s\n%s", name, type(e).__name__, e, traceback.format_exc(limit=3))


def _cpu_platform() -> str:
    from qurl_verl.platform import cpu  # noqa: F401 - @PlatformRegistry.register at the class

    if not cpu_platform_selected():
        return "registered, not selected"
    from qurl_verl.patches import cpu_platform

    return "selected: " + (describe(cpu_platform.apply_all()) or "nothing new")


def _config_checks() -> str:
    from qurl_verl.driver import ensure_prepared, on_validate_config
    from qurl_verl.patches import always

    return describe(always.apply_all(check=on_validate_config, prepare=ensure_prepared))


def _losses() -> None:
    import qurl_verl.losses.verl_losses  # noqa: F401 - @register_policy_loss at each definition


def _rollout() -> None:
    import qurl_verl.rollout.registration  # noqa: F401 - registers the lazy qurl_vllm loaders


def load() -> None:
    if STATUS:
        return
    _step("cpu platform", _cpu_platform)
    _step("config checks", _config_checks)
    _step("losses", _losses)
    _step("rollout", _rollout)
    if os.environ.get("QURL_VERBOSE_PLUGIN") == "1":
        logger.warning("qurl-verl plugin loaded in pid %d: %s", os.getpid(), STATUS)


load()
