"""Time re-quantizing every linear weight of a Qwen2-0.5B-shaped model, as each rollout weight sync does.

Random weights (std 0.02) are generated one decoder layer at a time to keep memory at one layer;
only the quantize calls are timed. Also times the per-step update-visibility statistics
(UpdateVisibilityTracker), and measures what UAQ does to one optimiser step: the share of q/k/v
codes that change and the update-to-quantization-error ratio, with and without UAQ (s = 1.5), for
Adam and SGD on a small random Qwen2 (spec §3.4 predicts the ratio grows by s under Adam, s^2 under SGD).
Writes bench/results/quantize.json and prints tables.

    .venv/bin/python bench/bench_quantize.py [--threads 2,1] [--repeats 5] [--layers 24] [--skip-uaq]
"""
from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import time
from pathlib import Path

import bench_harness
import torch

from qurl_verl.platform.cpu_features import cpu_model_and_flags
from qurl_verl.quant import (
    INT8_CHANNEL,
    UpdateStats,
    UpdateVisibilityTracker,
    apply_uaq,
    parse_scheme,
    quantize,
    update_visibility,
)

# Qwen2-0.5B: hidden 896, intermediate 4864, 14 heads / 2 KV heads (head_dim 64), 24 layers.
HIDDEN, INTERMEDIATE, KV = 896, 4864, 2 * 64
LAYER_SHAPES = {
    "self_attn.q_proj": (HIDDEN, HIDDEN),
    "self_attn.k_proj": (KV, HIDDEN),
    "self_attn.v_proj": (KV, HIDDEN),
    "self_attn.o_proj": (HIDDEN, HIDDEN),
    "mlp.gate_proj": (INTERMEDIATE, HIDDEN),
    "mlp.up_proj": (INTERMEDIATE, HIDDEN),
    "mlp.down_proj": (HIDDEN, INTERMEDIATE),
}
CASES = [  # (fmt, granularity, input dtype, note)
    ("int8", "channel", torch.float32, "paper W8A8; fp32 masters"),
    ("int8", "channel", torch.bfloat16, "paper W8A8; bf16 weights"),
    ("fp8", "channel", torch.float32, "paper W8A8"),
    ("fp8", "block", torch.float32, "verl FP8 rollout layout"),
    ("int8", "block", torch.float32, "no vLLM kernel; numerics only"),
]


def layer_weights(layer: int, dtype: torch.dtype, delta: float = 0.0) -> dict[str, torch.Tensor]:
    """Layer ``layer``'s weights; ``delta`` > 0 adds an Adam-like step of that size (in fp32, then cast)."""
    g, g_step = torch.Generator().manual_seed(layer), torch.Generator().manual_seed(10_000 + layer)
    out = {}
    for name, shape in LAYER_SHAPES.items():
        w = torch.randn(shape, generator=g) * 0.02
        if delta:
            w += delta * torch.sign(torch.randn(shape, generator=g_step))
        out[f"model.layers.{layer}.{name}.weight"] = w.to(dtype)
    return out


def timed(fn, repeats: int) -> list[float]:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return samples


def rounded(load) -> list[float] | None:
    return [round(x, 2) for x in load] if load else None


