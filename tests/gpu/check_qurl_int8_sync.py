"""GPU check of the ``qurl_int8`` checkpoint engine: two syncs between two GPUs over NCCL, with a CPU dry run.

For a user's machine with 2 CUDA GPUs and the user's own verl 0.9.1 install (verl, Ray, torch with NCCL,
transformers; vLLM is not needed: no engine starts), plus qurl-verl (``pip install -e .``). Run it from the
repository root (``qurl_recipes`` builds the tiny model and is not in the wheel). No network. It is not for a bare
GPU box with torch alone: the engine is verl's plugin, built through verl's registry, so without verl or Ray it
says so and exits 2.

    python tests/gpu/check_qurl_int8_sync.py                 # 2 GPUs: 2 syncs over NCCL, well under a minute
    python tests/gpu/check_qurl_int8_sync.py --dry-run       # CPU only: the same flow over gloo
    python tests/gpu/check_qurl_int8_sync.py --rest-dtype float32 --quantization fp8

WHAT RAN WHERE. The ``--dry-run`` flow ran on CPU (verl 0.9.1, Ray, torch 2.11 and 2.13); the test suite runs it
(``tests/unit/test_int8_sync_gpu_check_dry_run.py``). The NCCL path, the CUDA quantization and the memory check
were written without a GPU: nothing on CUDA was run.

What it does, as verl's ``CheckpointEngineManager`` does it in the disaggregated modes. A local Ray (``num_gpus=2``)
holds two Ray actors with one GPU each (``num_gpus=1``: Ray sets each one's ``CUDA_VISIBLE_DEVICES``, and verl's
``NCCLCheckpointEngine`` inside reads its node from ``ray.get_runtime_context().get_node_id()``, its zmq address
from ``ray.util.get_node_ip_address()`` and builds its group through ``ray.util.collective``; the trainer side's
buffers are cupy's, so cupy must be installed): the trainer side (actor rank 0, ``is_master=True``) and one
rollout worker. Each builds its engine through verl's registry (``import qurl_verl.checkpoint_engine.int8_engine``, then
``CheckpointEngineRegistry.new("qurl_int8", bucket_size=..., is_master=..., **engine_kwargs)``). Per sync:
``prepare()`` on both, the registered class's ``build_topology(1, 1, [metadata_actor, metadata_rollout])``,
``init_process_group(**kwargs)`` on each side, ``send_weights`` / ``receive_weights`` concurrently, ``finalize()``.
The trainer sends the fp32 weights of a tiny Qwen2 (tied embeddings) as verl's FSDP ``state_dict`` streams them
(``lm_head.weight`` included, the tied duplicate); between syncs every weight moves by 1 % of its spread, so the
codes change.

Checks, per sync (a ``PASS``/``FAIL`` line each):

- ``bits``: what the rollout received, name by name, equal bit for bit (dtype, shape, bytes) to a direct
  ``quantize_state_dict`` of the same weights with the engine's settings (``engine_settings.settings_of``),
  computed on the rollout worker's device, the rest in the rollout's dtype, and the tied ``lm_head.weight`` left
  out (``engine_kwargs["tie_word_embeddings"]``, read from the tiny model's ``config.json`` as the driver fills it:
  ``qurl_verl.driver.int8_sync_checks.ties_word_embeddings``);
- ``checksum_sent``: the sender's ``qurl_sync/checksum`` equal to ``StreamStats().add_checksum`` over what the
  rollout received; ``checksum_direct``: that sum equal to the same sum over the direct quantization;
- ``codes_changed`` (from sync 2): every 8-bit tensor holds other codes than at the sync before (the syncs are not
  the same bytes twice);
- ``memory`` (GPU only): the rollout GPU's caching allocator held verl's two bucket buffers during the sync
  (``torch.cuda.max_memory_reserved()`` at least ``2 * bucket`` above the level before the first sync: the check
  sees the memory it then wants back), and after ``finalize()`` (verl's engine drops its buffers and calls
  ``empty_cache``) ``torch.cuda.memory_reserved()`` is at most ``MEMORY_SLACK_BYTES`` above that level (the
  rollout's vLLM re-maps its KV cache after the sync; a cache the engine keeps is memory it cannot have). The
  numbers (before, peak, after; and the device's used memory from ``cudaMemGetInfo``, which counts NCCL's
  communicator buffers too: the group is kept across syncs, ``rebuild_group=False``) are in the result;
- time: every ``ray.get`` has a timeout (``--timeout-s``), and so has the engine's group.

``--perturb-sent-weight NAME`` (self-test): from ``--perturb-from-sync`` on, the trainer sends ``NAME`` negated
while the reference quantizes the true weights: ``bits`` and ``checksum_direct`` must fail, ``checksum_sent`` must
still pass (the transport carried what was sent). (Negated, not reversed: the checksum sums bit patterns, so a
permutation within a tensor keeps it.)

``--dry-run`` (CPU only): the same script with ``engine_kwargs["device"] = "cpu"`` (the engine's gloo transport)
and CPU-only Ray actors: everything but NCCL and the memory check runs.

Without 2 GPUs (and no ``--dry-run``) it prints ``SKIPPED`` and exits 0; without verl or Ray (or, on GPU, cupy) it
exits 2. Otherwise
it exits 0 when every check passed, 1 on any failure (a timeout included). Writes the result (every check, the engine's metrics, the memory
numbers, versions, seconds) as JSON to ``--out``.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # qurl_recipes (the tiny model)

ENGINE_NAME = "qurl_int8"
ENGINE_MODULE = "qurl_verl.checkpoint_engine.int8_engine"  # verl's custom_backend_module
CHECKSUM_METRIC = "qurl_sync/checksum"
TIED_LM_HEAD = "lm_head.weight"
ROLLOUT_DTYPE = "bfloat16"  # verl's default rollout dtype: what the rest is sent in (``--rest-dtype``)
# The GPU run's model: the Qwen2 shape of check_qurl_vllm_cuda.py (about 45 M parameters, 180 MB of fp32 masters,
# several buckets); the dry run keeps the default tiny spec (0.4 M parameters).
GPU_MODEL_SPEC = dict(hidden_size=1024, num_layers=4, num_heads=16, num_kv_heads=4, intermediate_size=2816)
GPU_BUCKET_BYTES = 16 << 20
DRY_RUN_BUCKET_BYTES = 128 << 10  # the fp32 embedding (256 KiB) spans two buckets
PERTURB_SCALE = 0.01  # of each weight's standard deviation, per sync: enough to move codes, seeded
# After finalize() the rollout GPU's reserved memory may exceed its level before the first sync by one block of
# the caching allocator's small pool (2 MiB): the engine may keep a few scalars, not buckets.
MEMORY_SLACK_BYTES = 2 << 20
DEFAULT_OUT = REPO / "outputs" / "gpu_checks"


def expected_stream(weights: dict, engine_kwargs: dict, device: str) -> list[tuple[str, object]]:
    """What the rollout must receive: ``quantize_state_dict`` of the trainer's weights with the engine's settings,
    the full-precision rest (not codes, not scales) in the rest dtype, without lm_head when ``engine_kwargs`` says
    the model ties it to the embedding."""
    import torch

    from qurl_verl.checkpoint_engine.engine_settings import settings_of
    from qurl_verl.quant.compressed_tensors_format import quantize_state_dict

    settings = settings_of(engine_kwargs)
    rest_dtype = getattr(torch, engine_kwargs["rest_dtype"]) if engine_kwargs.get("rest_dtype") else None
    tied = bool(engine_kwargs.get("tie_word_embeddings"))
    named = ((n, t.to(device)) for n, t in weights.items() if not (tied and n == TIED_LM_HEAD))
    out = []
    for name, t in quantize_state_dict(named, settings.quant_scheme, ignore=settings.ignore_patterns):
        if rest_dtype is not None and t.is_floating_point() and t.element_size() > 1 and not name.endswith("weight_scale"):
            t = t.to(rest_dtype)
        out.append((name, t))
    return out


def to_wire(t) -> tuple[str, tuple[int, ...], bytes]:
    """A tensor as plain bytes: dtype, shape and its bit pattern (FP8 storages do not pickle)."""
    import torch

    bits = t.detach().contiguous().reshape(-1).view(torch.uint8)
    return str(t.dtype).removeprefix("torch."), tuple(t.shape), bits.cpu().numpy().tobytes()


class SyncSide:
    """One side of the sync in its own Ray actor: the engine built as verl builds it, on this actor's device."""

    def __init__(self, is_master: bool, bucket_size: int, engine_kwargs: dict, dry_run: bool):
        import torch

        if dry_run:
            torch.set_num_threads(1)
        from verl.checkpoint_engine import CheckpointEngineRegistry

        importlib.import_module(ENGINE_MODULE)  # what verl's import_external_libs(custom_backend_module) does
        self.device = "cpu" if dry_run else "cuda"
        if not dry_run:
            torch.cuda.set_device(0)  # Ray's CUDA_VISIBLE_DEVICES: this actor's one GPU
            torch.cuda.init()
        self.engine = CheckpointEngineRegistry.new(ENGINE_NAME, bucket_size=bucket_size, is_master=is_master,
                                                   **engine_kwargs)

    def where(self) -> dict:
        import ray
        import torch

        info = {"engine_class": f"{type(self.engine).__module__}.{type(self.engine).__qualname__}",
                "gpu_ids": [str(g) for g in ray.get_gpu_ids()], "pid": os.getpid()}
        if self.device == "cuda":
            info["device_name"] = torch.cuda.get_device_name()
        return info

    def prepare(self):
        return self.engine.prepare()

    def init_process_group(self, **kwargs) -> None:
        self.engine.init_process_group(**kwargs)

    def finalize(self) -> None:
        self.engine.finalize()

    async def send(self, weights: dict, step: int, perturbed: str | None) -> dict:
        """verl's actor side: ``send_weights`` over the per-tensor generator (tensors on this GPU, as FSDP's)."""
        def generator():
            for name, t in weights.items():
                t = t.to(self.device)
                if name == perturbed:
                    t = -t
                yield name, t

        return await self.engine.send_weights(generator(), global_steps=step)

    async def receive(self, step: int) -> dict:
        """verl's ``CheckpointEngineWorker.update_weights``: the tensors as ``receive_weights`` yields them, handed on
        (here: copied off the device) and dropped, with the stream's checksum of what arrived."""
        from qurl_verl.rollout.sync_stats import StreamStats

        stats = StreamStats()
        received = []
        async for name, t in self.engine.receive_weights(global_steps=step):
            stats.add_checksum(((name, t),))
            received.append((name, to_wire(t)))
        return {"tensors": received, "checksum": stats.checksum}

    def direct(self, weights: dict, engine_kwargs: dict) -> dict:
        """The reference on this worker's device: the direct quantization of the same weights."""
        from qurl_verl.rollout.sync_stats import StreamStats

        expected = expected_stream(weights, engine_kwargs, self.device)
        stats = StreamStats()
        stats.add_checksum(expected)
        return {"tensors": [(n, to_wire(t)) for n, t in expected], "checksum": stats.checksum}

    def memory(self, reset_peak: bool = False) -> dict:
        """Reserved and peak bytes of this process's caching allocator, and the device's used bytes."""
        import torch

        if self.device != "cuda":
            return {}
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        out = {"reserved": torch.cuda.memory_reserved(), "allocated": torch.cuda.memory_allocated(),
               "peak_reserved": torch.cuda.max_memory_reserved(), "device_used": total - free}
        if reset_peak:
            torch.cuda.reset_peak_memory_stats()
        return out


