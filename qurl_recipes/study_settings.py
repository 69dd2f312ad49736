"""The GRPO study's variants (rollout format, loss, UAQ, learning rates, FP8 KV cache) and run settings."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

from qurl_verl.quant import int_format
from qurl_verl.quant.uaq import DEFAULT_UAQ_SCALE


@dataclass(frozen=True)
class Variant:
    """How a variant rolls out and which loss it trains with."""

    rollout: str  # "bf16" or "quantized" (W{b}A8)
    loss: str  # "vanilla" (ratio to pi_prox), "naive" (ratio to pi_behav, Eq. 3), "tis" (Eq. 5), "acr" (Eq. 9)
    uaq: bool = False
    per_group_lr: bool = False
    clip_as_uaq: bool = False  # clip by the gradient norm UAQ would see (uaq_vs_lr.clip_grad_norm_as_uaq_)
    fp8_kv: bool = False  # the rollout's KV cache holds K and V as FP8 E4M3 (per-layer scales)


VARIANTS: dict[str, Variant] = {
    "bf16": Variant("bf16", "vanilla"),
    "naive": Variant("quantized", "naive"),
    "tis": Variant("quantized", "tis"),
    "acr_no_uaq": Variant("quantized", "acr"),
    "acr_uaq": Variant("quantized", "acr", uaq=True),
    "acr_per_group_lr": Variant("quantized", "acr", per_group_lr=True),
    "acr_per_group_lr_uaq_clip": Variant("quantized", "acr", per_group_lr=True, clip_as_uaq=True),
    "tis_fp8kv": Variant("quantized", "tis", fp8_kv=True),
    "acr_uaq_fp8kv": Variant("quantized", "acr", uaq=True, fp8_kv=True),
    # the staleness arms' BF16 rollouts: a stale BF16 behaviour policy needs the same correction as a quantized one
    "bf16_tis": Variant("bf16", "tis"),
    "bf16_acr": Variant("bf16", "acr"),
}


@dataclass(frozen=True)
class StudySettings:
    steps: int = 200
    weight_bits: int = 5  # the mildest width whose pilot KL(behav||prox) reached 2e-3 (study README)
    prompts_per_step: int = 16
    group_size: int = 8
    mini_batches: int = 2
    lr: float = 1e-5  # 1e-4 wrecked greedy accuracy within 12 steps, BF16 included (study README)
    weight_decay: float = 0.01  # verl's actor.optim default
    max_grad_norm: float = 1.0
    is_cap: float = 2.0
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0
    uaq_scale: float = DEFAULT_UAQ_SCALE
    max_response_tokens: int = 64
    n_train: int = 64
    n_val: int = 64
    val_every: int = 25
    data_seed: int = 0
    # the behaviour policy is the rollout-format copy of the weights from this many updates (steps) ago, the
    # proximal one the current full-precision weights, as verl's asynchronous trainers run decoupled PPO;
    # the first steps use the oldest weights there are (the start), so their staleness is the step number
    staleness: int = 0

    def __post_init__(self):
        int_format(self.weight_bits)  # validates 4..8
        if self.mini_batches < 1 or (self.prompts_per_step * self.group_size) % self.mini_batches:
            raise ValueError(f"{self.prompts_per_step} x {self.group_size} responses do not split into "
                             f"{self.mini_batches} equal mini-batches")
        if self.steps < 1 or self.val_every < 1:
            raise ValueError("steps and val_every must be positive")
        if self.staleness < 0:
            raise ValueError(f"staleness counts updates and must be >= 0, got {self.staleness}")


# settings added after runs were recorded, with the value those runs ran under
_ADDED_SINCE = {"staleness": 0}


def recorded_settings(settings: dict) -> dict:
    """A run's recorded settings in today's terms: a setting it predates holds the value it ran under,
    so a finished run or a report of an earlier version still counts as the same settings."""
    return {**_ADDED_SINCE, **settings}


def add_settings_arguments(parser: argparse.ArgumentParser, leave: tuple[str, ...] = ()) -> None:
    """A ``--flag`` per ``StudySettings`` field (``--weight-bits`` for ``weight_bits``) with its default, but those
    in ``leave``; ``StudySettings(**{f: vars(args)[f] ...})`` rebuilds the settings."""
    defaults = StudySettings()
    for f in fields(StudySettings):
        if f.name not in leave:
            default = getattr(defaults, f.name)
            parser.add_argument(f"--{f.name.replace('_', '-')}", type=type(default), default=default)
