"""GRPO study of QuRL's mechanisms on the tiny model: rollout/loss variants, pure torch.

The study needs hundreds of GRPO steps per variant and seed, with 64-token answers; through
``main_ppo`` on two CPU cores a step costs tens of seconds, so the twelve runs would take most of
a day. This harness runs the same algorithm in one process instead:

* rollout: the current fp32 weights cast to bf16 (``bf16``) or re-quantized to W{b}A8 every step
  (``quantize_linear_modules_(fake=True)``: codes within +-(2^(b-1)-1), per-channel weight and
  per-token activation absmax, the function vLLM's INT8 kernel computes for the same codes, see
  ``tests/integration/test_qurl_vllm_reload.py``); temperature-1 sampling with a KV cache;
* FP8 KV cache (the ``*_fp8kv`` variants): in every attention call of the rollout, K and V are
  quantize-dequantized to FP8 E4M3 with one scale per layer for K and one for V, what the cache
  stores and gives back; the scales come from the K/V ranges of the previous step's update
  forwards of the fp32 trainer (``qurl_verl.quant.kv_cache``), 1.0 before the first update;
* behaviour log-probs from the sampling pass, proximal log-probs from the fp32 model before the
  update, GRPO advantages, ``mini_batches`` AdamW updates per rollout (so the PPO ratio moves
  off 1 and the clip bounds bind), token-mean loss, gradient clipping, as verl's defaults;
* losses from ``qurl_verl.losses.acr`` (Eq. 9; with w = 1 it is verl's vanilla PPO loss, see
  ``tests/unit/test_acr_loss.py``), UAQ from ``qurl_verl.quant.apply_uaq`` and the per-group
  learning rates from ``qurl_recipes.uaq_vs_lr``.

Every step appends one JSON line (reward, KL(behav||prox), w, clip fractions, changed codes,
timings; validation accuracy every ``val_every`` steps). A run that has logged all its steps is
not rerun; an interrupted one continues from its last checkpoint (every ``checkpoint_every``
steps), bit-identical to an uninterrupted run. Never imports verl or vLLM.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from qurl_recipes.data.chain_arithmetic import draw_problems
from qurl_recipes.rewards.chain_arithmetic import final_answer
from qurl_recipes.uaq_vs_lr import clip_grad_norm_as_uaq_, group_normalised_advantages, per_group_lr_param_groups
from qurl_verl.losses.acr import LOG_RATIO_BOUND, acr_token_loss
from qurl_verl.patches.qurl_vllm.attention_kv_hook import kv_hook, layer_index
from qurl_verl.platform.cpu_features import cpu_class, cpu_model_and_flags
from qurl_verl.quant import QuantScheme, apply_uaq, int_format, quantize_linear_modules_
from qurl_verl.quant.kv_cache import FP8_KV_MAX, KVRangeObserver, quantize_dequantize_fp8, scale_from_amax
from qurl_verl.quant.linear import W8A8Linear
from qurl_verl.quant.uaq import DEFAULT_UAQ_SCALE, DEFAULT_UAQ_TARGETS
from qurl_verl.quant.update_visibility import changed_code_count


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

    def __post_init__(self):
        int_format(self.weight_bits)  # validates 4..8
        if self.mini_batches < 1 or (self.prompts_per_step * self.group_size) % self.mini_batches:
            raise ValueError(f"{self.prompts_per_step} x {self.group_size} responses do not split into "
                             f"{self.mini_batches} equal mini-batches")
        if self.steps < 1 or self.val_every < 1:
            raise ValueError("steps and val_every must be positive")


def build_rollout(model: nn.Module, variant: Variant, weight_bits: int) -> nn.Module:
    """The policy the engine would hold after this step's weight sync (a copy; ``model`` untouched)."""
    policy = _clone(model)
    if variant.rollout == "bf16":
        return policy.to(torch.bfloat16)
    return quantize_linear_modules_(policy, scheme=QuantScheme(int_format(weight_bits)), fake=True)


