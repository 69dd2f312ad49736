"""Is UAQ just a per-layer learning rate? A pure-torch GRPO harness to compare the two.

Per-channel weight / per-token activation absmax quantization is scale-equivariant, so UAQ
(input-norm weight x s, q/k/v weights / s) leaves both the full-precision and the quantized
forward unchanged; it acts only through the optimiser. At equivalent points the UAQ gradients are
s x (q/k/v) and 1/s x (norm) the plain ones, and Adam's step m / sqrt(v) ignores a per-tensor
gradient scale, so mapped back to the original parametrisation UAQ + AdamW(lr) moves q/k/v by
lr x s and the norm by lr / s. UAQ should therefore equal AdamW with those per-group learning
rates, up to what breaks the scale invariance: Adam's eps, decoupled weight decay (it scales
the parameter, not the update) and global gradient-norm clipping (it sees the scaled gradients).

verl's FSDP engine builds its optimiser from ``module.parameters()`` without names, so the
per-group arm cannot run there; this harness runs both arms on the project's own quantizers
(``quantize_linear_modules_``, fake W{b}A8) and loss (``acr_token_loss``). Never imports verl
or vLLM.
"""
from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from qurl_verl.losses.acr import acr_token_loss
from qurl_verl.quant import QuantScheme, apply_uaq, int_format, quantize, quantize_linear_modules_
from qurl_verl.quant.uaq import DEFAULT_UAQ_TARGETS, NORM_GROUPS, resolve_uaq_targets

# reward_fn(prompt_ids [N, Lp], response_ids [N, L]) -> rewards [N]; rows are grouped by prompt.
RewardFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

SCALED_LINEAR_GROUP = "uaq_targets_lr_times_s"
SCALED_NORM_GROUP = "uaq_norms_lr_over_s"
UNSCALED_GROUP = "unscaled_lr"


def _uaq_parameter_names(model: nn.Module, targets: Iterable[str]) -> tuple[set[str], set[str]]:
    """(names of the linear weights UAQ divides by s, names of the norm weights it multiplies by s)."""
    targets = tuple(targets)
    norms = resolve_uaq_targets(targets)
    linear_suffixes = tuple(f".{NORM_GROUPS[n][0]}.{p}.weight" for n in norms for p in NORM_GROUPS[n][1])
    norm_suffixes = tuple(f".{n}.weight" for n in norms)
    linears, norm_weights = set(), set()
    for name, _ in model.named_parameters():
        if "layers." not in name:
            continue
        if name.endswith(linear_suffixes):
            linears.add(name)
        elif name.endswith(norm_suffixes):
            norm_weights.add(name)
    if not linears or not norm_weights:
        raise ValueError(f"found no UAQ targets {list(targets)} in {type(model).__name__}")
    return linears, norm_weights


def per_group_lr_param_groups(
    model: nn.Module, lr: float, scale: float, targets: Iterable[str] = DEFAULT_UAQ_TARGETS,
    weight_decay: float | None = None,
) -> list[dict]:
    """AdamW param groups that mimic UAQ(scale) on the unmodified model: targets lr x s, their norm lr / s.

    Biases of the targets keep lr: UAQ leaves them untouched, so their gradients and updates do
    not change. Every parameter appears exactly once. With ``weight_decay`` each group also gets
    the decay that keeps lr x decay at lr x ``weight_decay``: AdamW's decoupled decay shrinks a
    parameter by lr x decay relative to itself, which UAQ's rescaling leaves unchanged, so a group
    whose lr is multiplied by s needs its decay divided by s to match UAQ.
    """
    linears, norms = _uaq_parameter_names(model, targets)
    groups = {SCALED_LINEAR_GROUP: [], SCALED_NORM_GROUP: [], UNSCALED_GROUP: []}
    for name, param in model.named_parameters():
        key = SCALED_LINEAR_GROUP if name in linears else SCALED_NORM_GROUP if name in norms else UNSCALED_GROUP
        groups[key].append(param)
    lrs = {SCALED_LINEAR_GROUP: lr * scale, SCALED_NORM_GROUP: lr / scale, UNSCALED_GROUP: lr}
    out = [{"name": key, "params": params, "lr": lrs[key]} for key, params in groups.items() if params]
    if weight_decay is not None:
        for group in out:
            group["weight_decay"] = weight_decay * lr / group["lr"]
    return out


