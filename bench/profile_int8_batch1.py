"""Where an INT8 linear's time goes at batch 1 on vLLM-CPU, per x86 CPU class, against the BF16 linear.

The rollout bench measured INT8/BF16 at 0.16x at batch 1 on an AVX2 CPU without VNNI but 2.16x on
AVX-512 VNNI. This times, for the linear shapes of one decoder layer of the ~102M model the rollout bench uses
(``bench_models.SPECS["mid"]``) and M = 1, 8, 32 tokens, the pieces of each linear as vLLM-CPU 0.32
runs them, interleaved and with medians over rounds. Timed calls cycle through copies of each weight
that together exceed twice the L3, so weights come from memory as in decode (the model's ~200 MB of
BF16 weights do not fit a cache), not from a cache kept warm by repeating one call:

(a) ``quant``: dynamic symmetric per-token activation quantization (``onednn_scaled_int8_quant``);
(b) ``int8_gemm``: the oneDNN INT8 GEMM as ``CPUInt8ScaledMMLinearKernel`` builds it (bf16 output);
(c) ``split_gemm``: the saturation patch's GEMM over the [2N, K] split codes, fp32 output, then the
    add of the halves, the bias and the cast (``patches/vllm_cpu_worker/vllm_cpu_int8_saturation.py``);
(d) ``int8_7bit_gemm``: one unsplit GEMM over weight codes within +-63 (timed like (b));
(e) ``bf16_linear``: what ``dispatch_cpu_unquantized_gemm`` installs for a BF16 layer;
(f) ``avx2_packed_gemm``: the project's packed AVX2 GEMM on the 8-bit codes (bf16 output, bias), what
    the saturation patch runs on CPUs without VNNI (``qurl_verl/platform/cpu_int8_gemm_avx2.cpp``);
plus ``w8a16_int8pack`` (``torch._weight_int8pack_mm``: bf16 activations times int8 weights, no
activation quantization, other numerics than W8A8) as a reference point for weight-only INT8.

It also checks which 7-bit/8-bit codes give the exact integer product (int64 reference) on each class.

Every class runs in its own subprocess, because oneDNN reads its ISA cap once:

* native (named after this CPU's best int8 ISA, e.g. ``avx512_vnni``);
* ``avx2_onednn_emulated``: ``ONEDNN_MAX_CPU_ISA=AVX2``: oneDNN's AVX2 kernels (no VNNI), while vLLM's
  own kernels and torch's stay on this CPU's AVX-512;
* ``avx2_emulated``: in addition ``ATEN_CPU_CAPABILITY=avx2`` (torch's own kernels, e.g. the BF16
  ``F.linear`` fallback) and vLLM's ``_C_AVX2`` library, the one vLLM loads on a CPU without AVX-512.

Neither emulates an AVX2 CPU's cores, clocks, caches or memory: they show kernel choice and
instruction-set cost on this machine. A separate short subprocess per class runs each op once under
``ONEDNN_VERBOSE=1`` and records which oneDNN implementation ran. ``--engine`` adds a torch.profiler
view of the whole in-process vLLM engine at batch 1 (BF16 vs INT8, one engine thread).

    .venv/bin/python bench/profile_int8_batch1.py [--threads 2 1] [--rounds 11] [--engine]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from bench_models import SPECS  # noqa: E402

from qurl_verl.platform import cpu_int8_gemm  # noqa: E402
from qurl_verl.platform.cpu_features import cpu_class, cpu_model_and_flags  # noqa: E402

MS = (1, 8, 32)
OPS = ("quant", "int8_gemm", "split_gemm", "split_add", "int8_7bit_gemm", "bf16_linear", "w8a16_int8pack",
       "avx2_packed_gemm")
AVX2_ENV = {"ONEDNN_MAX_CPU_ISA": "AVX2"}
AVX2_FULL_ENV = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
# in-process engine (the profiler sees it) on one thread, as the rollout bench's engine computes on one core
ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1"}


def layer_shapes(model: str = "mid") -> list[dict]:
    """(name, N, K, bias) of the four quantized linears of one Qwen2 decoder layer (lm_head stays BF16)."""
    spec = SPECS[model]
    hidden, inter = spec["hidden_size"], spec["intermediate_size"]
    head_dim = hidden // spec["num_heads"]
    qkv = (spec["num_heads"] + 2 * spec["num_kv_heads"]) * head_dim
    return [
        {"name": "qkv_proj", "n": qkv, "k": hidden, "bias": True},
        {"name": "o_proj", "n": hidden, "k": hidden, "bias": False},
        {"name": "gate_up_proj", "n": 2 * inter, "k": hidden, "bias": False},
        {"name": "down_proj", "n": hidden, "k": inter, "bias": False},
    ]


def cpu_info() -> dict:
    model, flags = cpu_model_and_flags()
    return {"model": model, "cores": os.cpu_count(), "flags": sorted(flags)}


def last_level_cache_bytes() -> int:
    """L3 size: the timed weights must exceed it to come from memory, as in decode."""
    path = Path("/sys/devices/system/cpu/cpu0/cache/index3/size")
    text = path.read_text().strip() if path.exists() else "32768K"
    return int(text[:-1]) * {"K": 1 << 10, "M": 1 << 20}[text[-1]] if text[-1] in "KM" else int(text)


def weight_copies(shape: dict, stream_bytes: int) -> int:
    """Copies of a [N, K] weight whose int8 codes together hold at least ``stream_bytes``."""
    return max(1, -(-stream_bytes // (shape["n"] * shape["k"])))


def cpu_classes(flags: list[str]) -> list[dict]:
    """The native class, plus the AVX2 emulations where this CPU is above AVX2."""
    native = {"name": cpu_class(set(flags)), "env": {}, "avx2_kernels": False,
              "what": "native: every kernel uses this CPU's ISA"}
    if native["name"] in ("avx2", "avx2_vnni"):
        return [native]
    return [
        native,
        {"name": "avx2_onednn_emulated", "env": AVX2_ENV, "avx2_kernels": False,
         "what": "ONEDNN_MAX_CPU_ISA=AVX2: oneDNN runs its AVX2 kernels (no VNNI, no AVX-512 BF16); vLLM's own "
                 "kernels (vllm._C) and torch's keep this CPU's AVX-512"},
        {"name": "avx2_emulated", "env": AVX2_FULL_ENV, "avx2_kernels": True,
         "what": "ONEDNN_MAX_CPU_ISA=AVX2, ATEN_CPU_CAPABILITY=avx2 and vLLM's _C_AVX2 library (what vLLM "
                 "loads without AVX-512): every kernel on the AVX2 code path; cores, clocks, caches and "
                 "memory remain this machine's"},
    ]


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
        from qurl_verl.patches.vllm_cpu_worker.vllm_cpu_int8_saturation import split_codes

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
        """As ``vllm_cpu_int8_saturation._apply_packed`` runs it after quantization."""
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
    from qurl_verl.patches.vllm_cpu_worker.vllm_cpu_int8_saturation import split_codes

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


def worker(args) -> None:
    """Time every op for every shape and M in this process's CPU class; write JSON to args.worker_out."""
    ops = load_ops(args.avx2_kernels)
    torch.set_num_threads(args.threads[0])
    from qurl_verl.patches.vllm_cpu_worker.vllm_cpu_int8_saturation import onednn_int8_saturates

    gen = torch.Generator().manual_seed(0)
    result = {"threads": torch.get_num_threads(), "stream_bytes": args.stream_bytes, "loadavg_start": os.getloadavg(),
              "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
              "vllm_libraries_loaded": loaded_vllm_libraries(),
              "onednn_int8_saturates": onednn_int8_saturates(), "shapes": {}}
    try:
        ops.create_onednn_mm(torch.randn(64, 64).to(torch.bfloat16), 32)
        result["onednn_bf16_mm"] = "available"
    except RuntimeError as e:
        result["onednn_bf16_mm"] = f"refused: {str(e).splitlines()[0]}"
    t_start = time.perf_counter()
    for shape in layer_shapes():
        copies = weight_copies(shape, args.stream_bytes)
        lins = [Int8Linear(ops, shape, gen) for _ in range(copies)]
        bf16 = [bf16_linear(torch.randn(shape["n"], shape["k"], generator=gen).mul(shape["k"] ** -0.5)
                            .to(torch.bfloat16), lin.bias) for lin in lins]
        bf16_path = bf16[0][1]
        int8pack_scales = [lin.scale.squeeze(1).to(torch.bfloat16) for lin in lins]
        per_m = {}
        for m in MS:
            x = torch.randn(m, shape["k"], generator=gen).to(torch.bfloat16)
            x_q, x_s, _ = ops.onednn_scaled_int8_quant(x, None, None, True)
            split_out = torch.randn(m, 2 * shape["n"], generator=gen)
            fns = {
                "quant": lambda: ops.onednn_scaled_int8_quant(x, None, None, True),
                "int8_gemm": rotating(copies, lambda i: lins[i].gemm(lins[i].h8, x_q, x_s)),
                "split_gemm": rotating(copies, lambda i: lins[i].split_gemm(x_q, x_s)),
                "split_add": lambda: lins[0].split_add(split_out),
                "int8_7bit_gemm": rotating(copies, lambda i: lins[i].gemm(lins[i].h7, x_q, x_s)),
                "bf16_linear": rotating(copies, lambda i: bf16[i][0](x)),
                "w8a16_int8pack": rotating(copies, lambda i: torch._weight_int8pack_mm(
                    x, lins[i].codes, int8pack_scales[i])),
            }
            if lins[0].packed is not None:
                fns["avx2_packed_gemm"] = rotating(copies, lambda i: lins[i].packed_gemm(x_q, x_s))
            per_m[str(m)] = {"loadavg": os.getloadavg(), "ops": time_interleaved(fns, args.rounds, args.target_s)}
            print(f"  {shape['name']:<13} M={m:<3}", {k: round(v["median_us"], 1)
                                                    for k, v in per_m[str(m)]["ops"].items()}, flush=True)
        lins = bf16 = None  # free this shape's copies before the next shape builds its own
        result["shapes"][shape["name"]] = {**shape, "bf16_linear_path": bf16_path, "weight_copies": copies, "m": per_m}
    result["timing_s"] = time.perf_counter() - t_start
    result["exactness"] = exactness(ops, gen)
    result["loadavg_end"] = os.getloadavg()
    Path(args.worker_out).write_text(json.dumps(result, indent=1))


