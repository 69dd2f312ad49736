#!/usr/bin/env bash
# Every benchmark of bench/, one after the other; each writes its bench/results/*.json.
# Run alone on the machine: they measure side by side within one run, not against other jobs.
set -euo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-.venv/bin/python}"
for b in bench_quantize bench_acr_loss bench_quantize_side bench_rollout_throughput; do
  echo "=== $b"
  "$py" "bench/$b.py"
done
