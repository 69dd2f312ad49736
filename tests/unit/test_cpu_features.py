"""The CPU reader every result, study and kernel choice names its CPU class with; each branch forced."""
from __future__ import annotations

from pathlib import Path

import pytest

from qurl_verl.platform import cpu_features, cpu_int8_gemm

AMX = {"avx2", "avx512f", "avx512_vnni", "amx_tile", "amx_int8"}
VNNI512 = {"avx2", "avx512f", "avx512_vnni", "avx512_bf16"}


def test_this_machine_is_read():
    model, flags = cpu_features.cpu_model_and_flags()
    assert model and isinstance(flags, frozenset) and cpu_features.cpu_flags() == flags
    if Path("/proc/cpuinfo").exists():
        assert "fpu" in flags or "avx2" in flags  # x86 flags line parsed into words, not one string


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
    ({"avx2"}, None, "avx2", "avx2"),
])
def test_throughput_results_name_the_class_and_any_emulation(monkeypatch, flags, onednn_cap, aten_cap, name):
    """The file name of a throughput result says the CPU class and whether oneDNN alone or oneDNN and torch
    were capped (bench/bench_rollout_throughput.py)."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "bench"))
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "tests" / "integration"))
    for var, value in (("ONEDNN_MAX_CPU_ISA", onednn_cap), ("ATEN_CPU_CAPABILITY", aten_cap)):
        if value is None:
            monkeypatch.delenv(var, raising=False)
        else:
            monkeypatch.setenv(var, value)
    import bench_rollout_throughput

    assert bench_rollout_throughput.results_class(frozenset(flags)) == name