def verbose_probe(args) -> None:
    """Run each op once per shape at M=1 after a warm-up call, with markers between, for ONEDNN_VERBOSE."""
    ops = load_ops(args.avx2_kernels)
    torch.set_num_threads(args.threads[0])
    gen = torch.Generator().manual_seed(0)
    for shape in layer_shapes():
        lin = Int8Linear(ops, shape, gen)
        bf16_fn, path = bf16_linear(torch.randn(shape["n"], shape["k"], generator=gen).to(torch.bfloat16), lin.bias)
        x = torch.randn(1, shape["k"], generator=gen).to(torch.bfloat16)
        x_q, x_s, _ = ops.onednn_scaled_int8_quant(x, None, None, True)
        for name, fn in (("int8_gemm", lambda: lin.gemm(lin.h8, x_q, x_s)),
                         ("split_gemm", lambda: lin.split_gemm(x_q, x_s)),
                         ("int8_7bit_gemm", lambda: lin.gemm(lin.h7, x_q, x_s)),
                         ("bf16_linear", lambda: bf16_fn(x))):
            fn()
            os.write(1, f"### {shape['name']} {name} ({path if name == 'bf16_linear' else 'onednn'})\n".encode())
            fn()
            os.write(1, b"### end\n")


def parse_verbose(text: str) -> dict:
    """The ISA lines and, per marked op, the oneDNN primitives it executed (implementation, problem, ms)."""
    info = sorted({ln for ln in text.splitlines() if ln.startswith("onednn_verbose") and ",info,cpu," in ln})
    versions = sorted({ln.split(",")[-1] for ln in text.splitlines() if ",info,oneDNN" in ln})
    ops, current = {}, None
    for ln in text.splitlines():
        if ln == "### end":
            current = None
        elif ln.startswith("### "):
            current = ln[4:]
            ops[current] = []
        elif current and ",primitive,exec," in ln:
            f = ln.split(",")
            ops[current].append({"primitive": f[5], "implementation": f[6], "memory": f[8],
                                 "problem": f[-2], "exec_ms": float(f[-1])})
    return {"isa_lines": info, "versions": versions, "ops": ops}


