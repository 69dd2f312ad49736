"""KV-cache scales: an FP8 KV cache whose per-layer K and V scales come from the trainer at every sync, and
a bf16 cache's scales back to vLLM's defaults after every reload.

* driver: the KV-cache format has one home (``custom.qurl.kv_cache``, never vLLM's ``kv_cache_dtype`` in
  ``engine_kwargs``), the scales need the colocated sync (they are computed in the actor's process), and
  the engine must have an FP8 cache for the model, GPU (compute capability 8.9 or later) and CPU (the servers
  check again on their hosts);
* server: vLLM's ``kv_cache_dtype``; off Hopper, vLLM's Triton attention, which reads the device scales
  each sync rewrites in place (FlashInfer folds host copies into kernel arguments that CUDA graphs keep);
* trainer: appends the per-layer q/k/v scales (``qurl_verl.quant.kv_cache``) from the ranges the actor's
  training forwards saw since the last sync (``patches.qurl_vllm.actor_kv_ranges``, same on every rank);
  a sync with no forward since resends the last scales, and the first sync of a run sends none;
* worker: takes the scales out of the stream and writes them into the attention layers after the reload
  (``load_scales``), and resets the scales of layers with a bf16 cache (``reset_unquantized_scales``). Until a
  stream has carried scales (the first sync), it bounds |q|, |k|, |v| from the streamed weights as they pass
  (``AttentionInputBounds``) and uses those: vLLM's default 1.0 would clip every value past 448 (the query too,
  on CUDA), which Qwen2-family q/k biases can reach.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from qurl_verl.quant.kv_cache import KV_PARTS, AttentionInputBounds, kv_scales, parse_kv_scale_name
from qurl_verl.rollout.features import SyncFeature, register
from qurl_verl.rollout.layerwise_reload import WeightReloadError
from qurl_verl.rollout.sync_stats import stat
from qurl_verl.settings import (
    CHECKPOINT_ENGINE_KEY,
    COLOCATED_SYNC_BACKENDS,
    ROLLOUT_CUSTOM_KEY,
    ROLLOUT_KEY,
    ROLLOUT_NAME,
    ROLLOUT_NAME_KEY,
    QurlConfigError,
    RolloutSettings,
    select,
    show,
)
from qurl_verl.settings.errors import Check
from qurl_verl.settings.rollout import KVCacheFormat

ENGINE_KV_CACHE_DTYPE_KEY = f"{ROLLOUT_KEY}.engine_kwargs.vllm.kv_cache_dtype"  # verl passes it to vLLM as is

# vLLM-CPU's FP8 KV path (``v1/attention/backends/cpu_attn.py::_get_attn_isa``, 0.24 and 0.32) runs
# head sizes that are multiples of 32, on x86 CPUs with AVX-512 or AMX; it raises for the rest.
FP8_KV_CPU_HEAD_DIM_MULTIPLE = 32
FP8_KV_FIX = f"remove {ROLLOUT_CUSTOM_KEY}.kv_cache (the KV cache in the engine's dtype)"
ATTENTION_BACKEND_KEY = "attention_backend"  # vLLM's engine argument (engine/arg_utils.py, 0.24 and 0.32)
DEVICE_SCALE_ATTENTION = "TRITON_ATTN"
HOST_SCALE_ATTENTION = ("FLASHINFER",)  # backends that read the K/V scales as host floats
FP8_KV_NATIVE_MAJOR = 9  # FA3 takes an FP8 cache on the SM90 family only
FP8_KV_MIN_CAPABILITY = (8, 9)  # vLLM's Triton attention (v1/attention/backends/triton_attn.py) refuses FP8 below


# ---------------------------------------------------------------------------------------- driver
def check_kv_cache_setting(cfg: Any, rollout: RolloutSettings) -> None:
    """One home for the KV-cache format of a ``qurl_vllm`` rollout: ``custom.qurl.kv_cache``.

    vLLM's own ``kv_cache_dtype`` (through ``engine_kwargs``) would give the engine an FP8 cache whose
    scales nothing computes: they keep what the dummy start-up load left (on vLLM-CPU random, negative
    ones, refused at the first generation). With ``kv_cache=fp8`` the scales come from the actor's
    training forwards, which only the colocated sync carries."""
    engine_dtype = select(cfg, ENGINE_KV_CACHE_DTYPE_KEY)
    if engine_dtype not in (None, "auto"):
        raise QurlConfigError(
            f"{ENGINE_KV_CACHE_DTYPE_KEY}={show(engine_dtype)} with {ROLLOUT_NAME_KEY}={ROLLOUT_NAME}: the KV-cache format "
            f"of this rollout is set by {ROLLOUT_CUSTOM_KEY}.kv_cache, which also sends the K/V scales at every sync. "
            f"Remove the engine_kwargs entry and set {ROLLOUT_CUSTOM_KEY}.kv_cache=fp8"
        )
    if rollout.kv_cache is not KVCacheFormat.FP8:
        return
    backend = select(cfg, CHECKPOINT_ENGINE_KEY)
    if backend not in COLOCATED_SYNC_BACKENDS:
        raise QurlConfigError(
            f"{ROLLOUT_CUSTOM_KEY}.kv_cache=fp8 with {CHECKPOINT_ENGINE_KEY}={show(backend)}: the K/V scales are computed "
            "in the actor's process from its training forwards and travel with the colocated weight sync, which "
            f"this backend bypasses. Set {CHECKPOINT_ENGINE_KEY}=naive (colocated rollout), or remove "
            f"{ROLLOUT_CUSTOM_KEY}.kv_cache"
        )
    from qurl_verl.patches.qurl_vllm import attention_kv_hook

    if not attention_kv_hook.interface_available():
        raise QurlConfigError(
            f"{ROLLOUT_CUSTOM_KEY}.kv_cache=fp8 observes K and V in transformers' attention dispatch "
            "(AttentionInterface.get_interface, transformers 5), which the installed transformers lacks; "
            f"install transformers>=5.9 or remove {ROLLOUT_CUSTOM_KEY}.kv_cache"
        )


def check_fp8_kv_cache(settings: RolloutSettings, *, on_cpu: bool, avx512: bool, amx: bool,
                       head_dim: int | None, uses_mla: bool, cuda_capability: tuple[int, int] | None = None) -> None:
    """Refuse ``custom.qurl.kv_cache=fp8`` for a model, GPU (``cuda_capability``; None: none seen) or CPU the
    engine's FP8 KV cache cannot serve."""
    if settings.kv_cache is not KVCacheFormat.FP8:
        return
    key = f"{ROLLOUT_CUSTOM_KEY}.kv_cache=fp8"
    if uses_mla:
        raise QurlConfigError(
            f"{key}: this model uses multi-head latent attention, whose cache holds a compressed latent with "
            f"scales of its own, not per-layer K and V; {FP8_KV_FIX}"
        )
    if not on_cpu:
        check_fp8_kv_gpu(key, cuda_capability)
        return
    if not (avx512 or amx):
        raise QurlConfigError(
            f"{key}: vLLM-CPU runs an FP8 KV cache on x86 CPUs with AVX-512 or AMX only, and this CPU has neither "
            f"(AVX2); {FP8_KV_FIX}"
        )
    if head_dim is not None and head_dim % FP8_KV_CPU_HEAD_DIM_MULTIPLE:
        raise QurlConfigError(
            f"{key}: vLLM-CPU's FP8 KV cache needs a head size divisible by {FP8_KV_CPU_HEAD_DIM_MULTIPLE}; this model's "
            f"is {head_dim}; {FP8_KV_FIX}"
        )


