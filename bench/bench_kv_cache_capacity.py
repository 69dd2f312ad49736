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
import functools
import gc
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # qurl_testkit
sys.path.insert(0, str(REPO / "bench"))

from bench_models import INITS, SPECS, build_model, param_count  # noqa: E402
from bench_rollout_throughput import results_class  # noqa: E402

from qurl_verl.platform.cpu_features import cpu_flags, cpu_model_and_flags, vllm_cpu_library  # noqa: E402

# set-up -> (rollout.quantization, custom.qurl.kv_cache)
SETUPS = {"bf16": ("bf16", "auto"), "int8": ("int8", "auto"), "int8_fp8kv": ("int8", "fp8")}
WORKER_EXTENSION = "qurl_verl.rollout.worker_extension.QurlWorkerExtension"
ISA_FLAG_PREFIXES = ("avx", "amx", "fma", "f16c", "vnni")
POSITION_MARGIN = 16  # max_model_len above the longest prompt + generation


def rollout_settings(setup: str):
    from qurl_verl.settings import RolloutSettings

    fmt, kv_cache = SETUPS[setup]
    return RolloutSettings(format=fmt, kv_cache=kv_cache)


def fp8_kv_refusal(head_dim: int) -> str | None:
    """Why this CPU or model cannot run vLLM-CPU's FP8 KV cache (the rollout server's own check), or None."""
    from qurl_verl.platform.host import Host
    from qurl_verl.rollout.engine_checks import check_fp8_kv_cache
    from qurl_verl.settings import QurlConfigError

    host = Host.probe()
    try:
        check_fp8_kv_cache(rollout_settings("int8_fp8kv"), on_cpu=True, avx512=host.avx512, amx=host.amx,
                           head_dim=head_dim, uses_mla=False)
    except QurlConfigError as e:
        return str(e)
    return None


def parse_context(text: str) -> tuple[int, int]:
    prompt, _, gen = text.partition(":")
    return int(prompt), int(gen)


def build_long_model(out: Path, model: str, init: str, positions: int) -> Path:
    """``bench_models.build_model``'s model with room for ``positions`` tokens (RoPE: no weights change)."""
    build_model(out, model, init)
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    config["max_position_embeddings"] = max(positions, config["max_position_embeddings"])
    config_path.write_text(json.dumps(config, indent=2))
    return out