def build_weights(tmp: Path, dry_run: bool) -> tuple[dict, dict]:
    """The tiny Qwen2's fp32 weights as verl's FSDP ``state_dict`` streams them (the tied lm_head included), and its
    ``config.json``."""
    import torch
    from transformers import AutoModelForCausalLM

    from qurl_recipes.tiny_model import TinyModelSpec, build_tiny_model

    spec = TinyModelSpec() if dry_run else TinyModelSpec(**GPU_MODEL_SPEC)
    model_dir = build_tiny_model(tmp / "model", spec, dtype="float32")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    weights = {n: t.detach().clone() for n, t in model.state_dict().items()}
    if model.config.tie_word_embeddings:  # one tensor under both names, as in the module's state_dict
        weights[TIED_LM_HEAD] = weights["model.embed_tokens.weight"]
    return weights, json.loads((Path(model_dir) / "config.json").read_text())


def perturbed(weights: dict, step: int) -> dict:
    """The weights of the next step: every floating tensor moved by PERTURB_SCALE of its spread (seeded)."""
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    out = {}
    for name, t in weights.items():
        spread = t.std() if t.numel() > 1 and t.std() > 0 else t.abs().mean().clamp_min(1.0)  # norms start at ones
        out[name] = t + PERTURB_SCALE * spread * torch.randn(t.shape, generator=g, dtype=t.dtype)
    if weights.get(TIED_LM_HEAD) is weights["model.embed_tokens.weight"]:
        out[TIED_LM_HEAD] = out["model.embed_tokens.weight"]  # still one tensor
    return out