def _clone(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model).eval()


def quantized_codes(rollout: nn.Module) -> dict[str, torch.Tensor]:
    return {name: m.weight.clone() for name, m in rollout.named_modules() if isinstance(m, W8A8Linear)}


def changed_code_shares(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor],
                        targets=DEFAULT_UAQ_TARGETS) -> tuple[float, float]:
    """(share of all quantized weight codes that changed, the same over UAQ's q/k/v targets)."""
    changed = total = changed_t = total_t = 0
    for name, codes in after.items():
        n = changed_code_count(before[name], codes)
        changed, total = changed + n, total + codes.numel()
        if name.rsplit(".", 1)[-1] in targets:
            changed_t, total_t = changed_t + n, total_t + codes.numel()
    return changed / max(total, 1), changed_t / max(total_t, 1)


# vLLM's K and V scale before any is loaded, so what the first rollout of a run uses (the trainer
# has not run a forward yet that could measure the ranges)
INITIAL_KV_SCALE = 1.0


@dataclass(frozen=True)
class KVScales:
    """The per-layer FP8 KV cache scales one rollout uses: ``k[layer]``, ``v[layer]`` (float32)."""

    k: torch.Tensor
    v: torch.Tensor

    @classmethod
    def initial(cls, layers: int) -> KVScales:
        return cls(torch.full((layers,), INITIAL_KV_SCALE), torch.full((layers,), INITIAL_KV_SCALE))

    @classmethod
    def from_amax(cls, amax: dict[int, torch.Tensor]) -> KVScales:
        """Scales from ``KVRangeObserver.take()`` ({layer: [q, k, v] amax}), which must cover every layer."""
        if sorted(amax) != list(range(len(amax))) or not amax:
            raise ValueError(f"K/V ranges observed for layers {sorted(amax)}, not for every layer from 0")
        table = torch.stack([amax[i] for i in range(len(amax))])
        return cls(scale_from_amax(table[:, 1]), scale_from_amax(table[:, 2]))

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"k": self.k.clone(), "v": self.v.clone()}

    def stats(self) -> dict[str, float]:
        return {"kv_k_scale_min": float(self.k.min()), "kv_k_scale_max": float(self.k.max()),
                "kv_v_scale_min": float(self.v.min()), "kv_v_scale_max": float(self.v.max())}


