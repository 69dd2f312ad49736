#!/usr/bin/env bash
# DeepScaleR, 8k-context stage: GRPO on DeepSeek-R1-Distill-Qwen-1.5B with a k3 KL loss to the
# reference, validated with Avg@k on AIME 2024, AMC 2022-23, MATH-500, Minerva and OlympiadBench
# (the paper's Table 3 setting), through verl's own `python -m verl.trainer.main_ppo`.
#
# Hardware: 1 node x 8 GPUs with 80 GB each (A100/H100), as the original DeepScaleR 8k stage.
#
#   recipes/deepscaler/run.sh                         # PRESET=int8: INT8 rollout + ACR + UAQ
#   PRESET=bf16 recipes/deepscaler/run.sh             # the full-precision baseline
#   recipes/deepscaler/run.sh trainer.total_epochs=1  # extra arguments are Hydra overrides
#   recipes/deepscaler/run.sh --dry-run               # compose + validate only: no GPU, no download
#
# Environment (defaults in brackets):
#   PRESET [int8]    bf16 | naive_int8 | tis_int8 | tis_fp8 | int8 | fp8, or none (verl's stock vLLM rollout)
#   MODEL_PATH [deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B]   hub id or local folder
#   DATA [shipped]   shipped: the repository's data/ (a 1,975-problem training sample);
#                    hub: the full 40k DeepScaleR-Preview set and the same evaluation sets
#   DATA_DIR [outputs/data/deepscaler-$DATA]   where train.parquet / val.parquet are written once
#   N [8]            responses per prompt (DeepScaleR's 8; 16 is the common larger group)
#   RESPONSE_LENGTH [8192]   8k stage; DeepScaleR continues at 16384 and 24576 from the checkpoint
#   VAL_N [32]       samples per validation problem (Avg@32 as in the paper; 8 is 4x cheaper)
#   NNODES [1], NGPUS_PER_NODE [8], OUT [outputs/deepscaler/$PRESET] (checkpoints, validation dumps)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
py="${PYTHON:-$root/.venv/bin/python}"

source "$root/recipes/recipe_args.sh"
set -- "${recipe_args[@]}"
model="${MODEL_PATH:-deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B}"
data="${DATA:-shipped}"
data_dir="${DATA_DIR:-$root/outputs/data/deepscaler-$data}"
out="${OUT:-$root/outputs/deepscaler/$preset}"
n="${N:-8}"
prompt_len=2048  # DeepScaleR trained with 1,024; two OlympiadBench problems need more (see README)
response_len="${RESPONSE_LENGTH:-8192}"
val_n="${VAL_N:-32}"
nnodes="${NNODES:-1}"
gpus="${NGPUS_PER_NODE:-8}"

args=(
  "${preset_args[@]}"
  algorithm.adv_estimator=grpo
  algorithm.use_kl_in_reward=false
  data.train_files="$data_dir/train.parquet"
  data.val_files="$data_dir/val.parquet"
  data.train_batch_size=128
  data.max_prompt_length=$prompt_len
  data.max_response_length=$response_len
  data.filter_overlong_prompts=true
  data.truncation=error
  actor_rollout_ref.model.path="$model"
  actor_rollout_ref.model.use_remove_padding=true
  actor_rollout_ref.model.enable_gradient_checkpointing=true
  actor_rollout_ref.actor.optim.lr=1e-6
  actor_rollout_ref.actor.ppo_mini_batch_size=64
  actor_rollout_ref.actor.ppo_epochs=1
  actor_rollout_ref.actor.use_dynamic_bsz=true
  actor_rollout_ref.actor.ppo_max_token_len_per_gpu=32768
  actor_rollout_ref.actor.use_kl_loss=true
  actor_rollout_ref.actor.kl_loss_coef=0.001
  actor_rollout_ref.actor.kl_loss_type=low_var_kl
  actor_rollout_ref.actor.entropy_coeff=0
  actor_rollout_ref.actor.fsdp_config.param_offload=false
  actor_rollout_ref.actor.fsdp_config.optimizer_offload=false
  actor_rollout_ref.ref.fsdp_config.param_offload=true
  actor_rollout_ref.rollout.n=$n
  actor_rollout_ref.rollout.temperature=0.6
  actor_rollout_ref.rollout.tensor_model_parallel_size=1
  actor_rollout_ref.rollout.gpu_memory_utilization=0.85
  actor_rollout_ref.rollout.val_kwargs.n=$val_n
  actor_rollout_ref.rollout.val_kwargs.do_sample=true
  actor_rollout_ref.rollout.val_kwargs.temperature=0.6
  actor_rollout_ref.rollout.val_kwargs.top_p=0.95
  reward.custom_reward_function.path=pkg://qurl_recipes.rewards.boxed_math
  reward.custom_reward_function.name=compute_score
  trainer.n_gpus_per_node=$gpus
  trainer.nnodes=$nnodes
  trainer.val_before_train=true
  trainer.test_freq=20
  trainer.save_freq=20
  trainer.total_epochs=30
  trainer.project_name=qurl_deepscaler
  trainer.experiment_name="r1_distill_1.5b_${response_len}_${preset}"
  trainer.default_local_dir="$out/checkpoints"
  trainer.validation_data_dir="$out/validation"
  "$@"
)

if [[ "$mode" == print ]]; then printf '%s\0' "${args[@]}"; exit 0; fi

if [[ ! -f "$data_dir/train.parquet" || ! -f "$data_dir/val.parquet" ]]; then
  "$py" -m qurl_recipes.data.math_datasets --recipe deepscaler --source "$data" --out "$data_dir"
fi
if [[ "$mode" == dry ]]; then exec "$py" -m qurl_recipes.recipes_check --overrides -- "${args[@]}"; fi
exec "$py" -m verl.trainer.main_ppo "${args[@]}"