def uaq_one_step(scale: float = 1.5) -> list[dict]:
    """One optimiser step on a random Qwen2 (hidden 256, 4 layers) with and without UAQ."""
    import transformers

    config = transformers.Qwen2Config(hidden_size=256, intermediate_size=704, num_attention_heads=4,
                                      num_key_value_heads=2, num_hidden_layers=4, vocab_size=512,
                                      max_position_embeddings=256)
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    ids = torch.randint(0, 512, (8, 64), generator=torch.Generator().manual_seed(1))
    qkv = ("q_proj", "k_proj", "v_proj")
    rows = []
    for optimizer, lrs in (("adam", (1e-5, 1e-4, 1e-3)), ("sgd", (1e-2, 1e-1, 1.0))):
        for lr in lrs:
            stats = {}
            for label in ("base", "uaq"):
                model = copy.deepcopy(base)
                if label == "uaq":
                    apply_uaq(model, scale)
                before = {n: p.detach().clone() for n, p in model.named_parameters()}
                opt_cls = torch.optim.Adam if optimizer == "adam" else torch.optim.SGD
                opt = opt_cls(model.parameters(), lr=lr)
                model.train()
                model(ids, labels=ids).loss.backward()
                opt.step()
                after = {n: p.detach() for n, p in model.named_parameters()}
                stats[label] = {f: update_visibility(before, after, parse_scheme(f, "channel"), targets=qkv)["overall"]
                                for f in ("int8", "fp8")}
            for fmt in ("int8", "fp8"):
                b, u = stats["base"][fmt], stats["uaq"][fmt]
                rows.append({
                    "optimizer": optimizer, "lr": lr, "fmt": fmt,
                    "changed_fraction_base": round(b["changed_fraction"], 4),
                    "changed_fraction_uaq": round(u["changed_fraction"], 4),
                    "changed_ratio": round(u["changed_fraction"] / b["changed_fraction"], 3) if b["changed_fraction"] else None,
                    "update_to_error_base": round(b["update_to_error_ratio"], 4),
                    "update_to_error_uaq": round(u["update_to_error_ratio"], 4),
                    "update_to_error_gain": round(u["update_to_error_ratio"] / b["update_to_error_ratio"], 3),
                })
    return rows


def time_quantization(layers: int, repeats: int, threads: int) -> dict:
    """Quantize every linear weight of the model once per case; also one tracker step per tensor."""
    torch.set_num_threads(threads)
    quantize(torch.randn(256, 256), INT8_CHANNEL)  # warm-up
    load_before = bench_harness.loadavg()
    best = [0.0] * len(CASES)  # sum over tensors of the fastest run
    typical = [0.0] * len(CASES)  # sum over tensors of the median run
    vis_best = vis_typical = 0.0
    pooled = UpdateStats()
    numel = 0
    for layer in range(layers):
        by_dtype = {dtype: layer_weights(layer, dtype) for dtype in {c[2] for c in CASES}}
        numel += sum(w.numel() for w in by_dtype[torch.float32].values())
        for i, (fmt, gran, dtype, _) in enumerate(CASES):
            scheme = parse_scheme(fmt, gran)
            for name, w in by_dtype[dtype].items():
                samples = timed(lambda: quantize(w, scheme, name=name), repeats)
                best[i] += min(samples)
                typical[i] += statistics.median(samples)
        # One RL step seen by the update-visibility tracker (int8 channel, fp32 masters, |dW| = 1e-4).
        prev, new = by_dtype[torch.float32], layer_weights(layer, torch.float32, delta=1e-4)
        tracker = UpdateVisibilityTracker(INT8_CHANNEL)
        for name in new:
            samples = []
            for _ in range(repeats):
                tracker.observe(name, prev[name])  # untimed: sets the previous step
                start = time.perf_counter()
                stats = tracker.observe(name, new[name])
                samples.append(time.perf_counter() - start)
            pooled += stats
            vis_best += min(samples)
            vis_typical += statistics.median(samples)
        del by_dtype, prev, new, tracker
    rows = [
        {
            "fmt": fmt,
            "granularity": gran,
            "input_dtype": str(dtype).replace("torch.", ""),
            "seconds_best": round(best[i], 4),
            "seconds_median": round(typical[i], 4),
            "melem_per_s_best": round(numel / best[i] / 1e6, 1),
            "note": note,
        }
        for i, (fmt, gran, dtype, note) in enumerate(CASES)
    ]
    overall = pooled.as_dict()
    return {
        "threads": threads,
        "loadavg_before": load_before,
        "loadavg_after": bench_harness.loadavg(),
        "quantized_params": numel,
        "quantize": rows,
        "update_visibility": {
            "case": "int8 channel, fp32 weights, one UpdateVisibilityTracker.observe per tensor "
                    "(quantize + quantization error + code diff + keep a copy)",
            "seconds_best": round(vis_best, 4),
            "seconds_median": round(vis_typical, 4),
            "changed_fraction_at_step_1e-4": round(overall["changed_fraction"], 4),
            "update_to_error_ratio_at_step_1e-4": round(overall["update_to_error_ratio"], 4),
        },
    }