class FP8KVCache:
    """Attention hook (``kv_hook``) that gives every attention call K and V as an FP8 E4M3 cache with
    these per-layer scales holds them; Q is left as it is. ``fill`` keeps the largest |K| or |V| seen
    as a share of the FP8 range (448 x scale): above 1 the cache saturated.

    The hook sees the whole cache, past positions and new ones, at every call. It keeps the quantized
    tensors of each layer and, while decoding, quantizes only the positions added since the last call:
    the same values as quantizing everything again (elementwise, deterministic), without redoing the
    whole cache at every token. A call whose query covers every key (a prefill or a full forward)
    starts afresh."""

    def __init__(self, scales: KVScales):
        self.scales = scales
        self.fill = 0.0
        self._held: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @torch.no_grad()
    def __call__(self, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
        layer = layer_index(module)
        k_scale, v_scale = self.scales.k[layer], self.scales.v[layer]
        added, length = query.shape[-2], key.shape[-2]
        held = self._held.get(layer)
        if held is not None and added < length and held[0].shape[:-2] == key.shape[:-2] \
                and held[0].shape[-2] == length - added:
            key, value = key[..., -added:, :], value[..., -added:, :]
        else:
            held = None
        self.fill = max(self.fill, float(key.abs().amax() / (FP8_KV_MAX * k_scale)),
                        float(value.abs().amax() / (FP8_KV_MAX * v_scale)))
        key, value = quantize_dequantize_fp8(key, k_scale), quantize_dequantize_fp8(value, v_scale)
        if held is not None:
            key, value = torch.cat([held[0], key], dim=-2), torch.cat([held[1], value], dim=-2)
        self._held[layer] = (key, value)
        return query, key, value


def attended_kv_ranges(observer: KVRangeObserver, attention_mask: torch.Tensor):
    """Attention hook that feeds ``observer`` the Q/K/V of the attended tokens of a full forward
    (``attention_mask`` [n, T]): verl's padding-free forwards never see pad positions, so their K and
    V must not widen the ranges."""

    @torch.no_grad()
    def observe(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
        on = attention_mask[:, None, :, None].to(key.dtype)  # [n, 1, T, 1] against [n, heads, T, head_dim]
        observer.observe(layer_index(module), query.detach() * on, key.detach() * on, value.detach() * on)

    return observe


def _attention_hook(hook):
    return contextlib.nullcontext() if hook is None else kv_hook(hook)


@dataclass
class Rollout:
    sequences: torch.Tensor  # [N, Lp + L] left-padded prompt, then the response (pad after EOS)
    attention_mask: torch.Tensor  # [N, Lp + L]
    response_mask: torch.Tensor  # [N, L] response tokens up to and including EOS
    behaviour_log_probs: torch.Tensor  # [N, L] log pi_behav of the sampled tokens (float32)
    texts: list[str]
    behaviour_entropy: torch.Tensor  # [N, L] entropy of pi_behav at each response position (nats)


def _position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


@torch.no_grad()
def sample(policy: nn.Module, tokenizer, prompts: list[str], group_size: int, max_new_tokens: int,
           seed: int, greedy: bool = False, kv_cache: FP8KVCache | None = None) -> Rollout:
    """``group_size`` temperature-1 samples per prompt (or one greedy answer), with their log-probs;
    with ``kv_cache``, through an FP8 KV cache (sampling and log-probs are the same pass)."""
    tokenizer.padding_side = "left"
    enc = tokenizer([p for p in prompts for _ in range(group_size)], return_tensors="pt", padding=True,
                    add_special_tokens=False)
    torch.manual_seed(seed)
    with _attention_hook(kv_cache):
        out = policy.generate(**enc, do_sample=not greedy, temperature=None if greedy else 1.0, top_k=0, top_p=1.0,
                              max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                              eos_token_id=tokenizer.eos_token_id, output_logits=True, return_dict_in_generate=True)
    prompt_len = enc["input_ids"].shape[1]
    response = out.sequences[:, prompt_len:]
    logits = torch.stack(out.logits, dim=1).float()  # [N, L, V], raw (temperature 1, no top-k/p)
    log_p = torch.log_softmax(logits, dim=-1)
    behaviour = log_p.gather(-1, response[..., None]).squeeze(-1)
    entropy = -(log_p.exp() * log_p).nan_to_num().sum(-1)  # 0 * log 0 = 0 where top-k masked a token
    is_eos = response == tokenizer.eos_token_id
    ended_before = (is_eos.cumsum(-1) - is_eos.long()) > 0  # an EOS strictly earlier in the row
    response_mask = ~ended_before
    attention_mask = torch.cat([enc["attention_mask"], response_mask.long()], dim=1)
    texts = tokenizer.batch_decode(response, skip_special_tokens=True)
    return Rollout(out.sequences, attention_mask, response_mask, behaviour, texts, entropy)


def response_log_probs(model: nn.Module, rollout: Rollout, rows: slice | torch.Tensor = slice(None)) -> torch.Tensor:
    """log pi(response token | prefix) under ``model`` for the given rows, [n, L] float32."""
    seqs, mask = rollout.sequences[rows], rollout.attention_mask[rows]
    length = rollout.response_mask.shape[1]
    logits = model(input_ids=seqs, attention_mask=mask, position_ids=_position_ids(mask)).logits
    logits = logits[:, -length - 1:-1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, seqs[:, -length:, None]).squeeze(-1)


def exact_rewards(texts: list[str], answers: list[int]) -> torch.Tensor:
    return torch.tensor([float(final_answer(t) == a) for t, a in zip(texts, answers)])


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    return float((x * mask).sum() / mask.sum().clamp(min=1))


def mismatch_stats(log_w: torch.Tensor, mask: torch.Tensor, is_cap: float) -> dict[str, float]:
    """KL(pi_behav || pi_prox) estimators over the sampled tokens and the spread of w = pi_prox / pi_behav."""
    log_w = log_w.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    w = log_w.exp()
    on = mask.bool()
    return {
        "kl_k1": masked_mean(-log_w, mask),
        "kl_k3": masked_mean(w - 1 - log_w, mask),
        "w_max": float(w[on].max()),
        "w_frac_above_c": masked_mean((w > is_cap).float(), mask),
    }


class StudyRun:
    """One variant, one seed: the GRPO loop and its per-step record."""

    def __init__(self, model_dir: str | Path, variant: str, seed: int, settings: StudySettings):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if variant not in VARIANTS:
            raise ValueError(f"unknown variant {variant!r}; expected one of {list(VARIANTS)}")
        self.name, self.variant, self.seed, self.settings = variant, VARIANTS[variant], seed, settings
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model = apply_uaq(model, settings.uaq_scale) if self.variant.uaq else model
        s = settings
        params = (per_group_lr_param_groups(self.model, s.lr, s.uaq_scale, weight_decay=s.weight_decay)
                  if self.variant.per_group_lr else self.model.parameters())
        self.optimizer = torch.optim.AdamW(params, lr=s.lr, weight_decay=s.weight_decay)
        train = draw_problems(s.n_train, s.data_seed)
        val = draw_problems(s.n_val, s.data_seed + 1, exclude=set(train))
        self.train = [(self._prompt(p.question()), p.answer()) for p in train]
        self.val = [(self._prompt(p.question()), p.answer()) for p in val]
        self._order = random.Random(seed)
        self._queue: list[int] = []
        self._codes: dict[str, torch.Tensor] | None = None
        # the scales the next rollout's FP8 KV cache uses: 1.0 until the trainer has measured K and V
        self.kv_scales = KVScales.initial(self.model.config.num_hidden_layers) if self.variant.fp8_kv else None

    def state_dict(self) -> dict:
        """What carries over from one step to the next. Sampling and the mini-batch order draw from
        per-step seeds; the global RNG is kept too, so that nothing depends on that holding."""
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "order": self._order.getstate(), "queue": list(self._queue), "codes": self._codes,
                "torch_rng": torch.get_rng_state(),
                "kv_scales": self.kv_scales.state_dict() if self.kv_scales is not None else None}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])  # copies in place: the optimizer keeps its parameters
        self.optimizer.load_state_dict(state["optimizer"])
        self._order.setstate(state["order"])
        self._queue = list(state["queue"])
        self._codes = state["codes"]
        torch.set_rng_state(state["torch_rng"])
        kv = state.get("kv_scales")  # absent from checkpoints of variants written before the FP8 KV arm
        self.kv_scales = KVScales(kv["k"], kv["v"]) if kv is not None else None

    def rollout_kv_cache(self) -> FP8KVCache | None:
        """The FP8 KV cache of this step's rollout policy, None for a variant without one."""
        return FP8KVCache(self.kv_scales) if self.kv_scales is not None else None

    def _prompt(self, question: str) -> str:
        return self.tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                                  tokenize=False)

    def _next_prompts(self) -> list[tuple[str, int]]:
        picked = []
        while len(picked) < self.settings.prompts_per_step:
            if not self._queue:
                self._queue = list(range(len(self.train)))
                self._order.shuffle(self._queue)
            picked.append(self.train[self._queue.pop()])
        return picked

    def greedy_accuracy(self, policy: nn.Module, questions: list[tuple[str, int]],
                        kv_cache: FP8KVCache | None = None) -> float:
        out = sample(policy, self.tokenizer, [p for p, _ in questions], 1, self.settings.max_response_tokens,
                     seed=0, greedy=True, kv_cache=kv_cache)
        return float(exact_rewards(out.texts, [a for _, a in questions]).mean())

    def evaluate(self, rollout_policy: nn.Module) -> dict[str, float]:
        """Greedy accuracy of the rollout policy (what the variant samples from, through its FP8 KV
        cache where it has one) on the validation questions, and of the fp32 trainer weights (the model
        a run keeps, the same evaluator for every variant) on the validation and the training questions."""
        self.model.eval()
        return {"val_acc": self.greedy_accuracy(rollout_policy, self.val, self.rollout_kv_cache()),
                "val_acc_full": self.greedy_accuracy(self.model, self.val),
                "train_acc_full": self.greedy_accuracy(self.model, self.train)}

    def step(self, step: int) -> dict:
        s, v = self.settings, self.variant
        t0 = time.perf_counter()
        policy = build_rollout(self.model, v, s.weight_bits)
        sync_s = time.perf_counter() - t0
        record: dict = {"step": step}
        codes = quantized_codes(policy)
        if codes and self._codes is not None:
            record["changed_code_share"], record["changed_code_share_qkv"] = changed_code_shares(self._codes, codes)
        self._codes = codes
        if step % s.val_every == 0:
            record.update(self.evaluate(policy))

        t1 = time.perf_counter()
        batch = self._next_prompts()
        kv_cache = self.rollout_kv_cache()
        rollout = sample(policy, self.tokenizer, [p for p, _ in batch], s.group_size, s.max_response_tokens,
                         seed=self.seed * 1_000_003 + step, kv_cache=kv_cache)
        answers = [a for _, a in batch for _ in range(s.group_size)]
        rewards = exact_rewards(rollout.texts, answers)
        rollout_s = time.perf_counter() - t1

        t2 = time.perf_counter()
        mask = rollout.response_mask.float()
        with torch.no_grad():
            prox = response_log_probs(self.model, rollout)
        log_w = prox - rollout.behaviour_log_probs
        record.update(mismatch_stats(log_w, mask, s.is_cap))
        if kv_cache is not None:
            record.update(self.kv_scales.stats(), kv_fill_max=kv_cache.fill)
            # the mismatch the cache adds on its own: KL(pi_behav || the same W{b}A8 policy without
            # FP8 KV) on the sampled tokens, the same estimator as KL(behav || prox)
            with torch.no_grad():
                unquantized_kv = response_log_probs(policy, rollout)
            record["kl_fp8kv_k3"] = mismatch_stats(unquantized_kv - rollout.behaviour_log_probs, mask, s.is_cap)["kl_k3"]
        # how peaked the sampled policy is: a sharpening policy's log-probs move less under the same
        # weight error, so KL(behav||prox) can fall while the quantization error stays the same
        record["entropy"] = masked_mean(rollout.behaviour_entropy, mask)
        advantages = group_normalised_advantages(rewards, s.group_size)[:, None].expand_as(mask)
        old = rollout.behaviour_log_probs if v.loss == "naive" else prox
        loss_log_w = log_w if v.loss in ("tis", "acr") else torch.zeros_like(log_w)
        clip_upper = clip_lower = upper_bound_max = grad_norm_max = 0.0
        rows = torch.randperm(mask.shape[0], generator=torch.Generator().manual_seed(self.seed * 7919 + step))
        # the next rollout's FP8 KV scales come from the K/V ranges of this step's update forwards, as
        # the real system measures them in the actor's update and sends them with the next weight sync
        kv_ranges = KVRangeObserver() if kv_cache is not None else None
        for part in rows.chunk(s.mini_batches):
            observe = attended_kv_ranges(kv_ranges, rollout.attention_mask[part]) if kv_ranges is not None else None
            with _attention_hook(observe):
                log_prob = response_log_probs(self.model, rollout, part)
            loss_mat, stats = acr_token_loss(log_prob, old[part], loss_log_w[part], advantages[part], mask[part],
                                             is_cap=s.is_cap, clip_ratio_low=s.clip_ratio_low,
                                             clip_ratio_high=s.clip_ratio_high, clip_ratio_c=s.clip_ratio_c,
                                             adaptive=v.loss == "acr")
            loss = (loss_mat * mask[part]).sum() / mask[part].sum().clamp(min=1)  # token-mean
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if v.clip_as_uaq:
                grad_norm = clip_grad_norm_as_uaq_(self.model, s.max_grad_norm, s.uaq_scale)
            else:
                grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), s.max_grad_norm))
            self.optimizer.step()
            grad_norm_max = max(grad_norm_max, grad_norm)
            d = stats.as_dict()
            clip_upper += d["clipfrac_upper"] / s.mini_batches
            clip_lower += d["clipfrac_lower"] / s.mini_batches
            upper_bound_max = max(upper_bound_max, d["upper_bound_max"])
        if kv_ranges is not None:
            self.kv_scales = KVScales.from_amax(kv_ranges.take())
        record.update(
            reward=float(rewards.mean()),
            response_tokens=float(mask.sum(1).mean()),
            clipfrac_upper=clip_upper,
            clipfrac_lower=clip_lower,
            upper_bound_max=upper_bound_max,
            grad_norm_max=grad_norm_max,  # before clipping; above max_grad_norm the update was clipped
            sync_s=sync_s,
            rollout_s=rollout_s,
            train_s=time.perf_counter() - t2,
            step_s=time.perf_counter() - t0,
        )
        return record


