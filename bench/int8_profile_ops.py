"""The ops the INT8 batch-1 profile times, one CPU class per process: vLLM's INT8 and BF16 linears, oneDNN's
split and 7-bit GEMMs, the packed AVX2 GEMM, timed interleaved over rotating weight copies, and their exactness.
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from qurl_verl.platform import cpu_int8_gemm

# ---------------------------------------------------------------- worker side (one CPU class)

def load_ops(avx2_kernels: bool):
    """vLLM's custom ops; with ``avx2_kernels`` the ``_C_AVX2`` build, as vLLM picks it without AVX-512."""
    if avx2_kernels:
        torch.cpu._is_avx512_supported = lambda: False
        torch.cpu._is_avx512_bf16_supported = lambda: False
    from vllm import _custom_ops as ops

    return ops


def loaded_vllm_libraries() -> list[str]:
    """Which vLLM kernel library this process mapped (``_C``, ``_C_AVX512`` or ``_C_AVX2``)."""
    maps = Path("/proc/self/maps").read_text()
    return sorted({Path(ln.split()[-1]).name for ln in maps.splitlines() if "/vllm/_C" in ln})


def bf16_linear(weight: torch.Tensor, bias: torch.Tensor | None):
    """The BF16 linear vLLM-CPU installs for an unquantized layer, and which path it chose."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(weight, requires_grad=False)
    layer.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)
    dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
    names = layer.cpu_linear.__code__.co_names
    path = ("ops.onednn_mm" if "onednn_mm" in names else "ops.weight_packed_linear_cpu"
            if "weight_packed_linear_cpu" in names else "zentorch_linear_unary" if "zentorch" in names
            else "torch.nn.functional.linear")
    return (lambda x: layer.cpu_linear(x, layer.weight, layer.bias)), path


class Int8Linear:
    """The oneDNN INT8 GEMMs of one layer shape: unsplit 8-bit, split (the patch), unsplit 7-bit."""

    def __init__(self, ops, shape: dict, gen: torch.Generator):
        from qurl_verl.kernels.cpu_int8_paths import split_codes

        n, k = shape["n"], shape["k"]
        self.ops, self.n = ops, n
        self.codes = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
        self.codes7 = self.codes.clamp(-63, 63)
        self.scale = (torch.rand(n, 1, generator=gen) + 0.5) * 1e-3
        self.split_scale = torch.cat([self.scale, self.scale]).contiguous()
        self.bias = (torch.randn(n, generator=gen) * 0.01).to(torch.bfloat16) if shape["bias"] else None
        # vLLM builds with torch.get_default_dtype(), the engine's dtype (bf16); the split uses fp32
        self.h8 = ops.create_onednn_scaled_mm(self.codes.t(), self.scale, torch.bfloat16, True, False, 32)
        self.h7 = ops.create_onednn_scaled_mm(self.codes7.t(), self.scale, torch.bfloat16, True, False, 32)
        self.hsplit = ops.create_onednn_scaled_mm(split_codes(self.codes).t(), self.split_scale, torch.float32,
                                                  True, False, 32)
        self.packed = cpu_int8_gemm.pack_weight(self.codes) if cpu_int8_gemm.load() else None
        self.packed_scale = self.scale.reshape(-1).contiguous()

    def packed_gemm(self, x_q, x_s):
        """As ``cpu_int8_paths.apply_packed`` runs it after quantization."""
        return cpu_int8_gemm.int8_gemm(x_q, x_s, self.packed, self.packed_scale, self.bias, self.n, torch.bfloat16)

    def gemm(self, handler, x_q, x_s):
        out = torch.empty((x_q.size(0), self.n), dtype=torch.bfloat16)
        return self.ops.onednn_scaled_mm(handler, x_q, out, x_s, None, None, self.bias)

    def split_gemm(self, x_q, x_s):
        out = torch.empty((x_q.size(0), 2 * self.n), dtype=torch.float32)
        self.ops.onednn_scaled_mm(self.hsplit, x_q, out, x_s, None, None, None)
        return self.split_add(out)

    def split_add(self, out):
        y = out[:, :self.n] + out[:, self.n:]
        if self.bias is not None:
            y += self.bias
        return y.to(torch.bfloat16)


def rotating(copies: int, fn_of_copy):
    """A call that runs ``fn_of_copy`` on the next of ``copies`` weight copies, as decode walks the layers."""
    state = [0]

    def call():
        i = state[0]
        state[0] = (i + 1) % copies
        return fn_of_copy(i)

    return call


def time_interleaved(fns: dict, rounds: int, target_s: float) -> dict:
    """Median seconds per call of each fn: batches of calls sized to ~target_s, fns interleaved per round
    so that load drift on a shared machine hits all of them alike."""
    reps = {}
    for name, fn in fns.items():
        fn()
        fn()  # primitive creation, first touch
        t0, n = time.perf_counter(), 0
        while n < 3 or time.perf_counter() - t0 < 2 * target_s:
            fn()
            n += 1
        reps[name] = max(1, min(2000, round(target_s / ((time.perf_counter() - t0) / n))))
    samples = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(reps[name]):
                fn()
            samples[name].append((time.perf_counter() - t0) / reps[name])
    out = {}
    for name, s in samples.items():
        q = statistics.quantiles(s, n=4) if len(s) > 1 else [s[0]] * 3
        out[name] = {"median_us": statistics.median(s) * 1e6, "p25_us": q[0] * 1e6, "p75_us": q[2] * 1e6,
                     "reps": reps[name], "rounds": rounds}
    return out


def exactness(ops, gen: torch.Generator) -> list[dict]:
    """oneDNN int8 GEMM (scales 1, fp32 out) vs the int64 product: 8-bit, 7-bit and split codes.

    fp32 output equals float32(exact) whenever the int32 accumulation is exact; on AVX2 without VNNI
    oneDNN shifts activations to u8 and sums product pairs in int16 (vpmaddubsw), which saturates for
    255 * 127 * 2 but not for 255 * 63 * 2 = 32130. The ``all_127_vs_*`` cases put every pair at that
    bound. The split's two fp32 halves are only compared where each is below 2^24 (exact in fp32)."""
    from qurl_verl.kernels.cpu_int8_paths import split_codes

    rows, m = [], 8
    for n, k in ((5632, 1024), (1024, 2816)):
        for act in ("per_token_quantized_randn", "random_sign_127", "all_127_vs_plus_qmax", "all_127_vs_minus_qmax"):
            if act == "per_token_quantized_randn":
                x_q, _, _ = ops.onednn_scaled_int8_quant(torch.randn(m, k, generator=gen).to(torch.bfloat16),
                                                         None, None, True)
            elif act == "random_sign_127":
                x_q = (torch.randint(0, 2, (m, k), generator=gen) * 254 - 127).to(torch.int8)
            else:
                x_q = torch.full((m, k), 127, dtype=torch.int8)
            ones_m = torch.ones(m, 1)
            for codes_name, qmax in (("8bit", 127), ("7bit", 63)):
                if act == "per_token_quantized_randn":
                    w = torch.randint(-qmax, qmax + 1, (n, k), generator=gen, dtype=torch.int8)
                elif act == "random_sign_127":
                    w = ((torch.randint(0, 2, (n, k), generator=gen) * 2 - 1) * qmax).to(torch.int8)
                else:
                    w = torch.full((n, k), qmax if act.endswith("plus_qmax") else -qmax, dtype=torch.int8)
                ref64 = x_q.long() @ w.long().t()
                ref = ref64.to(torch.float32)
                variants = [("unsplit", w, n)]
                if qmax == 127:
                    split = split_codes(w)
                    if (x_q.long() @ split.long().t()).abs().max() < 2 ** 24:
                        variants.append(("split", split, 2 * n))
                def record(gemm: str, got: torch.Tensor) -> None:
                    err = (got.double() - ref64.double()).abs()
                    rows.append({"n": n, "k": k, "m": m, "activations": act, "weight_codes": codes_name,
                                 "gemm": gemm, "exact": bool((got == ref).all()),
                                 "mismatched_outputs": int((got != ref).sum()), "outputs": got.numel(),
                                 "max_abs_err_rel_to_max_abs_ref": float(err.max() / ref64.abs().max())})

                if cpu_int8_gemm.load():
                    record("avx2_packed", cpu_int8_gemm.int8_gemm(x_q, ones_m, cpu_int8_gemm.pack_weight(w),
                                                                  torch.ones(n), None, n, torch.float32))
                for variant, wv, nv in variants:
                    w_scale = torch.ones(nv, 1)  # the handler keeps a raw pointer to it: keep it alive
                    h = ops.create_onednn_scaled_mm(wv.t(), w_scale, torch.float32, True, False, 32)
                    out = torch.empty(m, nv, dtype=torch.float32)
                    ops.onednn_scaled_mm(h, x_q, out, ones_m, None, None, None)
                    record(variant, out[:, :n] + out[:, n:] if variant == "split" else out)
    return rows
