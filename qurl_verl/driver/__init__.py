"""What qurl-verl does in the driver, inside verl's ``validate_config``, before Ray starts.

For a config that uses qurl-verl (``settings.uses_qurl``): refuse verl's legacy trainer where
``main_ppo`` would run it (``trainer_modes``); check the config, with one message that names the key
to change (``checks``: one table of rows over the config, its settings, the model's ``config.json``
read once and the host probed once); then say what runs in 8 bits and what a disaggregated rollout's
full-precision sync leaves out, build what the workers would each build, and apply UAQ to the
checkpoint once, pointing the actor at the result (``prepare``). Every other config passes through untouched: stock verl runs in a shared
environment behave as if the plugin were not installed.
"""
from __future__ import annotations

import logging
import weakref
from typing import Any

from qurl_verl.driver.checks import CHECKS, COMPOSITION_CHECKS, Run
from qurl_verl.driver.int8_sync_checks import prepare_int8_sync
from qurl_verl.driver.prepare import prepare_config, prepare_cpu_int8_gemm, report_moe_share, warn_cpu_rollout_format
from qurl_verl.driver.trainer_modes import check_v1_trainer, full_precision_sync_warning, in_ray_actor
from qurl_verl.model_info import ModelInfo
from qurl_verl.platform.host import Host
from qurl_verl.settings import MODEL_PATH_KEY, QurlSettings, select, uses_qurl
from qurl_verl.settings.errors import refuse_first

# id(config) -> a weak reference to it, for each config the hook prepared (a DictConfig hashes by its content,
# which the preparation changes, so not a WeakSet)
_PREPARED: dict[int, weakref.ref] = {}
logger = logging.getLogger("qurl_verl")


def on_validate_config(cfg: Any, log=print, host: Host | None = None) -> QurlSettings | None:
    """The hook verl's ``validate_config`` runs first (``qurl_verl.patches.always.validate_config_hook``).

    In verl 0.9.1 the one call outside a Ray actor is ``main_ppo.main``'s, in the driver, which then runs the
    legacy trainer if ``trainer.use_v1`` is falsy: refused there. The other calls run in TaskRunner actors
    (the legacy trainer's, one-step-off's), after the driver's."""
    if not uses_qurl(cfg):
        return None
    in_driver = not in_ray_actor()
    if in_driver:
        check_v1_trainer(cfg)
    return check_and_prepare(cfg, log=log, host=host, in_driver=in_driver)


def check_and_prepare(cfg: Any, log=print, host: Host | None = None, in_driver: bool = True) -> QurlSettings:
    """Check a qurl config, say what the run will do (once, in the driver), and prepare it."""
    settings = check_config(cfg, log=log, host=host)
    if settings.uaq_skipped:
        log(settings.uaq_skipped)
    if in_driver:
        warning = full_precision_sync_warning(cfg, settings.rollout)
        if warning:
            logger.warning(warning)
    prepare_config(cfg, settings.uaq, log=log)
    prepare_int8_sync(cfg, ModelInfo(select(cfg, MODEL_PATH_KEY)).config)
    try:
        _PREPARED[id(cfg)] = weakref.ref(cfg)
    except TypeError:  # a plain dict: nothing to remember it by
        pass
    return settings


def prepared(cfg: Any) -> bool:
    """Whether ``on_validate_config`` has checked and prepared this config object in this process."""
    ref = _PREPARED.get(id(cfg))
    return ref is not None and ref() is cfg


def ensure_prepared(cfg: Any, log=print) -> None:
    """The driver's checks and preparation for an entry point that starts Ray without verl's ``validate_config``
    (verl 0.9.1's ``fully_async_policy.fully_async_main`` calls ``run_ppo`` directly): run once, before Ray."""
    if uses_qurl(cfg) and not prepared(cfg):
        log("[qurl] this entry point skips verl's validate_config: running qurl-verl's driver checks before Ray starts")
        check_and_prepare(cfg, log=log)


def check_config(cfg: Any, log=print, host: Host | None = None) -> QurlSettings:
    """Every check of a config that uses qurl-verl; returns its settings or raises QurlConfigError.

    ``host``: the machine the checks decide for (default: this one, probed now)."""
    refuse_first(COMPOSITION_CHECKS, cfg)
    settings = QurlSettings.from_config(cfg)
    run = Run(cfg, settings, ModelInfo(select(cfg, MODEL_PATH_KEY)), host or Host.probe())
    refuse_first(CHECKS, run)
    if run.rollout is not None:
        report_moe_share(run.rollout, run.model, log=log)
        if run.on_cpu:
            warn_cpu_rollout_format(run.rollout, run.host)
            prepare_cpu_int8_gemm(run.rollout)
    return settings
