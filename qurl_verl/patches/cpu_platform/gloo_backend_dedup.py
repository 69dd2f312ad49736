"""De-duplicate the process-group backend string verl builds on the CPU platform.

Targets: verl 0.9.1 (`verl/utils/distributed.py`, `initialize_global_process_group[_ray]`), torch 2.13.

Why: verl always asks for `f"cpu:gloo,{device}:{backend}"`. With device `cpu` and backend `gloo`
that is `cpu:gloo,cpu:gloo`, which torch rejects ("Duplicate device type cpu in backend
string"). We drop repeated `device:backend` pairs before torch sees them; any other string
passes through unchanged, so applying this on a GPU host changes nothing.
"""
from __future__ import annotations

import functools

import torch.distributed as dist

from qurl_verl.patches.contract import Patch, wrap_once

_MARK = "_qurl_dedup_backend"


def dedup_backend(backend: str | None) -> str | None:
    if not isinstance(backend, str) or "," not in backend:
        return backend
    seen, kept = set(), []
    for part in backend.split(","):
        device = part.split(":", 1)[0].strip() if ":" in part else None
        key = device or part
        if key in seen:
            continue
        seen.add(key)
        kept.append(part)
    return ",".join(kept)


def dedup_backend_for(original):
    @functools.wraps(original)
    def init_process_group(*args, **kwargs):
        if "backend" in kwargs:
            kwargs["backend"] = dedup_backend(kwargs["backend"])
        elif args:
            args = (dedup_backend(args[0]), *args[1:])
        return original(*args, **kwargs)

    return init_process_group


PATCH = Patch(
    module=__name__,
    target="torch.distributed:init_process_group",  # as verl/utils/distributed.py calls it
    package="verl",
    versions=("0.9.1",),
    when="on the CPU platform; other backend strings pass through unchanged",
    change=lambda: wrap_once(dist, "init_process_group", dedup_backend_for, _MARK),
)


def apply() -> str:
    """Wrap ``torch.distributed.init_process_group``; "" if already applied."""
    return PATCH.apply()
