"""The vLLM-CPU work-arounds qurl_vllm installs: each one is needed here, and each one works.

* ``vllm_cpu_int8_kernels`` where oneDNN's int8 GEMM saturates: vLLM's own INT8 kernel object, and the
  one vLLM's selector gives once the patch put the project's classes into its list, against the float64
  W8A8 reference (no engine; skipped on CPUs whose oneDNN int8 GEMM does not saturate).
* ``vllm_cpu_onednn_scale_keepalive`` and ``vllm_cpu_tied_lm_head_refresh``: on a live engine
  with vLLM's stock CPU GEMM dispatch (``VERL_PLATFORM`` unset, so the plugin's weight-keeping
  patch for stock verl syncs is not applied) and a test extension that installs the patches one by
  one. The engine runs in fp32: oneDNN then prepacks the lm_head on every x86 CPU (in bf16 it only
  does so with AVX512-BF16; elsewhere vLLM falls back to ``F.linear`` on the live weight and the
  refresh is a no-op), and the comparison with the torch reference is as tight as in
  ``test_qurl_vllm_reload.py`` (median <= 1e-5), against a median of 0.76 nat (measured; bound 0.1) for a stale lm_head.

If vLLM fixes one of these upstream, the "needed" half of its test fails: drop the patch then.
"""
from __future__ import annotations

import io

import pytest
import torch

from qurl_testkit.reload_harness import (
    TrainerWeights,
    abs_diffs,
    engine_logprobs,
    prompt_ids,
    reference_logprobs,
    reference_model,
    require_vllm,
    start_engine,
    stop_engine,
    summary,
)
from qurl_verl.settings import RolloutSettings

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("engine_environment")]

INT8 = RolloutSettings(format="int8")
PARAM_NAMES = ["weight", "weight_scale", "input_scale", "input_zero_point", "azp_adj"]


def _cpu_int8_linear(codes: torch.Tensor, scale: torch.Tensor, kernel_class=None):
    """A CPU W8A8 kernel on a bare layer, configured as the compressed-tensors scheme we build: ``kernel_class``,
    or (None) the class vLLM's selector gives the layer."""
    from vllm.model_executor.kernels.linear import init_int8_linear_kernel
    from vllm.model_executor.kernels.linear.scaled_mm.ScaledMMLinearKernel import Int8ScaledMMLinearLayerConfig

    if kernel_class is None:
        kernel = init_int8_linear_kernel(is_channelwise=True, is_static_input_scheme=False, input_symmetric=True,
                                         module_name="test.linear")
    else:
        config = Int8ScaledMMLinearLayerConfig(is_static_input_scheme=False, is_channelwise=True, input_symmetric=True)
        kernel = kernel_class(config, PARAM_NAMES)
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(codes.clone(), requires_grad=False)
    layer.weight_scale = torch.nn.Parameter(scale.clone(), requires_grad=False)
    layer.input_scale = layer.input_zero_point = layer.azp_adj = None
    layer.logical_widths = [codes.shape[0]]
    kernel.process_weights_after_loading(layer)
    return lambda x: kernel.apply_weights(layer, x)


def test_int8_saturation_patch_is_needed_and_exact(monkeypatch):
    require_vllm()
    from vllm.model_executor.kernels import linear
    from vllm.model_executor.kernels.linear.scaled_mm.cpu import CPUInt8ScaledMMLinearKernel
    from vllm.platforms import PlatformEnum

    from qurl_verl.kernels.cpu_int8 import SaturationFreeCPUInt8ScaledMMLinearKernel
    from qurl_verl.patches.vllm_cpu_worker import vllm_cpu_int8_kernels
    from qurl_verl.quant import INT8_CHANNEL, quantize
    from qurl_verl.quant.matmul import w8a8_linear_reference

    if not vllm_cpu_int8_saturates():
        pytest.skip("this CPU's oneDNN int8 GEMM does not saturate (VNNI/AMX): the patch stays off")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(16, 512, generator=gen)
    qw = quantize(torch.randn(384, 512, generator=gen) * 0.05, INT8_CHANNEL)
    want = w8a8_linear_reference(x, qw)

    def rel_error(linear) -> float:
        return float((linear(x).double() - want).abs().max() / want.abs().max())

    unpatched = rel_error(_cpu_int8_linear(qw.data, qw.scale, CPUInt8ScaledMMLinearKernel))
    possible = linear._POSSIBLE_INT8_KERNELS
    monkeypatch.setitem(possible, PlatformEnum.CPU, list(possible[PlatformEnum.CPU]))  # restored after the test
    vllm_cpu_int8_kernels.apply()  # "" where this process applied it already
    assert SaturationFreeCPUInt8ScaledMMLinearKernel in possible[PlatformEnum.CPU]
    patched = rel_error(_cpu_int8_linear(qw.data, qw.scale))
    print(f"\nint8 GEMM max error / max |out|: unpatched {unpatched:.3g}, patched {patched:.3g}")
    assert unpatched > 1e-2
    assert patched < 1e-6


