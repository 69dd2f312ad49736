"""The decode roofline's markdown, rendered from the report's JSON."""
from __future__ import annotations

from roofline_shapes import GB


def fmt(x: float, digits: int = 2) -> str:
    return f"{x:,.{digits}f}"


def fmt_bytes(x: float) -> str:
    """GB with two decimals, MB below a hundredth of a GB (the tiny CPU model)."""
    return f"{x / GB:,.2f} GB" if x >= GB / 100 else f"{x / 1e6:,.2f} MB"


def fmt_share(x: float) -> str:
    return f"{100 * x:.0f}%"


def seqs_text(x: float) -> str:
    return f"{x:g}"


def recipe_markdown(r: dict) -> list[str]:
    v = r["inputs"]
    gpus = f"{v['num_gpus']} GPU" + ("s" if v["num_gpus"] != 1 else "")
    lines = [f"## {r['name']} (`{r['file']}`)", ""]
    if r["cpu_toy"]:
        lines += ["A CPU toy: the recipe runs on a CPU; the figures are those of its model's shape on the cards below.", ""]
    lines += [f"Model `{v['model']}` ({r['model_shape']['source']}); {v['train_batch_size']} prompts x "
              f"{v['rollout_n']} = {v['sequences_per_step']} sequences on {gpus} "
              f"({v['nnodes']} x {v['n_gpus_per_node']}), rollout TP {v['tensor_model_parallel_size']}: "
              f"{seqs_text(v['seqs_per_gpu'])} sequences per GPU, {seqs_text(v['seqs_per_engine'])} per engine; "
              f"max prompt {v['max_prompt_length']}, max response {v['max_response_length']} "
              f"(recipe mean context {fmt(v['recipe_mean_context'], 0)}); "
              f"max_num_seqs {v['max_num_seqs']}, gpu_memory_utilization {v['gpu_memory_utilization']}.",
              "KV cache per token per rank: " + ", ".join(
                  f"{s['label']} {fmt(r['kv_bytes_per_token_per_rank'][s['name']] / 2**10, 1)} KiB" for s in r["setups"])
              + "; weights resident per rank: " + ", ".join(
                  f"{s['label']} {fmt_bytes(r['stored_weight_bytes_per_rank'][s['name']])}" for s in r["setups"]) + "."]
    if r["defaults_taken"]:
        lines.append("Not in the recipe, verl's default taken: " + "; ".join(f"`{d}`" for d in r["defaults_taken"]) + ".")
    if r["contexts_beyond_max_length"]:
        lines.append("Fixed contexts beyond the recipe's max length, left out: "
                     + ", ".join(str(c) for c in r["contexts_beyond_max_length"]) + ".")
    lines.append("")
    labels = [s["label"] for s in r["setups"]]
    for acc in r["accelerators"]:
        lines += [f"### {acc['label']} ({fmt(acc['bandwidth_bytes_per_s'] / 1e12)} TB/s)", "",
                  "| context (tokens) | sequences per engine | " + " | ".join(f"read per GPU {x}" for x in labels)
                  + " | " + " | ".join(f"step ms {x}" for x in labels)
                  + " | " + " | ".join(f"speed-up {x}" for x in labels[1:]) + " |",
                  "|" + "---|" * (2 + 3 * len(labels) - 1)]
        for row in r["rows"]:
            cells = [f"{fmt(row['mean_context'], 0)} ({row['context_label']})",
                     f"{seqs_text(row['seqs_per_engine'])} ({row['concurrency_label']})"]
            cells += [fmt_bytes(row["setups"][s["name"]]["total_bytes"]) for s in r["setups"]]
            cells += [fmt(row["setups"][s["name"]]["step_ms"][acc["name"]], 3) for s in r["setups"]]
            cells += [fmt(row["setups"][s["name"]]["speedup_over_bf16"]) + "x" for s in r["setups"][1:]]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["### Capacity-bound, at the recipe mean context", "",
              "| card | set-up | KV capacity per engine (tokens) | sequences running | limited by | decode tokens/s per GPU "
              "| speed-up |", "|---|---|---|---|---|---|---|"]
    for acc in r["accelerators"]:
        for s in r["setups"]:
            c = r["capacity_bound"][acc["name"]][s["name"]]
            sp = "-" if c["speedup_over_bf16"] is None else fmt(c["speedup_over_bf16"]) + "x"
            lines.append(f"| {acc['label']} | {s['label']} | {fmt(c['kv_capacity_tokens'], 0)} | {c['running_seqs']} "
                         f"| {c.get('limited_by', 'does not fit')} | {fmt(c['tokens_per_s_per_gpu'], 0)} | {sp} |")
    return lines + [""]


def published_range(p: dict) -> str:
    low, high = fmt(p["published_low"]) + "x", fmt(p["published_high"]) + "x"
    return low if low == high else f"{low} - {high}"


