#!/usr/bin/env bash
# DeepScaleR, 8k-context stage: GRPO on DeepSeek-R1-Distill-Qwen-1.5B with a k3 KL loss to the
# reference (the paper's Table 3 setting). Training validates on AIME 2024 at 8 samples per problem
# every 20 steps; VAL_ONLY=1 runs the paper's metric on a trained actor: Avg@32 on AIME 2024, AMC
# 2022-23, MATH-500, Minerva and OlympiadBench, no training. The recipe is the Hydra config `+qurl_recipe=deepscaler`
# (qurl_verl/hydra_configs/qurl_recipe/deepscaler.yaml); this script writes its data and starts
# verl's own `python -m verl.trainer.main_ppo` with it.
#
# Hardware: 1 node x 8 GPUs with 80 GB each (A100/H100), as the original DeepScaleR 8k stage.
#
#   recipes/deepscaler/run.sh                         # PRESET=int8: INT8 rollout + ACR + UAQ
#   PRESET=bf16 recipes/deepscaler/run.sh             # the full-precision baseline
#   recipes/deepscaler/run.sh trainer.total_epochs=1  # extra arguments are Hydra overrides
#   recipes/deepscaler/run.sh --dry-run               # compose + validate only: no GPU, no download
#   VAL_ONLY=1 recipes/deepscaler/run.sh actor_rollout_ref.model.path=<exported actor>   # final Avg@32
#
# Environment (defaults in brackets):
#   PRESET [int8]    bf16 | naive_int8 | tis_int8 | tis_fp8 | int8 | fp8, or none (verl's stock vLLM rollout)
#   DATA [hub; shipped for --dry-run]   hub: the full 40k DeepScaleR-Preview set and the evaluation
#                    sets (needs the hub or its cache); shipped: the repository's data/ (a 1,975-problem
#                    training sample, the complete evaluation sets), written to $QURL_DATA_DIR/shipped
#                    when QURL_DATA_DIR is unset
#   VAL_ONLY [0]     1: evaluate only (trainer.val_only): all five benchmarks, 32 samples each; PRESET
#                    defaults to bf16 then (the trained actor in full precision)
#   PYTHON [python]  the environment with verl, CUDA vLLM and qurl-verl installed
#   QURL_DATA_DIR [~/data/qurl], QURL_OUTPUT_DIR [outputs], MODEL_PATH, NNODES [1], NGPUS_PER_NODE [8]:
#                    read by the recipe's config (recipes/README.md lists them)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
py="${PYTHON:-python}"  # the GPU environment's python (the repository's .venv is the CPU demo stack)
val_only=()
if [[ "${VAL_ONLY:-0}" == 1 ]]; then
  export PRESET="${PRESET:-bf16}"
  # the single quotes keep the interpolation for Hydra: the recipe's own data folder, whatever QURL_DATA_DIR
  val_only=(trainer.val_only=true trainer.val_before_train=true 'data.val_files=${qurl_recipe.final_val_files}'
            actor_rollout_ref.rollout.val_kwargs.n=32)
fi
hub_data=1
source "$root/recipes/recipe_args.sh"

run_recipe +qurl_recipe=deepscaler "${preset_args[@]}" "${val_only[@]}" "${recipe_args[@]}"