# ---------------------------------------------------------------- engine-level view (optional)

LINEAR_OPS = ("_C::onednn_scaled_mm", "_C::dynamic_scaled_int8_quant", "_C::onednn_mm", "aten::mm", "aten::addmm",
              "aten::linear")


def engine_profile(args) -> None:
    """Wall time (median of 3 runs) and a torch.profiler run of ``engine_tokens`` tokens at batch 1
    (4-token prompt) of the in-process engine."""
    load_ops(args.avx2_kernels)
    sys.path.insert(0, str(REPO))  # qurl_testkit
    from bench_models import build_model
    from bench_rollout_throughput import start_engine
    from verl.plugin.platform import platform_manager
    from vllm import SamplingParams
    from vllm.model_executor.kernels.linear.scaled_mm.cpu import CPUInt8ScaledMMLinearKernel

    from qurl_testkit import reload_harness as harness
    from qurl_verl.platform.cpu import PlatformCPU

    os.environ.update(harness.engine_env())
    platform_manager._current_platform = PlatformCPU()
    out = {"format": args.engine_format, "loadavg_start": os.getloadavg()}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(Path(tmp) / "mid", "mid", "fanin")
        llm = start_engine(model_dir, args.engine_format, max_model_len=64)
        out["engine_threads"] = torch.get_num_threads()
        out["int8_split_patch_installed"] = bool(getattr(CPUInt8ScaledMMLinearKernel.process_weights_for_onednn,
                                                         "_qurl_int8_split", False))
        trainer = harness.TrainerWeights(model_dir)
        harness.sync_weights(llm, trainer.named_tensors(), bucket_mb=256)
        prompt = [{"prompt_token_ids": [1, 2, 3, 4]}]

        def generate(n):
            params = SamplingParams(temperature=1.0, seed=0, max_tokens=n, ignore_eos=True)
            return llm.generate(prompt, params, use_tqdm=False)

        generate(4)
        walls = []
        for _ in range(3):
            t0 = time.perf_counter()
            generate(args.engine_tokens)
            walls.append((time.perf_counter() - t0) / args.engine_tokens * 1e3)
        out["wall_ms_per_token_runs"] = walls
        out["wall_ms_per_token"] = statistics.median(walls)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            generate(args.engine_tokens)
        events = prof.key_averages()
        total = sum(e.self_cpu_time_total for e in events)
        per_token = 1e3 * args.engine_tokens
        out["profiled_tokens"] = args.engine_tokens
        out["self_cpu_ms_per_token"] = total / per_token
        out["linear_ops_ms_per_token"] = {e.key: e.self_cpu_time_total / per_token for e in events
                                          if e.key in LINEAR_OPS}
        out["linear_ops_share"] = sum(e.self_cpu_time_total for e in events if e.key in LINEAR_OPS) / total
        out["top_self_cpu"] = [{"name": e.key, "calls": e.count, "self_ms_per_token": e.self_cpu_time_total / per_token,
                                "share": e.self_cpu_time_total / total}
                               for e in sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:12]]
    out["loadavg_end"] = os.getloadavg()
    Path(args.worker_out).write_text(json.dumps(out, indent=1))


