"""Rollout throughput and fidelity of the quantized vLLM-CPU engine: BF16 vs INT8 (vs FP8) side by side.

The point of QuRL's quantized rollout is faster generation at a small log-prob cost. This measures
both on the same machine in one run:

* throughput: output tokens/s of ``LLM.generate`` at batch 1 / 8 / 32, temperature 1.0, fixed
  seeds, ``ignore_eos`` (every request decodes ``--max-tokens`` tokens, like a long rollout).
  Each engine lives for one block; blocks alternate between formats (bf16, int8, bf16, int8, ...)
  so that drift in machine load hits both formats alike. FP8 per-channel has no fast CPU kernel
  (vLLM emulates it), so it is only timed at batch 1 / 8 with short outputs, next to BF16 at the
  same setting, as a correctness-path figure.
* fidelity: the same token sequences (BF16 greedy and BF16 sampled continuations) scored by every
  engine through ``prompt_logprobs``; per-token |delta log p| vs BF16, and the k1 estimate of
  KL(bf16 || quantized) on the sampled ones (unbiased only there: those tokens are drawn from BF16).

Engines are built as the product builds them (``RolloutSettings.engine_quantization``, the
qurl worker extension, dummy load) and receive the model's weights through one verl-style sync, so
the INT8 engine runs the worker's own quantization and kernels. Writes
``bench/results/rollout_throughput_<cpu class>.{json,md}`` after every block, so a cut-short run still reports.

    .venv/bin/python bench/bench_rollout_throughput.py [--blocks 3] [--max-tokens 128] [--budget-s 900]
"""
from __future__ import annotations

import argparse
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

from bench_models import INITS, build_model, param_count  # noqa: E402
from bench_models import SPECS as MODELS  # noqa: E402

from qurl_verl.platform.cpu_features import cpu_class, cpu_flags, cpu_model_and_flags, vllm_cpu_library  # noqa: E402

BATCHES = (1, 8, 32)
SHORT = (1, 8)  # batch sizes of the FP8 comparison
N_FIDELITY = 8  # prompts per fidelity set (greedy, sampled)


def chat_prompts(model_dir: Path, n: int) -> list[list[int]]:
    """``n`` chat-templated arithmetic questions as token ids (the shape of a math RL prompt)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    rng = random.Random(0)
    out = []
    for _ in range(n):
        a, b, op = rng.randint(2, 99), rng.randint(2, 99), rng.choice("+-*")
        msg = [{"role": "user", "content": f"What is {a} {op} {b}? Think step by step, then answer."}]
        out.append(tok.apply_chat_template(msg, add_generation_prompt=True, tokenize=True, return_dict=False))
    return out


ONEDNN_SUFFIX = "_onednn"  # e.g. int8_onednn: the INT8 engine with QURL_VERL_CPU_INT8_GEMM=onednn


def engine_format(fmt: str) -> str:
    """``int7`` (etc.) is the INT8 engine fed b-bit weight codes (``custom.qurl.weight_bits``)."""
    return "int8" if fmt.startswith("int") else fmt


def weight_bits(fmt: str) -> int:
    base = fmt.removesuffix(ONEDNN_SUFFIX)
    return int(base[3:]) if base.startswith("int") else 8


def int8_gemm_choice(fmt: str) -> str:
    """``QURL_VERL_CPU_INT8_GEMM`` for this format's engine: ``onednn`` keeps oneDNN where it saturates."""
    return "onednn" if fmt.endswith(ONEDNN_SUFFIX) else "auto"


def start_engine(model_dir: Path, fmt: str, max_model_len: int, dtype: str = "bfloat16"):
    """The engine QurlvLLMHttpServer builds for ``rollout.quantization=fmt`` (dummy weights)."""
    from vllm import LLM

    from qurl_verl.settings import RolloutSettings

    quantization, hf_overrides = RolloutSettings(format=engine_format(fmt)).engine_quantization()
    return LLM(
        model=str(model_dir),
        dtype=dtype,
        load_format="dummy",
        quantization=quantization,
        hf_overrides=hf_overrides or None,
        max_model_len=max_model_len,
        max_num_seqs=max(BATCHES),
        enforce_eager=True,
        enable_prefix_caching=False,
        logprobs_mode="processed_logprobs",
        worker_extension_cls="qurl_verl.rollout.worker_extension.QurlWorkerExtension",
        seed=0,
    )


