#!/usr/bin/env bash
# DAPO on a Qwen2.5 base model (the paper's Table 2 / Table 4 setting: AIME 2024 Avg@32). The
# recipe is the Hydra config `+qurl_recipe=dapo` (7B), `dapo_1node` or `+qurl_recipe=dapo_32b`
# (qurl_verl/hydra_configs/qurl_recipe/); this script writes its data and starts verl's own
# `python -m verl.trainer.main_ppo` with it.
#
# Hardware (verl's DAPO recipes, GPUs with 80 GB each):
#   SIZE=7b  [default] Qwen2.5-Math-7B, 8k responses: 8 nodes x 8 GPUs (verl's test_dapo_7b_math.sh)
#   SIZE=7b_1node      the same on 1 node x 8 GPUs: 128 prompts x 800 steps instead of 512 x 200
#   SIZE=32b           Qwen2.5-32B, 20k responses: 16 nodes x 8 GPUs
#
#   recipes/dapo/run.sh                    # PRESET=int8: INT8 rollout + ACR + UAQ
#   PRESET=fp8 SIZE=32b recipes/dapo/run.sh
#   recipes/dapo/run.sh --dry-run          # compose + validate only: no GPU, no download
#
# Environment (defaults in brackets):
#   PRESET [int8]    bf16 | naive_int8 | tis_int8 | tis_fp8 | int8 | fp8, or none (verl's stock vLLM rollout)
#   SIZE [7b]        7b | 7b_1node | 32b
#   DATA [hub; shipped for --dry-run]   hub: all 17,917 problems of DAPO-Math-17k (needs the hub or its
#                    cache); shipped: the repository's 2,000-problem sample, written to
#                    $QURL_DATA_DIR/shipped when QURL_DATA_DIR is unset (a start and a check)
#   PYTHON [python]  the environment with verl, CUDA vLLM and qurl-verl installed
#   UAQ_CACHE_DIR [$QURL_OUTPUT_DIR/uaq-cache]   where the driver writes the UAQ checkpoint: on several
#                    nodes it must be a folder every node reads (the driver refuses a multi-node run without it)
#   QURL_DATA_DIR [~/data/qurl], QURL_OUTPUT_DIR [outputs], MODEL_PATH, NNODES [8 | 16], NGPUS_PER_NODE [8]:
#                    read by the recipe's config (recipes/README.md lists them)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
py="${PYTHON:-python}"  # the GPU environment's python (the repository's .venv is the CPU demo stack)
hub_data=1
source "$root/recipes/recipe_args.sh"

case "${SIZE:-7b}" in
  7b) recipe=dapo ;;
  7b_1node) recipe=dapo_1node ;;
  32b) recipe=dapo_32b ;;
  *) echo "error: unknown SIZE=$SIZE; choose 7b, 7b_1node or 32b" >&2; exit 2 ;;
esac
# qurl.uaq.* belongs to the preset: given here, on the command line, it holds in any order
uaq_args=()
if [[ "$preset" != none ]]; then uaq_args=("++qurl.uaq.cache_dir=${UAQ_CACHE_DIR:-${QURL_OUTPUT_DIR:-$root/outputs}/uaq-cache}"); fi

run_recipe "+qurl_recipe=$recipe" "${preset_args[@]}" "${uaq_args[@]}" "${recipe_args[@]}"