# ---------------------------------------------------------------- parent side

def run_child(mode: str, cls: dict, threads: int, args, extra_env: dict | None = None,
              extra_args: list[str] | None = None) -> tuple[dict | str, float]:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out_path = f.name
    cmd = [sys.executable, __file__, f"--{mode}", "--worker-out", out_path, "--threads", str(threads),
           "--rounds", str(args.rounds), "--target-s", str(args.target_s),
           "--stream-bytes", str(args.stream_bytes), *(extra_args or [])]
    if cls["avx2_kernels"]:
        cmd.append("--avx2-kernels")
    env = {**os.environ, **cls["env"], **(extra_env or {})}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.child_timeout_s)
    wall = time.perf_counter() - t0
    result = Path(out_path).read_text()
    os.unlink(out_path)
    if mode == "verbose-probe":
        return proc.stdout, wall
    sys.stdout.write(proc.stdout)
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} {cls['name']} failed:\n{proc.stderr[-4000:]}")
    return json.loads(result), wall


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=sorted({os.cpu_count() or 1, 1}, reverse=True),
                        help="torch threads per timing run (default: the core count, then 1 as the engine uses)")
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--stream-bytes", type=int, default=2 * last_level_cache_bytes(),
                        help="timed calls cycle through copies of each weight holding at least this many int8 bytes "
                             "(default: twice the L3), so weights come from memory as in decode; 0: hot cache")
    parser.add_argument("--target-s", type=float, default=0.015, help="seconds per timed batch of calls")
    parser.add_argument("--classes", nargs="+", help="subset of the CPU class names to run")
    parser.add_argument("--engine", action="store_true", help="also profile the in-process engine at batch 1")
    parser.add_argument("--engine-tokens", type=int, default=16)
    parser.add_argument("--child-timeout-s", type=float, default=600)
    parser.add_argument("--out-dir", default=str(REPO / "bench" / "results"))
    parser.add_argument("--render", action="store_true", help="only print the table from the existing JSON")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--verbose-probe", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--engine-profile", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--engine-format", default="int8", help=argparse.SUPPRESS)
    parser.add_argument("--avx2-kernels", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if args.verbose_probe:
        return verbose_probe(args)
    if args.engine_profile:
        return engine_profile(args)

    info = cpu_info()
    classes = [c for c in cpu_classes(info["flags"]) if not args.classes or c["name"] in args.classes]
    out_dir = Path(args.out_dir)
    paths = [out_dir / f"int8_batch1_profile_{c['name']}.json" for c in classes]
    if args.render:
        print(markdown([json.loads(p.read_text()) for p in paths if p.exists()]))
        return
    t_all = time.perf_counter()
    reports = []
    for cls, path in zip(classes, paths):
        print(f"== {cls['name']}: {cls['what']}", flush=True)
        report = {"cpu_class": cls["name"], "emulation": cls["what"], "env": cls["env"],
                  "vllm_avx2_library_forced": cls["avx2_kernels"],
                  "cpu": {**info, "loadavg_start": os.getloadavg()},
                  "versions": {"torch": torch.__version__, "python": platform.python_version()},
                  "model_shapes": layer_shapes(), "ms": list(MS), "runs": []}
        text, wall = run_child("verbose-probe", cls, args.threads[0], args, {"ONEDNN_VERBOSE": "1"})
        report["onednn_verbose"] = {**parse_verbose(text), "wall_s": wall}
        for threads in args.threads:
            print(f"-- threads {threads}", flush=True)
            run, wall = run_child("worker", cls, threads, args)
            run["wall_s"] = wall
            run["layer_sum_us"] = layer_sums(run)
            report["runs"].append(run)
        if args.engine:
            report["engine"] = {}
            for fmt in ("bf16", "int8"):
                try:
                    res, wall = run_child("engine-profile", cls, 1, args, ENGINE_ENV,
                                          ["--engine-format", fmt, "--engine-tokens", str(args.engine_tokens)])
                    report["engine"][fmt] = {**res, "wall_s": wall}
                except (RuntimeError, subprocess.TimeoutExpired) as e:
                    report["engine"][fmt] = {"error": str(e)[-2000:]}
        report["cpu"]["loadavg_end"] = os.getloadavg()
        out_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1) + "\n")
        reports.append(report)
        print("written", path.relative_to(REPO) if path.is_relative_to(REPO) else path, flush=True)
    print(f"\nSummed over one decoder layer's linears (qkv, o, gate_up, down), median us per call; "
          f"total runtime {time.perf_counter() - t_all:.0f} s\n")
    print(markdown(reports))


if __name__ == "__main__":
    main()
