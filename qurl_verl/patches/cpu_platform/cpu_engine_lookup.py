"""Let verl's engine registry hand the FSDP engine to the CPU platform.

Targets: verl 0.9.1 (`verl/workers/engine/base.py`, `EngineRegistry.get_engine_cls`).

Why: verl registers its FSDP/FSDP2 training engines for devices `cuda` and `npu` only, and looks
them up by the platform's device name, so on the `cpu` platform it fails with "No engine
registered for device='cpu' ... backend='fsdp'". The FSDP2 engine itself runs on CPU over gloo.
verl reads `VERL_ENGINE_DEVICE` to override the lookup key; we default it to `cuda` when the CPU
platform is selected (a user's explicit value wins). The env var is inherited by Ray workers.
"""
from __future__ import annotations

import os

ENV = "VERL_ENGINE_DEVICE"


def apply() -> bool:
    if os.environ.get(ENV):
        return False
    os.environ[ENV] = "cuda"
    return True
