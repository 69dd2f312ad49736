#!/usr/bin/env bash
# The studies' SFT warm start (`make study`, `make study-async`): the tiny model trained on chain arithmetic,
# built once under an output folder and kept. Usage: warm_start.sh PYTHON OUT SFT_STEPS; prints the model's
# folder on stdout (progress goes to stderr).
set -euo pipefail
py="$1" out="$2" sft_steps="$3"
model="$out/sft_chain_$sft_steps"
if [[ ! -f "$model/qurl_tiny_sft.json" ]]; then
  [[ -f "$out/base_model/config.json" ]] || "$py" -m qurl_recipes.tiny_model --out "$out/base_model" >/dev/null
  "$py" -m qurl_recipes.tiny_sft --base "$out/base_model" --out "$model" --task chain_arithmetic --steps "$sft_steps" >&2
fi
echo "$model"
