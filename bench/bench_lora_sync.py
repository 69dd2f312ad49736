"""LoRA over the 8-bit base: adapter sync time against full-weight sync time, and the mismatch of LoRA runs
next to full fine-tuning.

Part 1 (``--sync``): one vLLM-CPU engine (INT8 W8A8, bf16, ``enable_lora`` as verl sets it) of a Qwen2.5
shape, synced through verl's sender as a run syncs it: a full-weight sync (what full fine-tuning and
``lora.merge=true`` send at every step: every tensor, re-quantized), the LoRA base sync (step 1 of an
adapter run: the same tensors under verl's LoRA names), then adapter syncs (every later step: rank-r A
and B of all seven projections of every layer, through ``add_lora``), each timed on the client (the
wall time verl waits) and in the engine.

Part 2 (``--kl``): the tiny CPU recipe through verl's main_ppo, ``+qurl=int8``, full fine-tuning and
rank-8 adapters side by side in one run, the same steps and seed: KL(behav||prox) per step, and the sync
time each step paid. Records the CPU; sizes and times are this machine's.

    python bench/bench_lora_sync.py            # both parts, results in bench/results/lora_sync_<cpu>.{json,md}
"""
from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import bench_harness
import torch

from qurl_verl.platform.cpu_features import cpu_class, cpu_model_and_flags

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTER_SYNCS = 3
KL_STEPS = 4
KL_ARMS = {"full fine-tuning": [], "LoRA r=8 adapters": ["actor_rollout_ref.model.lora_rank=8",
                                                          "actor_rollout_ref.model.lora_alpha=16"]}


def adapters(shapes, rank: int, seed: int):
    """peft's names and verl's config dict for rank-``rank`` adapters on every projection."""
    from peft import LoraConfig

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in shapes:
        module = name.rpartition(".")[0]
        if len(shape) == 2 and module.rpartition(".")[2] in PROJECTIONS:
            out_features, in_features = shape
            tensors[f"base_model.model.{module}.lora_A.weight"] = 0.01 * torch.randn(rank, in_features, generator=gen)
            tensors[f"base_model.model.{module}.lora_B.weight"] = 0.01 * torch.randn(out_features, rank, generator=gen)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(PROJECTIONS), lora_dropout=0.0)
    return tensors, config


def timed_sync(harness, llm, stream, bucket_mb: int, **kwargs) -> dict:
    start = time.perf_counter()
    (engine,) = harness.sync_weights(llm, stream, bucket_mb=bucket_mb, **kwargs)
    return {"client_wall_s": time.perf_counter() - start, "engine_total_s": engine["total_s"],
            "tensors_in": engine["tensors_in"], "bytes_in": engine["bytes_in"], "quantized": engine["quantized"],
            "base_frozen": engine["base_frozen"]}


def sync_part(shape_name: str, rank: int) -> dict:
    import bench_sync_scaling as scaling
    from verl.utils.fsdp_utils import replace_lora_wrapper
    from verl.workers.rollout.vllm_rollout.utils import get_vllm_max_lora_rank

    from qurl_testkit import reload_harness as harness
    from qurl_verl.settings import RolloutSettings

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = scaling.write_config(Path(tmp) / shape_name, scaling.SHAPES[shape_name])
        shapes, params = scaling.streamed_shapes(model_dir)
        stream, bucket = scaling.masters(shapes), scaling.bucket_mb(shapes)
        tensors, config = adapters(shapes, rank, seed=0)
        peft_config = config.to_dict()
        llm = harness.start_engine(model_dir, RolloutSettings(format="int8"), dtype="bfloat16", enable_lora=True,
                                   max_loras=1, max_lora_rank=get_vllm_max_lora_rank(rank))
        try:
            warmup = timed_sync(harness, llm, stream, bucket)  # the engine's first sync pays one-time costs
            print(f"  full-weight sync (first): {warmup}", flush=True)
            full = timed_sync(harness, llm, stream, bucket)
            print(f"  full-weight sync: {full}", flush=True)
            base = timed_sync(harness, llm, lambda: ((replace_lora_wrapper(n, config), t) for n, t in stream()), bucket,
                              peft_config=peft_config, base_sync_done=False)
            print(f"  LoRA base sync: {base}", flush=True)
            syncs = []
            for seed in range(ADAPTER_SYNCS):
                step_tensors, _ = adapters(shapes, rank, seed=seed + 1)
                syncs.append(timed_sync(harness, llm, list(step_tensors.items()), bucket, peft_config=peft_config,
                                        base_sync_done=True))
                print(f"  adapter sync {seed + 1}: {syncs[-1]}", flush=True)
        finally:
            harness.stop_engine(llm)
            gc.collect()
    median_adapter = statistics.median(s["client_wall_s"] for s in syncs)
    return {"shape": shape_name, "params_b": params / 1e9, "rank": rank, "adapter_params_m": sum(t.numel() for t in tensors.values()) / 1e6,
            "first_sync": warmup, "full_sync": full, "lora_base_sync": base, "adapter_syncs": syncs,
            "full_over_adapter_wall": full["client_wall_s"] / median_adapter}


