# Sourced by the GPU recipes' run.sh (after `root` and `py` are set, with the script's "$@"): reads
# the first argument (--dry-run | --print-overrides) into `mode`, the rest into `recipe_args`, and
# PRESET into `preset` / `preset_args`, refusing an unknown preset with the list of known ones.
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

# The data: a recipe with a hub source (the script sets hub_data=1: deepscaler, dapo) trains on the
# full sets by default (DATA=hub) and is dry-run on the repository's shipped sample (DATA=shipped,
# no network). Shipped samples go to $QURL_DATA_DIR/shipped/<recipe> when QURL_DATA_DIR is unset, so
# a dry run never fills the folder a GPU run reads (the checker refuses to mix the two sources).
if [[ "${hub_data:-0}" == 1 ]]; then
  if [[ "$mode" == run ]]; then data="${DATA:-hub}"; else data="${DATA:-shipped}"; fi
  if [[ "$mode" != print && "$data" == shipped && -z "${QURL_DATA_DIR:-}" ]]; then export QURL_DATA_DIR=~/data/qurl/shipped; fi
else
  data="${DATA:-shipped}"
fi

# run_recipe OVERRIDES...: the recipe's main_ppo command line, by mode. print: the overrides,
# NUL-separated (what qurl_recipes.recipes_check checks); otherwise the recipe's data is written
# first where the composed config reads it (DATA=shipped|hub, once), then dry: the driver's checks
# with no GPU and no download; run: verl's main_ppo.
run_recipe() {
  if [[ "$mode" == print ]]; then printf '%s\0' "$@"; exit 0; fi
  local steps=(--write-data --source "$data")
  if [[ "$mode" == dry ]]; then steps+=(--dry-run); fi
  "$py" -m qurl_recipes.recipes_check "${steps[@]}" -- "$@"
  if [[ "$mode" == dry ]]; then exit 0; fi
  exec "$py" -m verl.trainer.main_ppo "$@"
}