def time_generate(llm, prompts: list[list[int]], max_tokens: int, reps: int) -> list[dict]:
    """``reps`` timed generations of the whole batch after one untimed warm-up."""
    from vllm import SamplingParams

    def params(rep):
        return [SamplingParams(temperature=1.0, seed=1000 * rep + i, max_tokens=max_tokens, ignore_eos=True)
                for i in range(len(prompts))]

    inputs = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(inputs, [SamplingParams(temperature=1.0, seed=i, max_tokens=4, ignore_eos=True)
                          for i in range(len(prompts))], use_tqdm=False)
    rows = []
    for rep in range(reps):
        start = time.perf_counter()
        outs = llm.generate(inputs, params(rep), use_tqdm=False)
        wall = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        rows.append({"wall_s": wall, "output_tokens": tokens, "tok_per_s": tokens / wall})
    return rows


def bf16_sequences(llm, prompts: list[list[int]], max_tokens: int) -> dict[str, list[list[int]]]:
    """Greedy and sampled (T=1, fixed seeds) BF16 continuations: the sequences every engine scores."""
    from vllm import SamplingParams

    inputs = [{"prompt_token_ids": p} for p in prompts]
    sets = {}
    for name, temp in (("greedy", 0.0), ("sampled", 1.0)):
        params = [SamplingParams(temperature=temp, seed=7 + i, max_tokens=max_tokens, ignore_eos=True)
                  for i in range(len(prompts))]
        outs = llm.generate(inputs, params, use_tqdm=False)
        sets[name] = [list(p) + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)]
    return sets


