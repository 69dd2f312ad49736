"""Model shapes, 8-bit products and timers shared by gpu_evidence.py's steps.

Separate from the steps so that each step module holds one measurement; torch and ``qurl_verl.quant`` only.
"""
from __future__ import annotations

import statistics
import time

import torch
from evidence_run_control import Context

from qurl_verl.quant.quantizer import MIN_SCALE
from qurl_verl.quant.update_visibility import changed_code_count

# Qwen2.5 decoder shapes from the released config.json files.
QWEN25 = {
    "qwen2.5-1.5b": dict(hidden=1536, inter=8960, heads=12, kv_heads=2, head_dim=128, layers=28),
    "qwen2.5-7b": dict(hidden=3584, inter=18944, heads=28, kv_heads=4, head_dim=128, layers=28),
    "qwen2.5-32b": dict(hidden=5120, inter=27648, heads=40, kv_heads=8, head_dim=128, layers=64),
}
# Dry-run stand-in: inter is not a multiple of 128, so the partial-block paths run too.
TOY = dict(hidden=128, inter=320, heads=4, kv_heads=2, head_dim=32, layers=4)
U32 = 2.0**-24  # unit roundoff of float32
# torch._int_mm on CUDA: "self.size(0) needs to be greater than 16". The dry run emulates the limit
# so that the padded path the GPU needs for decode-sized M also runs on CPU.
CUDA_INT_MM_MIN_ROWS = 17
# INT8: the int32 accumulation is exact (|acc| <= K * 127^2 < 2^31 for K < 133k), then three float32
# roundings (int32 -> float32, * x_scale, * w_scale): elementwise relative error <= (1+u)^3 - 1 < 3.001u.
INT8_REL_BOUND = 3.001 * U32
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
    ``quantize(x, parse_scheme(fmt, "token"))`` on every activation it times.
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