def clip_grad_norm_as_uaq_(model: nn.Module, max_norm: float, scale: float,
                           targets: Iterable[str] = DEFAULT_UAQ_TARGETS) -> float:
    """Global-norm gradient clipping of the unmodified model, with the factor UAQ's clipping would apply.

    Under UAQ the targets' gradients are s times, and their norm's 1/s times, those of the unmodified
    model at the equivalent point, so ``clip_grad_norm_`` there sees a different total norm and clips
    on other steps. This computes that norm, sqrt(sum of |s g_target|^2 + |g_norm / s|^2 + |g_other|^2),
    and scales every gradient here by the same factor min(1, max_norm / norm); with the per-group
    learning rates, Adam then sees gradients that differ from UAQ's by a constant per-tensor factor,
    which its step ignores (up to eps). Returns that norm, before clipping.
    """
    linears, norms = _uaq_parameter_names(model, targets)
    total = 0.0
    grads = []
    for name, param in model.named_parameters():
        if param.grad is None:
            continue
        factor = scale if name in linears else 1 / scale if name in norms else 1.0
        total += float(param.grad.detach().double().square().sum()) * factor ** 2
        grads.append(param.grad)
    norm = total ** 0.5
    clip = max_norm / (norm + 1e-6)  # the epsilon torch.nn.utils.clip_grad_norm_ adds
    if clip < 1:
        for g in grads:
            g.detach().mul_(clip)
    return norm


def undo_uaq(model: nn.Module, scale: float, targets: Iterable[str] = DEFAULT_UAQ_TARGETS) -> nn.Module:
    """A copy of a UAQ-scaled model mapped back to the original parametrisation (norm / s, targets x s)."""
    out = copy.deepcopy(model)
    linears, norms = _uaq_parameter_names(out, targets)
    with torch.no_grad():
        for name, param in out.named_parameters():
            if name in linears:
                param.mul_(scale)
            elif name in norms:
                param.div_(scale)
    return out


def quantized_rollout_copy(model: nn.Module, bits: int = 8) -> nn.Module:
    """The W{bits}A8 rollout policy built from the current weights (fake-quantized, as the engine sees them)."""
    return quantize_linear_modules_(copy.deepcopy(model), scheme=QuantScheme(int_format(bits)), fake=True)