def score(llm, seqs: list[list[int]], prompt_lens: list[int]) -> list[list[float]]:
    """log p(token) of each continuation token under this engine (raw logits, i.e. T=1)."""
    from vllm import SamplingParams

    outs = llm.generate([{"prompt_token_ids": s} for s in seqs],
                        SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    return [[o.prompt_logprobs[t][s[t]].logprob for t in range(n, len(s))]
            for o, s, n in zip(outs, seqs, prompt_lens)]


def fidelity(scores: dict, fmt: str) -> dict:
    """|delta log p| vs BF16 on both sets; k1 KL(bf16 || fmt) and BF16's own mean log p on the sampled set."""
    out = {}
    for name in ("greedy", "sampled"):
        ref = torch.tensor([x for row in scores["bf16"][name] for x in row], dtype=torch.float64)
        got = torch.tensor([x for row in scores[fmt][name] for x in row], dtype=torch.float64)
        d = (got - ref).abs()
        out[name] = {"tokens": int(d.numel()), "mean_abs_dlogp": float(d.mean()), "max_abs_dlogp": float(d.max()),
                     "p95_abs_dlogp": float(torch.quantile(d, 0.95))}
        if name == "sampled":
            out[name]["k1_kl_bf16_to_fmt"] = float((ref - got).mean())
            out[name]["bf16_mean_logp"] = float(ref.mean())  # -entropy estimate: how peaked the model is
    return out


def run_block(model_dir: Path, trainer, fmt: str, args, prompts, fid, first: bool) -> dict:
    from qurl_testkit import reload_harness as harness

    load_before = os.getloadavg()
    t0 = time.perf_counter()
    from qurl_verl.platform.cpu_int8_gemm import GEMM_CHOICE_ENV

    os.environ[GEMM_CHOICE_ENV] = int8_gemm_choice(fmt)  # the engine process inherits it
    llm = start_engine(model_dir, fmt, max_model_len=max(len(p) for p in prompts) + max(args.max_tokens, args.fidelity_tokens) + 8)
    init_s = time.perf_counter() - t0
    block = {"format": fmt, "load_before": load_before, "engine_init_s": init_s, "runs": {}}
    try:
        harness.sync_weights(llm, trainer.named_tensors(), bucket_mb=256, weight_bits=weight_bits(fmt))
        if fmt.startswith("int"):  # which GEMM the engine's INT8 linears hold, as it reports them
            from qurl_verl.rollout.int8_gemm_report import count

            block["int8_gemms"] = count(llm.collective_rpc("qurl_int8_gemms")[0])
        if fid["sets"] is None:  # the first BF16 block fixes the sequences every format scores
            assert fmt == "bf16"
            fid["sets"] = bf16_sequences(llm, prompts[:N_FIDELITY], args.fidelity_tokens)
        if first:
            lens = [len(p) for p in prompts[:N_FIDELITY]]
            fid["scores"][fmt] = {k: score(llm, v, lens) for k, v in fid["sets"].items()}
        settings = [(b, args.max_tokens) for b in args.batches] if fmt != "fp8" else []
        if not fmt.startswith("int") and (fmt == "fp8" or "fp8" in args.formats):
            settings += [(b, args.short_tokens) for b in SHORT]
        for b, n in settings:
            rows = time_generate(llm, prompts[:b], n, args.reps)
            block["runs"][f"b{b}_t{n}"] = rows
            print(fmt, f"batch {b} max_tokens {n}", [round(r["tok_per_s"], 1) for r in rows], flush=True)
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    block["load_after"] = os.getloadavg()
    return block


def summarize(report: dict) -> dict:
    """Median tokens/s per (format, setting) over every timed repeat of every block."""
    pooled: dict[str, dict[str, list[float]]] = {}
    for block in report["blocks"]:
        for key, rows in block["runs"].items():
            pooled.setdefault(block["format"], {}).setdefault(key, []).extend(r["tok_per_s"] for r in rows)
    med = {f: {k: {"median_tok_per_s": statistics.median(v), "n": len(v), "min": min(v), "max": max(v)}
               for k, v in d.items()} for f, d in pooled.items()}
    ratios = {}
    for fmt in [f for f in med if f != "bf16"]:
        for key, m in med.get(fmt, {}).items():
            if key in med.get("bf16", {}):
                ratios[f"{fmt}/bf16 {key}"] = m["median_tok_per_s"] / med["bf16"][key]["median_tok_per_s"]
    return {"median": med, "ratios": ratios}


def markdown(report: dict) -> str:
    s = report["summary"]
    med, m = s["median"], report["machine"]
    others = [f for f in report["args"]["formats"] if f != "bf16"]
    lines = [
        "# Rollout throughput: BF16 vs " + " vs ".join(f.upper() for f in others) + " on vLLM-CPU",
        "",
        f"Model: Qwen2-shaped, random weights, init {report['model'].get('init', 'gain4')} "
        f"({report['model']['params'] / 1e6:.1f}M parameters, "
        f"{report['model']['spec']}). Engine: vllm-cpu {m['vllm']}, bf16 activations, eager, one compute core. "
        f"CPU: {m['cpu_model']} ({m['cores']} cores, VNNI: {m['vnni']}, AMX: {m['amx']}"
        + (f"; emulating AVX2: ONEDNN_MAX_CPU_ISA={m['onednn_max_cpu_isa']}, torch kernels "
           f"{m.get('aten_cpu_capability', 'native')}" if m.get("onednn_max_cpu_isa") else "") + ").",
        f"Sampling: temperature 1.0, fixed seeds, ignore_eos. Blocks run: {len(report['blocks'])} "
        f"({', '.join(b['format'] for b in report['blocks'])}), {report['args']['reps']} timed repeats per "
        f"setting per block after a warm-up; figures are medians over all repeats.",
        f"Load average (1 min) at block starts: {', '.join(format(b['load_before'][0], '.2f') for b in report['blocks'])}.",
        "INT8 GEMMs as the engines report them ('inferred': a run from before the report): " + ("; ".join(
            f"{f}: " + ", ".join(f"{n} x{c}" for n, c in g.items()) if isinstance(g, dict) else f"{f}: {g} (inferred)"
            for f, g in report.get("int8_gemm", {}).items()) or "none run") + ".",
        "",
        "| batch | max_tokens | BF16 tok/s | " + " | ".join(f"{f.upper()} tok/s | {f.upper()}/BF16" for f in others) + " |",
        "|---:|---:|---:|" + "---:|---:|" * len(others),
    ]
    keys = sorted({k for d in med.values() for k in d}, key=lambda k: (int(k.split("_t")[1]), int(k[1:].split("_")[0])))
    for key in keys:
        b, n = key[1:].split("_t")
        cell = lambda f: f"{med[f][key]['median_tok_per_s']:.1f}" if key in med.get(f, {}) else "-"  # noqa: E731
        ratio = lambda f: f"{s['ratios'][f'{f}/bf16 {key}']:.2f}x" if f"{f}/bf16 {key}" in s["ratios"] else "-"  # noqa: E731
        lines.append(f"| {b} | {n} | {cell('bf16')} | " + " | ".join(f"{cell(f)} | {ratio(f)}" for f in others) + " |")
    lines += ["", "## Fidelity vs BF16 (same token sequences, prompt_logprobs)", "",
              "| format | set | tokens | mean abs dlogp | p95 | max | k1 KL(bf16, fmt) |", "|---|---|---:|---:|---:|---:|---:|"]
    for fmt, f in report.get("fidelity", {}).items():
        for name, r in f.items():
            kl = f"{r['k1_kl_bf16_to_fmt']:.2e}" if "k1_kl_bf16_to_fmt" in r else "-"
            lines.append(f"| {fmt} | {name} | {r['tokens']} | {r['mean_abs_dlogp']:.4f} | {r['p95_abs_dlogp']:.4f} "
                         f"| {r['max_abs_dlogp']:.4f} | {kl} |")
    if report.get("fidelity"):
        ent = next(iter(report["fidelity"].values()))["sampled"]["bf16_mean_logp"]
        lines.append(f"\nBF16 mean log p of its own samples: {ent:.2f} nats (ln vocab = "
                     f"{torch.log(torch.tensor(float(report['model']['vocab']))):.2f}).")
    lines += ["", "## Notes", ""] + [f"- {n}" for n in report["notes"] + derived_notes(report)]
    return "\n".join(lines) + "\n"


def derived_notes(report: dict) -> list[str]:
    """Notes that follow from the arguments and the measured figures (recomputed on every render)."""
    tps = [m["median_tok_per_s"] for runs in report["summary"]["median"].values() for m in runs.values()] or [0.0]
    a, ratios = report["args"], report["summary"]["ratios"]
    n = report["summary"]["median"].get("int8", {})
    out = [f"Scope: every batch decodes max_tokens={a['max_tokens']} tokens after ~{statistics.median(report['prompt_tokens']):.0f}-token "
           f"prompts; engine blocks run, alternating formats: {', '.join(b['format'] for b in report['blocks'])}; "
           f"{a['reps']} timed repeat(s) per setting per block, so each BF16/INT8 median is over "
           f"{min((m['n'] for m in n.values()), default=0)} runs over "
           f"{sum(blk['format'] == 'int8' for blk in report['blocks'])} engine(s) per format ({a['blocks']} planned). Reasoning rollouts run to "
           f"thousands of tokens; {a['max_tokens']} is what this run could afford at this CPU's "
           f"{min(tps):.0f}-{max(tps):.0f} tok/s. "
           "Decode cost per token grows with context, so longer outputs would weigh attention (unquantized in "
           "both formats) a little more."]
    loads = [x for blk in report["blocks"] for x in (blk["load_before"][0], blk.get("load_after", [0])[0])]
    cores = report["machine"]["cores"]
    if loads and max(loads) > cores:
        out.append(f"The machine was shared during this run: 1-min load averages at block starts/ends ranged "
                   f"{min(loads):.1f}-{max(loads):.1f} on {cores} cores (the engine itself accounts for about 1). "
                   "Absolute tokens/s are depressed and noisy; alternating blocks spread the load over both "
                   "formats, so the ratios are less affected, not unaffected.")
    b1 = next((v for k, v in ratios.items() if k.startswith("int8/bf16 b1_")), None)
    if b1 is not None and b1 < 1:
        out.append(f"INT8 at batch 1 runs at {b1:.2f}x BF16 here. Where the time goes per CPU class: "
                   "bench/INT8_BATCH1.md (without VNNI, oneDNN's int8 GEMM runs gemm:jit on unpacked weights, "
                   "nearly flat in batch size; the saturation split doubles it).")
    big = [(k, v) for k, v in ratios.items() if k.startswith("int8/") and v > 2]
    if big:
        out.append(f"INT8/BF16 above 2x ({', '.join(f'{k.split()[1]}: {v:.2f}x' for k, v in big)}) exceeds the "
                   "memory-bound limit: BF16 here is compute-bound (no native bf16 dot product on AVX2), so "
                   "the ratio compares int8 GEMMs with emulated bf16 compute, not memory traffic.")
    return out


def results_class(flags: frozenset[str]) -> str:
    """The CPU class of the results (``cpu_features.cpu_class``). An ``ONEDNN_MAX_CPU_ISA`` cap is named too:
    ``<cap>_onednn_on_<native>`` when it caps oneDNN alone (torch's and sgl-kernel's kernels keep the native
    ISA), ``<cap>_emulated_on_<native>`` when ``ATEN_CPU_CAPABILITY`` caps torch's kernels to the same ISA."""
    native = cpu_class(flags)
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "").strip().lower()
    if not cap or cap == "all":
        return native
    aten = os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower()
    return f"{cap}_emulated_on_{native}" if aten == cap else f"{cap}_onednn_on_{native}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="mid")
    parser.add_argument("--init", choices=INITS, default="fanin",
                        help="weight init (bench_models); only the fidelity figures depend on it")
    parser.add_argument("--formats", nargs="+", default=["bf16", "int8", "fp8"],
                        help="bf16 first; int4..int7 are the INT8 engine fed b-bit weight codes (custom.qurl.weight_bits)")
    parser.add_argument("--blocks", type=int, default=3, help="engine blocks per format (fp8: one)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--short-tokens", type=int, default=16)
    parser.add_argument("--fidelity-tokens", type=int, default=48)
    parser.add_argument("--budget-s", type=float, default=1800, help="no new block starts after this")
    parser.add_argument("--out", default=None, help="default: bench/results/rollout_throughput_<cpu class>")
    parser.add_argument("--render", action="store_true", help="only rewrite the .md from the existing .json")
    args = parser.parse_args()
    if args.out is None:
        args.out = str(REPO / "bench" / "results" / f"rollout_throughput_{results_class(cpu_flags())}")
    if args.render:
        out = Path(args.out)
        out.with_suffix(".md").write_text(markdown(json.loads(out.with_suffix(".json").read_text())))
        print("written", out.with_suffix(".md"))
        return
    assert args.formats[0] == "bf16", "bf16 first: it fixes the fidelity sequences"

    import vllm
    from verl.plugin.platform import platform_manager

    from qurl_testkit import reload_harness as harness
    from qurl_verl.patches.vllm_cpu_worker import vllm_cpu_int8_saturation
    from qurl_verl.platform.cpu import PlatformCPU

    os.environ.update(harness.engine_env())
    platform_manager._current_platform = PlatformCPU()
    start = time.perf_counter()
    cpu_model, flags = cpu_model_and_flags()
    saturates = vllm_cpu_int8_saturation.onednn_int8_saturates()
    report = {
        "args": {**vars(args), "out": os.path.relpath(args.out, REPO)},
        "machine": {"cpu_model": cpu_model, "cores": os.cpu_count(), "vllm": vllm.__version__,
                    "torch": torch.__version__, "vnni": "avx512_vnni" in flags or "avx_vnni" in flags,
                    "amx": "amx_int8" in flags, "avx512": "avx512f" in flags, "avx512_bf16": "avx512_bf16" in flags,
                    "vllm_library": vllm_cpu_library(flags),
                    "onednn_int8_saturates": saturates, "loadavg_start": os.getloadavg(),
                    "cpu_class": results_class(flags), "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA"),
                    "aten_cpu_capability": torch.backends.cpu.get_cpu_capability()},
        "blocks": [],
        "notes": [
            "This CPU's oneDNN int8 GEMM saturates (no VNNI), so patches/vllm_cpu_int8_saturation.py gives the "
            "INT8 linears an exact GEMM: `int8` runs the packed AVX2 GEMM (qurl_verl/platform/"
            "cpu_int8_gemm_avx2.cpp, QURL_VERL_CPU_INT8_GEMM=auto), `int8_onednn` oneDNN's split (every INT8 "
            "GEMM as two 7-bit GEMMs, QURL_VERL_CPU_INT8_GEMM=onednn). Both compute the same W8A8 codes "
            "exactly." if saturates else
            "oneDNN int8 does not saturate on this CPU: no INT8 GEMM is changed by the saturation patch.",
            "`int8_gemm` names the GEMM each INT8 engine's linears ran, as the engine reports it "
            "(qurl_verl/rollout/int8_gemm_report.py: amx_sgl, onednn, avx2_packed, onednn_split).",
            "FP8 per-channel has no fast CPU kernel; its figures only show the path works, at short outputs.",
            f"Weights are random, init {args.init!r} (bench/bench_models.py; see bench/results/fidelity_diagnosis.md "
            "for why the init matters for fidelity); speed does not depend on them.",
            "k1 KL is the mean of log p_bf16 - log p_fmt over BF16-sampled tokens: an unbiased but noisy "
            "estimate (it can be negative); greedy-set deltas are a worst-case-leaning view (argmax tokens).",
        ],
    }
    report["int8_gemm"] = {}  # format -> {GEMM: linears}, read from each INT8 engine after its first sync
    out = Path(args.out)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(Path(tmp) / args.model, args.model, args.init)
        trainer = harness.TrainerWeights(model_dir)
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(model_dir)
        report["model"] = {"spec": {k: v for k, v in MODELS[args.model].items()} or "tiny default", "init": args.init,
                           "vocab": cfg.vocab_size, "params": param_count(trainer.master, cfg.tie_word_embeddings)}
        prompts = chat_prompts(model_dir, max(BATCHES))
        report["prompt_tokens"] = [len(p) for p in prompts]
        fid = {"sets": None, "scores": {}}
        plan = []
        for k in range(args.blocks):  # FP8: one short block, in the first round so a time budget cannot drop it
            plan += [f for f in args.formats if f != "fp8" or k == 0]
        for i, fmt in enumerate(plan):
            if time.perf_counter() - start > args.budget_s:
                report["notes"].append(f"stopped at the time budget: blocks {plan[i:]} not run")
                break
            first = fmt not in fid["scores"]
            report["blocks"].append(run_block(model_dir, trainer, fmt, args, prompts, fid, first))
            if "int8_gemms" in report["blocks"][-1]:
                report["int8_gemm"].setdefault(fmt, report["blocks"][-1]["int8_gemms"])
            report["fidelity"] = {f: fidelity(fid["scores"], f) for f in fid["scores"] if f != "bf16"}
            report["summary"] = summarize(report)
            report["elapsed_s"] = time.perf_counter() - start
            out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
            out.with_suffix(".md").write_text(markdown(report))
            print(json.dumps(report["summary"]["ratios"]), flush=True)
    print("written", out.with_suffix(".json"), out.with_suffix(".md"))


if __name__ == "__main__":
    main()
