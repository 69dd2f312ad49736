#!/usr/bin/env bash
# Small-scale reproduction of QuRL's mechanisms on CPU (`make report`): SFT warm start of the tiny
# model on arithmetic, then the same GRPO budget under five rollout/loss variants through
# `python -m verl.trainer.main_ppo`, then plots and a table in this folder.
#
# Environment: OUT (default outputs/tiny_cpu_report) holds the model, data and per-variant runs;
# STEPS (default 30) GRPO steps per variant; VARIANTS (default: all five, space-separated) picks a
# subset; LR (default 1e-4), PROMPTS (default 16 per step, 8 samples each) and N_TRAIN (default 64
# distinct training questions) set the GRPO budget;
# REPORT_ONLY=1 skips training and redraws the report from the runs already under OUT; REPORT_DIR
# (default: this folder) receives the figures and tables.
# A variant whose metrics already hold STEPS steps is not rerun (delete its folder to rerun it).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../../.." && pwd)"
cd "$root"
py="${PYTHON:-$root/.venv/bin/python}"
out="${OUT:-$root/outputs/tiny_cpu_report}"
steps="${STEPS:-30}"
lr="${LR:-1e-4}"
prompts="${PROMPTS:-16}"
n_train="${N_TRAIN:-64}"
variants="${VARIANTS:-bf16 naive_int8 tis_int8 int8_no_uaq int8}"
mkdir -p "$out/runs"

# name -> preset and the overrides that make the variant
variant_args() {
  case "$1" in
    bf16) echo "bf16" ;;
    naive_int8) echo "naive_int8" ;;
    tis_int8) echo "tis_int8" ;;
    int8_no_uaq) echo "int8 qurl.uaq.enable=false" ;;
    int8) echo "int8" ;;
    *) echo "unknown variant '$1' (known: bf16 naive_int8 tis_int8 int8_no_uaq int8)" >&2; return 1 ;;
  esac
}
for v in $variants; do variant_args "$v" >/dev/null; done  # fail before any work on a typo

if [[ "${REPORT_ONLY:-0}" != 1 ]]; then
  # 1. the warm-started model (cached: rebuilt only when missing)
  if [[ ! -f "$out/sft_model/qurl_tiny_sft.json" ]]; then
    "$py" -m qurl_recipes.tiny_model --out "$out/base_model" >/dev/null
    "$py" -m qurl_recipes.tiny_sft --base "$out/base_model" --out "$out/sft_model"
  fi
  # 2. RL prompts: the SFT's distribution (+/-, operands 0..20), seeds of the data module. A small
  #    question set is revisited every few steps, so GRPO's gains show within a CPU budget.
  data="$out/data_n$n_train"
  [[ -f "$data/train.parquet" ]] || \
    "$py" -m qurl_recipes.data.arithmetic --out "$data" --ops "+-" --max-operand 20 --n-train "$n_train" --n-val 128
  # 3. one GRPO run per variant, same budget and seeds
  for v in $variants; do
    run="$out/runs/$v"
    if [[ -f "$run/metrics.jsonl" ]] && [[ "$(wc -l < "$run/metrics.jsonl")" -ge "$steps" ]]; then
      echo "[report] $v: $steps steps already logged in $run, kept"; continue
    fi
    read -r preset extra <<<"$(variant_args "$v")"
    echo "[report] $v: +qurl=$preset $extra, $steps steps -> $run"
    mkdir -p "$run"
    # shellcheck disable=SC2086  # $extra is a list of Hydra overrides
    OUT="$run" MODEL_DIR="$out/sft_model" DATA_DIR="$data" STEPS="$steps" PRESET="$preset" \
      bash "$root/recipes/tiny_cpu/run.sh" $extra \
        data.train_batch_size="$prompts" \
        data.max_response_length=8 \
        actor_rollout_ref.rollout.n=8 \
        actor_rollout_ref.actor.ppo_mini_batch_size=$(( prompts / 2 )) \
        actor_rollout_ref.actor.optim.lr="$lr" \
        reward.custom_reward_function.name=compute_exact_score \
        trainer.val_before_train=true \
        trainer.test_freq=10 \
        trainer.experiment_name="report_$v" \
        > "$run/train.log" 2>&1 || { echo "[report] $v failed; its log: $run/train.log" >&2; tail -20 "$run/train.log" >&2; exit 1; }
    tail -6 "$run/train.log"
  done
fi
# 4. plots + table
# shellcheck disable=SC2086  # $variants is a list
"$py" -m qurl_recipes.repro_report --runs "$out/runs" --variants $variants --sft "$out/sft_model/qurl_tiny_sft.json" \
  --out "${REPORT_DIR:-$here}"