@torch.no_grad()
def sample_responses(policy: nn.Module, prompts: torch.Tensor, group_size: int, response_len: int,
                     generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Temperature-1 samples, ``group_size`` per prompt, and their log-probs under ``policy``.

    Plain autoregressive loop without a KV cache (tiny models only). Returns (sequences
    [P*G, Lp+L], behaviour log-probs [P*G, L]).
    """
    seqs = prompts.repeat_interleave(group_size, dim=0)
    logps = []
    for _ in range(response_len):
        logits = policy(input_ids=seqs).logits[:, -1].float()
        log_probs = F.log_softmax(logits, dim=-1)
        token = torch.multinomial(log_probs.exp(), 1, generator=generator)
        logps.append(log_probs.gather(-1, token))
        seqs = torch.cat([seqs, token], dim=1)
    return seqs, torch.cat(logps, dim=1)


def response_log_probs(model: nn.Module, seqs: torch.Tensor, response_len: int) -> torch.Tensor:
    """log pi(response token | prefix) for the last ``response_len`` tokens, [N, L], with gradient."""
    logits = model(input_ids=seqs).logits[:, -response_len - 1:-1].float()
    return F.log_softmax(logits, dim=-1).gather(-1, seqs[:, -response_len:, None]).squeeze(-1)


def group_normalised_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """GRPO advantages: (r - group mean) / (group std + eps), one value per response."""
    grouped = rewards.float().view(-1, group_size)
    return ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + eps)).view(-1)


@dataclass(frozen=True)
class GrpoStepResult:
    mean_reward: float
    sequences: torch.Tensor
    rollout: nn.Module  # the quantized copy that sampled this step (weights before the step)


def grpo_acr_step(model: nn.Module, optimizer: torch.optim.Optimizer, prompts: torch.Tensor, reward_fn: RewardFn,
                  generator: torch.Generator, *, bits: int = 8, group_size: int = 4, response_len: int = 8,
                  loss_scale: float = 1.0, max_grad_norm: float | None = None, is_cap: float = 2.0,
                  clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.28, clip_ratio_c: float = 3.0,
                  clip_as_uaq: float | None = None) -> GrpoStepResult:
    """One GRPO step with QuRL's decoupled roles: sample with the quantized copy, ACR loss on the fp32 model.

    The proximal policy is the fp32 model before the step (one update per rollout, so R = 1 at
    the step) and log w = log pi_prox - log pi_behav. Token-mean aggregation. ``loss_scale``
    multiplies the loss (tiny values make Adam's eps matter). ``clip_as_uaq=s`` clips with
    ``clip_grad_norm_as_uaq_`` instead of the plain global norm.
    """
    rollout = quantized_rollout_copy(model, bits)
    seqs, behav_logp = sample_responses(rollout, prompts, group_size, response_len, generator)
    rewards = reward_fn(seqs[:, : prompts.shape[1]], seqs[:, prompts.shape[1]:])
    adv = group_normalised_advantages(rewards, group_size)[:, None].expand(-1, response_len)
    log_prob = response_log_probs(model, seqs, response_len)
    old_log_prob = log_prob.detach()
    mask = torch.ones_like(log_prob, dtype=torch.bool)
    loss_mat, _ = acr_token_loss(log_prob, old_log_prob, old_log_prob - behav_logp, adv, mask, is_cap=is_cap,
                                 clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high,
                                 clip_ratio_c=clip_ratio_c, with_stats=False)
    loss = loss_mat.mean() * loss_scale
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if max_grad_norm is not None and clip_as_uaq is not None:
        clip_grad_norm_as_uaq_(model, max_grad_norm, clip_as_uaq)
    elif max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    return GrpoStepResult(float(rewards.float().mean()), seqs, rollout)


def changed_code_fraction(before: nn.Module, after: nn.Module, bits: int,
                          targets: Iterable[str] = DEFAULT_UAQ_TARGETS) -> float:
    """Fraction of the targets' weight codes that re-quantizing ``after`` changes relative to ``before``.

    ``before`` is a rollout copy (its W8A8Linear buffers hold the codes), ``after`` the fp32 model.
    """
    scheme = QuantScheme(int_format(bits))
    changed = total = 0
    for name, param in after.named_parameters():
        if "layers." not in name or not name.endswith(tuple(f".{t}.weight" for t in targets)):
            continue
        old_codes = before.get_submodule(name[: -len(".weight")]).weight
        new_codes = quantize(param.detach(), scheme).data
        changed += int((old_codes != new_codes).sum())
        total += old_codes.numel()
    return changed / max(total, 1)


@dataclass(frozen=True)
class ArmComparison:
    """One step of the UAQ arm versus the per-group-LR arm (after the optimiser step)."""

    step: int
    max_abs_logit_diff: float  # fp32 models, UAQ arm mapped back to the original parametrisation
    max_abs_param_diff: float
    same_tokens: bool  # both arms sampled identical responses this step
    changed_code_fraction_uaq: float
    changed_code_fraction_per_group_lr: float
    mean_reward_uaq: float
    mean_reward_per_group_lr: float


def compare_uaq_with_per_group_lr(model: nn.Module, prompts: torch.Tensor, reward_fn: RewardFn, *, scale: float = 2.0,
                                  lr: float = 1e-3, steps: int = 3, eps: float = 1e-8, weight_decay: float = 0.0,
                                  betas: tuple[float, float] = (0.9, 0.999), max_grad_norm: float | None = None,
                                  bits: int = 8, group_size: int = 4, response_len: int = 8, loss_scale: float = 1.0,
                                  seed: int = 0, probe: torch.Tensor | None = None,
                                  match_decay: bool = True, clip_as_uaq: bool = False) -> list[ArmComparison]:
    """Run ``steps`` GRPO+ACR steps in two arms from copies of ``model`` and compare them after each step.

    (A) UAQ: ``apply_uaq(copy, scale)``, AdamW(lr). (B) per-group LR: unmodified copy, AdamW with
    ``per_group_lr_param_groups(copy, lr, scale)``. Both sample with the same generator seed per
    step; their quantized forwards agree (exactly for a power-of-two scale), so the tokens match
    while the arms stay equivalent. ``probe`` (default: ``prompts``) is the input for the logit
    comparison. ``match_decay`` gives each group of arm B the weight decay that matches UAQ's
    (see ``per_group_lr_param_groups``); without it, B decays q/k/v s times faster.
    ``clip_as_uaq`` makes B clip its gradients by the factor UAQ's clipping applies
    (``clip_grad_norm_as_uaq_``). ``model`` itself is not modified.
    """
    model_uaq = apply_uaq(copy.deepcopy(model), scale)
    model_lr = copy.deepcopy(model)
    opt_uaq = torch.optim.AdamW(model_uaq.parameters(), lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    groups = per_group_lr_param_groups(model_lr, lr, scale, weight_decay=weight_decay if match_decay else None)
    opt_lr = torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    probe = prompts if probe is None else probe
    step_kwargs = dict(bits=bits, group_size=group_size, response_len=response_len, loss_scale=loss_scale,
                       max_grad_norm=max_grad_norm)
    results = []
    for step in range(steps):
        res_uaq = grpo_acr_step(model_uaq, opt_uaq, prompts, reward_fn, torch.Generator().manual_seed(seed + step),
                                **step_kwargs)
        res_lr = grpo_acr_step(model_lr, opt_lr, prompts, reward_fn, torch.Generator().manual_seed(seed + step),
                               clip_as_uaq=scale if clip_as_uaq else None, **step_kwargs)
        mapped = undo_uaq(model_uaq, scale)
        with torch.no_grad():
            logit_diff = (mapped(input_ids=probe).logits - model_lr(input_ids=probe).logits).abs().max()
            param_diff = max(float((a - b).abs().max())
                             for a, b in zip(mapped.parameters(), model_lr.parameters()))
        results.append(ArmComparison(
            step=step,
            max_abs_logit_diff=float(logit_diff),
            max_abs_param_diff=param_diff,
            same_tokens=bool(torch.equal(res_uaq.sequences, res_lr.sequences)),
            changed_code_fraction_uaq=changed_code_fraction(res_uaq.rollout, model_uaq, bits),
            changed_code_fraction_per_group_lr=changed_code_fraction(res_lr.rollout, model_lr, bits),
            mean_reward_uaq=res_uaq.mean_reward,
            mean_reward_per_group_lr=res_lr.mean_reward,
        ))
    return results