def kl_part() -> dict:
    from qurl_testkit.main_ppo_runs import run_recipe

    arms = {}
    with tempfile.TemporaryDirectory() as tmp:
        for arm, overrides in KL_ARMS.items():
            out = Path(tmp) / arm.replace(" ", "_").replace("=", "")
            out.mkdir()
            proc, rows = run_recipe(out, KL_STEPS, *overrides, timeout=1800)
            if proc.returncode != 0:
                raise RuntimeError(f"{arm}: main_ppo failed\n{proc.stderr[-3000:]}")
            arms[arm] = [{"step": i + 1, "kl_behav_prox_k3": r["actor/qurl/kl_behav_prox_k3"],
                          "sync_total_s": r["actor/qurl/sync/total_s"], "sync_bytes_in": r["actor/qurl/sync/bytes_in"],
                          "reward": r.get("critic/score/mean")} for i, r in enumerate(rows)]
            print(f"  {arm}: {arms[arm]}", flush=True)
    return {"recipe": "tiny_cpu, +qurl=int8", "steps": KL_STEPS, "arms": arms}


def markdown(report: dict) -> str:
    cpu = report["cpu"]
    lines = [f"# LoRA over the 8-bit base: sync time and mismatch ({cpu['model']}, {cpu['class']}, {cpu['cores']} cores, "
             f"vLLM {report['vllm']})", ""]
    start, end = bench_harness.start_loadavg(report), bench_harness.loadavg_of(report, "end")
    if start is not None:
        lines += [f"Load average (1, 5, 15 min) at start {tuple(round(x, 1) for x in start)}, at end "
                  f"{tuple(round(x, 1) for x in end)}.", ""]
    if "sync" in report:
        s = report["sync"]
        lines += [f"## Sync time, {s['shape']} shape ({s['params_b']:.2f}B parameters), INT8 bf16 engine, rank-{s['rank']} "
                  f"adapters on all seven projections ({s['adapter_params_m']:.1f}M parameters)", "",
                  "| sync | tensors | MB sent | 8-bit tensors | client wall s | engine s |", "|---|---|---|---|---|---|"]
        rows = [("full weights, the engine's first sync (one-time costs)", s["first_sync"]),
                ("full weights (full FT, lora.merge=true): every step", s["full_sync"]),
                ("LoRA base (adapter mode, step 1 only)", s["lora_base_sync"])]
        rows += [(f"LoRA adapters, step {i + 2}", a) for i, a in enumerate(s["adapter_syncs"])]
        for label, r in rows:
            lines.append(f"| {label} | {r['tensors_in']} | {r['bytes_in'] / 2**20:.1f} | {r['quantized']} | "
                         f"{r['client_wall_s']:.3f} | {r['engine_total_s']:.3f} |")
        lines += ["", f"A full-weight sync takes {s['full_over_adapter_wall']:.0f}x the wall time of an adapter sync (median). "
                  "The engine has enable_lora on throughout (a merged run's engine has it off; not measured separately).", ""]
    if "kl" in report:
        k = report["kl"]
        lines += [f"## KL(behav||prox) per step, {k['recipe']}, {k['steps']} steps, same seed", "",
                  "| arm | " + " | ".join(f"step {i + 1}" for i in range(k["steps"])) + " | mean | sync s (mean) |",
                  "|---|" + "---|" * (k["steps"] + 2)]
        for arm, rows in k["arms"].items():
            kls = [r["kl_behav_prox_k3"] for r in rows]
            lines.append(f"| {arm} | " + " | ".join(f"{x:.2e}" for x in kls) + f" | {statistics.mean(kls):.2e} | "
                         f"{statistics.mean(r['sync_total_s'] for r in rows):.3f} |")
        lines += ["", "Full fine-tuning applies UAQ (the preset's); the adapter arm skips it (the driver's rule). The "
                  "adapter arm's step 1 sync includes its base sync.", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sync", action="store_true", help="part 1 only")
    ap.add_argument("--kl", action="store_true", help="part 2 only")
    ap.add_argument("--shape", default="qwen2.5-0.5b")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    both = not (args.sync or args.kl)
    import vllm

    model_name, flags = cpu_model_and_flags()
    cls = cpu_class(flags)
    report = {"environment": bench_harness.environment(cls),
              "cpu": {"model": model_name, "class": cls, "cores": os.cpu_count(), "machine": platform.machine()},
              "vllm": vllm.__version__}
    out = args.out or bench_harness.RESULTS / f"lora_sync_{cls}"
    if args.kl or both:  # main_ppo first: it starts its own Ray and engines
        report["kl"] = kl_part()
    if args.sync or both:
        from qurl_testkit import reload_harness as harness

        os.environ.update({k: v for k, v in harness.engine_env().items() if k not in os.environ})
        from verl.plugin.platform import platform_manager

        from qurl_verl.platform.cpu import PlatformCPU

        platform_manager._current_platform = PlatformCPU()  # the weight sender asks the platform to synchronize
        report["sync"] = sync_part(args.shape, args.rank)
    report["loadavg_end"] = bench_harness.loadavg()
    bench_harness.write_result(out, report, markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
