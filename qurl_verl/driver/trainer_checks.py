"""The trainer side of a qurl run: the attention the FSDP actor and the critic load with on GPUs, and the
actor strategy that can feed the ``qurl_vllm`` weight stream (the sync features' own rows:
``rollout.features``)."""
from __future__ import annotations

from typing import Any

from qurl_verl.platform.host import Host
from qurl_verl.settings import (
    ACTOR_STRATEGY_KEY,
    ATTN_IMPLEMENTATION_KEY,
    ROLLOUT_NAME,
    ROLLOUT_NAME_KEY,
    QurlConfigError,
    select,
)

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
