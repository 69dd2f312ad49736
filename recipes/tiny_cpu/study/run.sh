#!/usr/bin/env bash
# The GRPO study of QuRL's mechanisms at W{b}A8 mismatch (`make study`): SFT warm start of the tiny
# model on chain arithmetic, then nine variants x two seeds in the pure-torch harness
# (qurl_recipes.grpo_study; the last two, tis_fp8kv and acr_uaq_fp8kv, roll out through an FP8 KV
# cache), then tables, claim checks and figures in this folder.
#
# Environment: OUT (default outputs/tiny_cpu_study) holds the model and runs; STEPS (default 200)
# GRPO steps per run; WEIGHT_BITS (default 5); LR (default 1e-5); SFT_STEPS (default 900);
# VARIANTS (default: all nine) and SEEDS (default "1 2"); JOBS (default 2) runs that many seeds side
# by side, one thread each; REPORT_ONLY=1 redraws the report from the runs under OUT; REPORT_DIR
# (default: this folder) receives the figures and tables. Arms of the report already in REPORT_DIR
# whose runs are not under OUT are kept (same settings only), so VARIANTS="tis_fp8kv acr_uaq_fp8kv"
# adds those arms to the committed report without rerunning the others.
# LONG_HORIZON=1 (`make study-long`) runs the paper's horizon instead (Fig. 3): defaults OUT
# outputs/tiny_cpu_study_long, STEPS 1000, VARIANTS "bf16 tis acr_no_uaq", and adds its "Long horizon"
# section to the report already in REPORT_DIR, leaving the 200-step part as it is.
# Extra arguments go to `python -m qurl_recipes.grpo_study` (e.g. --n-val 32 --prompts-per-step 8).
# A run that finished with the same settings is kept; change a setting and it reruns. An interrupted
# run resumes from its last checkpoint (OUT/runs/<variant>/seed<k>/checkpoint.pt, every 50 steps;
# --checkpoint-every N to change, 0 for none), with the same results as an uninterrupted one.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../../.." && pwd)"
cd "$root"
py="${PYTHON:-$root/.venv/bin/python}"
long="${LONG_HORIZON:-0}"
[[ "$long" == 0 || "$long" == 1 ]] || { echo "[study] LONG_HORIZON must be 0 or 1, got '$long'" >&2; exit 2; }
if [[ "$long" == 1 ]]; then
  out="${OUT:-$root/outputs/tiny_cpu_study_long}"
  variants="${VARIANTS:-bf16 tis acr_no_uaq}"
  steps="${STEPS:-1000}"
else
  out="${OUT:-$root/outputs/tiny_cpu_study}"
  variants="${VARIANTS:-bf16 naive tis acr_no_uaq acr_uaq acr_per_group_lr acr_per_group_lr_uaq_clip tis_fp8kv acr_uaq_fp8kv}"
  steps="${STEPS:-200}"
fi
seeds="${SEEDS:-1 2}"
jobs="${JOBS:-2}"
sft_steps="${SFT_STEPS:-900}"
settings=(--steps "$steps" --weight-bits "${WEIGHT_BITS:-5}" --lr "${LR:-1e-5}")
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
mkdir -p "$out"

if [[ "${REPORT_ONLY:-0}" != 1 ]]; then
  model="$(bash "$root/recipes/tiny_cpu/study/warm_start.sh" "$py" "$out" "$sft_steps")"
  # seeds side by side, each process with one thread; every process runs all variants of its seeds.
  # If one fails or the script is interrupted, the others are stopped too (finished runs are kept).
  trap 'jobs -p | xargs -r kill 2>/dev/null || true' EXIT
  pids=()
  i=0
  for seed in $seeds; do
    # shellcheck disable=SC2086  # $variants is a list
    "$py" -m qurl_recipes.grpo_study --model "$model" --out "$out/runs" --variants $variants --seeds "$seed" \
      --threads 1 "${settings[@]}" "$@" > "$out/seed$seed.log" 2>&1 &
    pids+=($!)
    i=$((i + 1))
    if (( i % jobs == 0 )); then
      for p in "${pids[@]}"; do wait "$p" || { echo "[study] a run failed; logs: $out/seed*.log" >&2; exit 1; }; done
      pids=()
    fi
  done
  for p in "${pids[@]}"; do wait "$p" || { echo "[study] a run failed; logs: $out/seed*.log" >&2; exit 1; }; done
fi
if [[ "$long" == 1 ]]; then report=(--long-runs "$out/runs"); else report=(--runs "$out/runs"); fi
# shellcheck disable=SC2086
"$py" -m qurl_recipes.study_report "${report[@]}" --variants $variants --out "${REPORT_DIR:-$here}"
