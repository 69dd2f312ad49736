"""GPU evidence for QuRL's pure-torch layer, in one command on one CUDA device (written for an H200).

The GPU machine has no network, no vLLM and no verl, so everything here runs on torch alone plus
``qurl_verl.quant`` and ``qurl_verl.losses.acr`` (neither imports verl or vLLM). Four steps, each
under its own time budget; the JSON is rewritten after every step so a killed run keeps what it had:

numerics     INT8 / FP8 E4M3 quantizer codes and scales on CUDA vs CPU (channel, token, 128x128
             block, 1x128 group), and the W8A8 products of ``torch._int_mm`` / ``torch._scaled_mm``
             against an exactly accumulated float64 reference of the dequantized operands.
w8a8_decode  BF16 ``x @ w.T`` vs INT8 (``_int_mm`` + per-token / per-channel scales) vs FP8
             (``_scaled_mm``, row-wise scales) at decode batch sizes for the linears of
             Qwen2.5-1.5B / 7B / 32B (32B also at TP=2 shard shapes). These are torch's kernels,
             not vLLM's CUTLASS ones, and the activation quantization is unfused torch ops: the
             "gemm" columns bound what 8-bit GEMMs can give, the "total" columns what plain torch gives.
sync_cost    Re-quantizing every targeted linear of 7B- and 32B-shaped decoder layers from fp32 and
             bf16 masters (one weight sync), and the code-change tracker's time and memory.
acr_loss     Forward+backward of ``acr_token_loss`` vs a plain PPO clipped loss at 256 x 8192 tokens.

    PYTHONPATH=. python bench/gpu/gpu_evidence.py --out $OUT/gpu_evidence.json
    python bench/gpu/gpu_evidence.py --dry-run --out gpu_evidence_dry_run.json   # toy sizes on CPU, < 60 s
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from qurl_verl.losses.acr import acr_token_loss, log_weight_from_is_weights  # noqa: E402
from qurl_verl.quant import (  # noqa: E402
    FP8_BLOCK,
    FP8_CHANNEL,
    FP8_E4M3,
    FP8_GROUP,
    FP8_TOKEN,
    INT8,
    INT8_CHANNEL,
    INT8_TOKEN,
    QuantizedTensor,
    UpdateVisibilityTracker,
    int8_matmul_accumulate,
    parse_scheme,
    quantize,
    quantize_state_dict,
    w8a8_linear,
    w8a8_linear_reference,
)
from qurl_verl.quant.quantizer import MIN_SCALE  # noqa: E402
from qurl_verl.quant.update_visibility import changed_code_count  # noqa: E402

# Qwen2.5 decoder shapes from the released config.json files.
QWEN25 = {
    "qwen2.5-1.5b": dict(hidden=1536, inter=8960, heads=12, kv_heads=2, head_dim=128, layers=28),
    "qwen2.5-7b": dict(hidden=3584, inter=18944, heads=28, kv_heads=4, head_dim=128, layers=28),
    "qwen2.5-32b": dict(hidden=5120, inter=27648, heads=40, kv_heads=8, head_dim=128, layers=64),
}
# Dry-run stand-in: inter is not a multiple of 128, so the partial-block paths run too.
TOY = dict(hidden=128, inter=320, heads=4, kv_heads=2, head_dim=32, layers=4)

STEP_NAMES = ("numerics", "w8a8_decode", "sync_cost", "acr_loss")
# Soft budgets (checked between iterations) sum to 285 s; the hard limit adds HARD_GRACE_S per step.
GPU_BUDGET_S = {"numerics": 40, "w8a8_decode": 140, "sync_cost": 70, "acr_loss": 35}
DRY_RUN_BUDGET_S = {"numerics": 30, "w8a8_decode": 30, "sync_cost": 30, "acr_loss": 30}
HARD_GRACE_S = 10

U32 = 2.0**-24  # unit roundoff of float32
# torch._int_mm on CUDA: "self.size(0) needs to be greater than 16". The dry run emulates the limit
# so that the padded path the GPU needs for decode-sized M also runs on CPU.
CUDA_INT_MM_MIN_ROWS = 17
# INT8: the int32 accumulation is exact (|acc| <= K * 127^2 < 2^31 for K < 133k), then three float32
# roundings (int32 -> float32, * x_scale, * w_scale): elementwise relative error <= (1+u)^3 - 1 < 3.001u.
INT8_REL_BOUND = 3.001 * U32
# ACR / PPO hyper-parameters of bench/bench_acr_loss.py.
IS_CAP, CLIP_LOW, CLIP_HIGH, CLIP_C = 2.0, 0.2, 0.28, 3.0


# ----------------------------------------------------------------------------- run control


class StepTimeout(Exception):
    """Raised by the hard limit when a step overruns its budget inside one long iteration."""


class Budget:
    """A step's soft wall-clock budget; loops ask ``expired()`` between iterations and stop early."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.deadline = time.monotonic() + seconds
        self.truncated = False

    def expired(self) -> bool:
        if time.monotonic() > self.deadline:
            self.truncated = True
        return self.truncated


