"""What the INT8 batch-1 profile's child processes run (each in one CPU class's environment): the op timings,
the oneDNN verbose probe, and the optional profile of an in-process engine.
"""
from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from int8_profile_classes import MS, layer_shapes, weight_copies
from int8_profile_ops import Int8Linear, bf16_linear, exactness, load_ops, loaded_vllm_libraries, rotating, time_interleaved


def worker(args) -> None:
    """Time every op for every shape and M in this process's CPU class; write JSON to args.worker_out."""
    ops = load_ops(args.avx2_kernels)
    torch.set_num_threads(args.threads[0])
    from qurl_verl.kernels.cpu_int8_paths import onednn_int8_saturates

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
    from bench_models import build_model
    from rollout_engines import start_engine
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