def cpu_description() -> dict:
    """This machine's CPU model and class, recorded with every run (step times depend on them)."""
    model, flags = cpu_model_and_flags()
    return {"model": model, "isa": cpu_class(flags), "torch_threads": torch.get_num_threads()}


CHECKPOINT = "checkpoint.pt"


def _identity(variant: str, seed: int, settings: StudySettings) -> dict:
    return {"variant": variant, "seed": seed, "settings": asdict(settings)}


def save_checkpoint(path: Path, study: StudyRun, next_step: int, lines: int, wall_s: float,
                    resumed_at: list[int]) -> None:
    """Write to a temporary file, then rename: a kill mid-write leaves the previous checkpoint whole."""
    tmp = path.with_name(path.name + ".tmp")
    torch.save({**_identity(study.name, study.seed, study.settings), "next_step": next_step, "lines": lines,
                "wall_s": wall_s, "resumed_at": resumed_at, "state": study.state_dict()}, tmp)
    os.replace(tmp, path)


def _resume(study: StudyRun, checkpoint: Path, partial: Path) -> tuple[int, float, list[int]]:
    """(next step, wall seconds spent, steps resumed at) after loading ``checkpoint`` if it belongs to
    this run, with ``partial`` cut back to the lines it covers; (0, 0.0, []) to start over."""
    label = f"[study] {study.name} seed {study.seed}"
    if not checkpoint.exists():
        return 0, 0.0, []
    saved = torch.load(checkpoint, weights_only=True)
    if {k: saved.get(k) for k in ("variant", "seed", "settings")} != _identity(study.name, study.seed, study.settings):
        print(f"{label}: checkpoint at step {saved.get('next_step')} has other settings; starting over", flush=True)
        return 0, 0.0, []
    lines = partial.read_text().splitlines(keepends=True) if partial.exists() else []
    if len(lines) < saved["lines"]:
        print(f"{label}: {partial.name} holds {len(lines)} of the checkpoint's {saved['lines']} lines; "
              f"starting over", flush=True)
        return 0, 0.0, []
    study.load_state_dict(saved["state"])
    kept = partial.with_name(partial.name + ".tmp")
    kept.write_text("".join(lines[:saved["lines"]]))  # drops the steps after the checkpoint
    os.replace(kept, partial)
    print(f"{label}: resuming from the checkpoint at step {saved['next_step']} ({checkpoint})", flush=True)
    return saved["next_step"], saved["wall_s"], [*saved["resumed_at"], saved["next_step"]]


