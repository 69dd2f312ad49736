"""Step ``numerics`` of gpu_evidence.py: quantizer codes on the device vs CPU, W8A8 products vs an exact reference."""
from __future__ import annotations

import math

import torch
from evidence_kernels import (
    CUDA_INT_MM_MIN_ROWS,
    INT8_REL_BOUND,
    QWEN25,
    TOY,
    U32,
    checked_int_mm,
    code_mismatches,
    first_runnable_rows,
    fused_linear_shapes,
    padded_rows,
    random_weight,
)
from evidence_run_control import Budget, Context

from qurl_verl.quant import (
    FP8_BLOCK,
    FP8_GROUP,
    FP8_TOKEN,
    INT8_TOKEN,
    QuantizedTensor,
    int8_matmul_accumulate,
    parse_scheme,
    quantize,
    w8a8_linear,
    w8a8_linear_reference,
)

# ----------------------------------------------------------------------------- step 1: numerics


def quantizer_cases(dry_run: bool) -> list[tuple[str, tuple[int, ...], tuple[str, ...]]]:
    if dry_run:
        return [("weight_96x200", (96, 200), ("channel", "block")), ("act_2x8x200", (2, 8, 200), ("token", "group"))]
    return [
        ("weight_7b_qkv", (4608, 3584), ("channel", "block")),
        ("weight_1000x1000", (1000, 1000), ("channel", "block")),
        ("act_256x3584", (256, 3584), ("token", "group")),
        ("act_4x64x1000", (4, 64, 1000), ("token", "group")),
    ]


def compare_quantizers(ctx: Context, budget: Budget, res: dict) -> None:
    """Same input on the step's device and on CPU: the codes and scales must agree."""
    gen = torch.Generator().manual_seed(1)
    rows, totals = [], {"int8_code_mismatches": 0, "fp8_code_mismatches": 0, "scale_mismatches": 0,
                        "max_scale_rel_diff": 0.0, "elements": 0}
    res["quantizer"] = {"compared": "device vs cpu" if ctx.cuda else "cpu vs cpu (dry run)", "cases": rows,
                        "totals": totals}
    for case, shape, granularities in quantizer_cases(ctx.dry_run):
        x32 = torch.randn(*shape, generator=gen) * torch.exp(torch.randn(*shape[:-1], 1, generator=gen))
        for dtype in (torch.float32, torch.bfloat16):
            x_cpu = x32.to(dtype)
            x_dev = x_cpu.to(ctx.device)
            for fmt in ("int8", "fp8"):
                for gran in granularities:
                    if budget.expired():
                        return
                    q_cpu = quantize(x_cpu, parse_scheme(fmt, gran))
                    q_dev = quantize(x_dev, parse_scheme(fmt, gran))
                    s_cpu, s_dev = q_cpu.scale, q_dev.scale.cpu()
                    rel = float(((s_dev.double() - s_cpu.double()).abs() / s_cpu.double()).max())
                    mism = code_mismatches(q_dev.data, q_cpu.data)
                    row = dict(case=case, shape=list(shape), dtype=str(dtype).replace("torch.", ""), fmt=fmt,
                               granularity=gran, code_mismatches=mism,
                               scale_mismatches=int((s_dev != s_cpu).sum()), max_scale_rel_diff=rel)
                    if fmt == "fp8" and mism:
                        diff = (q_dev.data.cpu().float() - q_cpu.data.float()).abs()
                        row["max_code_abs_diff"] = float(diff.max())
                    rows.append(row)
                    totals[f"{fmt}_code_mismatches"] += mism
                    totals["scale_mismatches"] += row["scale_mismatches"]
                    totals["max_scale_rel_diff"] = max(totals["max_scale_rel_diff"], rel)
                    totals["elements"] += x_cpu.numel()