@contextmanager
def hard_time_limit(seconds: float):
    """SIGALRM backstop for a step stuck in one iteration; a no-op off the main thread or without SIGALRM."""
    if not hasattr(signal, "SIGALRM") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_alarm(signum, frame):
        raise StepTimeout(f"step exceeded its hard limit of {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def jsonable(obj):
    """Non-finite floats become strings so the file stays strict JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    return obj


def write_json(path: Path, report: dict) -> None:
    """Atomic rewrite, so a kill during the write leaves the previous complete file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(jsonable(report), indent=1) + "\n")
    os.replace(tmp, path)


class Context:
    """What every step needs: the device, whether this is a dry run, and the sizes that follow from it."""

    def __init__(self, device: torch.device, dry_run: bool):
        self.device = device
        self.dry_run = dry_run
        self.cuda = device.type == "cuda"
        self.emulate_int_mm_limit = dry_run

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def free(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()


def environment(ctx: Context) -> dict:
    env = {
        "device": str(ctx.device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "dry_run": ctx.dry_run,
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception:
        env["triton"] = None
    if ctx.cuda:
        props = torch.cuda.get_device_properties(ctx.device)
        env.update(
            device_name=props.name,
            capability=list(torch.cuda.get_device_capability(ctx.device)),
            total_memory_gib=round(props.total_memory / 2**30, 1),
            multiprocessors=props.multi_processor_count,
            l2_cache_bytes=getattr(props, "L2_cache_size", None),
            cudnn=torch.backends.cudnn.version(),
        )
        try:
            smi = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm,clocks.max.mem,power.limit",
                 "--format=csv,noheader"], capture_output=True, text=True, timeout=10)
            env["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
        except Exception as exc:
            env["nvidia_smi"] = f"unavailable: {type(exc).__name__}"
    else:
        env.update(device_name=platform.processor() or platform.machine(), capability=None)
    return env


# ----------------------------------------------------------------------------- shapes and helpers


def fused_linear_shapes(spec: dict, tp: int = 1) -> dict[str, tuple[int, int]]:
    """(N, K) of the four GEMMs of one decoder layer as vLLM fuses them, per tensor-parallel rank."""
    hd = spec["head_dim"]
    if spec["heads"] % tp or spec["kv_heads"] % tp or spec["inter"] % tp:
        raise ValueError(f"tp={tp} does not divide the heads / intermediate size of {spec}")
    q, kv = spec["heads"] * hd // tp, spec["kv_heads"] * hd // tp
    return {
        "qkv": (q + 2 * kv, spec["hidden"]),
        "o": (spec["hidden"], q),
        "gate_up": (2 * spec["inter"] // tp, spec["hidden"]),
        "down": (spec["hidden"], spec["inter"] // tp),
    }


def hf_linear_shapes(spec: dict, layer: int) -> dict[str, tuple[int, int]]:
    """HF-named (N, K) of the seven targeted linears of one layer, as the trainer streams them."""
    hd, hidden, inter = spec["head_dim"], spec["hidden"], spec["inter"]
    q, kv = spec["heads"] * hd, spec["kv_heads"] * hd
    p = f"model.layers.{layer}"
    return {
        f"{p}.self_attn.q_proj.weight": (q, hidden),
        f"{p}.self_attn.k_proj.weight": (kv, hidden),
        f"{p}.self_attn.v_proj.weight": (kv, hidden),
        f"{p}.self_attn.o_proj.weight": (hidden, q),
        f"{p}.mlp.gate_proj.weight": (inter, hidden),
        f"{p}.mlp.up_proj.weight": (inter, hidden),
        f"{p}.mlp.down_proj.weight": (hidden, inter),
    }


def quantize_rows(x: torch.Tensor, fmt) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token absmax quantization with ``quantize``'s arithmetic but without its NaN/inf host check.

    The check reads a value back to the host, which CUDA graphs cannot capture and vLLM's fused
    activation kernel does not do. ``w8a8_decode`` counts code and scale mismatches against
    ``quantize(x, fmt, "token")`` on every activation it times.
    """
    amax = torch.maximum(x.amax(dim=-1, keepdim=True), x.amin(dim=-1, keepdim=True).neg()).to(torch.float32)
    scale = (amax / fmt.qmax).clamp_min(MIN_SCALE)
    scaled = x / scale
    if fmt.dtype == torch.int8:
        return scaled.round().clamp(-fmt.qmax, fmt.qmax).to(torch.int8), scale
    return scaled.clamp(-fmt.qmax, fmt.qmax).to(fmt.dtype), scale


def code_mismatches(a: torch.Tensor, b: torch.Tensor) -> int:
    """Positions whose 8-bit codes differ (FP8 +0 and -0 count as equal)."""
    return changed_code_count(a.cpu(), b.cpu())


def padded_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """``x`` with zero rows appended up to ``rows`` (zero rows quantize to zero codes)."""
    if rows == x.shape[0]:
        return x
    return torch.cat([x, x.new_zeros(rows - x.shape[0], x.shape[1])])


def row_candidates(m: int) -> list[int]:
    """Row counts to try for a GEMM whose kernel may reject small M (CUDA ``_int_mm`` needs M > 16)."""
    return [m] + [r for r in (16, 32) if r > m]


def checked_int_mm(a: torch.Tensor, b_kn: torch.Tensor, emulate_limit: bool) -> torch.Tensor:
    """``torch._int_mm(a, b_kn)``, refusing small M as CUDA does when ``emulate_limit`` is set."""
    if emulate_limit and a.shape[0] < CUDA_INT_MM_MIN_ROWS:
        raise RuntimeError(f"emulated CUDA _int_mm limit: M={a.shape[0]} must be > 16")
    return torch._int_mm(a, b_kn)


def first_runnable_rows(m: int, probe) -> int:
    """The smallest row count in ``row_candidates(m)`` for which ``probe(rows)`` runs."""
    error = None
    for rows in row_candidates(m):
        try:
            probe(rows)
            return rows
        except (RuntimeError, ValueError) as exc:
            error = exc
    raise error


def time_per_call_ms(ctx: Context, fn, iters: int, reps: int) -> tuple[float, str]:
    """Median milliseconds per ``fn(i)`` call, i = 0..iters-1 per repetition.

    On CUDA the ``iters`` calls are captured in one CUDA graph and timed with events, so launch
    overhead (which vLLM also hides with graphs) stays out; if capture fails, the same loop runs eagerly.
    On CPU: wall clock.
    """
    if not ctx.cuda:
        fn(0)
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            for i in range(iters):
                fn(i)
            times.append((time.perf_counter() - start) * 1e3 / iters)
        return statistics.median(times), "eager_cpu"

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream, as torch.cuda.graph requires
        for i in range(3):
            fn(i)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()

    graph, method = torch.cuda.CUDAGraph(), "cuda_graph"
    try:
        with torch.cuda.graph(graph):
            for i in range(iters):
                fn(i)
        run = graph.replay
    except Exception as exc:
        graph, method = None, f"eager ({type(exc).__name__})"
        torch.cuda.synchronize()

        def run():
            for i in range(iters):
                fn(i)

    for _ in range(2):
        run()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for start, end in zip(starts, ends):
        start.record()
        run()
        end.record()
    torch.cuda.synchronize()
    times = [s.elapsed_time(e) / iters for s, e in zip(starts, ends)]
    del graph
    return statistics.median(times), method


def wall_ms(ctx: Context, fn, reps: int) -> float:
    """Median wall milliseconds of ``fn()``, device-synchronised before and after (one warm-up call)."""
    fn()
    times = []
    for _ in range(reps):
        ctx.sync()
        start = time.perf_counter()
        fn()
        ctx.sync()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def random_weight(shape, device, dtype, generator, std=0.02) -> torch.Tensor:
    """Gaussian rows with log-normal row gains, so per-channel scales spread over ~2 decades."""
    w = torch.randn(*shape, device=device, dtype=torch.float32, generator=generator)
    gains = torch.exp(0.8 * torch.randn(shape[0], 1, device=device, generator=generator))
    return (w.mul_(gains).mul_(std)).to(dtype)


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


# ----------------------------------------------------------------------------- step 3: sync cost


def sync_models(dry_run: bool) -> list[tuple[str, dict, int]]:
    """(name, shape, layers measured together to check the one-layer extrapolation)."""
    if dry_run:
        return [("toy", TOY, 2)]
    return [("qwen2.5-7b", QWEN25["qwen2.5-7b"], 8), ("qwen2.5-32b", QWEN25["qwen2.5-32b"], 4)]


def make_masters(ctx: Context, spec: dict, n_layers: int, gen) -> list[dict[str, torch.Tensor]]:
    return [{name: random_weight(shape, ctx.device, torch.float32, gen)
             for name, shape in hf_linear_shapes(spec, i).items()} for i in range(n_layers)]


def tensor_bytes_held(obj) -> tuple[int, int]:
    """(bytes, tensors): distinct storages reachable from ``obj``'s attributes, containers walked recursively."""
    storages: dict[tuple, int] = {}
    seen: set[int] = set()

    def visit(o, depth: int) -> None:
        if isinstance(o, torch.Tensor):
            st = o.untyped_storage()
            storages[(str(o.device), st.data_ptr())] = st.nbytes()
            return
        if depth > 8 or id(o) in seen:
            return
        seen.add(id(o))
        if isinstance(o, dict):
            for v in o.values():
                visit(v, depth + 1)
        elif isinstance(o, (list, tuple, set, frozenset)):
            for v in o:
                visit(v, depth + 1)
        elif type(o).__module__.startswith("qurl_verl") and hasattr(o, "__dict__"):
            visit(vars(o), depth + 1)

    visit(obj, 0)
    return sum(storages.values()), len(storages)


def quantize_layers_ms(ctx: Context, layers: list[dict[str, torch.Tensor]], fmt: str, gran: str, reps: int) -> float:
    """Median ms to run one sync's quantize work over ``layers``: quantize_state_dict, outputs held per layer."""

    scheme = parse_scheme(fmt, gran)

    def run():
        for named in layers:
            out = list(quantize_state_dict(named.items(), scheme))
            del out

    return wall_ms(ctx, run, reps)


def tracker_cost(ctx: Context, layers: list[dict[str, torch.Tensor]], row_stride: int) -> dict:
    """Two syncs through an INT8 channel tracker, fed the sync's own codes as the rollout worker does."""
    named = [(name, w) for layer in layers for name, w in layer.items()]
    q_first = [quantize(w, INT8_CHANNEL) for _, w in named]
    tracker = UpdateVisibilityTracker(INT8_CHANNEL, row_stride=row_stride)

    def observe_all(weights, quantized) -> float:
        ctx.sync()
        start = time.perf_counter()
        for (name, _), w, q in zip(named, weights, quantized):
            tracker.observe(name, w, q)
        ctx.sync()
        return (time.perf_counter() - start) * 1e3

    allocated_before = torch.cuda.memory_allocated(ctx.device) if ctx.cuda else None
    first_ms = observe_all([w for _, w in named], q_first)
    allocated_after = torch.cuda.memory_allocated(ctx.device) if ctx.cuda else None
    del q_first
    gen = torch.Generator(device=ctx.device).manual_seed(5)
    updated = [w + 1e-4 * torch.randn(w.shape, device=w.device, dtype=torch.float32, generator=gen).to(w.dtype)
               for _, w in named]
    q_second = [quantize(w, INT8_CHANNEL) for w in updated]
    second_ms = observe_all(updated, q_second)
    start = time.perf_counter()
    summary = tracker.end_step()
    end_step_ms = (time.perf_counter() - start) * 1e3
    held_bytes, held_tensors = tensor_bytes_held(tracker)
    return {
        "first_sync_ms": first_ms,
        "steady_sync_ms": second_ms,
        "end_step_ms": end_step_ms,
        "resident_bytes": held_bytes,
        "resident_tensors": held_tensors,
        "cuda_allocated_delta_bytes": (allocated_after - allocated_before) if ctx.cuda else None,
        "changed_fraction": summary["overall"]["changed_fraction"],
    }


def step_sync_cost(ctx: Context, budget: Budget, res: dict, flush) -> None:
    formats = (("int8", "channel"), ("fp8", "channel"), ("fp8", "block"))
    reps_one, reps_many = (5, 3) if ctx.cuda else (2, 1)
    row_stride = 8  # custom.qurl.code_change_row_stride default (DEFAULT_CODE_CHANGE_ROW_STRIDE, qurl_verl/settings/rollout.py)
    res.update(
        what="quantize_state_dict over the 7 targeted linears (q,k,v,o,gate,up,down) per layer, masters on the device",
        tracker_settings={"fmt": "int8", "granularity": "channel", "row_stride": row_stride},
        resident_bytes_method=("sum of untyped_storage().nbytes() over the distinct storages of every tensor "
                               "reachable from the tracker's attributes (dicts, tuples, lists and qurl_verl "
                               "objects walked recursively), after the second sync; cuda_allocated_delta_bytes "
                               "is torch.cuda.memory_allocated() across the first sync, as a cross-check"),
        models={},
    )
    gen = torch.Generator(device=ctx.device).manual_seed(4)
    for model, spec, n_measured in sync_models(ctx.dry_run):
        if budget.expired():
            break
        entry = res["models"][model] = {"layers_full": spec["layers"], "layers_measured": n_measured, "syncs": {}}
        masters = make_masters(ctx, spec, n_measured, gen)
        for master_dtype in (torch.float32, torch.bfloat16):
            if budget.expired():
                break
            dname = str(master_dtype).replace("torch.", "")
            layers = masters if master_dtype == torch.float32 else [
                {n: w.to(torch.bfloat16) for n, w in layer.items()} for layer in masters]
            layer_bytes = sum(w.numel() * w.element_size() for w in layers[0].values())
            for fmt, gran in formats:
                if budget.expired():
                    break
                one = quantize_layers_ms(ctx, layers[:1], fmt, gran, reps_one)
                many = quantize_layers_ms(ctx, layers, fmt, gran, reps_many) / n_measured
                entry["syncs"][f"{fmt}_{gran}_from_{dname}"] = {
                    "input_bytes_per_layer": layer_bytes,
                    "ms_per_layer_one": one,
                    "ms_per_layer_many": many,
                    "many_over_one": many / one,
                    "full_sync_ms_from_one": one * spec["layers"],
                    "full_sync_ms_from_many": many * spec["layers"],
                    "input_gb_per_s": layer_bytes / (many * 1e-3) / 1e9,
                }
            flush()
            if budget.expired():
                break
            cost = tracker_cost(ctx, layers, row_stride)
            scale = spec["layers"] / n_measured
            cost.update(full_model_steady_ms=cost["steady_sync_ms"] * scale,
                        full_model_resident_bytes=int(cost["resident_bytes"] * scale),
                        full_model_resident_gib=cost["resident_bytes"] * scale / 2**30)
            entry[f"tracker_from_{dname}"] = cost
            del layers
            ctx.free()
            flush()
        del masters
        ctx.free()


# ----------------------------------------------------------------------------- step 4: ACR loss


def ppo_clipped_token_mean(logp, old, adv, maskf, is_weight=None):
    """verl's vanilla PPO loss (dual clip for A < 0), optionally times the truncated IS weight, token-mean."""
    ratio = torch.exp(torch.clamp(logp - old, -20.0, 20.0))
    loss = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - CLIP_LOW, 1 + CLIP_HIGH))
    loss = torch.where(adv < 0, torch.minimum(-adv * CLIP_C, loss), loss)
    if is_weight is not None:
        loss = loss * is_weight
    return (loss * maskf).sum() / maskf.sum()


def step_acr_loss(ctx: Context, budget: Budget, res: dict, flush) -> None:
    batch, length = (8, 256) if ctx.dry_run else (256, 8192)
    warm, reps = (1, 3) if ctx.dry_run else (3, 20)
    gen = torch.Generator(device=ctx.device).manual_seed(6)
    old = -torch.rand(batch, length, device=ctx.device, generator=gen) * 5
    logp0 = old + torch.randn(batch, length, device=ctx.device, generator=gen) * 0.2
    log_w_true = torch.randn(batch, length, device=ctx.device, generator=gen) * 0.5
    adv = torch.randn(batch, 1, device=ctx.device, generator=gen).expand(batch, length).contiguous()
    lengths = torch.randint(length // 4, length + 1, (batch,), device=ctx.device, generator=gen)
    mask = torch.arange(length, device=ctx.device)[None, :] < lengths[:, None]
    maskf = mask.float()
    w = torch.exp(log_w_true) * maskf  # what verl's rollout correction sends
    w_tis = torch.clamp(w, max=IS_CAP)

    def acr(logp, adaptive=True, with_stats=True):
        log_w = log_weight_from_is_weights(w, mask)
        loss_mat, _ = acr_token_loss(logp, old, log_w, adv, mask, is_cap=IS_CAP, clip_ratio_low=CLIP_LOW,
                                     clip_ratio_high=CLIP_HIGH, clip_ratio_c=CLIP_C, adaptive=adaptive,
                                     with_stats=with_stats)
        return (loss_mat * maskf).sum() / maskf.sum()

    contenders = {
        "vanilla_ppo": lambda logp: ppo_clipped_token_mean(logp, old, adv, maskf),
        "vanilla_tis": lambda logp: ppo_clipped_token_mean(logp, old, adv, maskf, w_tis),
        "acr": acr,
        "acr_no_stats": lambda logp: acr(logp, with_stats=False),
    }
    tis_value = float(acr(logp0, adaptive=False))
    vanilla_tis_value = float(contenders["vanilla_tis"](logp0))
    res.update(
        shape=[batch, length],
        masked_tokens=int(mask.sum()),
        hyper_parameters=dict(is_cap=IS_CAP, clip_ratio_low=CLIP_LOW, clip_ratio_high=CLIP_HIGH, clip_ratio_c=CLIP_C),
        what=("forward+backward of one token-mean loss on fp32 [B, T] tensors, device-synchronised wall time, "
              "round-robin over contenders, median; acr includes log_weight_from_is_weights (one host sync) "
              "and the on-device diagnostics; vanilla_ppo is verl's vanilla loss in plain torch, "
              "vanilla_tis the same times min(w, C)"),
        qurl_tis_minus_vanilla_tis=abs(tis_value - vanilla_tis_value),
    )
    times: dict[str, list[float]] = {name: [] for name in contenders}
    peak: dict[str, int] = {}
    for rep in range(warm + reps):
        if budget.expired():
            break
        for name, fn in contenders.items():
            logp = logp0.clone().requires_grad_(True)
            if ctx.cuda:
                torch.cuda.reset_peak_memory_stats(ctx.device)
            base = torch.cuda.memory_allocated(ctx.device) if ctx.cuda else 0
            ctx.sync()
            start = time.perf_counter()
            fn(logp).backward()
            ctx.sync()
            if rep >= warm:
                times[name].append((time.perf_counter() - start) * 1e3)
            if ctx.cuda:
                peak[name] = torch.cuda.max_memory_allocated(ctx.device) - base
    med = {name: statistics.median(t) for name, t in times.items() if t}
    res.update(
        reps=min(len(t) for t in times.values()),
        median_ms=med,
        ratio_to_vanilla_ppo={k: v / med["vanilla_ppo"] for k, v in med.items()} if "vanilla_ppo" in med else {},
        ratio_to_vanilla_tis={k: v / med["vanilla_tis"] for k, v in med.items()} if "vanilla_tis" in med else {},
        peak_extra_bytes=peak or None,
    )


STEPS = {
    "numerics": step_numerics,
    "w8a8_decode": step_w8a8_decode,
    "sync_cost": step_sync_cost,
    "acr_loss": step_acr_loss,
}


# ----------------------------------------------------------------------------- driver


def num(value, spec: str = ".2e") -> str:
    return "n/a" if value is None else format(value, spec)


def summary_lines(report: dict) -> list[str]:
    env = report["env"]
    lines = [f"device: {env.get('device_name')} (capability {env.get('capability')}), torch {env['torch']}, "
             f"CUDA {env['cuda']}, dry_run={env['dry_run']}"]
    for name, step in report["steps"].items():
        lines.append(f"[{name}] {step['status']} in {step.get('seconds', 0):.1f} s"
                     + (f": {step['error'].splitlines()[0]}" if step.get("error") else ""))
        res = step.get("result", {})
        try:
            if name == "numerics" and "summary" in res:
                s = res["summary"]
                lines.append(f"  codes vs CPU: int8 mismatches {s['int8_code_mismatches']}, fp8 mismatches "
                             f"{s['fp8_code_mismatches']}, scale mismatches {s['scale_mismatches']} "
                             f"(max rel {s['max_scale_rel_diff']:.1e}) over {s['elements']} elements")
                lines.append(f"  W8A8 vs exact: int8 max rel {num(s['int8_max_rel_err'])}, fp8 max err/abs-sum "
                             f"{num(s['fp8_max_err_over_abs_sum'])}, all within bound: {s['products_within_bound']}")
            elif name == "w8a8_decode":
                for model, entry in res.get("models", {}).items():
                    cells = [f"M={m}: int8 {t['speedup_vs_bf16'].get('int8_total', float('nan')):.2f}x "
                             f"(gemm {t['speedup_vs_bf16'].get('int8_gemm', float('nan')):.2f}x), "
                             f"fp8 {t['speedup_vs_bf16'].get('fp8_total', float('nan')):.2f}x"
                             for m, t in entry.get("per_decoder_layer", {}).items()]
                    lines.append(f"  {model} per layer vs bf16: " + "; ".join(cells))
            elif name == "sync_cost":
                for model, entry in res.get("models", {}).items():
                    for key, s in entry["syncs"].items():
                        lines.append(f"  {model} {key}: {s['full_sync_ms_from_many']:.1f} ms/sync "
                                     f"({s['input_gb_per_s']:.0f} GB/s in; many/one {s['many_over_one']:.2f})")
                    for key in ("tracker_from_float32", "tracker_from_bfloat16"):
                        if key in entry:
                            t = entry[key]
                            lines.append(f"  {model} {key}: {t['full_model_steady_ms']:.1f} ms/sync, "
                                         f"{t['full_model_resident_gib']:.2f} GiB resident")
            elif name == "acr_loss" and "median_ms" in res:
                lines.append("  " + ", ".join(f"{k} {v:.2f} ms ({res['ratio_to_vanilla_tis'][k]:.2f}x tis)"
                                              for k, v in res["median_ms"].items()))
        except (KeyError, TypeError, ValueError) as exc:
            lines.append(f"  (summary incomplete: {type(exc).__name__}: {exc})")
    lines.append(f"total {report.get('total_seconds', 0):.1f} s")
    return lines


def default_out(ctx: Context, env: dict) -> Path:
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"]) / "gpu_evidence.json"
    if ctx.dry_run:
        return Path(tempfile.gettempdir()) / "gpu_evidence_dry_run.json"
    slug = "".join(c if c.isalnum() else "_" for c in str(env.get("device_name", "gpu")).lower()).strip("_")
    return REPO / "bench" / "results" / f"gpu_{slug}.json"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="toy sizes on CPU: every step's code path, < 60 s")
    ap.add_argument("--steps", nargs="+", choices=STEP_NAMES, default=list(STEP_NAMES))
    ap.add_argument("--out", type=Path, default=None, help="JSON path (default $OUT/gpu_evidence.json)")
    args = ap.parse_args(argv)

    if args.dry_run:
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        print("no CUDA device; use --dry-run for the CPU code-path check", file=sys.stderr)
        return 2
    ctx = Context(device, args.dry_run)
    started = time.perf_counter()
    env = environment(ctx)
    out = args.out or default_out(ctx, env)
    budgets = DRY_RUN_BUDGET_S if args.dry_run else GPU_BUDGET_S
    report = {"script": "bench/gpu/gpu_evidence.py", "argv": sys.argv[1:], "env": env,
              "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "steps": {}}
    torch.manual_seed(0)
    for name in args.steps:
        entry = report["steps"][name] = {"status": "running", "budget_s": budgets[name], "result": {}}
        write_json(out, report)
        budget = Budget(budgets[name])
        start = time.perf_counter()
        try:
            grad_mode = torch.enable_grad() if name == "acr_loss" else torch.no_grad()
            with grad_mode, hard_time_limit(budgets[name] + HARD_GRACE_S):
                STEPS[name](ctx, budget, entry["result"], lambda: write_json(out, report))
            entry["status"] = "partial" if budget.truncated else "ok"
        except StepTimeout as exc:
            entry.update(status="timeout", error=str(exc))
        except Exception as exc:
            entry.update(status="error", error=f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}")
        entry["seconds"] = time.perf_counter() - start
        ctx.free()
        report["total_seconds"] = time.perf_counter() - started
        write_json(out, report)
    print("\n".join(summary_lines(report)))
    print(f"wrote {out}")
    return 0 if all(s["status"] == "ok" for s in report["steps"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
