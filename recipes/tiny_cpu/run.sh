#!/usr/bin/env bash
# GRPO on the embedded tiny model and the synthetic arithmetic task, on CPU, through verl's own
# `python -m verl.trainer.main_ppo +qurl_recipe=tiny_cpu`. Extra arguments are passed to main_ppo
# as Hydra overrides, e.g. `recipes/tiny_cpu/run.sh trainer.total_training_steps=5`.
#
# Environment: OUT (default outputs/tiny_cpu) holds the model, data and metrics; STEPS (default 3);
# PRESET (default int8: INT8 rollout + ACR + UAQ) picks `+qurl=<preset>` (bf16, naive_int8,
# tis_int8, tis_fp8, int8, fp8); PRESET=none runs verl's stock vLLM rollout with no preset;
# MODEL_DIR / DATA_DIR (default: built under OUT) point at another model or train/val parquet pair;
# TASK (default arithmetic) picks the task: arithmetic (one operation, 16-token responses) or
# chain_arithmetic (multi-step, solutions written out, 64-token responses, exact final-answer reward);
# the default DATA_DIR of a non-default task is OUT/data_<TASK>, so the tasks never share files;
# MAIN_MODULE (default verl.trainer.main_ppo) picks verl's entry point, e.g.
# verl.experimental.one_step_off_policy.main_ppo or verl.experimental.fully_async_policy.fully_async_main.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
py="${PYTHON:-$root/.venv/bin/python}"
out="${OUT:-$root/outputs/tiny_cpu}"
steps="${STEPS:-3}"
preset="${PRESET:-int8}"
task="${TASK:-arithmetic}"
main_module="${MAIN_MODULE:-verl.trainer.main_ppo}"
case "$task" in
  arithmetic) data_dir_default="$out/data"; max_response_length=16 ;;
  chain_arithmetic) data_dir_default="$out/data_$task"; max_response_length=64 ;;
  *) echo "unknown TASK=$task (arithmetic, chain_arithmetic)" >&2; exit 2 ;;
esac
preset_arg=()
if [[ "$preset" == none ]]; then preset_arg=("actor_rollout_ref.rollout.name=vllm"); else preset_arg=("+qurl=$preset"); fi
mkdir -p "$out"

model="${MODEL_DIR:-$out/model}"
data="${DATA_DIR:-$data_dir_default}"
[[ -f "$model/config.json" ]] || "$py" -m qurl_recipes.tiny_model --out "$model" >/dev/null
[[ -f "$data/train.parquet" ]] || "$py" -m "qurl_recipes.data.$task" --out "$data" >/dev/null

metrics="$out/metrics.jsonl"
rm -f "$metrics"
export VERL_PLATFORM=cpu
export VERL_FILE_LOGGER_PATH="$metrics"
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
export TOKENIZERS_PARALLELISM=false
export HF_HUB_OFFLINE=1
export QURL_CACHE_DIR="${QURL_CACHE_DIR:-$out/cache}"
export RAY_DEDUP_LOGS=0
# Ray's own dashboard/metrics agents are of no use here and cost memory on a small box.
export RAY_ENABLE_UV_RUN_RUNTIME_ENV=0

start=$(date +%s)
# The recipe is the Hydra config `+qurl_recipe=tiny_cpu` (qurl_verl/hydra_configs/qurl_recipe/
# tiny_cpu.yaml); what changes from run to run (model, data, task, steps) is given here.
"$py" -m "$main_module" \
  +qurl_recipe=tiny_cpu \
  "${preset_arg[@]}" \
  data.train_files="$data/train.parquet" \
  data.val_files="$data/val.parquet" \
  data.max_response_length="$max_response_length" \
  actor_rollout_ref.model.path="$model" \
  reward.custom_reward_function.path="pkg://qurl_verl.recipe_rewards.$task" \
  trainer.total_training_steps="$steps" \
  "$@"
"$py" -m qurl_recipes.run_summary "$metrics" --wall-s $(( $(date +%s) - start ))