def compare(received: list, expected: list) -> dict:
    """Names, then dtype, shape and bytes per tensor; what differs, by name."""
    got, want = dict(received), dict(expected)
    problems = []
    if len(got) != len(received):
        problems.append("a name arrived twice")
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    if missing:
        problems.append(f"missing: {missing}")
    if extra:
        problems.append(f"not expected: {extra}")
    differing = []
    for name in sorted(set(got) & set(want)):
        (gd, gs, gb), (wd, ws, wb) = got[name], want[name]
        if (gd, gs) != (wd, ws):
            differing.append(f"{name}: {gd}{list(gs)} where {wd}{list(ws)}")
        elif gb != wb:
            differing.append(f"{name}: other bytes")
    problems += differing
    return {"ok": not problems, "tensors": len(received), "differing": len(differing), "problems": problems[:20]}


def changed_codes(current: list, previous: list | None) -> dict:
    """8-bit tensors whose codes are the same bytes as at the previous sync (should be none)."""
    if previous is None:
        return {"ok": True, "skipped": "first sync"}
    before = dict(previous)
    codes = [(n, w) for n, w in current if w[0] in ("int8", "float8_e4m3fn") and n in before]
    same = [n for n, w in codes if w == before[n]]
    return {"ok": bool(codes) and not same, "code_tensors": len(codes), "unchanged": same}


