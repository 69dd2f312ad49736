# Sourced by the recipes' run.sh (after `root` is set, with the script's "$@"): reads the first
# argument (--dry-run | --print-overrides) into `mode` and PRESET into `preset` / `preset_args`,
# refusing an unknown preset with the list of known ones.
mode=run
case "${1:-}" in
  --dry-run) mode=dry; shift ;;
  --print-overrides) mode=print; shift ;;
esac
recipe_args=("$@")

preset="${PRESET:-int8}"
if [[ "$preset" != none && ! -f "$root/qurl_verl/hydra_configs/qurl/$preset.yaml" ]] || [[ "$preset" == _* ]]; then
  presets=$(cd "$root/qurl_verl/hydra_configs/qurl" && ls [!_]*.yaml | sed 's/\.yaml$//' | tr '\n' ' ')
  echo "error: unknown PRESET=$preset; choose one of: ${presets}or none (verl's stock vLLM rollout)" >&2
  exit 2
fi
if [[ "$preset" == none ]]; then preset_args=(actor_rollout_ref.rollout.name=vllm); else preset_args=("+qurl=$preset"); fi
