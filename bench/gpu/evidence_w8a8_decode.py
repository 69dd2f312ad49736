"""Step ``w8a8_decode`` of gpu_evidence.py: BF16 vs INT8 vs FP8 GEMMs at decode batch sizes."""
from __future__ import annotations

import math

import torch
from evidence_kernels import (
    QWEN25,
    TOY,
    checked_int_mm,
    code_mismatches,
    first_runnable_rows,
    fused_linear_shapes,
    padded_rows,
    quantize_rows,
    random_weight,
    time_per_call_ms,
)
from evidence_run_control import Budget, Context

from qurl_verl.quant import (
    FP8_CHANNEL,
    FP8_E4M3,
    INT8,
    INT8_CHANNEL,
    parse_scheme,
    quantize,
)

# ----------------------------------------------------------------------------- step 2: W8A8 decode


VARIANTS = ("bf16", "int8_gemm", "int8_total", "fp8_gemm", "fp8_total")


def decode_models(dry_run: bool) -> list[tuple[str, dict, int]]:
    if dry_run:
        return [("toy", TOY, 1), ("toy-tp2", TOY, 2)]
    return [("qwen2.5-1.5b", QWEN25["qwen2.5-1.5b"], 1), ("qwen2.5-7b", QWEN25["qwen2.5-7b"], 1),
            ("qwen2.5-32b", QWEN25["qwen2.5-32b"], 1), ("qwen2.5-32b-tp2", QWEN25["qwen2.5-32b"], 2)]


def weight_copies(ctx: Context, n: int, k: int, target_bytes: int) -> int:
    """Enough copies of a weight that one pass over them (counted in INT8 bytes) overflows L2, as decode does."""
    if not ctx.cuda:
        return 2
    return max(1, min(64, math.ceil(target_bytes / (n * k))))


def time_layer(ctx: Context, n: int, k: int, ms, gen, target_bytes: int, budget: Budget, counters: dict) -> list[dict]:
    """All variants at every M for one (N, K) GEMM; weights rotate over copies so they stream from memory."""
    copies = weight_copies(ctx, n, k, target_bytes)
    iters = max(copies, 4) if ctx.cuda else 2
    reps = 10 if ctx.cuda else 3
    w = random_weight((n, k), ctx.device, torch.bfloat16, gen)
    q8, qf = quantize(w, INT8_CHANNEL), quantize(w, FP8_CHANNEL)
    w_bf16 = [w] + [w.clone() for _ in range(copies - 1)]
    w_int8_t = [q8.data.t()] + [q8.data.clone().t() for _ in range(copies - 1)]  # [K, N] column-major
    w_fp8_t = [qf.data.t()] + [qf.data.clone().t() for _ in range(copies - 1)]
    s_int8, s_fp8 = q8.scale.reshape(1, -1).contiguous(), qf.scale.reshape(1, -1).contiguous()
    out = []
    for m in ms:
        if budget.expired():
            break
        x = torch.randn(m, k, device=ctx.device, dtype=torch.bfloat16, generator=gen)
        row = {"n": n, "k": k, "m": m, "weight_copies": copies, "iters_per_timing": iters}
        errors = {}
        for fmt in (INT8, FP8_E4M3):  # the graph-capturable activation quantizer must be quantize()'s
            codes, scale = quantize_rows(x, fmt)
            ref = quantize(x, parse_scheme(fmt, "token"))
            counters["act_quant_code_mismatches"] += code_mismatches(codes, ref.data)
            counters["act_quant_scale_mismatches"] += int((scale != ref.scale).sum())
            counters["act_quant_checked"] += 1

        def int8_gemm_of(xr):
            return lambda i: torch._int_mm(xr, w_int8_t[i % copies])

        def fp8_gemm_of(xr, sa):
            return lambda i: torch._scaled_mm(xr, w_fp8_t[i % copies], scale_a=sa, scale_b=s_fp8,
                                              out_dtype=torch.bfloat16)

        try:
            rows8 = first_runnable_rows(m, lambda r: checked_int_mm(
                quantize_rows(padded_rows(x, r), INT8)[0], w_int8_t[0], ctx.emulate_int_mm_limit))
            x8 = padded_rows(x, rows8)
            c8 = quantize_rows(x8, INT8)[0]

            def int8_total(i):
                codes, xs = quantize_rows(x8, INT8)
                acc = torch._int_mm(codes, w_int8_t[i % copies])
                return (acc.to(torch.float32) * xs * s_int8).to(torch.bfloat16)

            row["int8_rows"] = rows8
        except Exception as exc:
            errors["int8"] = f"{type(exc).__name__}: {exc}"[:300]
        try:
            rowsf = first_runnable_rows(m, lambda r: fp8_gemm_of(*quantize_rows(padded_rows(x, r), FP8_E4M3))(0))
            xf = padded_rows(x, rowsf)
            cf, xsf = quantize_rows(xf, FP8_E4M3)

            def fp8_total(i):
                codes, xs = quantize_rows(xf, FP8_E4M3)
                return torch._scaled_mm(codes, w_fp8_t[i % copies], scale_a=xs, scale_b=s_fp8,
                                        out_dtype=torch.bfloat16)

            row["fp8_rows"] = rowsf
        except Exception as exc:
            errors["fp8"] = f"{type(exc).__name__}: {exc}"[:300]

        fns = {"bf16": lambda i: x @ w_bf16[i % copies].t()}
        if "int8" not in errors:
            fns.update(int8_gemm=int8_gemm_of(c8), int8_total=int8_total)
        if "fp8" not in errors:
            fns.update(fp8_gemm=fp8_gemm_of(cf, xsf), fp8_total=fp8_total)
        for name, fn in fns.items():
            try:
                ms_per_call, method = time_per_call_ms(ctx, fn, iters, reps)
                row[f"{name}_ms"] = ms_per_call
                counters["timing_methods"][method] = counters["timing_methods"].get(method, 0) + 1
            except Exception as exc:
                errors[name] = f"{type(exc).__name__}: {exc}"[:300]
        row["speedup_vs_bf16"] = {v: row["bf16_ms"] / row[f"{v}_ms"] for v in VARIANTS[1:]
                                  if f"{v}_ms" in row and "bf16_ms" in row}
        if errors:
            row["errors"] = errors
        out.append(row)
    return out