def run(args) -> dict:
    import ray
    import torch
    from verl.checkpoint_engine import CheckpointEngineRegistry

    from qurl_verl.driver.int8_sync_checks import ties_word_embeddings

    importlib.import_module(ENGINE_MODULE)
    engine_cls = CheckpointEngineRegistry.get(ENGINE_NAME)
    bucket = DRY_RUN_BUCKET_BYTES if args.dry_run else GPU_BUCKET_BYTES
    with tempfile.TemporaryDirectory() as tmp:
        weights, hf_config = build_weights(Path(tmp), args.dry_run)
    # what the driver fills in engine_kwargs.qurl_int8: the rollout's dtype and the model's tie_word_embeddings
    engine_kwargs = {"quantization": args.quantization, "rest_dtype": args.rest_dtype,
                     "tie_word_embeddings": ties_word_embeddings(hf_config),
                     "device": "cpu" if args.dry_run else "cuda", "timeout_s": args.timeout_s}
    result = {"engine_kwargs": engine_kwargs, "bucket_bytes": bucket, "engine_class": engine_cls.__qualname__,
              "syncs": []}
    checks = result["checks"] = []

    def check(name: str, step: int | None, outcome: dict) -> None:
        checks.append({"check": name, "sync": step, **outcome})
        where = f" sync {step}" if step else ""
        detail = {k: v for k, v in outcome.items() if k != "ok"}
        print(f"{'PASS' if outcome['ok'] else 'FAIL'} {name}{where}: {json.dumps(detail, default=str)}", flush=True)

    result["model"] = {"tensors": len(weights), "fp32_bytes": sum(t.numel() * 4 for t in weights.values()),
                       "tie_word_embeddings": hf_config.get("tie_word_embeddings")}

    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    ray.init(address="local", num_cpus=2, num_gpus=0 if args.dry_run else 2, include_dashboard=False,
             runtime_env={"env_vars": {"PYTHONPATH": path}}, log_to_driver=True)
    try:
        actor = ray.remote(SyncSide).options(num_cpus=1, num_gpus=0 if args.dry_run else 1)
        trainer = actor.remote(True, bucket, engine_kwargs, args.dry_run)
        rollout = actor.remote(False, bucket, engine_kwargs, args.dry_run)
        get = lambda refs: ray.get(refs, timeout=args.timeout_s)  # noqa: E731 - every wait bounded
        result["actors"] = dict(zip(("trainer", "rollout"), get([trainer.where.remote(), rollout.where.remote()])))
        baseline = get(rollout.memory.remote(reset_peak=True))
        previous = None
        for step in range(1, args.syncs + 1):
            if step > 1:
                weights = perturbed(weights, step)
            started = time.monotonic()
            bad = args.perturb_sent_weight if args.perturb_sent_weight and step >= args.perturb_from_sync else None
            before = get(rollout.memory.remote(reset_peak=True))
            metadata = get([trainer.prepare.remote(), rollout.prepare.remote()])
            actor_kwargs, rollout_kwargs = engine_cls.build_topology(1, 1, metadata)
            get([trainer.init_process_group.remote(**{k: v[0] for k, v in actor_kwargs.items()}),
                 rollout.init_process_group.remote(**{k: v[0] for k, v in rollout_kwargs.items()})])
            shared = ray.put(weights)
            metrics, received = get([trainer.send.remote(shared, step, bad), rollout.receive.remote(step)])
            during = get(rollout.memory.remote())
            get([trainer.finalize.remote(), rollout.finalize.remote()])
            after = get(rollout.memory.remote())
            sync_s = time.monotonic() - started
            direct = get(rollout.direct.remote(shared, engine_kwargs))
            check("bits", step, compare(received["tensors"], direct["tensors"]))
            sent, got, want = metrics.get(CHECKSUM_METRIC), float(received["checksum"]), float(direct["checksum"])
            check("checksum_sent", step, {"ok": sent == got, "sent": sent, "received": got})
            check("checksum_direct", step, {"ok": got == want, "received": got, "direct": want})
            check("codes_changed", step, changed_codes(received["tensors"], previous))
            if not args.dry_run:
                held = during["peak_reserved"] >= before["reserved"] + 2 * bucket  # verl's two bucket buffers
                back = after["reserved"] <= baseline["reserved"] + MEMORY_SLACK_BYTES
                check("memory", step, {"ok": held and back, "buffers_seen": held, "released": back,
                                       "reserved_first": baseline["reserved"], "reserved_before": before["reserved"],
                                       "peak_reserved": during["peak_reserved"], "reserved_after": after["reserved"],
                                       "device_used_before": before["device_used"],
                                       "device_used_after": after["device_used"], "slack": MEMORY_SLACK_BYTES})
            names = [n for n, _ in received["tensors"]]
            result["syncs"].append({"sync": step, "seconds": round(sync_s, 3), "perturbed": bad,
                                    "metrics": metrics, "received_tensors": len(names),
                                    "tied_lm_head_received": TIED_LM_HEAD in names,
                                    "memory": {"before": before, "during": during, "after": after}})
            previous = received["tensors"]
        if torch.cuda.is_available() and not args.dry_run:
            result["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    finally:
        ray.shutdown()
    return result


def versions() -> dict:
    import ray
    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__, "ray": ray.__version__}
    try:
        import verl

        out["verl"] = verl.__version__
    except Exception:  # noqa: BLE001 - reported as missing
        out["verl"] = None
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="qurl_int8 checkpoint engine: two syncs between two GPUs over NCCL")
    parser.add_argument("--dry-run", action="store_true", help="CPU only: gloo, CPU-only Ray actors")
    parser.add_argument("--syncs", type=int, default=2)
    parser.add_argument("--quantization", choices=("int8", "fp8"), default="int8")
    parser.add_argument("--rest-dtype", default=ROLLOUT_DTYPE, choices=("bfloat16", "float16", "float32"),
                        help="engine_kwargs rest_dtype: the dtype of what is not sent as codes (the rollout's dtype)")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="every ray.get, and the engine's group")
    parser.add_argument("--out", type=Path, default=None, help=f"result JSON (default under {DEFAULT_OUT})")
    parser.add_argument("--perturb-sent-weight", nargs="?", const="model.layers.1.mlp.down_proj.weight", default=None,
                        help="self-test: the trainer sends this weight negated; the check must fail")
    parser.add_argument("--perturb-from-sync", type=int, default=1)
    args = parser.parse_args(argv)
    out = args.out or DEFAULT_OUT / ("qurl_int8_sync_dry_run.json" if args.dry_run else "qurl_int8_sync.json")

    import torch

    if not args.dry_run and torch.cuda.device_count() < 2:
        print(f"SKIPPED: this check needs 2 CUDA GPUs, {torch.cuda.device_count()} visible "
              "(--dry-run runs its flow on a CPU)", flush=True)
        return 0
    # verl's NCCLCheckpointEngine (the engine's CUDA transport) imports cupy: needed on GPU only
    needed = ("verl", "ray", "transformers") + (() if args.dry_run else ("cupy",))
    missing = [m for m in needed if importlib.util.find_spec(m) is None]
    if missing:
        print(f"CANNOT RUN: {', '.join(missing)} not installed; this check runs in a verl 0.9.1 environment "
              "(verl, Ray, transformers; cupy on GPU) with qurl-verl", flush=True)
        return 2
    started = time.monotonic()
    result = {"dry_run": args.dry_run, "versions": versions(), "argv": sys.argv[1:] if argv is None else list(argv)}
    try:
        result.update(run(args))
        ok = bool(result["checks"]) and all(c["ok"] for c in result["checks"])
    except Exception as e:  # noqa: BLE001 - a timeout or a crash is a failure with its reason
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()
        print(f"FAIL {result['error']}", flush=True)
        ok = False
    result["ok"] = ok
    result["seconds"] = round(time.monotonic() - started, 1)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    failed = sorted({c["check"] for c in result.get("checks", []) if not c["ok"]})
    print(f"{'PASS' if ok else 'FAIL'} qurl_int8 sync check ({'dry run, cpu' if args.dry_run else 'cuda, 2 GPUs'}): "
          f"{len(result.get('checks', []))} checks, failed {failed or 'none'}, {result['seconds']} s; result in {out}",
          flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