def check_fp8_kv_gpu(key: str, cuda_capability: tuple[int, int] | None) -> None:
    """Below compute capability 8.9 (T4, A100, A10) an FP8 KV cache has no attention that runs it and reads the
    scales each sync writes: off Hopper the server gives the engine vLLM's Triton attention, which raises for an
    FP8 cache there at engine start (``TritonAttentionImpl``: native FP8 needs SM89+), and FlashInfer would keep
    the start-up scales in its kernel arguments."""
    from qurl_verl.rollout.cuda_kernel_env import nvidia_capability

    capability = nvidia_capability(cuda_capability)
    if capability is not None and tuple(capability) < FP8_KV_MIN_CAPABILITY:
        raise QurlConfigError(
            f"{key} on compute capability {capability[0]}.{capability[1]}: vLLM's attention runs an FP8 KV cache from "
            f"{FP8_KV_MIN_CAPABILITY[0]}.{FP8_KV_MIN_CAPABILITY[1]} on (L40S, H100, B200; its Triton attention raises "
            f"below at engine start). Use int8 without the FP8 cache: +qurl=int8 instead of +qurl=int8_fp8kv, or "
            f"{FP8_KV_FIX}"
        )


# ---------------------------------------------------------------------------------------- server
def fp8_kv_attention_backend(kv_cache: KVCacheFormat, capability: tuple[int, int] | None,
                             engine_kwargs: Mapping[str, Any]) -> str | None:
    """The attention backend an FP8-KV engine on an NVIDIA GPU of ``capability`` must be given (None: vLLM's own
    choice is right); refuses a user's host-scale backend there."""
    if kv_cache is not KVCacheFormat.FP8 or capability is None or capability[0] == FP8_KV_NATIVE_MAJOR:
        return None
    nested = engine_kwargs.get("attention_config") or {}
    chosen = engine_kwargs.get(ATTENTION_BACKEND_KEY) or (nested.get("backend") if isinstance(nested, Mapping) else None)
    name = str(getattr(chosen, "name", chosen) or "auto").upper()  # vLLM takes its enum or the member's name
    if name == "AUTO":
        return DEVICE_SCALE_ATTENTION
    if name in HOST_SCALE_ATTENTION:
        raise QurlConfigError(
            f"{ROLLOUT_CUSTOM_KEY}.kv_cache=fp8 with attention_backend={chosen} on compute capability "
            f"{capability[0]}.{capability[1]}: it reads the K/V scales as host floats that CUDA graphs keep from "
            "start-up, so the scales the trainer sends would not reach attention. Remove the attention_backend "
            f"engine argument (the server then picks {DEVICE_SCALE_ATTENTION}), or remove {ROLLOUT_CUSTOM_KEY}.kv_cache"
        )
    return None


