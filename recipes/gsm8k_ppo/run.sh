#!/usr/bin/env bash
# GSM8K with PPO and a critic (GAE) on Qwen2.5-0.5B-Instruct, greedy test accuracy: the paper's
# Table 1 setting. The recipe is the Hydra config `+qurl_recipe=gsm8k_ppo`
# (qurl_verl/hydra_configs/qurl_recipe/gsm8k_ppo.yaml); this script writes its data (the complete
# GSM8K train and test sets shipped in data/gsm8k/) and starts verl's own
# `python -m verl.trainer.main_ppo` with it, UAQ off as in the paper.
#
# Hardware: 1 GPU with 24 GB or more (verl's PPO GSM8K quickstart).
#
#   recipes/gsm8k_ppo/run.sh                  # PRESET=int8: INT8 rollout + ACR, no UAQ
#   PRESET=bf16 recipes/gsm8k_ppo/run.sh      # the full-precision baseline
#   recipes/gsm8k_ppo/run.sh --dry-run        # compose + validate only: no GPU, no download
#
# Environment (defaults in brackets):
#   PRESET [int8]    bf16 | naive_int8 | tis_int8 | tis_fp8 | int8 | fp8, or none (verl's stock vLLM rollout)
#   QURL_DATA_DIR [~/data/qurl], QURL_OUTPUT_DIR [outputs], MODEL_PATH, NNODES [1], NGPUS_PER_NODE [1]:
#                    read by the recipe's config (recipes/README.md lists them)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
py="${PYTHON:-python}"  # the GPU environment's python (the repository's .venv is the CPU demo stack)
source "$root/recipes/recipe_args.sh"

# The paper trains this setting without UAQ. qurl.uaq.* belongs to the preset, so it is turned off
# here, on the command line, where it holds whichever order the two groups come in.
uaq_off=()
if [[ "$preset" != none ]]; then uaq_off=(qurl.uaq.enable=false); fi

run_recipe +qurl_recipe=gsm8k_ppo "${preset_args[@]}" "${uaq_off[@]}" "${recipe_args[@]}"
