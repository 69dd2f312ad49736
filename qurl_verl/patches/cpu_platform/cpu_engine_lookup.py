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

from qurl_verl.patches.contract import Patch

ENV = "VERL_ENGINE_DEVICE"


def _set_default() -> str:
    if os.environ.get(ENV):
        return ""  # the user's value wins
    os.environ[ENV] = "cuda"
    return f"{ENV}=cuda"


PATCH = Patch(
    module=__name__,
    target="verl.workers.engine.base:EngineRegistry.get_engine_cls",
    package="verl",
    versions=("0.9.1",),
    when=f"on the CPU platform, unless {ENV} is set",
    change=_set_default,
)


def apply() -> str:
    return PATCH.apply()
