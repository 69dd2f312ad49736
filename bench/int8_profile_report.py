"""The INT8 batch-1 profile's sums over one decoder layer and its markdown table."""
from __future__ import annotations

from int8_profile_classes import MS, OPS


def layer_sums(run: dict) -> dict:
    """Per M: per-op times summed over the decoder layer's linears, and the INT8 variants vs BF16."""
    out = {}
    for m in map(str, MS):
        t = {op: sum(s["m"][m]["ops"][op]["median_us"] for s in run["shapes"].values()) for op in OPS
             if all(op in s["m"][m]["ops"] for s in run["shapes"].values())}
        row = dict(t)
        row["int8"] = t["quant"] + t["int8_gemm"]
        row["int8_split"] = t["quant"] + t["split_gemm"]
        row["int8_7bit"] = t["quant"] + t["int8_7bit_gemm"]
        variants = ["int8", "int8_split", "int8_7bit"]
        if "avx2_packed_gemm" in t:
            row["int8_avx2_packed"] = t["quant"] + t["avx2_packed_gemm"]
            variants.append("int8_avx2_packed")
        for v in variants:
            row[f"bf16_over_{v}"] = t["bf16_linear"] / row[v]
        row["bf16_over_w8a16_int8pack"] = t["bf16_linear"] / t["w8a16_int8pack"]
        out[m] = row
    return out


def markdown(reports: list[dict]) -> str:
    """One row per class, thread count and M: summed over one decoder layer's four linears (us)."""
    lines = ["| class | thr | M | quant (a) | INT8 GEMM (b) | split GEMM (c) | 7-bit GEMM (d) | BF16 (e) | "
             "packed AVX2 (f) | BF16/(a+b) | BF16/(a+c) | BF16/(a+d) | BF16/(a+f) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for rep in reports:
        for run in rep["runs"]:
            for m, r in run["layer_sum_us"].items():
                lines.append(f"| {rep['cpu_class']} | {run['threads']} | {m} | {r['quant']:.0f} | "
                             f"{r['int8_gemm']:.0f} | "
                             f"{r['split_gemm']:.0f} | {r['int8_7bit_gemm']:.0f} | {r['bf16_linear']:.0f} | "
                             + (f"{r['avx2_packed_gemm']:.0f}" if "avx2_packed_gemm" in r else "-") + " | "
                             f"{r['bf16_over_int8']:.2f}x | {r['bf16_over_int8_split']:.2f}x | "
                             f"{r['bf16_over_int8_7bit']:.2f}x | "
                             + (f"{r['bf16_over_int8_avx2_packed']:.2f}x" if "avx2_packed_gemm" in r else "-") + " |")
    engines = [(rep["cpu_class"], fmt, e) for rep in reports for fmt, e in rep.get("engine", {}).items()]
    if engines:
        lines += ["", "| class | engine | threads | ms/token (wall, median of 3) | linear ops (self CPU) | top op |",
                  "|---|---|---:|---:|---:|---|"]
        for cls, fmt, e in engines:
            if "error" in e:
                lines.append(f"| {cls} | {fmt} | - | failed | - | - |")
                continue
            top = e["top_self_cpu"][0]
            lines.append(f"| {cls} | {fmt} | {e['engine_threads']} | {e['wall_ms_per_token']:.1f} | "
                         f"{100 * e['linear_ops_share']:.0f}% | {top['name']} {100 * top['share']:.0f}% |")
    return "\n".join(lines)
