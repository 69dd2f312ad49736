#!/usr/bin/env bash
# DAPO on a Qwen2.5 base model (the paper's Table 2 / Table 4 setting: AIME 2024 Avg@32), through
# verl's own `python -m verl.trainer.main_ppo`: decoupled clip 0.2/0.28 with dual-clip c=10,
# token-mean loss, overlong reward shaping (verl's `dapo` reward manager) and dynamic sampling
# (verl's group filtering on `acc`), no KL.
#
# Hardware (verl's DAPO recipes, GPUs with 80 GB each):
#   SIZE=7b  [default] Qwen2.5-7B,  8k responses:  8 nodes x 8 GPUs (runs on fewer nodes, slower)
#   SIZE=32b           Qwen2.5-32B, 20k responses: 16 nodes x 8 GPUs
#
#   recipes/dapo/run.sh                    # PRESET=int8: INT8 rollout + ACR + UAQ
#   PRESET=fp8 SIZE=32b recipes/dapo/run.sh
#   recipes/dapo/run.sh --dry-run          # compose + validate only: no GPU, no download
#
# Environment (defaults in brackets):
#   PRESET [int8]    bf16 | naive_int8 | tis_int8 | tis_fp8 | int8 | fp8, or none (verl's stock vLLM rollout)
#   SIZE [7b]        7b | 32b
#   MODEL_PATH [Qwen/Qwen2.5-7B | Qwen/Qwen2.5-32B]   hub id or local folder
#   DATA [shipped]   shipped: a 2,000-problem sample of DAPO-Math-17k; hub: all 17,917 problems
#   DATA_DIR [outputs/data/dapo-$DATA]   where train.parquet / val.parquet are written once
#   VAL_N [32]       samples per AIME problem (Avg@32)
#   STEPS [200]      training steps (verl's 7B DAPO run; the paper shows curves to about 1,200)
#   NNODES [8 | 16], NGPUS_PER_NODE [8], OUT [outputs/dapo/$SIZE-$PRESET]
#   UAQ_CACHE_DIR [$OUT/uaq-cache]   where the driver writes the UAQ checkpoint: on several nodes it
#                    must be a folder every node reads (the driver refuses a multi-node run without it)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
py="${PYTHON:-$root/.venv/bin/python}"

source "$root/recipes/recipe_args.sh"
set -- "${recipe_args[@]}"
size="${SIZE:-7b}"
case "$size" in
  7b)  model_default=Qwen/Qwen2.5-7B;  response_len=8192;  sp=4; nnodes_default=8;  train_tokens=2; infer_tokens=3; val_top_p=0.7 ;;
  32b) model_default=Qwen/Qwen2.5-32B; response_len=20480; sp=8; nnodes_default=16; train_tokens=1; infer_tokens=1; val_top_p=1.0 ;;
  *) echo "error: unknown SIZE=$size; choose 7b or 32b" >&2; exit 2 ;;
esac
model="${MODEL_PATH:-$model_default}"
data="${DATA:-shipped}"
data_dir="${DATA_DIR:-$root/outputs/data/dapo-$data}"
out="${OUT:-$root/outputs/dapo/$size-$preset}"
prompt_len=2048
overlong_len=4096
max_len=$((prompt_len + response_len))
val_n="${VAL_N:-32}"
nnodes="${NNODES:-$nnodes_default}"
gpus="${NGPUS_PER_NODE:-8}"
uaq_args=()
if [[ "$preset" != none ]]; then uaq_args=("++qurl.uaq.cache_dir=${UAQ_CACHE_DIR:-$out/uaq-cache}"); fi

