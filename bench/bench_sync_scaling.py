"""How one INT8 weight sync grows with the model, at rollout TP 1 and TP 2, on vLLM-CPU.

For random models shaped like Qwen2.5-0.5B, 1.5B and 3B (config only: the engine starts on dummy
weights, as verl's does), one INT8 ``qurl_vllm`` engine per (model, TP) receives two syncs of fp32
masters through verl's own sender (1 GiB buckets over shared memory; at TP 2 one sender per rank, each
sending the full tensors, as colocated trainer ranks do). The masters are one random tensor per
distinct shape, made before the timing and sent for every layer of that shape, so the bench process
never holds a whole model. Reported per sync, from the engine (``sync_stats.combine_ranks``): quantize, load, total seconds (slowest rank), bytes received per
rank, worker RSS summed over ranks and the largest rank's, and the client's wall time of the sync.
The second sync is the steady state (the first allocates once). A shape whose fp32 stream and engine
would not fit in this machine's memory is skipped, and the reason recorded.

The GPU counterpart, ``bench/gpu/gpu_evidence.py`` (step ``sync_cost``), measures the quantize part alone
on the device (``quantize_state_dict`` over the same projections); it has not been run.

    .venv/bin/python bench/bench_sync_scaling.py [--models qwen2.5-0.5b qwen2.5-1.5b] [--tp 1 2]

Writes ``bench/results/sync_scaling_<cpu class>.{json,md}``.
"""
from __future__ import annotations

import argparse
import gc
import math
import os
import platform
import tempfile
import time
from pathlib import Path

import bench_harness
import psutil
import torch

from qurl_verl.platform.cpu_features import cpu_class, cpu_model_and_flags

# Qwen2.5 shapes (their config.json), tied embeddings as the small ones have
SHAPES = {
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14, num_kv_heads=2),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_layers=28, num_heads=12, num_kv_heads=2),
    "qwen2.5-3b": dict(hidden_size=2048, intermediate_size=11008, num_layers=36, num_heads=16, num_kv_heads=2),
}
VOCAB = 151936
BUCKET_MB = 1024
ENGINE_BYTES_PER_PARAM = 2  # bf16 engine before quantization (vLLM starts dummy weights in the model dtype)


def write_config(out: Path, shape: dict) -> Path:
    from qurl_recipes.tiny_model import TinyModelSpec, build_tiny_model

    build_tiny_model(out, TinyModelSpec(**shape, vocab_size=VOCAB, max_position_embeddings=2048), weights=False)
    return out


