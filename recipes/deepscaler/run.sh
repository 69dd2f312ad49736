#!/usr/bin/env bash
# DeepScaleR, 8k-context stage: GRPO on DeepSeek-R1-Distill-Qwen-1.5B with a k3 KL loss to the
# reference, validated with Avg@k on AIME 2024, AMC 2022-23, MATH-500, Minerva and OlympiadBench
# (the paper's Table 3 setting). The recipe is the Hydra config `+qurl_recipe=deepscaler`
# (qurl_verl/hydra_configs/qurl_recipe/deepscaler.yaml); this script writes its data and starts
# verl's own `python -m verl.trainer.main_ppo` with it.
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
#   DATA [shipped]   shipped: the repository's data/ (a 1,975-problem training sample);
#                    hub: the full 40k DeepScaleR-Preview set and the same evaluation sets
#   QURL_DATA_DIR [~/data/qurl], QURL_OUTPUT_DIR [outputs], MODEL_PATH, NNODES [1], NGPUS_PER_NODE [8]:
#                    read by the recipe's config (recipes/README.md lists them)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
py="${PYTHON:-$root/.venv/bin/python}"
source "$root/recipes/recipe_args.sh"

run_recipe +qurl_recipe=deepscaler "${preset_args[@]}" "${recipe_args[@]}"
