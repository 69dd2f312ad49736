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
import copy
import json
import os
import random
import time
from dataclasses import asdict
from pathlib import Path

import torch
from torch import nn

from qurl_recipes.data.chain_arithmetic import draw_problems
from qurl_recipes.study_checkpoint import CHECKPOINT, resume, save_checkpoint
from qurl_recipes.study_fp8_kv import FP8KVCache, KVScales, attended_kv_ranges, attention_hook
from qurl_recipes.study_rollout import (
    build_rollout,
    changed_code_shares,
    exact_kl,
    exact_rewards,
    masked_mean,
    mismatch_stats,
    quantized_codes,
    response_log_dists,
    response_log_probs,
    sample,
)
from qurl_recipes.study_settings import VARIANTS, StudySettings, add_settings_arguments, recorded_settings
from qurl_recipes.uaq_vs_lr import clip_grad_norm_as_uaq_, group_normalised_advantages, per_group_lr_param_groups
from qurl_verl.losses.acr import acr_token_loss
from qurl_verl.platform.cpu_features import cpu_class, cpu_model_and_flags
from qurl_verl.quant import apply_uaq
from qurl_verl.quant.kv_cache import KVRangeObserver

# responses per step the mismatch's parts are measured on (the first prompts' groups): exact per position, so a
# few thousand positions give a steady mean; the whole batch would cost a third of a step on one core
KL_PART_ROWS = 32


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
        # (step, fp32 weights at its start) of the last ``staleness`` + 1 steps: the oldest is what the rollout holds
        self._past: list[tuple[int, dict[str, torch.Tensor]]] = []
        # the scales the next rollout's FP8 KV cache uses: 1.0 until the trainer has measured K and V
        self.kv_scales = KVScales.initial(self.model.config.num_hidden_layers) if self.variant.fp8_kv else None

    def state_dict(self) -> dict:
        """What carries over from one step to the next. Sampling and the mini-batch order draw from
        per-step seeds; the global RNG is kept too, so that nothing depends on that holding."""
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "order": self._order.getstate(), "queue": list(self._queue), "codes": self._codes,
                "past": list(self._past), "torch_rng": torch.get_rng_state(),
                "kv_scales": self.kv_scales.state_dict() if self.kv_scales is not None else None}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])  # copies in place: the optimizer keeps its parameters
        self.optimizer.load_state_dict(state["optimizer"])
        self._order.setstate(state["order"])
        self._queue = list(state["queue"])
        self._codes = state["codes"]
        self._past = list(state.get("past", []))  # absent from checkpoints written before the staleness setting
        torch.set_rng_state(state["torch_rng"])
        kv = state.get("kv_scales")  # absent from checkpoints of variants written before the FP8 KV arm
        self.kv_scales = KVScales(kv["k"], kv["v"]) if kv is not None else None

    def behaviour_weights(self, step: int) -> tuple[nn.Module, int]:
        """The trainer weights the rollout holds at ``step`` and how many updates old they are: the current
        model itself without staleness, else a copy of the weights from ``staleness`` steps ago (the start
        while there are fewer), which ``step`` records before it updates."""
        k = self.settings.staleness
        if not k:
            return self.model, 0
        self._past.append((step, {n: t.detach().clone() for n, t in self.model.state_dict().items()}))
        del self._past[:-(k + 1)]
        source_step, weights = self._past[0]
        stale = copy.deepcopy(self.model)
        stale.load_state_dict(weights)
        return stale, step - source_step

    def mismatch_parts(self, weights: nn.Module, policy: nn.Module, rollout, prox_dists: torch.Tensor,
                       mask: torch.Tensor, age: int) -> dict[str, float]:
        """KL(pi_behav || pi_prox) and its two parts as defined pairs, exact over the vocabulary at the
        positions the rollout visited: staleness = KL(BF16 copy of the rollout's weights || BF16 copy of the
        current ones), quantization = KL(the rollout policy || the BF16 copy of its own weights). KL does not
        add, so the total is measured, not summed. A BF16 rollout's quantization part is 0, as is the
        staleness part of a step whose rollout holds the current weights. Measured on the step's first
        ``KL_PART_ROWS`` responses."""
        bf16, rows = VARIANTS["bf16"], slice(0, KL_PART_ROWS)
        prox_dists, mask = prox_dists[rows], mask[rows]
        with torch.no_grad(), attention_hook(self.rollout_kv_cache()):
            behaviour = response_log_dists(policy, rollout, rows)
        with torch.no_grad():
            own_bf16 = behaviour if self.variant.rollout == "bf16" else \
                response_log_dists(build_rollout(weights, bf16, self.settings.weight_bits), rollout, rows)
            current_bf16 = own_bf16 if age == 0 else \
                response_log_dists(build_rollout(self.model, bf16, self.settings.weight_bits), rollout, rows)
        return {"kl_total": exact_kl(behaviour, prox_dists, mask), "kl_staleness": exact_kl(own_bf16, current_bf16, mask),
                "kl_quantization": exact_kl(behaviour, own_bf16, mask)}

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
        weights, age = self.behaviour_weights(step)
        policy = build_rollout(weights, v, s.weight_bits)
        sync_s = time.perf_counter() - t0
        record: dict = {"step": step, "staleness": age}
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
            prox_dists = response_log_dists(self.model, rollout)
        prox = prox_dists.gather(-1, rollout.sequences[:, -mask.shape[1]:, None]).squeeze(-1)
        log_w = prox - rollout.behaviour_log_probs
        record.update(mismatch_stats(log_w, mask, s.is_cap))
        record.update(self.mismatch_parts(weights, policy, rollout, prox_dists, mask, age))
        del prox_dists
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
            with attention_hook(observe):
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

def run(model_dir: str | Path, variant: str, seed: int, settings: StudySettings, out_dir: str | Path,
        checkpoint_every: int = 50) -> Path:
    """Run (or keep, or resume) one variant/seed; returns its folder with ``metrics.jsonl`` and ``run.json``.

    ``checkpoint_every`` (0: never) is not a setting: it does not change the results, so a finished
    run is kept whatever interval it ran with."""
    if checkpoint_every < 0:
        raise ValueError(f"checkpoint_every must be >= 0, got {checkpoint_every}")
    folder = Path(out_dir) / variant / f"seed{seed}"
    metrics, summary = folder / "metrics.jsonl", folder / "run.json"
    if summary.exists() and recorded_settings(json.loads(summary.read_text()).get("settings", {})) == asdict(settings):
        print(f"[study] {variant} seed {seed}: finished earlier, kept ({folder})", flush=True)
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    study = StudyRun(model_dir, variant, seed, settings)
    partial = metrics.with_suffix(".jsonl.partial")
    checkpoint = folder / CHECKPOINT
    start, spent, resumed_at = resume(study, checkpoint, partial)
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
    add_settings_arguments(ap)
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
