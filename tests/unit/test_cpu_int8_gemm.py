"""The packed AVX2 W8A8 GEMM against the int64 product of its codes, on shapes, tails and worst cases.

The kernel's integer part must be exact (that is its whole claim: no int16 saturation), so outputs
with unit scales are compared for equality with the int64 product; with real scales the only
rounding left is the float32 epilogue (acc * a_scale * w_scale + bias: at most a few float32 ulps)
and the cast to the output dtype.
"""
from __future__ import annotations

import logging

import pytest
import torch

from qurl_verl.platform import cpu_int8_gemm

needs_kernel = pytest.mark.skipif(not cpu_int8_gemm.cpu_supports_kernel(cpu_int8_gemm.cpu_flags()),
                                  reason="this CPU has no AVX2")


@pytest.fixture(scope="module")
def kernel():
    assert cpu_int8_gemm.load(), "the AVX2 INT8 GEMM failed to build (see the warning above)"


def codes(shape, low, high, seed):
    return torch.randint(low, high + 1, shape, generator=torch.Generator().manual_seed(seed), dtype=torch.int8)


def int_product(a, w):
    return a.long() @ w.long().t()


@needs_kernel
@pytest.mark.parametrize("m,n,k", [(1, 3072, 768), (2, 64, 64), (3, 8, 32), (4, 37, 100), (7, 5, 31), (32, 96, 2816),
                                   (1, 1, 1), (5, 4, 33)])
def test_integer_products_are_exact(kernel, m, n, k):
    """Unit scales, float32 output: every output equals the int64 product (all sums here < 2^24)."""
    a, w = codes((m, k), -128, 127, 0), codes((n, k), -127, 127, 1)
    out = cpu_int8_gemm.int8_gemm(a, torch.ones(m), cpu_int8_gemm.pack_weight(w), torch.ones(n), None, n, torch.float32)
    ref = int_product(a, w)
    assert ref.abs().max() < 2 ** 24
    assert torch.equal(out, ref.float())


@needs_kernel
@pytest.mark.parametrize("a_code,w_code", [(-128, -127), (-128, 127), (127, 127), (127, -127), (-127, -127)])
def test_codes_at_the_pair_bound_do_not_saturate(kernel, a_code, w_code):
    """Every pair of products at its largest (|a| 128 or 127 times |w| 127): 32512 fits int16; a u8 shift
    (oneDNN's scheme) would need 255 * 127 * 2 and saturate. K = 1024 keeps the sum exact in float32."""
    k = 1024
    a = torch.full((2, k), a_code, dtype=torch.int8)
    w = torch.full((4, k), w_code, dtype=torch.int8)
    out = cpu_int8_gemm.int8_gemm(a, torch.ones(2), cpu_int8_gemm.pack_weight(w), torch.ones(4), None, 4, torch.float32)
    assert torch.equal(out, torch.full((2, 4), float(a_code * w_code * k)))


@needs_kernel
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_scales_bias_and_output_dtypes_match_float64(kernel, out_dtype):
    """Real per-token and per-channel scales and a bias: float32 within 4 ulps of the float64 formula
    (three roundings in the epilogue), then one rounding to the output dtype: within one of its ulps."""
    m, n, k = 5, 40, 96
    a, w = codes((m, k), -128, 127, 2), codes((n, k), -127, 127, 3)
    g = torch.Generator().manual_seed(4)
    a_scale, w_scale = torch.rand(m, generator=g) * 1e-2 + 1e-3, torch.rand(n, generator=g) * 1e-3 + 1e-4
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    out = cpu_int8_gemm.int8_gemm(a, a_scale.reshape(m, 1), cpu_int8_gemm.pack_weight(w), w_scale.reshape(n, 1),
                                  bias, n, out_dtype)
    ref = int_product(a, w).double() * a_scale.double()[:, None] * w_scale.double()[None, :] + bias.double()
    assert out.dtype == out_dtype and out.shape == (m, n)
    ulp = torch.finfo(out_dtype).eps * ref.abs()
    slack = 4 * torch.finfo(torch.float32).eps * ref.abs() + 1e-6
    assert ((out.double() - ref).abs() <= ulp + slack).all()


@needs_kernel
def test_threads_split_the_work_without_changing_it(kernel):
    """The output blocks are independent: 1 and 2 threads give the same bits."""
    a, w = codes((9, 512), -128, 127, 5), codes((1000, 512), -127, 127, 6)
    packed, sa, sw = cpu_int8_gemm.pack_weight(w), torch.rand(9) + 0.5, torch.rand(1000) + 0.5
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_int8_gemm.int8_gemm(a, sa, packed, sw, None, 1000, torch.float32)
        torch.set_num_threads(2)
        two = cpu_int8_gemm.int8_gemm(a, sa, packed, sw, None, 1000, torch.float32)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_pack_weight_layout_and_padding():
    """Block b, chunk c, row j, lane l holds w[4b + j, 32c + l], zero outside [N, K]."""
    w = codes((6, 40), -127, 127, 7)
    packed = cpu_int8_gemm.pack_weight(w)
    assert packed.shape == (2, 2, 4, 32)
    padded = torch.zeros(8, 64, dtype=torch.int8)
    padded[:6, :40] = w
    for b in range(2):
        for c in range(2):
            assert torch.equal(packed[b, c], padded[4 * b:4 * b + 4, 32 * c:32 * c + 32])