def vllm_cpu_int8_saturates() -> bool:
    from qurl_verl.kernels import cpu_int8_paths

    return cpu_int8_paths.onednn_int8_saturates()


@pytest.fixture(scope="module")
def probe_engine(tiny_model_dir, engine_environment):
    require_vllm()
    from vllm import envs

    engine_environment.delenv("VERL_PLATFORM")  # stock vLLM-CPU GEMM dispatch in the worker
    if "VLLM_CPU_SGL_KERNEL" in envs.environment_variables:  # 0.24 takes the AMX paths only when opted in
        engine_environment.setenv("VLLM_CPU_SGL_KERNEL", "1")
    llm = start_engine(tiny_model_dir, INT8, dtype="float32", extension="qurl_testkit.reload_probe.ProbeWorkerExtension")
    engine_environment.setenv("VERL_PLATFORM", "cpu")
    yield llm
    stop_engine(llm)


def _sync(llm, trainer: TrainerWeights) -> dict:
    """Reload from the trainer's tensors, the tied lm_head under the embedding's name only (as a HF
    checkpoint stores it). verl's FSDP engine also streams ``lm_head.weight``; vLLM 0.32 then
    reloads the lm_head itself and the refresh is a no-op (test_qurl_vllm_reload covers that)."""
    tensors = [(n, t) for n, t in trainer.master.items() if n != "lm_head.weight"]
    blob = io.BytesIO()
    torch.save(tensors, blob)  # RPC arguments cannot carry tensors as such
    return llm.collective_rpc("probe_sync", args=(blob.getvalue(),))[0]


def _vs_reference(llm, model_dir, trainer, prompts) -> dict:
    seqs, got = engine_logprobs(llm, prompts)
    if not all(bool(torch.isfinite(g).all()) for g in got):
        return {"nan": True}
    ref = reference_logprobs(reference_model(model_dir, trainer.master, INT8, torch.float32), seqs)
    return {"nan": False, **summary(abs_diffs(got, ref))}


def test_scale_keepalive_and_tied_lm_head_refresh_are_needed_and_work(probe_engine, tiny_model_dir):
    trainer = TrainerWeights(tiny_model_dir)
    prompts = prompt_ids(tiny_model_dir)[:4]

    # No patches: the first reload leaves each oneDNN handler reading a freed weight-scale tensor. What it reads is
    # whatever the allocator put there since (NaN, or log-probs off by a median 0.8-1.5 nats, measured), against a
    # median <= 1e-5 with the patch: "off by more than 0.1 nats" is that difference, whatever the memory held.
    _sync(probe_engine, trainer)
    no_keepalive = _vs_reference(probe_engine, tiny_model_dir, trainer, prompts)
    print("\nno patches:", no_keepalive)
    assert no_keepalive["nan"] or no_keepalive["median"] > 0.1, no_keepalive

    # Keep-alive (and exact INT8 on saturating CPUs), a clean KV cache (the NaN run poisoned it):
    # finite, but the tied lm_head still computes logits from its prepacked copy of the dummy weights.
    probe_engine.collective_rpc("probe_install", args=("keepalive",))
    probe_engine.collective_rpc("probe_install", args=("saturation",))
    probe_engine.collective_rpc("probe_zero_kv_cache")
    trainer.step()
    _sync(probe_engine, trainer)
    stale = _vs_reference(probe_engine, tiny_model_dir, trainer, prompts)
    print("keep-alive, no lm_head refresh:", stale)
    # vLLM 0.32's Qwen2 ties through a ParallelLMHead of its own that shares the embedding's weight and
    # prepacks it apart: that copy goes stale. vLLM 0.24's Qwen2 uses the embedding module itself as
    # lm_head (qwen2.py: ``self.lm_head = self.model.embed_tokens``), whose reload repacks it.
    (separate_lm_head,) = probe_engine.collective_rpc("probe_refresh_lm_head")
    if not separate_lm_head:
        assert not stale["nan"] and stale["median"] <= 1e-5 and stale["max"] <= 0.1, stale
        return
    assert not stale["nan"] and stale["median"] > 0.1, stale

    # Refreshing the tied lm_head fixes it (the refresh ran just above); refreshing again changes nothing.
    refreshed = _vs_reference(probe_engine, tiny_model_dir, trainer, prompts)
    assert probe_engine.collective_rpc("probe_refresh_lm_head") == [True]
    again = _vs_reference(probe_engine, tiny_model_dir, trainer, prompts)
    print("lm_head refreshed:", refreshed)
    assert refreshed["median"] <= 1e-5 and refreshed["max"] <= 0.1 and again == refreshed, (refreshed, again)

    # Both fixes inside the reload, as QurlWorkerExtension runs them: the next sync is right at once.
    probe_engine.collective_rpc("probe_install", args=("refresh",))
    trainer.step()
    _sync(probe_engine, trainer)
    patched = _vs_reference(probe_engine, tiny_model_dir, trainer, prompts)
    print("all patches, next sync:", patched)
    assert not patched["nan"] and patched["median"] <= 1e-5 and patched["max"] <= 0.1, patched