def published_markdown(p: dict, label: dict) -> list[str]:
    """One published figure against the roofline, and what the gap says."""
    cap = p["capacity_bound_speedup"]
    if cap > p["published_high"]:
        where = f"above it ({fmt(cap)}x)"
    elif cap < p["published_low"]:
        where = f"below it ({fmt(cap)}x)"
    else:
        where = f"within it ({fmt(cap)}x)"
    text = [f"**{p['name']}** ({label[p['setup']]}). Published: {p['claim']} ({p['source']}). Assumed: {p['assumed']}. "
            f"The capacity-bound roofline on {p['capacity_bound_accelerator_label']} is {where}; per step it spans "
            f"{fmt(p['per_step_speedup_min'])}x - {fmt(p['per_step_speedup_max'])}x."]
    share = p["kv_share_matching_published"]
    if share is None:
        text.append(f"No KV share of the step gives {fmt(p['published_mid'])}x: the roofline cannot fall to it "
                    "at any context or batch.")
    else:
        text.append(f"The per-step roofline gives {fmt(p['published_mid'])}x when the KV cache is "
                    f"{fmt_share(share)} of a BF16 step's bytes; at the mean context with the capacity-bound batch it is "
                    f"{fmt_share(p['kv_share_at_mean_context'])}.")
    if p["untouched_share_of_bf16_time"] is not None:
        text.append(f"Read as Amdahl's law, the published figure leaves {fmt_share(p['untouched_share_of_bf16_time'])} "
                    "of the BF16 rollout time to parts the roofline does not speed up.")
    if p.get("published_kv_gain_over_linear"):
        text.append(f"The KV cache alone, over 8-bit linears: published {fmt(p['published_kv_gain_over_linear'])}x, "
                    f"capacity-bound roofline {fmt(p['roofline_kv_gain_over_linear'])}x.")
    return [" ".join(text), ""] + [f"- {e}" for e in p["explanations"]] + [""]


def markdown(report: dict) -> str:
    setups = report["setups"]
    label = {s["name"]: s["label"] for s in setups}
    lines = ["# Decode bytes per step: a memory-bound roofline of rollout", "",
             "Written by `bench/bench_decode_roofline.py` from `decode_roofline.json`; pure arithmetic, no run.", "",
             report["model_text"], "",
             "Set-ups: " + "; ".join(f"**{s['label']}**: linear weights {s['linear_weight_bytes']} B"
                                     + (f" + {s['linear_scale_bytes']} B scale per output channel" if s["linear_scale_bytes"]
                                        else "")
                                     + f", KV {s['kv_bytes']} B per element" for s in setups)
             + f"; embeddings, lm_head, norms and biases {report['other_weight_bytes']} B in all.", "",
             "Rows: the recipe mean context (max prompt + max response / 2) and fixed contexts, each with all sequences "
             f"of a step at once (batch x n / GPUs x TP, an upper bound) and a fixed {report['fixed_seqs_per_engine']} "
             "sequences per engine. Speed-up = BF16 bytes / set-up bytes: the same on every card at fixed concurrency; "
             "the cards differ in step time and, in the capacity-bound tables, in how many sequences fit.", ""]
    s = report["issue_sanity_check"]
    lines += ["## Sanity check (the issue's arithmetic)", "",
              f"`{s['model']}`, {s['seqs_per_gpu']} sequences per GPU at {s['mean_context']} tokens: KV "
              f"{fmt(s['kv_kib_per_token_bf16'], 1)} KiB per token, {fmt(s['kv_gb_bf16'])} GB per step against "
              f"{fmt(s['weights_gb']['bf16'])} GB of BF16 weights ({fmt(s['weights_gb']['w8a8'])} GB W8A8); "
              f"{label['w8a8']} {fmt(s['speedup']['w8a8'])}x, {label['w8a8_fp8kv']} {fmt(s['speedup']['w8a8_fp8kv'])}x.", ""]
    for r in report["recipes"]:
        lines += recipe_markdown({**r, "setups": setups, "accelerators": report["accelerators"]})
    lines += ["## Compared with published figures", "",
              "Each published set-up is modelled with the values it states and the assumptions listed where it does "
              "not. Per step: the range of the roofline's speed-up over the contexts and concurrencies listed. "
              "Capacity-bound: the tokens/s speed-up at the mean context, with the sequences that fit.", "",
              "| publication | set-up | published | roofline per step | roofline capacity-bound | contexts | concurrencies |",
              "|---|---|---|---|---|---|---|"]
    for p in report["published"]:
        lines.append(f"| {p['name']} | {label[p['setup']]} | {published_range(p)} | {fmt(p['per_step_speedup_min'])}x - "
                     f"{fmt(p['per_step_speedup_max'])}x | {fmt(p['capacity_bound_speedup'])}x "
                     f"({p['capacity_bound_accelerator_label']}) | {', '.join(fmt(c, 0) for c in p['contexts'])} | "
                     f"{', '.join(seqs_text(c) for c in p['concurrencies'])} |")
    lines.append("")
    for p in report["published"]:
        lines += published_markdown(p, label)
    return "\n".join(lines)
