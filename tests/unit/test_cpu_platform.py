"""The CPU platform answers verl's device questions with CPU answers, and only when selected."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import torch


def _probe(env: dict) -> str:
    code = textwrap.dedent("""
        import verl, torch
        from verl.utils import device as d
        print("NAME", d.get_device_name(), d.get_nccl_backend(), d.get_device_id(), d.get_resource_name())
        m = d.get_torch_device()
        free, total = m.mem_get_info()
        assert 0 < free <= total
        m.empty_cache(); m.synchronize()
        s = m.get_rng_state(); a = torch.rand(3); m.set_rng_state(s); b = torch.rand(3)
        print("RNG", bool(torch.equal(a, b)))
        print("TENSOR", torch.zeros(2).to(d.get_device_id()).device)
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **env}, timeout=120)
    return p.stdout + p.stderr[-2000:]


def test_selected_platform_is_cpu_gloo():
    out = _probe({"VERL_PLATFORM": "cpu"})
    assert "NAME cpu gloo cpu GPU" in out, out
    assert "RNG True" in out, out
    assert "TENSOR cpu" in out, out


def test_not_auto_detected():
    from qurl_verl.platform.cpu import PlatformCPU

    assert PlatformCPU().is_platform_available(use_smi_check=True) is False
    env = {k: v for k, v in os.environ.items() if k != "VERL_PLATFORM"}
    code = "import verl; from verl.utils.device import get_device_name; print('NAME', get_device_name())"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert "NAME cuda" in p.stdout or "NAME " in p.stdout and "NAME cpu" not in p.stdout


def test_device_module_rng_round_trip():
    from qurl_verl.platform.cpu import CPU_DEVICE_MODULE as m

    state = m.get_rng_state()
    x = torch.randn(4)
    m.set_rng_state(state)
    assert torch.equal(x, torch.randn(4))
    assert m.current_device() == "cpu" and m.device_count() == 1 and m.memory_allocated() == 0