def test_pack_weight_rejects_codes_outside_the_kernel_range():
    w = torch.zeros(4, 32, dtype=torch.int8)
    w[1, 3] = -128
    with pytest.raises(ValueError, match="-128"):
        cpu_int8_gemm.pack_weight(w)
    with pytest.raises(ValueError, match="int8"):
        cpu_int8_gemm.pack_weight(torch.zeros(4, 32))


@needs_kernel
def test_gemm_rejects_a_weight_packed_for_another_shape(kernel):
    packed = cpu_int8_gemm.pack_weight(torch.zeros(8, 64, dtype=torch.int8))
    with pytest.raises(RuntimeError, match="packed weight does not match"):
        cpu_int8_gemm.int8_gemm(torch.zeros(1, 96, dtype=torch.int8), torch.ones(1), packed, torch.ones(8), None, 8,
                                torch.float32)


@pytest.mark.parametrize("flags,supported", [({"avx2", "fma"}, True), ({"avx512f", "avx2"}, True),
                                             ({"sse4_2", "avx"}, False), (set(), False)])
def test_kernel_needs_avx2(flags, supported):
    assert cpu_int8_gemm.cpu_supports_kernel(flags) is supported


def test_load_without_avx2_does_not_build(monkeypatch):
    """A CPU without AVX2 would fault on the kernel's first instruction: load() must not even build it."""
    from torch.utils import cpp_extension

    monkeypatch.setattr(cpu_int8_gemm, "cpu_flags", lambda: {"sse4_2"})
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: pytest.fail("built on a CPU without AVX2"))
    assert cpu_int8_gemm.load.__wrapped__() is False


def test_load_reports_a_failed_build_and_returns_false(monkeypatch, caplog):
    """No compiler (or any build error): a warning naming the cause, and False so callers keep oneDNN."""
    from torch.utils import cpp_extension

    def no_compiler(**kwargs):
        raise RuntimeError("Error building extension: g++: command not found")

    monkeypatch.setattr(cpu_int8_gemm, "cpu_flags", lambda: {"avx2"})
    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    with caplog.at_level(logging.WARNING, logger="qurl_verl"):
        assert cpu_int8_gemm.load.__wrapped__() is False
    assert "cannot build the AVX2 INT8 GEMM" in caplog.text and "g++: command not found" in caplog.text


@pytest.mark.parametrize("value,choice", [(None, "auto"), ("", "auto"), ("auto", "auto"), ("oneDNN", "onednn"),
                                          (" onednn ", "onednn")])
def test_gemm_choice_reads_the_environment(monkeypatch, value, choice):
    if value is None:
        monkeypatch.delenv(cpu_int8_gemm.GEMM_CHOICE_ENV, raising=False)
    else:
        monkeypatch.setenv(cpu_int8_gemm.GEMM_CHOICE_ENV, value)
    assert cpu_int8_gemm.gemm_choice() == choice


def test_gemm_choice_rejects_unknown_values(monkeypatch):
    monkeypatch.setenv(cpu_int8_gemm.GEMM_CHOICE_ENV, "avx512")
    with pytest.raises(ValueError, match="expected 'auto'"):
        cpu_int8_gemm.gemm_choice()


def test_a_stale_build_lock_gives_up_in_bounded_time(monkeypatch, tmp_path, caplog):
    """torch's loader would wait forever on a lock a killed build left behind: load() waits a bounded
    time, then warns with the file to delete and keeps oneDNN, never calling the loader."""
    from torch.utils import cpp_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_int8_gemm, "cpu_flags", lambda: {"avx2"})
    monkeypatch.setattr(cpu_int8_gemm, "BUILD_LOCK_WAIT_S", 0.5)
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: pytest.fail("waited on a stale lock"))
    lock = cpu_int8_gemm.build_directory() / "lock"
    assert lock.is_relative_to(tmp_path)
    lock.parent.mkdir(parents=True)
    lock.touch()
    with caplog.at_level(logging.WARNING, logger="qurl_verl"):
        assert cpu_int8_gemm.load.__wrapped__() is False
    assert str(lock) in caplog.text


def test_a_lock_released_during_the_wait_lets_the_build_go_on(tmp_path):
    import threading

    lock = tmp_path / "lock"
    lock.touch()
    threading.Timer(0.3, lock.unlink).start()
    assert cpu_int8_gemm.wait_for_build_lock(lock, timeout_s=30)
    assert cpu_int8_gemm.wait_for_build_lock(tmp_path / "absent", timeout_s=0)


@needs_kernel
def test_the_op_traces_for_compiled_engines(kernel):
    """vLLM engines with enforce_eager=false trace the model: the op needs a shape-only (fake) kernel
    that agrees with the real one, checked by torch's own opcheck and by a full-graph trace."""
    a, w = codes((3, 64), -128, 127, 8), codes((10, 64), -127, 127, 9)
    args = (a, torch.rand(3) + 0.5, cpu_int8_gemm.pack_weight(w), torch.rand(10) + 0.5, None, 10, torch.bfloat16)
    torch.library.opcheck(torch.ops.qurl_cpu.int8_gemm_avx2.default, args,
                          test_utils=("test_schema", "test_faketensor"))
    traced = torch.compile(lambda *xs: cpu_int8_gemm.int8_gemm(*xs) * 2, fullgraph=True, backend="eager")
    assert torch.equal(traced(*args), cpu_int8_gemm.int8_gemm(*args) * 2)
