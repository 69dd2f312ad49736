"""The GRPO study's rollout side: the re-quantized policy, sampling with a KV cache, log-probs and
the behaviour/proximal mismatch statistics.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from qurl_recipes.study_fp8_kv import FP8KVCache, attention_hook
from qurl_recipes.study_settings import Variant
from qurl_verl.losses.acr import LOG_RATIO_BOUND
from qurl_verl.quant import QuantScheme, int_format, quantize_linear_modules_
from qurl_verl.quant.linear import W8A8Linear
from qurl_verl.quant.uaq import DEFAULT_UAQ_TARGETS
from qurl_verl.quant.update_visibility import changed_code_count
from qurl_verl.recipe_rewards.chain_arithmetic import final_answer


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
    with attention_hook(kv_cache):
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


def response_log_dists(model: nn.Module, rollout: Rollout, rows: slice | torch.Tensor = slice(None)) -> torch.Tensor:
    """log pi(. | prefix) over the whole vocabulary at every response position, [n, L, V] float32."""
    seqs, mask = rollout.sequences[rows], rollout.attention_mask[rows]
    length = rollout.response_mask.shape[1]
    logits = model(input_ids=seqs, attention_mask=mask, position_ids=_position_ids(mask)).logits
    return torch.log_softmax(logits[:, -length - 1:-1].float(), dim=-1)


def response_log_probs(model: nn.Module, rollout: Rollout, rows: slice | torch.Tensor = slice(None)) -> torch.Tensor:
    """log pi(response token | prefix) under ``model`` for the given rows, [n, L] float32."""
    length = rollout.response_mask.shape[1]
    tokens = rollout.sequences[rows][:, -length:, None]
    return response_log_dists(model, rollout, rows).gather(-1, tokens).squeeze(-1)


def exact_kl(p_log: torch.Tensor, q_log: torch.Tensor, mask: torch.Tensor) -> float:
    """KL(p || q) summed over the whole vocabulary at each response position, averaged over the positions
    the behaviour policy's samples visited: exact per position, where the sampled-token estimators
    (``mismatch_stats``) are noisy. Takes log-probabilities [n, L, V]."""
    per_position = (p_log.exp() * (p_log - q_log)).sum(-1)
    return masked_mean(per_position, mask)


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