def run(model_dir: str | Path, variant: str, seed: int, settings: StudySettings, out_dir: str | Path,
        checkpoint_every: int = 50) -> Path:
    """Run (or keep, or resume) one variant/seed; returns its folder with ``metrics.jsonl`` and ``run.json``.

    ``checkpoint_every`` (0: never) is not a setting: it does not change the results, so a finished
    run is kept whatever interval it ran with."""
    if checkpoint_every < 0:
        raise ValueError(f"checkpoint_every must be >= 0, got {checkpoint_every}")
    folder = Path(out_dir) / variant / f"seed{seed}"
    metrics, summary = folder / "metrics.jsonl", folder / "run.json"
    if summary.exists() and json.loads(summary.read_text()).get("settings") == asdict(settings):
        print(f"[study] {variant} seed {seed}: finished earlier, kept ({folder})", flush=True)
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    study = StudyRun(model_dir, variant, seed, settings)
    partial = metrics.with_suffix(".jsonl.partial")
    checkpoint = folder / CHECKPOINT
    start, spent, resumed_at = _resume(study, checkpoint, partial)
    t0 = time.perf_counter() - spent
    with partial.open("a" if start else "w") as f:
        for step in range(start, settings.steps):
            record = study.step(step)
            f.write(json.dumps(record) + "\n")
            f.flush()
            if step % 10 == 0 or step == settings.steps - 1:
                print(f"[study] {variant} seed {seed} step {step}: reward {record['reward']:.3f} "
                      f"kl {record['kl_k3']:.2e} w_max {record['w_max']:.2f} {record['step_s']:.1f}s", flush=True)
            if checkpoint_every and (step + 1) % checkpoint_every == 0 and step + 1 < settings.steps:
                save_checkpoint(checkpoint, study, step + 1, step + 1, time.perf_counter() - t0, resumed_at)
        final = build_rollout(study.model, study.variant, settings.weight_bits)  # evaluate(): last step's KV scales
        f.write(json.dumps({"step": settings.steps, **study.evaluate(final)}) + "\n")
    torch.save(study.model.state_dict(), folder / "final_state_dict.pt")  # fp32 trainer weights (UAQ space for acr_uaq)
    partial.replace(metrics)
    summary.write_text(json.dumps({
        "variant": variant, "seed": seed, "settings": asdict(settings), "model_dir": str(model_dir),
        "cpu": cpu_description(), "wall_s": round(time.perf_counter() - t0, 1), "resumed_at": resumed_at,
    }, indent=1, sort_keys=True) + "\n")
    for leftover in (checkpoint, checkpoint.with_name(checkpoint.name + ".tmp")):  # a .tmp if a save was killed
        leftover.unlink(missing_ok=True)  # only after run.json: until then a kill can still resume
    return folder


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Pure-torch GRPO study of QuRL's variants on the tiny model.")
    ap.add_argument("--model", required=True, help="warm-started HF folder (python -m qurl_recipes.tiny_sft)")
    ap.add_argument("--out", required=True, help="runs go to OUT/<variant>/seed<k>/")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--threads", type=int, default=int(os.environ.get("QURL_STUDY_THREADS", 1)))
    ap.add_argument("--checkpoint-every", type=int, default=50,
                    help="save OUT/<variant>/seed<k>/checkpoint.pt every N steps, resumed from if interrupted (0: never)")
    for f, default in asdict(StudySettings()).items():
        ap.add_argument(f"--{f.replace('_', '-')}", type=type(default), default=default)
    a = vars(ap.parse_args(argv))
    model, out, variants, seeds = a.pop("model"), a.pop("out"), a.pop("variants"), a.pop("seeds")
    torch.set_num_threads(a.pop("threads"))
    checkpoint_every = a.pop("checkpoint_every")
    settings = StudySettings(**a)
    for variant in variants:
        for seed in seeds:
            run(model, variant, seed, settings, out, checkpoint_every=checkpoint_every)


if __name__ == "__main__":
    main()