args=(
  "${preset_args[@]}"
  "${uaq_args[@]}"
  algorithm.adv_estimator=grpo
  algorithm.use_kl_in_reward=false
  algorithm.filter_groups.enable=true
  algorithm.filter_groups.metric=acc
  data.train_files="$data_dir/train.parquet"
  data.val_files="$data_dir/val.parquet"
  data.train_batch_size=512
  data.max_prompt_length=$prompt_len
  data.max_response_length=$response_len
  data.truncation=left
  actor_rollout_ref.model.path="$model"
  actor_rollout_ref.model.use_remove_padding=true
  actor_rollout_ref.model.enable_gradient_checkpointing=true
  actor_rollout_ref.actor.optim.lr=1e-6
  actor_rollout_ref.actor.optim.lr_warmup_steps=10
  actor_rollout_ref.actor.optim.weight_decay=0.1
  actor_rollout_ref.actor.ppo_mini_batch_size=32
  actor_rollout_ref.actor.use_kl_loss=false
  actor_rollout_ref.actor.kl_loss_coef=0.0
  actor_rollout_ref.actor.clip_ratio_low=0.2
  actor_rollout_ref.actor.clip_ratio_high=0.28
  actor_rollout_ref.actor.clip_ratio_c=10.0
  actor_rollout_ref.actor.loss_agg_mode=token-mean
  actor_rollout_ref.actor.entropy_coeff=0
  actor_rollout_ref.actor.grad_clip=1.0
  actor_rollout_ref.actor.use_dynamic_bsz=true
  actor_rollout_ref.actor.ppo_max_token_len_per_gpu=$((max_len * train_tokens))
  actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=$((max_len * infer_tokens))
  actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=$((max_len * infer_tokens))
  actor_rollout_ref.actor.ulysses_sequence_parallel_size=$sp
  actor_rollout_ref.actor.fsdp_config.param_offload=true
  actor_rollout_ref.actor.fsdp_config.optimizer_offload=true
  actor_rollout_ref.actor.fsdp_config.fsdp_size=-1
  actor_rollout_ref.ref.fsdp_config.param_offload=true
  actor_rollout_ref.rollout.n=16
  actor_rollout_ref.rollout.temperature=1.0
  actor_rollout_ref.rollout.top_p=1.0
  actor_rollout_ref.rollout.top_k=-1
  actor_rollout_ref.rollout.tensor_model_parallel_size=4
  actor_rollout_ref.rollout.gpu_memory_utilization=0.80
  actor_rollout_ref.rollout.enable_chunked_prefill=true
  actor_rollout_ref.rollout.max_num_batched_tokens=$max_len
  actor_rollout_ref.rollout.val_kwargs.n=$val_n
  actor_rollout_ref.rollout.val_kwargs.do_sample=true
  actor_rollout_ref.rollout.val_kwargs.temperature=1.0
  actor_rollout_ref.rollout.val_kwargs.top_p=$val_top_p
  actor_rollout_ref.rollout.val_kwargs.top_k=-1
  reward.reward_manager.name=dapo
  +reward.reward_kwargs.overlong_buffer_cfg.enable=true
  +reward.reward_kwargs.overlong_buffer_cfg.len=$overlong_len
  +reward.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0
  +reward.reward_kwargs.overlong_buffer_cfg.log=false
  +reward.reward_kwargs.max_resp_len=$response_len
  trainer.n_gpus_per_node=$gpus
  trainer.nnodes=$nnodes
  trainer.val_before_train=true
  trainer.test_freq=10
  trainer.save_freq=10
  trainer.total_epochs=1000
  trainer.total_training_steps="${STEPS:-200}"
  trainer.project_name=qurl_dapo
  trainer.experiment_name="qwen2.5_${size}_${preset}"
  trainer.default_local_dir="$out/checkpoints"
  trainer.validation_data_dir="$out/validation"
  "$@"
)

if [[ "$mode" == print ]]; then printf '%s\0' "${args[@]}"; exit 0; fi

if [[ ! -f "$data_dir/train.parquet" || ! -f "$data_dir/val.parquet" ]]; then
  "$py" -m qurl_recipes.data.math_datasets --recipe dapo --source "$data" --out "$data_dir"
fi
if [[ "$mode" == dry ]]; then exec "$py" -m qurl_recipes.recipes_check --overrides -- "${args[@]}"; fi
exec "$py" -m verl.trainer.main_ppo "${args[@]}"
