#!/usr/bin/env bash
# GRPO on the embedded tiny model and the synthetic arithmetic task, on CPU, through verl's own
# `python -m verl.trainer.main_ppo`. Extra arguments are passed to main_ppo as Hydra overrides,
# e.g. `recipes/tiny_cpu/run.sh trainer.total_training_steps=5`.
#
# Environment: OUT (default outputs/tiny_cpu) holds the model, data and metrics; STEPS (default 3);
# PRESET (default int8: INT8 rollout + ACR + UAQ) picks `+qurl=<preset>` (bf16, naive_int8,
# tis_int8, tis_fp8, int8, fp8); PRESET=none runs verl's stock vLLM rollout with no preset;
# MODEL_DIR / DATA_DIR (default: built under OUT) point at another model or train/val parquet pair;
# TASK (default arithmetic) picks the task: arithmetic (one operation, 16-token responses) or
# chain_arithmetic (multi-step, solutions written out, 64-token responses, exact final-answer reward);
# the default DATA_DIR of a non-default task is OUT/data_<TASK>, so the tasks never share files.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
py="${PYTHON:-$root/.venv/bin/python}"
out="${OUT:-$root/outputs/tiny_cpu}"
steps="${STEPS:-3}"
preset="${PRESET:-int8}"
task="${TASK:-arithmetic}"
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
"$py" -m verl.trainer.main_ppo \
  "${preset_arg[@]}" \
  algorithm.adv_estimator=grpo \
  data.train_files="$data/train.parquet" \
  data.val_files="$data/val.parquet" \
  data.train_batch_size=4 \
  data.max_prompt_length=64 \
  data.max_response_length="$max_response_length" \
  data.dataloader_num_workers=0 \
  actor_rollout_ref.model.path="$model" \
  actor_rollout_ref.model.use_remove_padding=false \
  +actor_rollout_ref.model.override_config.attn_implementation=sdpa \
  actor_rollout_ref.actor.strategy=fsdp2 \
  actor_rollout_ref.ref.strategy=fsdp2 \
  actor_rollout_ref.actor.optim.lr=1e-3 \
  actor_rollout_ref.actor.ppo_mini_batch_size=4 \
  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8 \
  actor_rollout_ref.actor.use_kl_loss=false \
  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8 \
  actor_rollout_ref.rollout.n=4 \
  actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
  +actor_rollout_ref.rollout.enable_sleep_mode=false \
  actor_rollout_ref.rollout.enforce_eager=true \
  actor_rollout_ref.rollout.max_num_batched_tokens=1024 \
  actor_rollout_ref.rollout.agent.num_workers=1 \
  algorithm.use_kl_in_reward=false \
  reward.num_workers=1 \
  reward.custom_reward_function.path="pkg://qurl_recipes.rewards.$task" \
  reward.custom_reward_function.name=compute_score \
  transfer_queue.backend.SimpleStorage.num_data_storage_units=1 \
  ray_kwargs.ray_init.num_cpus=16 \
  +ray_kwargs.ray_init.num_gpus=1 \
  +ray_kwargs.ray_init.include_dashboard=false \
  trainer.device=cpu \
  trainer.n_gpus_per_node=1 \
  trainer.nnodes=1 \
  trainer.val_before_train=false \
  trainer.test_freq=-1 \
  trainer.save_freq=-1 \
  trainer.total_training_steps="$steps" \
  trainer.logger='[console,file]' \
  trainer.project_name=qurl_tiny_cpu \
  trainer.experiment_name=demo \
  "$@"
"$py" -m qurl_recipes.run_summary "$metrics" --wall-s $(( $(date +%s) - start ))