def long_prompts(model_dir: Path, n: int, tokens: int, seed: int = 0) -> list[list[int]]:
    """``n`` prompts of exactly ``tokens`` tokens: the last ``tokens`` of a chat turn holding many worked
    arithmetic examples and a question (the shape of a few-shot math prompt), each with other examples."""
    from transformers import AutoTokenizer

    from qurl_recipes.tiny_model import tokenizer_corpus

    tok = AutoTokenizer.from_pretrained(model_dir)
    lines = tokenizer_corpus(seed=seed + 1, n=2000)
    out = []
    for i in range(n):
        rng = random.Random(seed * 1000 + i)
        shots: list[str] = []
        while True:
            shots += rng.sample(lines, 16)
            body = "\n\n".join(shots) + "\n\nWhat is 37 * 12? Think step by step, then answer."
            ids = tok.apply_chat_template([{"role": "user", "content": body}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False)
            if len(ids) >= tokens:
                out.append(list(ids[-tokens:]))
                break
    return out


@torch.no_grad()
def calibrated_kv_scales(model_dir: Path, prompts: list[list[int]]) -> dict[int, dict[str, float]]:
    """Per-layer K and V amax of a bf16 transformers forward of the same weights on ``prompts``, and the
    FP8 E4M3 scales the project derives from them (``scale_from_amax``)."""
    from transformers import AutoModelForCausalLM

    from qurl_verl.patches.qurl_vllm.attention_kv_hook import kv_hook, layer_index
    from qurl_verl.quant.kv_cache import KVRangeObserver, scale_from_amax

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    observer = KVRangeObserver()

    def observe(module, query, key, value):
        observer.observe(layer_index(module), query, key, value)

    with kv_hook(observe):
        for ids in prompts:
            model(torch.tensor([ids]))
    amax = observer.take()
    del model
    gc.collect()
    return {layer: {"k_amax": float(a[1]), "v_amax": float(a[2]),
                    "k_scale": float(scale_from_amax(a[1])), "v_scale": float(scale_from_amax(a[2]))}
            for layer, a in amax.items()}


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


def attention_kernel_times(config: dict, batch: int, contexts: dict[str, int], kv_dtypes: list[str], iters: int) -> dict:
    """vLLM-CPU's decode attention kernel alone, as one decode step runs it: every layer of this model in turn,
    each with a KV cache of its own (so the cache streams from memory as in the engine, not from a warm
    CPU cache), one query token for each of ``batch`` sequences with ``context`` cached tokens, the caches
    filled by vLLM's own write op, on one thread as the engine computes. Steps alternate between the KV
    dtypes, so load hits them alike. What the FP8 cache costs or saves per step, free of everything else
    the engine does (weights, sampling). Also the same step on one layer's cache called ``layers`` times
    ("warm": it can stay in the CPU's caches), which leaves mostly the kernel's arithmetic."""
    from vllm import _custom_ops as ops
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    current_platform.import_kernels()
    heads, kv_heads, layers = config["num_attention_heads"], config["num_key_value_heads"], config["num_hidden_layers"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    block_size, scale = 128, 0.02  # vLLM-CPU's block size here; a scale of the size the calibration gives
    gen = torch.Generator().manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out: dict[str, dict] = {}
    try:
        for name, context in contexts.items():
            blocks_per_seq = -(-context // block_size)
            block_table = torch.arange(batch * blocks_per_seq, dtype=torch.int32).view(batch, blocks_per_seq)
            slots = torch.cat([block_table[b].long().repeat_interleave(block_size)[:context] * block_size
                               + torch.arange(context) % block_size for b in range(batch)])
            key = torch.randn(batch * context, kv_heads, head_dim, generator=gen).to(torch.bfloat16)
            value = torch.randn(batch * context, kv_heads, head_dim, generator=gen).to(torch.bfloat16)
            query = torch.randn(batch, heads, head_dim, generator=gen).to(torch.bfloat16)
            output = torch.empty_like(query)
            query_start = torch.arange(batch + 1, dtype=torch.int32)
            seq_lens = torch.full((batch,), context, dtype=torch.int32)
            steps = {}
            for kv_dtype in kv_dtypes:
                isa = _get_attn_isa(torch.bfloat16, block_size, head_dim, kv_dtype)
                metadata = ops.cpu_attn_get_scheduler_metadata(
                    num_reqs=batch, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, seq_lens=seq_lens,
                    dtype=torch.bfloat16, query_start_loc=query_start, causal=True, sliding_window_size=-1, isa=isa,
                    enable_kv_split=False, kv_cache_dtype=kv_dtype)
                calls = []
                for _ in range(layers):
                    cache = torch.zeros(batch * blocks_per_seq, kv_heads, block_size, 2 * head_dim,
                                        dtype=torch.bfloat16 if kv_dtype == "auto" else torch.uint8)
                    key_cache, value_cache = cache.view(cache.shape[0], kv_heads, 2 * block_size, head_dim).chunk(2, dim=2)
                    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa, k_scale=scale,
                                                   v_scale=scale, kv_cache_dtype=kv_dtype)
                    calls.append(functools.partial(
                        ops.cpu_attention_with_kv_cache, query=query, key_cache=key_cache, value_cache=value_cache,
                        output=output, query_start_loc=query_start, seq_lens=seq_lens, scale=head_dim ** -0.5,
                        causal=True, alibi_slopes=None, sliding_window=-1, block_table=block_table, softcap=0.0,
                        scheduler_metadata=metadata, s_aux=None, k_scale=scale, v_scale=scale, kv_cache_dtype=kv_dtype))
                steps[kv_dtype] = (isa, calls, cache.numel() * cache.element_size() * layers)
            times: dict[tuple[str, str], list[float]] = {}
            for i in range(iters + max(1, iters // 10)):
                for kv_dtype, (_, calls, _) in steps.items():
                    for mode, step in (("step", calls), ("warm", [calls[0]] * layers)):
                        start = time.perf_counter()
                        for call in step:
                            call()
                        if i >= max(1, iters // 10):  # the first tenth warms up
                            times.setdefault((kv_dtype, mode), []).append(time.perf_counter() - start)
            row = {"context": context, "layers": layers,
                   **{k: {"isa": isa, "cache_bytes": cache_bytes,
                          **{f"{mode}_{stat}_ms": 1e3 * f(times[k, mode]) for mode in ("step", "warm")
                             for stat, f in (("median", statistics.median), ("min", min))}}
                      for k, (isa, _, cache_bytes) in steps.items()}}
            if "auto" in steps and len(steps) > 1:
                other = next(k for k in steps if k != "auto")
                row[f"{other}/auto"] = row[other]["step_median_ms"] / row["auto"]["step_median_ms"]
                row[f"{other}/auto warm"] = row[other]["warm_median_ms"] / row["auto"]["warm_median_ms"]
            out[name] = row
            print(f"attention kernel, context {context}, all {layers} layers:",
                  {k: (round(v["step_median_ms"], 2), round(v["warm_median_ms"], 2)) for k, v in row.items()
                   if isinstance(v, dict)}, "ms (streamed, warm)", flush=True)
    finally:
        torch.set_num_threads(threads)
    return out


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

    block = {"setup": setup, "load_before": os.getloadavg(), "contexts": {}}
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
    block["load_after"] = os.getloadavg()
    return block


def summarize(report: dict) -> dict:
    """Capacity per set-up (the same at every engine start) and median tokens/s per (set-up, context)."""
    caps: dict[str, dict] = {}
    pooled: dict[str, dict[str, dict[str, list[float]]]] = {}
    for block in report["blocks"]:
        cap = block["capacity"]
        seen = caps.setdefault(block["setup"], {**cap, "engines": 0, "consistent": True})
        seen["engines"] += 1
        seen["consistent"] &= cap["tokens"] == seen["tokens"]
        for context, res in block["contexts"].items():
            d = pooled.setdefault(block["setup"], {}).setdefault(context, {"tok_per_s": [], "decode_tok_per_s": [],
                                                                          "prefill_s": []})
            d["tok_per_s"] += [r["tok_per_s"] for r in res["runs"]]
            d["decode_tok_per_s"] += [r["decode_tok_per_s"] for r in res["runs"] if r.get("decode_tok_per_s")]
            d["prefill_s"] += [r["prefill_s"] for r in res["runs"] if "prefill_s" in r]
    median = {s: {c: {k: statistics.median(v) if v else None for k, v in d.items()} | {"n": len(d["tok_per_s"]),
                                                                                      "min_tok_per_s": min(d["tok_per_s"]),
                                                                                      "max_tok_per_s": max(d["tok_per_s"])}
                  for c, d in by.items()} for s, by in pooled.items()}
    ratios = {}
    for setup, by in median.items():
        for context, m in by.items():
            for base_setup in ("bf16", "int8"):
                base = median.get(base_setup, {}).get(context)
                if setup == base_setup or not base or (base_setup == "int8" and setup != "int8_fp8kv"):
                    continue
                ratios[f"{setup}/{base_setup} {context}"] = m["tok_per_s"] / base["tok_per_s"]
                if m["decode_tok_per_s"] and base["decode_tok_per_s"]:
                    ratios[f"decode {setup}/{base_setup} {context}"] = m["decode_tok_per_s"] / base["decode_tok_per_s"]
    if "bf16" in caps:
        for cap in caps.values():
            cap["capacity_vs_bf16"] = cap["tokens"] / caps["bf16"]["tokens"]
    return {"capacity": caps, "median": median, "ratios": ratios, "attention_share": attention_share(report, median)}


def attention_share(report: dict, median: dict) -> dict:
    """Per context: the attention kernel's time over all layers against the INT8 engine's decode step, and the
    decode rate the FP8 cache would give if only the attention kernel changed (the rest of the step as measured)."""
    batch = report["args"]["batch"]
    out = {}
    for context, row in report.get("attention_kernel", {}).items():
        decode = median.get("int8", {}).get(context, {}).get("decode_tok_per_s")
        if not decode:
            continue
        step_ms = 1e3 * batch / decode
        bf16_ms = row["auto"]["step_median_ms"]
        entry = {"int8_decode_step_ms": step_ms, "attention_bf16_kv_ms": bf16_ms, "share": bf16_ms / step_ms}
        fp8 = next((v for k, v in row.items() if isinstance(v, dict) and k != "auto"), None)
        if fp8:
            fp8_ms = fp8["step_median_ms"]
            entry |= {"attention_fp8_kv_ms": fp8_ms, "predicted_fp8kv_decode_vs_int8": step_ms / (step_ms - bf16_ms + fp8_ms)}
        out[context] = entry
    return out


def markdown(report: dict) -> str:
    m, model, s, a = report["machine"], report["model"], report["summary"], report["args"]
    lines = [
        "# KV-cache capacity and long-context rollout throughput: BF16 KV vs FP8 KV on vLLM-CPU",
        "",
        f"Model: Qwen2-shaped, random weights, init {model['init']} ({model['params'] / 1e6:.1f}M parameters, "
        f"{model['spec']}, head size {model['head_dim']}, {model['kv_heads']} KV heads x {model['layers']} layers). "
        f"Engines: vllm-cpu {m['vllm']}, dtype bf16, eager, `VLLM_CPU_KVCACHE_SPACE={a['kv_space_gib']}` GiB, "
        f"max_model_len {report['max_model_len']}, max_num_seqs {a['batch']}.",
        f"CPU: {m['cpu_model']} ({m['cpu_class']}, {m['cores']} cores, torch AVX-512: {m['torch_avx512']}, "
        f"AMX: {m['amx']}; flags {' '.join(m['isa_flags'])}).",
        f"Load average (1 / 5 / 15 min) at the start: {fmt_load(m['loadavg_start'])}; at the end: "
        f"{fmt_load(report.get('loadavg_end'))}; 1-min at block starts: "
        f"{', '.join(format(b['load_before'][0], '.2f') for b in report['blocks'])}.",
        "",
        "## Capacity (vLLM's own report)",
        "",
        f"Tokens: vLLM's `num_gpu_blocks` x `block_size`, what the cache holds. vLLM's log line ('KV cache size: N "
        f"tokens', `cache_config.kv_cache_size_tokens`) counts whole requests of max_model_len {report['max_model_len']} "
        "tokens, each rounded up to whole blocks, so it is lower by that rounding; both are in the table.",
        "",
        "| set-up | KV dtype | tokens | blocks x block size | vs BF16 KV | vLLM's logged tokens (max concurrency) "
        "| bytes / token allocated | expected bytes / token | attention ISA | engines |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for setup, cap in s["capacity"].items():
        lines.append(f"| {setup} | {', '.join(cap['kv_tensor_dtypes'])} | {cap['tokens']:,} | "
                     f"{cap['num_gpu_blocks']} x {cap['block_size']} | {cap.get('capacity_vs_bf16', 0):.2f}x | "
                     f"{cap['kv_cache_size_tokens']:,} ({cap['max_concurrency']:.1f}x) | "
                     f"{cap['bytes_per_token_allocated']:.0f} | {report['expected_bytes_per_token'][setup]} | "
                     f"{', '.join(cap['attention_isa'])} | {cap['engines']}"
                     + ("" if cap["consistent"] else " (differs between engines)") + " |")
    for setup, why in report.get("refused", {}).items():
        lines.append(f"| {setup} | refused: {why} | | | | | | | | |")
    lines += [
        "",
        "## Throughput (generated tokens/s, medians)",
        "",
        f"Batch of {a['batch']} sequences, temperature 1.0, engine seed 0, ignore_eos; {a['reps']} timed repeat(s) per "
        f"context per engine; engine blocks, alternating set-ups: {', '.join(b['setup'] for b in report['blocks'])}. "
        "tok/s: generated tokens / wall time of the whole `generate` (prefill included). Prefill s and decode tok/s "
        "come from the engine core's per-request timestamps: prefill from the first request scheduled to the last "
        "sequence's first token, decode = (generated tokens - one per sequence) / (last token - that first token).",
        "",
        "| prompt tokens | generated | set-up | tok/s | decode tok/s | prefill s | tok/s vs BF16 | tok/s vs INT8 "
        "| decode vs BF16 | decode vs INT8 | runs |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for context in a["contexts"]:
        n_prompt, n_gen = parse_context(context)
        for setup in a["setups"]:
            med = s["median"].get(setup, {}).get(context)
            if med is None:
                continue
            ratio = lambda key: f"{s['ratios'][key]:.2f}x" if key in s["ratios"] else "-"  # noqa: E731
            decode = f"{med['decode_tok_per_s']:.1f}" if med["decode_tok_per_s"] else "-"
            prefill = f"{med['prefill_s']:.2f}" if med["prefill_s"] else "-"
            lines.append(f"| {n_prompt} | {n_gen} | {setup} | {med['tok_per_s']:.1f} | {decode} | {prefill} | "
                         f"{ratio(f'{setup}/bf16 {context}')} | {ratio(f'{setup}/int8 {context}')} | "
                         f"{ratio(f'decode {setup}/bf16 {context}')} | {ratio(f'decode {setup}/int8 {context}')} | {med['n']} |")
    kernel = report.get("attention_kernel") or {}
    if kernel:
        share = s.get("attention_share", {})
        lines += ["", "## The decode attention kernel alone", "",
                  f"vLLM-CPU's `cpu_attention_with_kv_cache` as one decode step runs it: every layer of this model in "
                  f"turn, each with its own KV cache (streamed from memory, as in the engine), one query token for each of "
                  f"{a['batch']} sequences holding the stated number of cached tokens (the mean context while decoding: "
                  f"prompt + half the generated tokens), one thread, BF16 and FP8 steps alternating, {a['kernel_iters']} "
                  "timed steps each; medians. Against the INT8 engine's measured decode step it gives the share of the "
                  "step the KV cache's format can change, and the decode rate an FP8 cache would give if nothing else "
                  "changed (an estimate: alone, the kernel has the memory bandwidth to itself; in the engine it shares "
                  "it with the weights). Warm: the same number of calls on one layer's cache, which can stay in "
                  "the CPU's caches (as far as the machine's other work leaves them): mostly the kernel's arithmetic.",
                  "",
                  "| context | cached tokens | KV bytes per step, BF16 / FP8 | BF16 KV ms | FP8 KV ms | FP8 / BF16 "
                  "| warm: BF16 / FP8 ms | warm FP8 / BF16 | ISA | INT8 decode step ms | attention share "
                  "| predicted FP8 KV decode vs INT8 |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|"]
        for context, row in kernel.items():
            fp8 = next((v for k, v in row.items() if isinstance(v, dict) and k != "auto"), None)
            ratio = next((v for k, v in row.items() if k.endswith("/auto")), None)
            warm_ratio = next((v for k, v in row.items() if k.endswith("/auto warm")), None)
            warm = f"{row['auto']['warm_median_ms']:.2f}" + (f" / {fp8['warm_median_ms']:.2f}" if fp8 else "")
            sh = share.get(context, {})
            cache_mb = f"{row['auto']['cache_bytes'] / 2**20:.1f}" + (f" / {fp8['cache_bytes'] / 2**20:.1f}" if fp8 else "")
            cells = [context, str(row["context"]), cache_mb + " MiB", cell(row["auto"]["step_median_ms"], ".2f"),
                     cell(fp8 and fp8["step_median_ms"], ".2f"), cell(ratio, ".2f", "x"), warm, cell(warm_ratio, ".2f", "x"),
                     row["auto"]["isa"],
                     cell(sh.get("int8_decode_step_ms"), ".1f"),
                     cell(sh.get("share"), ".0%"), cell(sh.get("predicted_fp8kv_decode_vs_int8"), ".2f", "x")]
            lines.append("| " + " | ".join(cells) + " |")
    scales = report.get("kv_scales") or {}
    if scales:
        ks = [v["k_scale"] for v in scales.values()]
        vs = [v["v_scale"] for v in scales.values()]
        lines += ["", "## FP8 KV scales", "",
                  f"Per layer, from a bf16 transformers forward of the same weights on {report['calibration_prompts']} "
                  f"benchmark prompts (`KVRangeObserver`, `scale_from_amax`: amax at half of E4M3's range): K "
                  f"{min(ks):.4g}-{max(ks):.4g}, V {min(vs):.4g}-{max(vs):.4g}. Set in each FP8 engine after its weight sync "
                  "(the engine's values, read back, are in the JSON)."]
        fp8_blocks = [b for b in report["blocks"] if SETUPS[b["setup"]][1] == "fp8"]
        for key, when in (("engine_k_scales_at_start", "at start-up"), ("engine_k_scales_after_sync", "after the sync")):
            held = [x for b in fp8_blocks for x in b.get(key, [])]
            if held:
                lines.append(f"The FP8 engines' K scales {when}, before these were set: {min(held):.3g} to {max(held):.3g}.")
    lines += ["", "## Notes", ""] + [f"- {n}" for n in report["notes"] + derived_notes(report)]
    return "\n".join(lines) + "\n"


def cell(value, spec: str, suffix: str = "") -> str:
    return "-" if value is None else format(value, spec) + suffix


def fmt_load(load) -> str:
    return " / ".join(f"{x:.2f}" for x in load) if load else "-"


def derived_notes(report: dict) -> list[str]:
    """Notes that follow from the measured figures (recomputed on every render)."""
    out = []
    caps = report["summary"]["capacity"]
    if "bf16" in caps and "int8_fp8kv" in caps:
        out.append(f"FP8 KV holds {caps['int8_fp8kv']['capacity_vs_bf16']:.2f}x the tokens of the BF16 KV cache in the same "
                   f"{report['args']['kv_space_gib']} GiB ({caps['int8_fp8kv']['tokens']:,} vs "
                   f"{caps['bf16']['tokens']:,}); INT8 weights do not change it (vLLM-CPU sizes the KV cache "
                   "from VLLM_CPU_KVCACHE_SPACE alone, not from the memory left after the weights).")
    fp8_vs_int8 = {k.split()[-1]: v for k, v in report["summary"]["ratios"].items() if k.startswith("decode int8_fp8kv/int8")}
    if fp8_vs_int8:
        slower = {c: v for c, v in fp8_vs_int8.items() if v < 1}
        out.append("Decode with the FP8 KV cache against the BF16 KV cache, same INT8 weights: "
                   + ", ".join(f"{c}: {v:.2f}x" for c, v in fp8_vs_int8.items()) + " (medians; the spread of the single "
                   "runs is in the JSON)."
                   + (" Below 1 the FP8 cache costs more on this CPU (quantize on write, dequantize on every read of every "
                      "cached token) than its halved KV traffic saves." if slower else ""))
    loads = [x for b in report["blocks"] for x in (b["load_before"][0], b.get("load_after", [0])[0])]
    cores = report["machine"]["cores"]
    if loads and max(loads) > 1.5:
        out.append(f"The machine was shared during this run: 1-min load averages at block starts/ends ranged "
                   f"{min(loads):.1f}-{max(loads):.1f} on {cores} cores (the engine accounts for about 1). Absolute tokens/s "
                   "are depressed and noisy; alternating blocks spread the load over the set-ups, so the ratios are less "
                   "affected, not unaffected.")
    return out


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
    args.out = args.out or str(REPO / "bench" / "results" / f"kv_cache_capacity_{cls}")
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
    start = time.perf_counter()
    cpu_model, flags = cpu_model_and_flags()
    contexts = [parse_context(c) for c in args.contexts]
    max_model_len = max(p + g for p, g in contexts) + POSITION_MARGIN
    report = {
        "args": {**vars(args), "out": os.path.relpath(args.out, REPO)},
        "machine": {"cpu_model": cpu_model, "cpu_class": cls, "cores": os.cpu_count(), "vllm": vllm.__version__,
                    "torch": torch.__version__, "vllm_library": vllm_cpu_library(flags),
                    "isa_flags": sorted(f for f in flags if f.startswith(ISA_FLAG_PREFIXES)),
                    "torch_avx512": bool(torch.cpu._is_avx512_supported()),
                    "amx": bool(torch.cpu._is_amx_tile_supported()), "loadavg_start": os.getloadavg()},
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
            if time.perf_counter() - start > args.budget_s:
                report["notes"].append(f"stopped at the time budget ({args.budget_s:.0f} s): blocks {plan[i:]} not run")
                break
            report["blocks"].append(run_block(model_dir, trainer, setup, args, prompts, scales, max_model_len))
            report["summary"] = summarize(report)
            report["elapsed_s"] = time.perf_counter() - start
            report["loadavg_end"] = os.getloadavg()
            out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
            out.with_suffix(".md").write_text(markdown(report))
            print(json.dumps(report["summary"]["ratios"]), flush=True)
    if not report["blocks"]:  # every set-up refused
        report["summary"] = summarize(report)
        report["loadavg_end"] = os.getloadavg()
        out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
        out.with_suffix(".md").write_text(markdown(report))
    print("written", out.with_suffix(".json"), out.with_suffix(".md"))


if __name__ == "__main__":
    main()
