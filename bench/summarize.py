"""Targets vs measured, from the result files only: rewrites the summary block of bench/README.md.

The numbers in that block are never typed by hand; rerun this after any bench. A missing or
partial result shows as "not measured".

    .venv/bin/python bench/summarize.py
"""
from __future__ import annotations

import json

import bench_harness

REPO = bench_harness.REPO
RESULTS = bench_harness.RESULTS
README = REPO / "bench" / "README.md"
START, END = "<!-- summary:start -->", "<!-- summary:end -->"


def load(name: str) -> dict | None:
    path = RESULTS / name
    return json.loads(path.read_text()) if path.exists() else None


def verdict(ok: bool | None) -> str:
    return "not measured" if ok is None else ("met" if ok else "**not met**")


def int8_gemm_text(rt: dict) -> str:
    """Which GEMM each INT8 format ran; results from before the packed AVX2 GEMM only had oneDNN's."""
    paths = rt.get("int8_gemm")
    if paths is None:
        return "oneDNN split, measured before the packed AVX2 GEMM existed" if rt["machine"].get(
            "onednn_int8_saturates") else "oneDNN"
    # {format: {GEMM: linears}} as the engines report them; a plain name where a run predates that report
    return ", ".join(f"{f} " + ("/".join(p) if isinstance(p, dict) else p) for f, p in paths.items())


def throughput_row(cpu_class: str, rt: dict) -> str:
    """Every integer format against BF16 at batch 1 / 8 / 32, for one CPU class; the target holds for a
    format that reaches 1.4x at every batch measured."""
    ratios, n = rt["summary"]["ratios"], rt["args"]["max_tokens"]
    parts, met = [], []
    for fmt in [f for f in rt["args"]["formats"] if f.startswith("int")]:
        by_batch = {int(k.split()[1][1:].split("_t")[0]): v for k, v in ratios.items()
                    if k.startswith(f"{fmt}/") and k.endswith(f"_t{n}")}
        if by_batch:
            parts.append(f"{fmt}: " + ", ".join(f"b{b} {v:.2f}x" for b, v in sorted(by_batch.items())))
            if min(by_batch.values()) >= 1.4:
                met.append(fmt)
    m = rt["machine"]
    load_avg = ", ".join(f"{bench_harness.loadavg_of(b, 'before')[0]:.1f}" for b in rt["blocks"])
    measured = (f"{'; '.join(parts) or '-'} ({n} tokens, {rt['model']['params'] / 1e6:.0f}M model, {m['cpu_model']}, "
                f"oneDNN int8 saturates: {m.get('onednn_int8_saturates')}; INT8 GEMM: {int8_gemm_text(rt)}; "
                f"1-min load at block starts: {load_avg})")
    verdict_text = f"met by {', '.join(met)}" if met else ("**not met**" if parts else "not measured")
    return f"| INT8/BF16 rollout throughput >= 1.4x at batch 1, 8, 32 ({cpu_class}) | {measured} | {verdict_text} |"


