#!/usr/bin/env bash
# Staleness x quantization (`make study-async`): the GRPO study's SFT warm start of the tiny model, then the
# grid of qurl_recipes.study_async (rollout BF16 / W5A8 x staleness x TIS / ACR x learning rate), one process
# per seed side by side, then tables, verdicts and figures in this folder (qurl_recipes.study_async_report).
#
# Environment: OUT (default outputs/tiny_cpu_study_async) holds the model and runs; STEPS (default 80) GRPO
# steps per run; SEEDS (default "1 2") run the whole grid, then MORE_SEEDS (default "3 4"; empty for none) the
# arms at the learning rates MORE_SEEDS_LRS (default 4e-5), where the verdicts are closest; SFT_STEPS (default
# 900, the study's warm start); REPORT_ONLY=1 redraws the report from the runs under OUT; REPORT_DIR (default:
# this folder) receives it. Extra arguments go to
# `python -m qurl_recipes.study_async` (e.g. --lrs 1e-5 --staleness-grid 0 1 --also, or any study setting).
# Finished runs are kept and interrupted ones resume, so a second call only redraws.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../../.." && pwd)"
cd "$root"
py="${PYTHON:-$root/.venv/bin/python}"
out="${OUT:-$root/outputs/tiny_cpu_study_async}"
steps="${STEPS:-80}"
seeds="${SEEDS:-1 2}"
more_seeds="${MORE_SEEDS-3 4}"
sft_steps="${SFT_STEPS:-900}"
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
mkdir -p "$out"

if [[ "${REPORT_ONLY:-0}" != 1 ]]; then
  model="$(bash "$root/recipes/tiny_cpu/study/warm_start.sh" "$py" "$out" "$sft_steps")"
  # one process per seed, one thread each; if one fails or the script is interrupted, the others stop too
  trap 'jobs -p | xargs -r kill 2>/dev/null || true' EXIT
  run_seeds() {  # seeds, then arguments of qurl_recipes.study_async
    local pids=() seed
    local seeds="$1"
    shift
    for seed in $seeds; do
      "$py" -m qurl_recipes.study_async --model "$model" --out "$out/runs" --seed "$seed" --steps "$steps" --threads 1 \
        "$@" >> "$out/seed$seed.log" 2>&1 &
      pids+=($!)
    done
    for p in "${pids[@]}"; do wait "$p" || { echo "[study-async] a run failed; logs: $out/seed*.log" >&2; exit 1; }; done
  }
  run_seeds "$seeds" "$@"
  # more seeds where the verdicts are closest: the higher learning rate's arms
  [[ -z "$more_seeds" ]] || run_seeds "$more_seeds" "$@" --lrs ${MORE_SEEDS_LRS:-4e-5}
fi
"$py" -m qurl_recipes.study_async_report --runs "$out/runs" --out "${REPORT_DIR:-$here}"
