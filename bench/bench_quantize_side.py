"""Where should the rollout copy be quantized: in the trainer, or in the vLLM worker?

Both routes end in the same layerwise reload; they differ in who runs ``quantize_state_dict`` and
in what crosses the trainer -> engine transport:

* ``engine``: the trainer streams its fp32 masters as verl does today; the worker quantizes
  (what ``qurl_vllm`` ships);
* ``trainer``: the trainer quantizes and streams int8 codes + fp32 scales (+ the fp32 rest); the
  worker only loads.

For the tiny Qwen2 and a ~90M Qwen2-shaped model (h 1024, 8 layers), on a bf16 INT8 engine, this
times the trainer-side quantization, then full syncs through verl's ``BucketedWeightSender``
(shared memory) for each route: wall time seen by the trainer, and the worker's own split
(quantize / load incl. prepacking / total). The engine computes on one core; the trainer here uses
all of this machine's cores. Writes ``bench/results/quantize_side.json``.

    .venv/bin/python bench/bench_quantize_side.py [--reps 3]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import bench_harness
import torch

MODELS = {
    "tiny_h128_l2": dict(),
    "mid_h1024_l8": dict(hidden_size=1024, num_layers=8, num_heads=16, num_kv_heads=4, intermediate_size=2816),
}


def build(out: Path, **spec) -> Path:
    from transformers import AutoModelForCausalLM

    from qurl_recipes.tiny_model import TinyModelSpec, build_tiny_model

    build_tiny_model(out, TinyModelSpec(**spec))
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    model.save_pretrained(out)  # fp32 checkpoint: what the trainer's masters look like
    return out


def bench_model(name: str, model_dir: Path, reps: int) -> dict:
    from verl.plugin.platform import platform_manager

    from qurl_testkit import reload_harness as harness
    from qurl_verl.platform.cpu import PlatformCPU
    from qurl_verl.quant import INT8_CHANNEL, quantize_state_dict
    from qurl_verl.settings import RolloutSettings

    settings = RolloutSettings(format="int8")
    trainer = harness.TrainerWeights(model_dir)
    n_params = sum(t.numel() for n, t in trainer.master.items() if n != "lm_head.weight")

    def trainer_quantized():
        return list(quantize_state_dict(trainer.master.items(), INT8_CHANNEL, ignore=settings.ignore_patterns))

    q_times = []
    for _ in range(reps):
        start = time.perf_counter()
        payload = trainer_quantized()
        q_times.append(time.perf_counter() - start)
    nbytes = lambda items: sum(t.numel() * t.element_size() for _, t in items)  # noqa: E731

    os.environ.update(harness.engine_env())
    platform_manager._current_platform = PlatformCPU()
    llm = harness.start_engine(model_dir, settings, dtype="bfloat16")
    result = {
        "params": n_params,
        "trainer_quantize_s": q_times,
        "bytes_sent": {"engine": nbytes(trainer.master.items()), "trainer": nbytes(payload)},
        "routes": {},
    }
    try:
        harness.sync_weights(llm, trainer.named_tensors(), bucket_mb=256)  # warm-up: first-sync allocations
        for route in ("engine", "trainer"):
            rows = []
            for _ in range(reps):
                trainer.step()
                start = time.perf_counter()
                items = trainer.master.items() if route == "engine" else trainer_quantized()
                (stats,) = harness.sync_weights(llm, iter(items), bucket_mb=256)
                stats["trainer_wall_s"] = time.perf_counter() - start
                rows.append(stats)
            result["routes"][route] = rows
    finally:
        harness.stop_engine(llm)
    for route, rows in result["routes"].items():
        result[f"median_{route}"] = {
            k: statistics.median(r[k] for r in rows) for k in ("trainer_wall_s", "total_s", "quantize_s", "load_s")
        }
    result["median_trainer_quantize_s"] = statistics.median(q_times)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default=str(bench_harness.RESULTS / "quantize_side.json"))
    args = parser.parse_args()
    from qurl_verl.kernels import cpu_int8_paths

    report = {
        "environment": bench_harness.environment(),
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "torch_threads": torch.get_num_threads(),
                    "onednn_int8_saturates": cpu_int8_paths.onednn_int8_saturates()},
        "models": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for name, spec in MODELS.items():
            model_dir = build(Path(tmp) / name, **spec)
            report["models"][name] = bench_model(name, model_dir, args.reps)
            print(name, json.dumps({k: v for k, v in report["models"][name].items() if k.startswith("median")}))
    bench_harness.write_json(Path(args.out), report)
    print("written", args.out)


if __name__ == "__main__":
    main()