def rows() -> list[str]:
    out = ["| target | measured | verdict |", "|---|---|---|"]
    for path in sorted(RESULTS.glob("rollout_throughput_*.json")):
        out.append(throughput_row(path.stem.removeprefix("rollout_throughput_"), json.loads(path.read_text())))
    so = load("step_overheads.json")
    for name, label in (("tiny", "tiny"), ("mid", "~100M")):
        r = (so or {}).get("setups", {}).get(name)
        if r:
            f, s = r["fractions"], r["setup"]
            out.append(f"| INT8 quantize + sync <= 10% of generation time per step ({label}) | "
                       f"{100 * f['int8_sync_over_generation']:.1f}% ({r['int8']['median_sync_wall_s']:.3f} s sync vs "
                       f"{r['int8']['median_generate_s']:.2f} s generating {s['prompts'] * s['n']} x {s['max_tokens']} tokens; "
                       f"{100 * f['int8_sync_over_step']:.1f}% of the step) | {verdict(f['int8_sync_over_generation'] <= 0.10)} |")
        else:
            out.append(f"| INT8 quantize + sync <= 10% of generation time per step ({label}) | - | not measured |")
    report = REPO / "recipes" / "tiny_cpu" / "report" / "results.json"
    if report.exists():  # the same ratio inside verl's main_ppo loop, from `make report`'s runs
        runs = json.loads(report.read_text())["variants"]
        parts, ok = [], []
        for v in ("naive_int8", "tis_int8", "int8_no_uaq", "int8"):
            r = runs.get(v) or {}
            if r.get("sync_s_median") and r.get("gen_s_median"):
                frac = r["sync_s_median"] / r["gen_s_median"]
                ok.append(frac <= 0.10)
                parts.append(f"{v} {100 * frac:.1f}% ({r['sync_s_median']:.3f} s vs {r['gen_s_median']:.2f} s)")
        if parts:
            out.append("| INT8 quantize + sync <= 10% of generation time per step (tiny, inside verl main_ppo: "
                       "recipes/tiny_cpu/report, medians of timing_s/gen and qurl/sync/total_s) | "
                       f"{'; '.join(parts)} | {verdict(all(ok))} |")
    acr = load("acr_loss.json")
    if acr:
        v = acr["ratio_to_vanilla_tis_wall"]["qurl_acr"]
        extra = ""
        if so and so.get("setups"):
            extra = "; ACR extra as share of step: " + ", ".join(
                f"{n} {100 * r['fractions']['acr_minus_vanilla_over_step']:.3f}%" for n, r in so["setups"].items())
        out.append(f"| ACR loss <= 1.2x vanilla (TIS) loss, fwd+bwd | {v:.2f}x at {acr['shape'][0]} x {acr['shape'][1]}{extra} "
                   f"| {verdict(v <= 1.2)} |")
    if so and so.get("uaq"):
        u = so["uaq"]
        parts = ", ".join(f"{k} {v.get('median_s', v.get('s')):.2f} s" for k, v in u.items())
        out.append(f"| UAQ one-time cost (no target) | {parts} | - |")
    fd = load("fidelity_diagnosis.json")
    if fd and "fanin" in fd["inits"]:
        p = fd["inits"]["fanin"]["pairs"]
        parts = []
        for key, label in (("vllm_int8 vs vllm_bf16", "vLLM INT8 vs BF16"), ("hf_fp8 vs hf_bf16", "torch FP8 vs BF16")):
            if key in p:
                parts.append(f"{label}: mean {p[key]['mean_abs_dlogp']:.4f}, max {p[key]['max_abs_dlogp']:.3f}, "
                             f"k1 KL {p[key]['k1_kl_ref_to_x']:.1e}")
        out.append(f"| fidelity (no target), ~100M 'fanin' model, mean/max abs dlogp (nats) | {'; '.join(parts)} | - |")
    for path in sorted(RESULTS.glob("rollout_throughput_*.json")):
        rt = json.loads(path.read_text())
        if rt.get("fidelity"):
            parts = [f"{fmt}: mean {f['sampled']['mean_abs_dlogp']:.4f}, max {f['sampled']['max_abs_dlogp']:.3f}, "
                     f"k1 KL {f['sampled']['k1_kl_bf16_to_fmt']:.1e}" for fmt, f in rt["fidelity"].items()]
            out.append(f"| fidelity (no target), vLLM engines vs vLLM BF16 on BF16-sampled tokens, "
                       f"{rt['model'].get('init', 'gain4')} init ({path.stem.removeprefix('rollout_throughput_')}) "
                       f"| {'; '.join(parts)} | - |")
    f32, jit = load("fidelity_diagnosis_fp32.json"), load("fidelity_jitter.json")
    if f32 and jit:
        parts = []
        for init in ("gain4", "fanin"):
            k = f32["inits"].get(init, {}).get("pairs", {}).get("vllm_int8_fp32 vs hf_int8_fp32")
            j = jit["inits"].get(init, {}).get("pairs", {}).get("hf_int8_fp32_eps vs hf_int8_fp32")
            if k and j:
                parts.append(f"{init}: vLLM INT8 vs torch W8A8 (fp32 engine) mean {k['mean_abs_dlogp']:.1e}; torch W8A8 vs "
                             f"itself with 1e-6 norm jitter {j['mean_abs_dlogp']:.1e}")
        gemm = jit.get("gemm_check") or []
        if gemm:
            parts.append("op-level vLLM INT8 linear vs exact: max rel. error "
                         f"{max(r['max_rel_err_vs_exact'] for r in gemm):.0e}, activation codes differing: "
                         f"{sum(r['activation_codes_differing'] for r in gemm)}")
        out.append(f"| INT8 kernel correctness (no target; fidelity_diagnosis*.md, fidelity_jitter.md) | {'; '.join(parts)} | - |")
    for path in sorted(RESULTS.glob("lora_sync_*.json")):
        ls = json.loads(path.read_text())
        parts = []
        if ls.get("sync"):
            sy = ls["sync"]
            adapter = sorted(a["client_wall_s"] for a in sy["adapter_syncs"])[len(sy["adapter_syncs"]) // 2]
            parts.append(f"{sy['shape']}: full-weight sync {sy['full_sync']['client_wall_s']:.2f} s, rank-{sy['rank']} adapter "
                         f"sync {adapter:.3f} s ({sy['full_over_adapter_wall']:.0f}x), base once {sy['lora_base_sync']['client_wall_s']:.2f} s")
        if ls.get("kl"):
            means = {arm: sum(r["kl_behav_prox_k3"] for r in rows) / len(rows) for arm, rows in ls["kl"]["arms"].items()}
            parts.append("KL(behav||prox) " + ", ".join(f"{arm} {v:.1e}" for arm, v in means.items()))
        out.append(f"| LoRA over the 8-bit base (no target; {path.stem.removeprefix('lora_sync_')}) | {'; '.join(parts)} | - |")
    out.append("| `make bench` reproduces all numbers | `bench/run_all.sh` runs every script above with the "
               "arguments of the committed results | - |")
    return out


def main() -> None:
    text = README.read_text()
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    README.write_text(head + START + "\n" + "\n".join(rows()) + "\n" + END + tail)
    print("updated", README)


if __name__ == "__main__":
    main()
