#!/usr/bin/env bash
# The staleness x quantization study confirmed with verl itself: the tiny CPU recipe (recipes/tiny_cpu/run.sh,
# `main_ppo +qurl_recipe=tiny_cpu`) under verl's asynchronous colocated trainer
# (`trainer.v1.trainer_mode=colocate_async`: a second batch in flight, so a step trains on rollouts of staleness
# 0 or 1, as verl's `training/off_policy/trajectory_staleness/*` reports), for each preset and seed, one run at a
# time, then the summary (qurl_recipes/study_async_verl.py) into verl_colocate_async.md / .json here. About
# 110 s a run on a 2-core AVX-512 VNNI CPU beside other work; the whole of it about 7.5 minutes.
#
# Environment: STEPS (default 20), PRESETS (default "bf16 int8"), SEEDS (default "1 2"), TASK (default
# arithmetic), OUT_ROOT (default outputs/tiny_cpu_study_async_verl; each run in OUT_ROOT/<preset>/seed<k>/),
# SUMMARY_DIR (default recipes/tiny_cpu/study_async: where the summary is written).
# Extra arguments are Hydra overrides given to every run. A run whose metrics.jsonl already has all STEPS steps
# is kept; a failed run stops the script with the path of its log.
#
# A seed k sets every seed of verl's config that reaches this run: the data shuffle (`data.seed`; verl's default
# null leaves torch's generator at its fixed default seed, so every run would see the same prompts), vLLM's
# engine seed, which its sampler draws from (`actor_rollout_ref.rollout.seed`), the actor's mini-batch shuffle
# (`actor_rollout_ref.actor.data_loader_seed`, used when `actor.shuffle` is on; the recipe leaves it off) and its
# engine seed (`actor_rollout_ref.actor.fsdp_config.seed`, which seeds torch only under full determinism). The same
# seed gives the same prompt stream under every preset; the sampled responses are not reproduced token for token
# (a 2-step run repeated with its seed shared 7 of its 64 responses: the engine's one generator serves requests in
# the order they arrive; verl's `rollout.full_determinism` would give every request the same seed, and a GRPO
# group's n responses to one prompt would all be alike). The model and data are built once, shared by all runs.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
cd "$root"
py="${PYTHON:-$root/.venv/bin/python}"
steps="${STEPS:-20}"
presets="${PRESETS:-bf16 int8}"
seeds="${SEEDS:-1 2}"
task="${TASK:-arithmetic}"
out_root="${OUT_ROOT:-$root/outputs/tiny_cpu_study_async_verl}"
summary=(-m qurl_recipes.study_async_verl)

for preset in $presets; do
  for seed in $seeds; do
    out="$out_root/$preset/seed$seed"
    if "$py" "${summary[@]}" --complete "$out" --steps "$steps" 2>/dev/null; then
      echo "[study-async-verl] $preset seed $seed: kept ($out has $steps steps)"
      continue
    fi
    rm -rf "$out/rollouts"
    mkdir -p "$out"
    log="$out/run.log"
    echo "[study-async-verl] $preset seed $seed: $steps steps, log $log"
    start=$(date +%s)
    if ! OUT="$out" STEPS="$steps" PRESET="$preset" TASK="$task" \
        MODEL_DIR="$out_root/model" DATA_DIR="$out_root/data_$task" \
        bash recipes/tiny_cpu/run.sh \
          trainer.v1.trainer_mode=colocate_async \
          data.seed="$seed" \
          actor_rollout_ref.rollout.seed="$seed" \
          actor_rollout_ref.actor.data_loader_seed="$seed" \
          actor_rollout_ref.actor.fsdp_config.seed="$seed" \
          trainer.rollout_data_dir="$out/rollouts" \
          trainer.experiment_name="async_verl_${preset}_seed$seed" \
          "$@" >"$log" 2>&1; then
      echo "[study-async-verl] $preset seed $seed FAILED: see $log" >&2
      exit 1
    fi
    echo $(( $(date +%s) - start )) >"$out/wall_s"
    if ! "$py" "${summary[@]}" --complete "$out" --steps "$steps"; then
      echo "[study-async-verl] $preset seed $seed ended without all $steps steps: see $log" >&2
      exit 1
    fi
    echo "[study-async-verl] $preset seed $seed: done in $(cat "$out/wall_s") s"
  done
done

"$py" "${summary[@]}" --root "$out_root" --presets $presets --seeds $seeds --steps "$steps" --task "$task" \
  --out-dir "${SUMMARY_DIR:-recipes/tiny_cpu/study_async}"
