"""qurl_vllm with an FP8 KV cache (``custom.qurl.kv_cache=fp8``): the K/V scales the trainer streams are
the ones the engine's attention uses, sync after sync.

One live INT8 engine (fp32, vLLM's ``kv_cache_dtype=fp8_e4m3``), synced through verl's sender. Its
``o_proj`` stays in full precision: the output of attention over an FP8 cache sits on a coarse grid
(near the start of a sequence it is a stored E4M3 value times the scale), where the INT8 activation
quantization of o_proj meets exact rounding ties that vLLM (x * (1/s)) and the torch reference (x / s)
break differently, one flipped code each. Everything else is INT8 as usual.

* sync 1 carries no scales, as the first sync of a run (before any actor forward): the engine bounds |q|,
  |k|, |v| from the streamed weights (``AttentionInputBounds``, recomputed here in float64), and its
  log-probs track a torch reference whose K and V go through an E4M3 quantize-dequantize with those scales;
* syncs 2-4 carry scales computed as the actor computes them (K/V ranges observed in the attention
  dispatch of the trainer's model, ``scale_from_amax``), then the same times 4 at sync 4: each time the
  engine tracks the reference with those scales, and not the reference with the previous ones;
* a stream with the scales of one layer only fails the sync (no stale scale).

On vLLM 0.24 (GPU users' vLLM) the INT8 linears run vLLM's CUDA ``TritonInt8ScaledMMLinearKernel``, chosen by its
selector under the rollout server's environment for a Blackwell GPU over exact fp32 stand-ins
(``qurl_testkit.cuda_kernel_probe.start_triton_int8_engine``; the bounds below hold), and the CUDA-graph pointer
contract is checked after every sync: the attention layers' scales (``_q_scale``/``_k_scale``/``_v_scale`` take the
streamed scales; ``_prob_scale`` is read by CUDA kernels that quantize probabilities), and every parameter and buffer, keep the pointer, shape, stride and dtype they had at the engine's start (a captured
graph reads the scales from there).

The reference stores K and V as vLLM-CPU does: x times the float32 reciprocal of the scale, saturated,
rounded toward zero to E4M3 (``csrc/cpu/cpu_attn_fp8.hpp``; CUDA kernels round to nearest). Its query stays in
the engine's dtype, as vLLM-CPU's attention reads it (its backend never sets ``supports_quant_query_input``); CUDA
backends quantize it with ``_q_scale`` too, which the GPU check's reference models
(``quantize_dequantize_query_fp8``). Tolerance
of engine vs reference (per-token |log-prob difference|), the bounds of the INT8 engine tests with a
bf16 cache: median <= 1e-5, p75 <= 1e-3, max <= 0.1. Most tokens agree to float32 rounding; an INT8
activation that vLLM and the reference round to neighbouring codes moves the rest of its sequence by
1e-4..1e-2, as without an FP8 cache (measured with bf16 weights, where no INT8 GEMM precedes the
cache: max 1e-4). The reference with the previous sync's scales is off by more than 1e-4 at the
median: the check can fail."""
from __future__ import annotations

import pytest
import torch

from qurl_testkit.cuda_kernel_probe import ON_GPU_USERS_VLLM, moved_records, start_triton_int8_engine
from qurl_testkit.cuda_kernel_stand_ins import TRITON
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
    sync_weights,
)
from qurl_verl.patches.qurl_vllm.attention_kv_hook import kv_hook, layer_index
from qurl_verl.quant.kv_cache import KVRangeObserver, kv_scales, parse_kv_scale_name
from qurl_verl.settings import RolloutSettings

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("engine_environment")]

INT8_FP8_KV = RolloutSettings(format="int8", kv_cache="fp8", ignore=("o_proj",))
LAYERS = 2


@pytest.fixture(scope="module")
def fp8_kv_engine(tiny_model_dir, engine_environment):
    require_vllm()
    import torch as torch_

    if not (torch_.cpu._is_avx512_supported() or torch_.cpu._is_amx_tile_supported()):
        pytest.skip("vLLM-CPU has an FP8 KV cache on AVX-512 and AMX CPUs only; the driver refuses it here "
                    "(tests/unit/test_config_checks.py forces this branch on every CPU)")
    if ON_GPU_USERS_VLLM:
        llm, at_start = start_triton_int8_engine(tiny_model_dir, INT8_FP8_KV, engine_environment, dtype="float32")
    else:
        llm, at_start = start_engine(tiny_model_dir, INT8_FP8_KV, dtype="float32"), None
    yield llm, at_start
    stop_engine(llm)


def trainer_scales(model, prompts) -> dict[str, torch.Tensor]:
    """The stream entries the actor would send: ranges observed in the model's attention dispatch."""
    observer = KVRangeObserver()
    with torch.no_grad(), kv_hook(lambda m, q, k, v: observer.observe(layer_index(m), q, k, v)):
        for ids in prompts:
            model(torch.tensor([ids]))
    return kv_scales(observer.take())