# ---------------------------------------------------------------------------------------- worker
def attention_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """vLLM's attention layers: the modules that hold KV-cache scales."""
    return [m for m in model.modules() if hasattr(m, "_k_scale") and hasattr(m, "kv_cache_dtype")]


def unquantized_cache_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The attention layers whose KV cache is in the engine's dtype."""
    from vllm.utils.torch_utils import is_quantized_kv_cache

    return [m for m in attention_layers(model) if not is_quantized_kv_cache(m.kv_cache_dtype)]


def fp8_cache_layers(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """{decoder layer: attention layer} of the attention layers with an FP8 KV cache, by the layer index
    vLLM itself reads from their names; a decoder layer with two such layers cannot take one K and one V
    scale per layer from the stream and is refused."""
    from vllm.model_executor.models.utils import extract_layer_index
    from vllm.utils.torch_utils import is_quantized_kv_cache

    layers: dict[int, torch.nn.Module] = {}
    for layer in attention_layers(model):
        if not is_quantized_kv_cache(layer.kv_cache_dtype):
            continue
        index = extract_layer_index(layer.layer_name)
        if index in layers:
            raise WeightReloadError(f"decoder layer {index} has more than one attention layer with an FP8 KV cache "
                                 f"({layers[index].layer_name}, {layer.layer_name}); qurl_vllm sends one scale each")
        layers[index] = layer
    return layers


def fp8_attention(model: torch.nn.Module) -> dict[str, list]:
    """What the attention layers with an FP8 cache run, each as the sorted set of what their layers say:
    ``backends`` (vLLM's backend names), ``impls`` (their classes) and ``quantizes_query``: whether ``forward``
    quantizes the query to FP8 with ``_q_scale`` (vLLM sets ``query_quant`` for an FP8 cache when the backend's
    implementation ``supports_quant_query_input``: Triton attention on CUDA, FlashAttention 3; never on CPU)."""
    layers = list(fp8_cache_layers(model).values())
    return {
        "backends": sorted({layer.attn_backend.get_name() for layer in layers}),
        "impls": sorted({type(layer.impl).__name__ for layer in layers}),
        "quantizes_query": sorted({getattr(layer, "query_quant", None) is not None
                                   and bool(getattr(layer.impl, "supports_quant_query_input", False)) for layer in layers}),
    }


def load_scales(layers: dict[int, torch.nn.Module], scales: dict[tuple[int, str], float]) -> dict[str, float]:
    """After a reload: the streamed ``{(layer, part): scale}`` into the FP8 attention layers; returns
    their range (``kv_scale_{k,v}_{min,max}``, empty without FP8 layers).

    No scales (a first sync whose stream lacked a weight the bounds need, ``AttentionInputBounds``): vLLM's
    defaults, 1.0, what an FP8 cache without calibration uses. Some but not all: ``WeightReloadError``, never a stale
    scale. A scale for a layer without an FP8 cache, or not finite and > 0: ``WeightReloadError``."""
    from qurl_verl.rollout import vllm_versions

    if not layers:
        if scales:
            raise WeightReloadError("the stream carries KV-cache scales, but this engine's KV cache is not FP8")
        return {}
    if not scales:
        scales = {(index, part): 1.0 for index in layers for part in KV_PARTS}
    unknown = sorted({index for index, _ in scales} - set(layers))
    missing = sorted(f"{index}.{part}" for index in layers for part in KV_PARTS if (index, part) not in scales)
    bad = sorted(f"{index}.{part}={value}" for (index, part), value in scales.items()
                 if not (math.isfinite(value) and value > 0))
    problems = [f"{what} {found[:6]}" for what, found in (
        ("missing for layer.part", missing), ("for layers without an FP8 cache", unknown), ("not finite and > 0", bad),
    ) if found]
    if problems:
        raise WeightReloadError(f"KV-cache scales of the stream: {'; '.join(problems)}")
    with torch.no_grad():
        for index, layer in layers.items():
            vllm_versions.set_attention_scales(layer, *(scales[(index, part)] for part in KV_PARTS))
    return {
        f"kv_scale_{part}_{name}": fn(scales[(index, part)] for index in layers)
        for part in ("k", "v") for name, fn in (("min", min), ("max", max))
    }


def reset_unquantized_scales(layers: list[torch.nn.Module]) -> None:
    """After a reload: vLLM's defaults (1.0) in the KV-cache scales of attention layers with an
    unquantized KV cache, as vLLM sets them there (``set_default_quant_scales``).

    No stream delivers them, and the reload puts back whatever the layer held. Under vLLM 0.24 a
    compressed-tensors model keeps ``_q_scale``/``_k_scale``/``_v_scale`` as *parameters* (its KV-cache
    method assigns its ``k_scale`` Parameter to them), filled by the dummy load with random values;
    a level-2 sleep (verl, ``enable_sleep_mode``) discards them and restores only buffers, leaving
    uninitialized memory. The same goes for the scale ranges and host copies kept as plain
    attributes. vLLM forces these scales to 1.0 for an unquantized KV cache, yet its GPU
    FlashAttention still receives ``_q/_k/_v_scale`` as descale factors on every call: after the
    reset they hold exactly vLLM's values, whatever the kernel does with them, and the sync
    defines every tensor the engine holds."""
    from vllm.model_executor.layers.attention.attention import set_default_quant_scales

    for layer in layers:
        set_default_quant_scales(layer, register_buffer=False)


@dataclass
class KVScaleStats:
    # how many layers took their scales from the stream (0: the first sync), how many from the bounds of the
    # streamed weights (the first sync; 0 there: vLLM's default 1.0, a weight the bounds need did not pass),
    # and the range of the K and V scales after the sync (None: no FP8 cache)
    kv_scale_layers_streamed: int = stat(0)
    kv_scale_layers_from_weights: int = stat(0)
    kv_scale_k_min: float | None = stat()
    kv_scale_k_max: float | None = stat()
    kv_scale_v_min: float | None = stat()
    kv_scale_v_max: float | None = stat()


@register
class KVCacheScales(SyncFeature):
    name = "kv_cache_scales"
    stats = KVScaleStats
    checks = (
        Check("the KV-cache format has one home, and FP8 KV scales a way to the engine", lambda r: r.rollout is not None,
              lambda r: check_kv_cache_setting(r.cfg, r.rollout), f"set {ROLLOUT_CUSTOM_KEY}.kv_cache=fp8"),
        Check("the engine has an FP8 KV cache for this model, GPU and CPU", lambda r: r.rollout is not None,  # servers: again
              lambda r: check_fp8_kv_cache(r.rollout, on_cpu=r.on_cpu, avx512=r.host.avx512, amx=r.host.amx,
                                           head_dim=r.model.head_dim, uses_mla=r.model.uses_mla,
                                           cuda_capability=r.host.cuda_capability),
              f"remove {ROLLOUT_CUSTOM_KEY}.kv_cache"),
    )

    def __init__(self, settings: RolloutSettings):
        super().__init__(settings)
        self.last_sent: dict | None = None  # trainer: the scales last sent, {stream name: tensor}
        self.streamed: dict[tuple[int, str], float] = {}  # worker: this sync's, (layer, part) -> scale
        self.scales_received = False  # worker: a stream has carried scales (from then on, no weight bounds)
        self.bounds: AttentionInputBounds | None = None
        self.from_weights: dict[tuple[int, str], float] = {}  # worker: this sync's scales bounded from the weights

    @property
    def fp8(self) -> bool:
        return self.settings.kv_cache is KVCacheFormat.FP8

    def stream_setting(self) -> tuple[str, str] | None:
        return (f"{ROLLOUT_CUSTOM_KEY}.kv_cache", "the K/V scales") if self.fp8 else None

    def engine_kwargs(self, engine_kwargs: dict, hf_config: Any, model_path: str) -> None:
        if self.fp8:
            from vllm.platforms import current_platform

            from qurl_verl.model_info import ModelInfo
            from qurl_verl.platform.host import Host
            from qurl_verl.rollout.console_log import engine_logger
            from qurl_verl.rollout.cuda_kernel_env import nvidia_capability

            host = Host.probe()
            model = ModelInfo.of_config(hf_config.to_dict(), model_path)
            check_fp8_kv_cache(self.settings, on_cpu=current_platform.is_cpu(), avx512=host.avx512, amx=host.amx,
                               head_dim=model.head_dim, uses_mla=model.uses_mla, cuda_capability=host.cuda_capability)
            backend = fp8_kv_attention_backend(self.settings.kv_cache, nvidia_capability(host.cuda_capability),
                                               engine_kwargs)
            if backend:
                engine_logger().warning(  # in the server process, whose root logger is at ERROR (console_log)
                    "qurl_vllm: FP8 KV cache on compute capability %s: attention_backend=%s, which reads the K/V "
                    "scales each sync writes", host.cuda_capability, backend)
                engine_kwargs[ATTENTION_BACKEND_KEY] = backend
        engine_kwargs["kv_cache_dtype"] = self.settings.kv_cache.engine_dtype

    def trainer_setup(self) -> None:
        if self.fp8:
            from qurl_verl.patches import qurl_vllm as qurl_vllm_patches

            qurl_vllm_patches.apply_all(kv_cache_scales=True)

    def trainer_tensors(self) -> Iterable[tuple[str, torch.Tensor]]:
        """The scales this sync sends: from the ranges observed since the last sync, else the last ones."""
        if not self.fp8:
            return ()
        from qurl_verl.patches.qurl_vllm import actor_kv_ranges

        observed = actor_kv_ranges.observer.take()
        if observed:
            self.last_sent = kv_scales(observed)
        return list((self.last_sent or {}).items())

    def prepare(self, sync) -> None:
        """The attention layers, read while the model is intact."""
        self.unquantized = unquantized_cache_layers(sync.model)
        self.fp8_layers = fp8_cache_layers(sync.model)
        self.streamed = {}
        self.bounds = AttentionInputBounds() if self.fp8_layers and not self.scales_received else None

    def take(self, name: str, tensor: torch.Tensor) -> bool:
        kv = parse_kv_scale_name(name)
        if kv is not None:
            self.streamed[kv] = float(tensor)
        elif self.bounds is not None:
            self.bounds.see(name, tensor)  # the tensor still goes to the loader
        return kv is not None

    def after_finalize(self, sync) -> None:
        with torch.device(sync.device), torch.no_grad():  # 0.24's scale parameters require grad
            reset_unquantized_scales(self.unquantized)
            scales, self.from_weights = self.streamed, {}
            if not scales and self.bounds is not None:
                scales = self.from_weights = self.bounds.scales(self.fp8_layers)
            self.range = load_scales(self.fp8_layers, scales)
        self.scales_received |= bool(self.streamed)
        self.bounds = None

    def summarize(self, sync) -> KVScaleStats:
        return KVScaleStats(kv_scale_layers_streamed=len({layer for layer, _ in self.streamed}),
                            kv_scale_layers_from_weights=len({layer for layer, _ in self.from_weights}), **self.range)
