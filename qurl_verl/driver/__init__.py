"""What qurl-verl does in the driver, inside verl's ``validate_config``, before Ray starts.

For a config that uses qurl-verl (``settings.uses_qurl``): check it, with one message that names
the key to change (``checks``: one table of rows over the config, its settings, the model's
``config.json`` read once and the host probed once), then say what runs in 8 bits, build what the
workers would each build, and apply UAQ to the checkpoint once, pointing the actor at the result
(``prepare``). Every other config passes through untouched: stock verl runs in a shared
environment behave as if the plugin were not installed.
"""
from __future__ import annotations

from typing import Any

from qurl_verl.driver.checks import CHECKS, COMPOSITION_CHECKS, Run, refuse_first
from qurl_verl.driver.prepare import prepare_config, prepare_cpu_int8_gemm, report_moe_share, warn_cpu_rollout_format
from qurl_verl.model_info import ModelInfo
from qurl_verl.platform.host import Host
from qurl_verl.settings import MODEL_PATH_KEY, QurlSettings, select, uses_qurl


def on_validate_config(cfg: Any, log=print, host: Host | None = None) -> QurlSettings | None:
    """The hook verl's ``validate_config`` runs first (``qurl_verl.patches.always.validate_config_hook``)."""
    if not uses_qurl(cfg):
        return None
    settings = check_config(cfg, log=log, host=host)
    if settings.uaq_skipped:
        log(settings.uaq_skipped)
    prepare_config(cfg, settings.uaq, log=log)
    return settings


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