def weight_bounded_scales(master: dict[str, torch.Tensor]) -> dict[tuple[int, str], float]:
    """The scales of a sync without streamed ones: per layer and part, the largest ``sqrt(d) max|g| ||W_j||_2 +
    |b_j|`` (g: input_layernorm's weight), times sqrt(2) for q and k (RoPE), over 448; in float64."""
    scales = {}
    for i in range(LAYERS):
        g = master[f"model.layers.{i}.input_layernorm.weight"].double().abs().max()
        for part in "qkv":
            w = master[f"model.layers.{i}.self_attn.{part}_proj.weight"].double()
            b = master[f"model.layers.{i}.self_attn.{part}_proj.bias"].double()
            bound = (w.shape[1] ** 0.5 * g * w.norm(dim=-1) + b.abs()).max() * (2**0.5 if part in "qk" else 1.0)
            scales[(i, part)] = float(bound) / 448
    return scales


def as_pairs(scales: dict[str, torch.Tensor]) -> dict[tuple[int, str], float]:
    return {parse_kv_scale_name(name): float(value) for name, value in scales.items()}


def test_the_engine_attends_with_the_streamed_kv_scales(fp8_kv_engine, tiny_model_dir):
    fp8_kv_engine, at_start = fp8_kv_engine
    if at_start is not None:
        (classes,) = fp8_kv_engine.collective_rpc("probe_int8_kernel_classes")
        assert set(classes.values()) == {TRITON}, classes
        scales_held = [k.rpartition(".")[2] for k in at_start if k.startswith("attention ")]
        assert sorted(scales_held) == sorted(["_q_scale", "_k_scale", "_v_scale", "_prob_scale"] * LAYERS), scales_held
    (attention,) = fp8_kv_engine.collective_rpc("qurl_fp8_attention")  # the GPU check's reference reads it
    assert attention["backends"] == ["CPU_ATTN"] and attention["quantizes_query"] == [False], attention
    trainer = TrainerWeights(tiny_model_dir)
    prompts = prompt_ids(tiny_model_dir)
    previous = {(i, p): 1.0 for i in range(LAYERS) for p in "qkv"}
    for sync in range(4):
        if sync:
            trainer.step()
        model = reference_model(tiny_model_dir, trainer.master, INT8_FP8_KV, torch.float32)
        streamed = {}
        if sync:
            streamed = trainer_scales(model, prompts)
            if sync == 3:
                streamed = {name: 4 * value for name, value in streamed.items()}
        scales = as_pairs(streamed) or weight_bounded_scales(trainer.master)
        [stats] = sync_weights(fp8_kv_engine, [*trainer.named_tensors(), *streamed.items()])
        assert stats["kv_scale_layers_streamed"] == (LAYERS if sync else 0), stats
        assert stats["kv_scale_layers_from_weights"] == (0 if sync else LAYERS), stats
        assert stats["kv_scale_k_max"] == pytest.approx(max(scales[(i, "k")] for i in range(LAYERS)), rel=1e-6)
        assert stats["kv_scale_v_min"] == pytest.approx(min(scales[(i, "v")] for i in range(LAYERS)), rel=1e-6)
        assert stats["quantized"] == 6 * LAYERS, stats  # the scales are not weights of the stream

        seqs, got = engine_logprobs(fp8_kv_engine, prompts)
        vs_ref = summary(abs_diffs(got, reference_logprobs(model, seqs, kv_scales=scales)))
        print(f"\nFP8 KV sync {sync + 1}: scales {scales}; engine vs reference {vs_ref}")
        assert vs_ref["median"] <= 1e-5 and vs_ref["p75"] <= 1e-3 and vs_ref["max"] <= 0.1, vs_ref
        if scales != previous:
            vs_stale = summary(abs_diffs(got, reference_logprobs(model, seqs, kv_scales=previous)))
            print(f"FP8 KV sync {sync + 1}: engine vs reference with the previous scales {vs_stale}")
            assert vs_stale["median"] > 1e-4, vs_stale
        if at_start is not None:
            assert not moved_records(fp8_kv_engine, at_start), sync + 1
        previous = scales


def test_a_stream_with_some_layers_scales_only_fails_the_sync(fp8_kv_engine, tiny_model_dir):
    """Runs last: it breaks the engine on purpose."""
    fp8_kv_engine, _ = fp8_kv_engine
    trainer = TrainerWeights(tiny_model_dir)
    model = reference_model(tiny_model_dir, trainer.master, INT8_FP8_KV, torch.float32)
    layer0 = {n: t for n, t in trainer_scales(model, prompt_ids(tiny_model_dir)).items() if parse_kv_scale_name(n)[0] == 0}
    with pytest.raises(Exception, match=r"missing for layer.part \['1.k', '1.q', '1.v'\]"):
        sync_weights(fp8_kv_engine, [*trainer.named_tensors(), *layer0.items()])
