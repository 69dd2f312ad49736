#!/usr/bin/env bash
# Every benchmark of bench/, one after the other, with the arguments the committed results were
# produced with; each writes its bench/results/*.json (+ .md). Then the plot.
# Run alone on the machine: they measure side by side within one run, not against other jobs.
# About 1.5 h on an idle 2-core CPU: the fidelity diagnoses and the rollout throughput run take most of it.
set -euo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-.venv/bin/python}"
run() { echo "=== $*"; "$py" "$@"; }
run bench/bench_decode_roofline.py  # arithmetic only: seconds
run bench/bench_quantize.py
run bench/bench_acr_loss.py
run bench/bench_quantize_side.py
"${PYTHON_VLLM024:-.venv-vllm024/bin/python}" bench/bench_e8m0_drift.py  # on vLLM 0.24 (GPU users' vLLM): seconds
run bench/diagnose_fidelity.py
run bench/diagnose_fidelity.py --inits gain4 fanin --engine-inits gain4 fanin --engine-dtypes float32 \
  --out bench/results/fidelity_diagnosis_fp32
run bench/diagnose_fidelity.py --inits gain4 fanin --engine-inits --out bench/results/fidelity_jitter
run bench/bench_step_overheads.py --reps 2 --no-bf16-sync
run bench/bench_sync_scaling.py
run bench/bench_lora_sync.py  # LoRA adapter vs full-weight sync (Qwen2.5-0.5B shape), KL beside full fine-tuning: ~8 min
run bench/bench_delta_sync.py  # what changes per 8-bit sync at lr 1e-6, offline (0.5B / 7B shapes): ~3 min
run bench/bench_delta_sync_engine.py  # the delta mode through the engine beside the full syncs, 20 syncs: ~12 min
run bench/bench_kv_cache_capacity.py  # KV-cache capacity and long-context throughput, BF16 vs FP8 KV: ~10 min
run bench/bench_rollout_throughput.py --formats bf16 int8 --blocks 3 --reps 1 --max-tokens 64 --batches 1 8 32 --budget-s 1500
# the same with oneDNN and torch capped at AVX2 (how a CPU without VNNI runs INT8; a no-op on an AVX2 CPU, where the
# run above already is that class): INT8 on the packed AVX2 GEMM and on oneDNN's split, side by side
ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 run bench/bench_rollout_throughput.py --formats bf16 int8 int8_onednn \
  --blocks 3 --reps 1 --max-tokens 64 --batches 1 8 32 --budget-s 1800
# where the time of an INT8 linear goes at batch 1 per CPU class, and the engine's profile
run bench/profile_int8_batch1.py --threads 1 --engine
run bench/plot_results.py
run bench/summarize.py