def streamed_shapes(model_dir: Path) -> list[tuple[str, tuple[int, ...]]]:
    """The (name, shape) pairs an FSDP trainer streams for this config, from a model on the meta device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return [(n, tuple(t.shape)) for n, t in model.state_dict().items()], sum(p.numel() for p in model.parameters())


def masters(shapes, seed: int = 0):
    """A fresh iterator of fp32 'master' tensors per call: one random tensor per distinct shape, made once
    and sent for every layer that has that shape (std 1/sqrt(fan_in) matrices, ones for norms, zeros
    for biases). Sync time does not depend on the values; making 6 GB of random numbers per sync
    would dominate it, so they are made before the timing."""
    gen = torch.Generator().manual_seed(seed)
    pool: dict[tuple, torch.Tensor] = {}
    for name, shape in shapes:
        key = (shape, name.endswith("bias"))
        if key not in pool:
            if len(shape) == 2:
                pool[key] = torch.randn(shape, generator=gen) / math.sqrt(shape[1])
            else:
                pool[key] = torch.zeros(shape) if name.endswith("bias") else torch.ones(shape)

    def stream():
        for name, shape in shapes:
            yield name, pool[(shape, name.endswith("bias"))]
    return stream


def bucket_mb(shapes) -> int:
    """verl's shared-memory sender cannot send a tensor larger than its bucket (the driver refuses such a
    run on the CPU platform): at least BUCKET_MB, and the largest fp32 tensor (3B's embedding: 1187 MiB)."""
    return max(BUCKET_MB, -(-max(math.prod(s) for _, s in shapes) * 4 // 2**20))


def fits(shapes, tp: int) -> tuple[bool, str]:
    params = sum(math.prod(s) for _, s in shapes)
    largest = max(math.prod(s) for _, s in shapes) * 4
    need = params * ENGINE_BYTES_PER_PARAM + tp * (bucket_mb(shapes) * 2**20 + largest * 3) + 4 * 2**30
    have = psutil.virtual_memory().available
    return need < 0.8 * have, f"{params / 1e9:.2f}B parameters need ~{need / 2**30:.1f} GiB, {have / 2**30:.1f} GiB free"


def run_one(model_dir: Path, shapes, tp: int, syncs: int) -> dict:
    from qurl_testkit import reload_harness as harness
    from qurl_verl.patches.cpu_platform import vllm_cpu_thread_binding as binding
    from qurl_verl.rollout.sync_stats import combine_ranks
    from qurl_verl.settings import RolloutSettings

    if tp > 1:
        from vllm.utils import cpu_resource_utils

        cpus = [(c.id, c.numa_node) for c in cpu_resource_utils.get_allowed_cpu_list()]
        os.environ[binding.BIND_ENV] = binding.thread_binding(cpus, tp)
    t0 = time.perf_counter()
    llm = harness.start_engine(model_dir, RolloutSettings(format="int8"), dtype="bfloat16", tensor_parallel_size=tp)
    row = {"tp": tp, "binding": os.environ.get(binding.BIND_ENV, "auto (vLLM)"), "engine_start_s": time.perf_counter() - t0,
           "syncs": []}
    try:
        for sync in range(syncs):
            stream = masters(shapes, seed=sync)
            start = time.perf_counter()
            per_rank = harness.sync_weights(llm, stream, bucket_mb=bucket_mb(shapes), ranks=tp)
            wall = time.perf_counter() - start
            engine = combine_ranks(per_rank)
            row["syncs"].append({
                "sync": sync + 1, "client_wall_s": wall,
                **{k: engine[k] for k in ("total_s", "quantize_s", "copy_s", "code_change_s", "load_s", "finalize_s",
                                          "bytes_in", "quantized", "rss_mb", "ranks")},
                "rss_mb_largest_rank": max(r["rss_mb"] for r in per_rank),
            })
            print(f"  TP {tp} sync {sync + 1}: {row['syncs'][-1]}", flush=True)
    finally:
        harness.stop_engine(llm)
        os.environ.pop(binding.BIND_ENV, None)
        gc.collect()
    return row


def markdown(report: dict) -> str:
    lines = [
        "# One INT8 weight sync against model size, vLLM-CPU",
        "",
        f"CPU: {report['cpu']['model']} ({report['cpu']['class']}, {report['cpu']['cores']} cores), vLLM {report['vllm']}, "
        f"engine bf16, buckets of {BUCKET_MB} MiB (or the largest tensor) over shared memory, fp32 masters streamed by verl's sender "
        "(one per TP rank). Second sync (steady state); seconds of the slowest rank, RSS summed over ranks. "
        "total - (quantize + tracker + copy + load) is the time the worker waits for and unpacks verl's buckets. "
        "Thread binding: TP 1 takes vLLM's automatic binding (one core per NUMA node, minus the cores it reserves "
        "for the scheduler: on a 2-core machine the worker gets one core), TP 2 the rollout server's split "
        "(``patches/cpu_platform/vllm_cpu_thread_binding``: one core per rank here), so TP 2 may compute on more cores.",
        "",
        "| model | params | TP | quantize s | tracker s | copy s | load s | total s | client wall s | bytes in / rank | worker RSS MiB (sum / largest) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, m in report["models"].items():
        if "skipped" in m:
            lines.append(f"| {name} | {m['params_b']:.2f}B | - | skipped: {m['skipped']} | | | | | | | |")
            continue
        for row in m["runs"]:
            s = row["syncs"][-1]
            lines.append(f"| {name} | {m['params_b']:.2f}B | {row['tp']} | {s['quantize_s']:.2f} | {s['code_change_s']:.2f} | "
                         f"{s['copy_s']:.2f} | {s['load_s']:.2f} | "
                         f"{s['total_s']:.2f} | {s['client_wall_s']:.2f} | {s['bytes_in'] / 2**30:.2f} GiB | "
                         f"{s['rss_mb']:.0f} / {s['rss_mb_largest_rank']:.0f} |")
    lines += ["", "GPU: not run here; `bench/gpu/gpu_evidence.py` measures the quantize part of one sync on the device."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--tp", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--syncs", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    os.environ.update({k: v for k, v in {"VERL_PLATFORM": "cpu", "QURL_VLLM_LAYERWISE_RELOAD": "1",
                                         "VLLM_CPU_KVCACHE_SPACE": "1"}.items() if k not in os.environ})
    os.environ.setdefault("VERL_RAY_JOB_ID", __import__("qurl_testkit.reload_harness").reload_harness.JOB_ID)
    from verl.plugin.platform import platform_manager

    from qurl_verl.platform.cpu import PlatformCPU

    platform_manager._current_platform = PlatformCPU()  # the weight sender asks the platform to synchronize
    import vllm

    model_name, flags = cpu_model_and_flags()
    cls = cpu_class(flags)
    report = {"environment": bench_harness.environment(cls),
              "cpu": {"model": model_name, "class": cls, "cores": os.cpu_count(), "machine": platform.machine()},
              "vllm": vllm.__version__, "bucket_mb": BUCKET_MB, "models": {}}
    out = args.out or bench_harness.RESULTS / f"sync_scaling_{cls}"
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            model_dir = write_config(Path(tmp) / name, SHAPES[name])
            shapes, params = streamed_shapes(model_dir)
            entry = {"shape": SHAPES[name], "params_b": params / 1e9, "runs": []}
            report["models"][name] = entry
            for tp in args.tp:
                ok, why = fits(shapes, tp)
                if not ok:
                    entry.pop("runs", None)
                    entry["skipped"] = why
                    print(f"{name} TP {tp}: skipped, {why}", flush=True)
                    break
                print(f"{name} TP {tp}: {why}", flush=True)
                entry["runs"].append(run_one(model_dir, shapes, tp, args.syncs))
                bench_harness.write_result(out, report)
    bench_harness.write_result(out, report, markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