def per_model_totals(layers: dict[str, list[dict]], ms) -> dict:
    """Per M: the four GEMM times of one decoder layer summed, and the speedups of those sums."""
    totals = {}
    for m in ms:
        rows = [next((r for r in layer_rows if r["m"] == m), None) for layer_rows in layers.values()]
        if len(rows) != 4 or any(r is None for r in rows):
            continue
        sums = {v: sum(r[f"{v}_ms"] for r in rows) for v in VARIANTS if all(f"{v}_ms" in r for r in rows)}
        totals[str(m)] = {
            "layer_ms": sums,
            "speedup_vs_bf16": {v: sums["bf16"] / t for v, t in sums.items() if v != "bf16" and "bf16" in sums},
        }
    return totals


def step_w8a8_decode(ctx: Context, budget: Budget, res: dict, flush) -> None:
    ms = (1, 8) if ctx.dry_run else (1, 8, 32, 64, 128, 256)
    l2 = getattr(torch.cuda.get_device_properties(ctx.device), "L2_cache_size", 0) if ctx.cuda else 0
    target_bytes = max(4 * (l2 or 50 * 2**20), 200 * 2**20)
    counters = {"act_quant_code_mismatches": 0, "act_quant_scale_mismatches": 0, "act_quant_checked": 0,
                "timing_methods": {}}
    res.update(
        m_values=list(ms),
        method=("CUDA events around CUDA-graph replays of `iters` calls, median of 10; weights rotate over "
                "copies whose INT8 bytes exceed the working-set target, so every call streams its weight "
                "from HBM as in decode" if ctx.cuda else "wall clock, eager, CPU (dry run)"),
        working_set_target_bytes=target_bytes if ctx.cuda else None,
        variants={
            "bf16": "x @ w.T, bf16",
            "int8_gemm": "torch._int_mm on pre-quantized codes (int32 out): the bare GEMM",
            "int8_total": "per-token quantize (unfused torch ops) + _int_mm + float32 rescale + cast to bf16",
            "fp8_gemm": "torch._scaled_mm, row-wise float32 scales, bf16 out, pre-quantized activations",
            "fp8_total": "per-token FP8 quantize (unfused torch ops) + _scaled_mm",
        },
        note=("CUDA _int_mm needs M > 16: smaller M run padded (int8_rows); vLLM's CUTLASS kernels fuse "
              "the quantization and the rescale, so its W8A8 time lies between the gemm and total columns"),
        counters=counters,
        models={},
    )
    gen = torch.Generator(device=ctx.device).manual_seed(3)
    for model, spec, tp in decode_models(ctx.dry_run):
        if budget.expired():
            break
        layers = {}
        entry = res["models"][model] = {"tp": tp, "shapes_nk": fused_linear_shapes(spec, tp), "layers": layers}
        for layer, (n, k) in fused_linear_shapes(spec, tp).items():
            if budget.expired():
                break
            layers[layer] = time_layer(ctx, n, k, ms, gen, target_bytes, budget, counters)
            ctx.free()
        entry["per_decoder_layer"] = per_model_totals(layers, ms)
        flush()
