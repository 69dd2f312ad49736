"""Bytes one decode step reads from accelerator memory, per recipe: a memory-bound roofline of rollout.

Why: a decode step of a large batch reads every weight once and the KV cache of every running
sequence. Quantizing only the linear weights (W8A8, what QuRL does) shrinks the first term; the KV
term, which grows with batch and context, stays in BF16 unless the KV cache is quantized as well
(FP8 KV). Counting both terms for the shapes and batch sizes of this project's recipes tells how
much of the rollout speed-up 8-bit weights can buy at all, and where an FP8 KV cache matters more.

Three rollout set-ups: ``bf16`` (weights and KV cache bf16), ``w8a8`` (every linear layer of the
decoder 1 byte per weight plus one fp32 scale per output channel; embeddings, lm_head, norms and
biases bf16, as the project keeps them), ``w8a8_fp8kv`` (the same with a 1-byte KV cache).

Model: step time = bytes read per GPU / memory bandwidth (H100 SXM, H200), with tensor parallelism
splitting weights and KV heads over the ranks of one engine. It ignores compute (GEMMs and attention
arithmetic, which INT8/FP8 tensor cores also speed up), attention-kernel efficiency, activations,
sampling and the logits, the prefill, weight sync and CPU overheads. Speed-ups are therefore the
same on both cards; the cards differ in memory capacity, which caps how many sequences fit in the KV
cache at once, so a second, capacity-bound view counts resident sequences and tokens/s.

    .venv/bin/python bench/bench_decode_roofline.py [--contexts 1024 3072 8192 16384] [--fixed-seqs 32]

Writes ``bench/results/decode_roofline.{json,md}``; the .md is rendered from the .json.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

import bench_harness
from roofline_markdown import markdown
from roofline_published import PUBLISHED, issue_sanity_check, published_comparison
from roofline_recipes import RECIPE_DIR, VERL_DEFAULTS, recipe_inputs, recipe_roofline
from roofline_shapes import ACCELERATORS, OTHER_WEIGHT_BYTES, SETUPS

DEFAULT_OUT = bench_harness.RESULTS / "decode_roofline"

MODEL_TEXT = ("Roofline: a decode step's time is the bytes one GPU reads divided by its memory bandwidth: every "
              "decoder weight and the lm_head once, the embedding rows of the tokens it embeds, and the KV cache of "
              "every running sequence at its mean context; tensor parallelism splits weights and KV heads over "
              "the ranks of an engine (KV heads replicated where fewer than ranks). Ignored: compute, attention-"
              "kernel efficiency, activations, sampling and logits, the prefill, weight sync and CPU overheads. "
              "FP8 linear weights read as many bytes as INT8 (one per weight; their scales are negligible), so the "
              "W8A8 set-up stands for either. "
              "Concurrency 'all sequences of a step at once' is an upper bound; the capacity-bound tables cap it by "
              "max_num_seqs and by the KV cache that fits in the memory vLLM may use after the weights.")


def build_report(recipe_paths: list[Path], fixed_contexts: list[int], fixed_seqs: int) -> dict:
    recipes = []
    for p in recipe_paths:
        recipes.append(recipe_roofline(recipe_inputs(p), fixed_contexts, fixed_seqs))
    return {
        "what": "bytes a decode step reads per GPU and the memory-bound step time, per recipe and rollout set-up",
        "model_text": MODEL_TEXT,
        "setups": [asdict(s) for s in SETUPS],
        "other_weight_bytes": OTHER_WEIGHT_BYTES,
        "accelerators": [asdict(a) for a in ACCELERATORS],
        "fixed_contexts": fixed_contexts,
        "fixed_seqs_per_engine": fixed_seqs,
        "verl_defaults": VERL_DEFAULTS,
        "issue_sanity_check": issue_sanity_check(),
        "recipes": recipes,
        "published": [published_comparison(ref, fixed_contexts, fixed_seqs) for ref in PUBLISHED],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--recipes", nargs="*", default=None,
                    help="recipe names in qurl_verl/hydra_configs/qurl_recipe (default: every one not starting with _)")
    ap.add_argument("--contexts", nargs="*", type=int, default=[1024, 3072, 8192, 16384],
                    help="fixed mean contexts (tokens) besides each recipe's own mean")
    ap.add_argument("--fixed-seqs", type=int, default=32, help="the smaller concurrency, sequences per engine")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output path without suffix (.json and .md)")
    args = ap.parse_args()
    names = args.recipes or sorted(p.stem for p in RECIPE_DIR.glob("*.yaml") if not p.stem.startswith("_"))
    report = build_report([RECIPE_DIR / f"{n}.yaml" for n in names], args.contexts, args.fixed_seqs)
    # the .md from the JSON as written, so that it shows exactly what the file holds
    bench_harness.write_result(args.out, report, markdown(json.loads(json.dumps(report))) + "\n")
    print(f"wrote {args.out.with_suffix('.json')} and .md")


if __name__ == "__main__":
    main()
