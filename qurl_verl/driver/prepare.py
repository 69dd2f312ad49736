"""What the driver does once a config passed its checks: say what runs in 8 bits, warn about slow CPU
formats, build the packed AVX2 INT8 GEMM once, and apply UAQ to the checkpoint (the changes to the
config: the actor is pointed at the converted copy, and the rollout told the UAQ it carries)."""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from qurl_verl.model_info import ModelInfo
from qurl_verl.platform.host import Host
from qurl_verl.rollout.engine_checks import check_cpu_rollout_format
from qurl_verl.settings import (
    MODEL_PATH_KEY,
    ROLLOUT_CUSTOM_KEY,
    UAQ_KEY,
    QurlConfigError,
    RolloutSettings,
    UaqSettings,
    dry_run,
    select,
)
from qurl_verl.settings.keys import ROLLOUT_UAQ_KEY

logger = logging.getLogger("qurl_verl")


def report_moe_share(rollout: RolloutSettings, model: ModelInfo, log=print) -> None:
    """With bf16 experts most of an MoE model's weights stay in full precision: say how much runs in 8 bits."""
    if model.moe_experts is None or not rollout.quantized:
        return
    share = model.quantized_share(rollout)
    log(f"[qurl] MoE rollout in {rollout.format.value}: {share['weights']:.0%} of the linear weights and "
        f"{share['active_flops']:.0%} of the active linear FLOPs per token run in 8 bits; routed experts in "
        f"{'the rollout format' if rollout.experts.value == 'quantized' else 'full precision'} "
        f"({ROLLOUT_CUSTOM_KEY}.experts={rollout.experts.value}), routers and lm_head in full precision")


def warn_cpu_rollout_format(rollout: RolloutSettings, host: Host) -> None:
    warning = check_cpu_rollout_format(rollout, amx=host.amx, amx_fp8=host.amx_fp8)
    if warning:
        logger.warning(warning)


def prepare_cpu_int8_gemm(rollout: RolloutSettings) -> None:
    """INT8 rollout on a CPU without VNNI: build the packed AVX2 GEMM once here, so that the rollout
    workers load it from the cache instead of each compiling it (the choice itself is checked first)."""
    from qurl_verl.platform import cpu_int8_gemm

    try:
        choice = cpu_int8_gemm.gemm_choice()
    except ValueError as exc:
        raise QurlConfigError(str(exc)) from None
    if rollout.format == "int8" and choice == "auto" and cpu_int8_gemm.cpu_int8_saturates(cpu_int8_gemm.cpu_flags()):
        cpu_int8_gemm.load()  # logs and returns False if it cannot be built; the workers then use oneDNN


def tell_rollout_uaq(cfg: Any, uaq: UaqSettings) -> None:
    """The UAQ the rollout servers check the checkpoint for (``custom.qurl_uaq``, interpolated by the presets from
    ``qurl.uaq``) follows the driver's decision: off where the driver leaves UAQ out (LoRA adapters)."""
    node = select(cfg, ROLLOUT_UAQ_KEY)
    if node is not None and bool(select(node, "enable", False)) != uaq.enable:
        node["enable"] = uaq.enable


def prepare_config(cfg: Any, uaq: UaqSettings, log=print) -> None:
    """The change qurl-verl makes to a checked config: point the actor at its UAQ checkpoint.

    The checkpoint at ``actor_rollout_ref.model.path`` is converted once (or found in the cache,
    or used as is when it already carries the same UAQ) and the path is rewritten, so the trainer,
    the reference policy and the rollout all start from the re-parametrised weights. The rollout is
    told which UAQ its checkpoint carries (``tell_rollout_uaq``).
    """
    tell_rollout_uaq(cfg, uaq)
    if not uaq.enable:
        return
    from qurl_verl.uaq_checkpoint import ensure_uaq_checkpoint

    model_path = select(cfg, MODEL_PATH_KEY)
    if dry_run():
        log(f"[qurl] dry run: would apply UAQ (s={uaq.scale:g}, {'/'.join(uaq.targets)}) to {model_path} "
            "and point the actor at the converted copy")
        return
    try:
        path = ensure_uaq_checkpoint(local_checkpoint(model_path), scale=uaq.scale, targets=uaq.targets,
                                     cache_dir=uaq.cache_dir, log=log)
    except ValueError as e:  # unsupported architecture, bad targets, a clash with an earlier UAQ: the user's to fix
        raise QurlConfigError(f"{UAQ_KEY}: {e}") from e
    cfg.actor_rollout_ref.model.path = str(path)


def local_checkpoint(path: str) -> Path:
    """The checkpoint folder behind ``path``; a hub id is fetched into the Hugging Face cache first.

    UAQ rewrites the weights on disk, so it needs them locally; verl would download the same
    files into the same cache anyway.
    """
    p = Path(os.path.expanduser(str(path)))
    if p.exists():
        return p
    import huggingface_hub

    try:
        return Path(huggingface_hub.snapshot_download(str(path), ignore_patterns=["*.bin", "*.pth", "*.pt", "*.gguf", "original/*"]))
    except Exception as e:  # noqa: BLE001 - offline, unknown id, no access: the user's to fix
        raise QurlConfigError(
            f"{UAQ_KEY}: cannot fetch {MODEL_PATH_KEY}={path} to convert it ({type(e).__name__}: {e}); "
            "download the checkpoint and pass its local folder"
        ) from e
