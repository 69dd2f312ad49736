"""What this machine offers the checks, probed once: CUDA and its compute capability, AMX, the
packages the workers load (flash-attn, vLLM), and the platform verl is told to use.

The checks read a ``Host`` instead of asking torch or the environment themselves, so a check is
decided on one answer per run, and a test states the machine it means by building one.
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

from qurl_verl.platform.cpu_features import cpu_flags
from qurl_verl.settings import cpu_platform_selected
from qurl_verl.versions import installed_vllm_version


@dataclass(frozen=True)
class Host:
    cuda_available: bool = False  # torch sees a GPU (a driver on a GPU-less head node does not)
    cuda_capability: tuple[int, int] | None = None  # of the first visible GPU; None without CUDA
    amx: bool = False  # AMX tiles (Sapphire Rapids or newer), what vLLM-CPU's sgl and MoE kernels need
    amx_fp8: bool = False  # AMX-FP8: vLLM-CPU runs block FP8 W8A8 only there
    avx512: bool = False  # torch's AVX-512 test, which vLLM-CPU's attention asks before an FP8 cache
    flash_attn: bool = False  # the flash-attn package is installed
    vllm_version: str | None = None  # the installed vLLM's version (distribution metadata), None without
    vllm_importable: bool = False  # a ``vllm`` module can be imported
    cpu_platform: bool = False  # VERL_PLATFORM=cpu
    usable_cpus: int = 1  # the CPUs this process may run on (its affinity), what vLLM-CPU ranks here share
    outside_ray_cluster: bool = False  # RAY_ADDRESS is set: main_ppo joins a cluster, whose nodes are not this one

    @classmethod
    def probe(cls) -> Host:
        """This process's answers (imports torch, not vLLM)."""
        import torch

        cuda = torch.cuda.is_available()
        return cls(
            cuda_available=cuda,
            cuda_capability=tuple(torch.cuda.get_device_capability(0)) if cuda else None,
            amx=bool(torch.cpu._is_amx_tile_supported()),
            amx_fp8="amx_fp8" in cpu_flags(),
            avx512=bool(torch.cpu._is_avx512_supported()),
            flash_attn=importlib.util.find_spec("flash_attn") is not None,
            vllm_version=installed_vllm_version(),
            vllm_importable=importlib.util.find_spec("vllm") is not None,
            cpu_platform=cpu_platform_selected(),
            usable_cpus=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1),
            outside_ray_cluster=bool(os.environ.get("RAY_ADDRESS")),
        )