def exact_reference(qx: QuantizedTensor, qw: QuantizedTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 (x_q @ w_q^T) * x_scale * w_scale and the matching sum of |terms|.

    8-bit codes multiply and add exactly in float64 (INT8: |sum| < K * 127^2 << 2^53; E4M3:
    products span 2^-18 .. 2^17.6, so K < 2^17 partial sums fit 53 bits), so the only rounding in
    the reference is the final scaling, 2^-53 each: exact for every purpose here.
    """
    cx, cw = qx.data.double(), qw.data.double()
    scale = qx.scale.double() * qw.scale.double().reshape(1, -1)
    return (cx @ cw.t()) * scale, (cx.abs() @ cw.abs().t()) * scale


def product_errors(out: torch.Tensor, ref: torch.Tensor, abs_sum: torch.Tensor) -> dict:
    out = out.double()
    diff = (out - ref).abs()
    nonzero = ref != 0
    rel = diff[nonzero] / ref[nonzero].abs()
    return {
        "max_rel_err": float(rel.max()) if rel.numel() else 0.0,
        "max_err_over_abs_sum": float((diff / abs_sum.clamp_min(1e-300)).max()),
        "zero_ref_nonzero_out": int(((~nonzero) & (out != 0)).sum()),
    }


def int8_product(x: torch.Tensor, qw: QuantizedTensor, emulate_limit: bool) -> tuple[torch.Tensor, str]:
    """The project's INT8 W8A8 product in float32; M padded where CUDA ``_int_mm`` rejects small M."""
    if not (emulate_limit and x.shape[0] < CUDA_INT_MM_MIN_ROWS):
        try:
            return w8a8_linear(x, qw, out_dtype=torch.float32), "w8a8_linear"
        except RuntimeError:
            if x.device.type != "cuda":
                raise
    qx = quantize(x, INT8_TOKEN)
    rows = first_runnable_rows(
        x.shape[0], lambda r: checked_int_mm(padded_rows(qx.data, r), qw.data.t(), emulate_limit))
    acc = int8_matmul_accumulate(padded_rows(qx.data, rows), qw.data)[: x.shape[0]]
    return acc.to(torch.float32) * qx.scale * qw.scale.reshape(1, -1), f"int8_matmul_accumulate, M padded to {rows}"


def fp8_product(x: torch.Tensor, qw: QuantizedTensor) -> tuple[torch.Tensor, str]:
    """The project's FP8 W8A8 product (float32 out); bf16 out straight from ``_scaled_mm`` if float32 is refused."""
    try:
        return w8a8_linear(x, qw, out_dtype=torch.float32), "w8a8_linear (fp8_scaled_matmul, float32 out)"
    except (RuntimeError, ValueError) as exc:
        first_error = f"{type(exc).__name__}: {exc}"[:300]
    qx = quantize(x, FP8_TOKEN)
    out = torch._scaled_mm(qx.data.contiguous(), qw.data.t(), scale_a=qx.scale.reshape(-1, 1).contiguous(),
                           scale_b=qw.scale.reshape(1, -1).contiguous(), out_dtype=torch.bfloat16)
    return out.float(), f"_scaled_mm bfloat16 out (float32 out failed: {first_error})"


def check_products(ctx: Context, budget: Budget, res: dict) -> None:
    """W8A8 products at decode shapes against the exact float64 reference."""
    if ctx.dry_run:
        model, spec, ms = "toy", TOY, (1, 8, 32)
    else:
        model, spec, ms = "qwen2.5-7b", QWEN25["qwen2.5-7b"], (1, 8, 64, 256)
    gen = torch.Generator(device=ctx.device).manual_seed(2)
    rows = []
    res["products"] = {
        "model": model,
        "reference": "float64 x_q @ w_q^T with the scales applied after the exact code accumulation",
        "int8_rel_bound": INT8_REL_BOUND,
        "int8_bound_why": "exact int32 accumulation, then 3 float32 roundings (to float, * x_scale, * w_scale)",
        "fp8_bound_over_abs_sum": "(K + 2) * 2^-24: float32 accumulation of exact E4M3 products, then 2 scalings",
        "cases": rows,
    }
    for layer, (n, k) in fused_linear_shapes(spec).items():
        w = random_weight((n, k), ctx.device, torch.bfloat16, gen)
        for fmt in ("int8", "fp8"):
            qw = quantize(w, parse_scheme(fmt, "channel"))
            for m in ms:
                if budget.expired():
                    return
                x = torch.randn(m, k, device=ctx.device, dtype=torch.bfloat16, generator=gen)
                row = dict(layer=layer, n=n, k=k, m=m, fmt=fmt)
                try:
                    if fmt == "int8":
                        out, path = int8_product(x, qw, ctx.emulate_int_mm_limit)
                    else:
                        out, path = fp8_product(x, qw)
                    ref, abs_sum = exact_reference(quantize(x, parse_scheme(fmt, "token")), qw)
                    row.update(path=path, **product_errors(out, ref, abs_sum))
                    if fmt == "int8":
                        row["within_bound"] = row["max_rel_err"] <= INT8_REL_BOUND and row["zero_ref_nonzero_out"] == 0
                    else:
                        bound = (k + 2) * U32 if "float32 out" in path else 2.0**-8
                        row.update(bound_over_abs_sum=bound, within_bound=row["max_err_over_abs_sum"] <= bound)
                except Exception as exc:
                    row["error"] = f"{type(exc).__name__}: {exc}"[:500]
                rows.append(row)
    # FP8 128x128 blocks through the project's block loop, against the project's float64 reference.
    n, k = fused_linear_shapes(spec)["down"]
    w = random_weight((n, k), ctx.device, torch.bfloat16, gen)
    qw = quantize(w, FP8_BLOCK)
    m = ms[-1]
    x = torch.randn(m, k, device=ctx.device, dtype=torch.bfloat16, generator=gen)
    row = dict(layer="down", n=n, k=k, m=m, fmt="fp8_block")
    try:
        out = w8a8_linear(x, qw, out_dtype=torch.float32)
        ref = w8a8_linear_reference(x, qw)
        qx = quantize(x, FP8_GROUP)
        abs_sum = qx.dequantize(torch.float64).abs() @ qw.dequantize(torch.float64).abs().t()
        row.update(path="w8a8_linear (block loop)", **product_errors(out, ref, abs_sum))
        bound = (k + 3 * math.ceil(k / 128)) * U32  # per-block accumulation, 2 scalings, 1 add per block
        row.update(bound_over_abs_sum=bound, within_bound=row["max_err_over_abs_sum"] <= bound)
    except Exception as exc:
        row["error"] = f"{type(exc).__name__}: {exc}"[:500]
    rows.append(row)


def step_numerics(ctx: Context, budget: Budget, res: dict, flush) -> None:
    compare_quantizers(ctx, budget, res)
    flush()
    check_products(ctx, budget, res)
    cases = [c for c in res["products"]["cases"] if "error" not in c]
    res["summary"] = {
        **res["quantizer"]["totals"],
        "int8_max_rel_err": max((c["max_rel_err"] for c in cases if c["fmt"] == "int8"), default=None),
        "fp8_max_err_over_abs_sum": max((c["max_err_over_abs_sum"] for c in cases if c["fmt"] == "fp8"), default=None),
        "products_within_bound": all(c["within_bound"] for c in cases) and len(cases) == len(res["products"]["cases"]),
        "product_errors": len(res["products"]["cases"]) - len(cases),
    }