def print_timing(run: dict) -> None:
    print(f"\n{run['quantized_params'] / 1e6:.0f} M quantized parameters, {run['threads']} thread(s), "
          f"load {rounded(run['loadavg_before'])} -> {rounded(run['loadavg_after'])}")
    print(f"{'fmt':<5} {'granularity':<12} {'input':<9} {'best s':>7} {'median s':>9} {'Melem/s':>8}  note")
    for r in run["quantize"]:
        print(f"{r['fmt']:<5} {r['granularity']:<12} {r['input_dtype']:<9} {r['seconds_best']:>7.3f} "
              f"{r['seconds_median']:>9.3f} {r['melem_per_s_best']:>8.1f}  {r['note']}")
    uv = run["update_visibility"]
    print(f"update visibility per RL step (int8 channel, fp32): best {uv['seconds_best']:.3f} s, median "
          f"{uv['seconds_median']:.3f} s; at |dW|=1e-4: {uv['changed_fraction_at_step_1e-4']:.3f} of codes changed, "
          f"update/error ratio {uv['update_to_error_ratio_at_step_1e-4']:.3f}")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="2,1", help="comma-separated torch thread counts, each timed in turn")
    parser.add_argument("--repeats", type=int, default=5, help="timings per tensor; min and median are reported")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--skip-uaq", action="store_true", help="skip the UAQ one-step measurement")
    parser.add_argument("--out", default=str(bench_harness.RESULTS / "quantize.json"))
    args = parser.parse_args(argv)
    print(f"{cpu_model_and_flags()[0]}, {os.cpu_count()} CPUs, torch {torch.__version__}")
    runs = []
    for threads in [int(t) for t in args.threads.split(",")]:
        runs.append(time_quantization(args.layers, args.repeats, threads))
        print_timing(runs[-1])
    result = {
        "what": "quantize all linear weights of a Qwen2-0.5B-shaped model (random, std 0.02), one tensor at a time",
        "model": {"layers": args.layers, "hidden": HIDDEN, "intermediate": INTERMEDIATE, "heads": 14, "kv_heads": 2},
        "timing": (f"per tensor {args.repeats} runs; seconds_best sums each tensor's fastest run, seconds_median its "
                   "median run; weight generation not timed. The machine is shared: with other jobs on the cores, "
                   "2 torch threads wait on each other at every parallel region, so 1 thread can be faster."),
        "environment": bench_harness.environment(),
        "machine": {"cpu": cpu_model_and_flags()[0], "cpu_count": os.cpu_count(), "torch": torch.__version__,
                    "python": platform.python_version()},
        "runs": runs,
        "target": "INT8 channel < 3 s on 2 cores",
    }
    if not args.skip_uaq:
        torch.set_num_threads(int(args.threads.split(",")[0]))
        result["uaq_one_step"] = {
            "what": "one step on a random Qwen2 (hidden 256, 4 layers, vocab 512, batch 8x64 tokens), q/k/v weights, "
                    "per-channel quantization; base vs UAQ s=1.5 from the same initial function",
            "rows": uaq_one_step(),
        }
        print("\nUAQ s=1.5, one step, q/k/v: changed codes base -> UAQ (ratio); update/error gain")
        for r in result["uaq_one_step"]["rows"]:
            print(f"  {r['optimizer']:<4} lr={r['lr']:<7g} {r['fmt']:<4} {r['changed_fraction_base']:.4f} -> "
                  f"{r['changed_fraction_uaq']:.4f} ({r['changed_ratio']}); x{r['update_to_error_gain']}")
    out = bench_harness.write_json(Path(args.out), result, indent=2)
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
