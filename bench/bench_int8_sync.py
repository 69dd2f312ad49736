"""Bytes and seconds per weight sync: what verl 0.9.1 streams vs what ``qurl_int8`` sends, side by side.

Two processes on this machine (a trainer side and a rollout side) in the engine's own gloo group, at the
Qwen2.5-0.5B (tied embeddings) and DeepSeek-R1-Distill-Qwen-1.5B (untied) layer shapes, random weights of those
shapes. The streams:

- ``fp32``: what verl 0.9.1 streams in the disaggregated modes, the FSDP engine's ``get_per_tensor_param``: the
  module's ``state_dict`` (with a tied model's ``lm_head.weight``, the duplicate of the embedding) in the trainer's
  dtype, fp32 masters, not cast before sending (``verl/workers/engine/fsdp/transformer_impl.py``,
  ``get_per_tensor_param``; verl's ``nccl`` engine sends the tensors as given). Here: the same engine, buckets and
  group as the 8-bit streams with the quantizer bypassed (same payload as verl's engine; its seconds are gloo's, not
  NCCL's);
- ``int8`` / ``fp8``: what ``qurl_int8`` sends: trainer-side codes + fp32 per-row scales + the full-precision rest
  (embeddings, an untied lm_head, norms, biases) in fp32, the tied ``lm_head.weight`` not sent;
- ``int8+bf16`` / ``fp8+bf16``: the same with the rest in the rollout's bf16 (``engine_kwargs.qurl_int8.rest_dtype``).

Seconds are the sender's wall time per sync, quantization included (``quantize_s``); the group is rebuilt per sync
as in verl's manager (not timed). Every measured payload must equal the byte count from the model's shapes
(``stream_bytes``); the same count gives the Qwen2.5-7B and 32B rows, too big to allocate here (shapes from their
published config.json, ``roofline_shapes.MODEL_SHAPES``), with the network time at 400 Gb/s.

Writes ``bench/results/int8_sync.{json,md}`` with the CPU (model name and flag class).
Usage: python bench/bench_int8_sync.py [--models 0.5b 1.5b] [--formats fp32 int8 int8+bf16 fp8+bf16] [--repeats 2]
"""
from __future__ import annotations

import argparse
import asyncio
import pickle
import sys
import time

import bench_harness  # noqa: F401 - sys.path first
import torch
import torch.multiprocessing as mp
from bench_harness import RESULTS, environment, loadavg, write_result
from roofline_shapes import MODEL_SHAPES, ModelShape

from qurl_verl.checkpoint_engine.int8_engine import QurlInt8CheckpointEngine

MODELS = {"0.5b": "Qwen/Qwen2.5-0.5B-Instruct", "1.5b": "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B"}
COMPUTED_MODELS = ("Qwen/Qwen2.5-7B", "Qwen/Qwen2.5-32B")  # bytes from shapes: 30 / 131 GB of fp32 masters
LINK_GBPS = 400
BUCKET_MB = 256
FORMATS = ("fp32", "int8", "int8+bf16", "fp8+bf16")
REST_DTYPES = {"": None, "bf16": "bfloat16"}
REST_BYTES = {"": 4, "bf16": 2}
TIED_LM_HEAD = "lm_head.weight"
# How the tied lm_head stays out of the 8-bit stream. The engine at 0.2.0 sends it (the rollout worker drops it),
# so the bench leaves it out of the stream it hands the engine (what the rebuilt engine does itself). With an
# engine that skips it from an ``engine_kwargs`` entry, put that entry here: the bench then hands the engine the
# whole state_dict, and the payload check below says whether the engine left the duplicate out.
ENGINE_KWARGS_SKIPPING_TIED_LM_HEAD: dict | None = None


class FullPrecisionEngine(QurlInt8CheckpointEngine):
    """The same transport with the quantizer bypassed: the fp32 baseline."""

    def quantized_stream(self, weights, stats=None):
        for name, tensor in weights:
            if stats is not None:
                stats.tensors += 1
            yield name, tensor.detach().to(self.device).contiguous()


def layer_tensors(s: ModelShape, seed: int = 0) -> dict[str, torch.Tensor]:
    """One decoder layer (Qwen2 names, under ``model.layers.{i}.``): reused for every layer, so memory stays
    one layer + embeddings while bytes and quantization work are those of the whole model."""
    g = torch.Generator().manual_seed(seed)
    h, kv = s.hidden_size, s.num_kv_heads * s.head_dim
    q = s.num_heads * s.head_dim

    def r(*shape):
        return torch.randn(*shape, generator=g) * 0.02

    return {
        "input_layernorm.weight": torch.ones(h), "post_attention_layernorm.weight": torch.ones(h),
        "self_attn.q_proj.weight": r(q, h), "self_attn.q_proj.bias": r(q),
        "self_attn.k_proj.weight": r(kv, h), "self_attn.k_proj.bias": r(kv),
        "self_attn.v_proj.weight": r(kv, h), "self_attn.v_proj.bias": r(kv),
        "self_attn.o_proj.weight": r(h, q),
        "mlp.gate_proj.weight": r(s.intermediate_size, h), "mlp.up_proj.weight": r(s.intermediate_size, h),
        "mlp.down_proj.weight": r(h, s.intermediate_size),
    }


def model_stream(s: ModelShape, layer: dict[str, torch.Tensor], embed: torch.Tensor, lm_head: torch.Tensor):
    """The module's ``state_dict`` order and names, as verl's FSDP engine streams it: a tied model's
    ``lm_head.weight`` is the embedding tensor under a second name."""
    yield "model.embed_tokens.weight", embed
    for i in range(s.num_layers):
        for name, t in layer.items():
            yield f"model.layers.{i}.{name}", t
    yield "model.norm.weight", layer["input_layernorm.weight"]
    yield TIED_LM_HEAD, embed if s.tie_word_embeddings else lm_head


def qurl_stream(s: ModelShape, weights):
    """What the bench hands ``qurl_int8``: the state_dict, less the tied lm_head while the engine sends it."""
    for name, t in weights:
        if s.tie_word_embeddings and name == TIED_LM_HEAD and ENGINE_KWARGS_SKIPPING_TIED_LM_HEAD is None:
            continue
        yield name, t


def element_counts(s: ModelShape) -> dict[str, int]:
    """Elements per kind, from the shapes: the decoder linears (8-bit codes), their output rows (one fp32 scale each
    in the channel schemes), and the rest (embedding, untied lm_head, norms, biases; Qwen3's q/k norms)."""
    h, q, kv, i = s.hidden_size, s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim, s.intermediate_size
    per_layer_rest = 2 * h + (q + 2 * kv if s.qkv_bias else 0) + (2 * s.head_dim if s.qk_norm else 0)
    return {"linear": s.num_layers * (q * h + 2 * kv * h + h * q + 3 * i * h),
            "rows": s.num_layers * (q + 2 * kv + h + 2 * i + h),
            "embedding": s.vocab_size * h,
            "other_rest": s.num_layers * per_layer_rest + h}


def stream_bytes(s: ModelShape, fmt: str, tied_lm_head_sent: bool | None = None) -> int:
    """Payload bytes of one sync. ``fp32``: verl's stream (every state_dict tensor, a tied lm_head's duplicate
    included, 4 bytes each); 8-bit: codes + fp32 scales + the rest at its dtype, the tied lm_head not sent.
    ``tied_lm_head_sent`` overrides whether a tied model's duplicate is counted (the previous accounting: never)."""
    n = element_counts(s)
    quantization, _, rest = fmt.partition("+")
    if quantization not in ("fp32", "int8", "fp8"):
        raise ValueError(f"{fmt}: bytes are counted for fp32 and the channel schemes (int8, fp8), with +bf16")
    sent = (quantization == "fp32") if tied_lm_head_sent is None else tied_lm_head_sent
    heads = 1 if s.tie_word_embeddings and not sent else 2
    rest_elements = heads * n["embedding"] + n["other_rest"]
    if quantization == "fp32":
        return 4 * (n["linear"] + rest_elements)
    return n["linear"] + 4 * n["rows"] + REST_BYTES[rest] * rest_elements


def _side(side: str, s: ModelShape, formats: list[str], repeats: int, queue, results) -> None:
    """One side, every stream in turn (an engine per stream, as a run has one), ``repeats`` syncs each."""
    torch.set_num_threads(1)  # two processes on a 2-core machine
    if side == "trainer":
        layer, embed = layer_tensors(s), torch.randn(s.vocab_size, s.hidden_size) * 0.02
        lm_head = embed  # untied: a head of the embedding's shape and bytes (its values do not matter here)

    async def sync(engine, cls, fmt: str) -> dict:
        if side == "trainer":
            meta = engine.prepare()
            queue.put(meta)
        else:
            meta = queue.get(timeout=300)
        actor, rollout = cls.build_topology(1, 1, [meta, None])
        kwargs = actor if side == "trainer" else rollout
        engine.init_process_group(**{k: v[0] for k, v in kwargs.items()})
        start = time.perf_counter()
        names = []
        if side == "trainer":
            weights = model_stream(s, layer, embed, lm_head)
            await engine.send_weights(weights if fmt == "fp32" else qurl_stream(s, weights))
        else:
            async for name, _tensor in engine.receive_weights():
                names.append(name)
        wall = time.perf_counter() - start
        st = engine.last_stats
        engine.finalize()
        return {"seconds": wall, "payload_bytes": st.payload_bytes, "meta_bytes": st.meta_bytes,
                "buckets": st.buckets, "quantize_s": st.quantize_s, "dtype_bytes": st.dtype_bytes,
                "tied_lm_head_received": TIED_LM_HEAD in names if side == "rollout" else None}

    async def main():
        out = {}
        for fmt in formats:
            cls = FullPrecisionEngine if fmt == "fp32" else QurlInt8CheckpointEngine
            quantization, _, rest = fmt.partition("+")  # "int8+bf16": the rest in bf16 (engine_kwargs rest_dtype)
            extra_kwargs = (ENGINE_KWARGS_SKIPPING_TIED_LM_HEAD or {}) if fmt != "fp32" else {}
            engine = cls(BUCKET_MB << 20, is_master=side == "trainer",
                         quantization="int8" if fmt == "fp32" else quantization, rest_dtype=REST_DTYPES[rest],
                         device="cpu", **extra_kwargs)
            out[fmt] = [await sync(engine, cls, fmt) for _ in range(repeats)]
        results.put(pickle.dumps((side, out)))

    asyncio.run(main())


def measure(s: ModelShape, formats: list[str], repeats: int, model: str) -> list[dict]:
    """Every stream of one model between the same two processes; a row per stream, its best sync's seconds."""
    ctx = mp.get_context("spawn")
    queue, results = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_side, args=(side, s, list(formats), repeats, queue, results))
             for side in ("trainer", "rollout")]
    for p in procs:
        p.start()
    out = {}
    for _ in procs:
        side, rows = pickle.loads(results.get(timeout=3600))
        out[side] = rows
    for p in procs:
        p.join(timeout=120)
    report = []
    for fmt in formats:
        trainer, rollout = out["trainer"][fmt], out["rollout"][fmt]
        assert all(t["payload_bytes"] == r["payload_bytes"] for t, r in zip(trainer, rollout))
        expected = stream_bytes(s, fmt)
        assert trainer[0]["payload_bytes"] == expected, (model, fmt, trainer[0]["payload_bytes"], expected)
        best = min(range(repeats), key=lambda i: trainer[i]["seconds"])
        report.append({
            "model": model, "format": fmt, "repeats": repeats, "baseline_bytes": stream_bytes(s, "fp32"),
            "payload_bytes": trainer[best]["payload_bytes"], "meta_bytes": trainer[best]["meta_bytes"],
            "buckets": trainer[best]["buckets"], "dtype_bytes": trainer[best]["dtype_bytes"],
            "tied_lm_head_received": rollout[best]["tied_lm_head_received"],
            "send_s": trainer[best]["seconds"], "quantize_s": trainer[best]["quantize_s"],
            "receive_s": rollout[best]["seconds"], "send_s_all": [t["seconds"] for t in trainer]})
    return report


def byte_ratios(model: str, formats=("int8", "int8+bf16")) -> dict:
    """Per model, from the shapes: bytes of each stream, its ratio to verl's fp32 stream, and the previous
    accounting's ratio (the tied lm_head in neither stream), the ratio with the duplicate sent (the engine at 0.2.0),
    and the network seconds at LINK_GBPS."""
    s = MODEL_SHAPES[model]
    base = stream_bytes(s, "fp32")
    link = LINK_GBPS / 8 * 1e9
    rows = {"model": model, "source": s.source, "tied": s.tie_word_embeddings, "fp32_bytes": base,
            "fp32_s": base / link, "bf16_bytes": base // 2, "formats": {}}
    for fmt in formats:
        got = stream_bytes(s, fmt)
        previous = stream_bytes(s, fmt, tied_lm_head_sent=False) / stream_bytes(s, "fp32", tied_lm_head_sent=False)
        with_duplicate = stream_bytes(s, fmt, tied_lm_head_sent=True) / base
        rows["formats"][fmt] = {"bytes": got, "ratio": got / base, "previous_ratio": previous,
                                "duplicate_sent_ratio": with_duplicate, "seconds": got / link}
    return rows


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = ["# Weight sync: what verl 0.9.1 streams vs what `qurl_int8` sends", "",
             f"{env['cpu_model']} (class `{env['cpu_class']}`, {env['cores']} cores, load {env['loadavg']}), "
             f"torch {env['torch']}, verl {env['verl']}; two processes over the engine's own gloo group on loopback, "
             f"{BUCKET_MB} MiB buckets, 1 thread each; best of {report['repeats']} syncs. Random weights of each "
             "model's shapes, fp32 masters.", "",
             "`fp32` is verl 0.9.1's stream: the FSDP state_dict in the trainer's fp32, a tied model's `lm_head.weight` "
             "(the embedding's duplicate) included. `int8`/`fp8` are what `qurl_int8` sends: codes + fp32 per-row "
             "scales + the rest (embedding, an untied lm_head, norms, biases) in fp32, the tied lm_head not sent; "
             "`+bf16`: that rest in the rollout's bf16 (`engine_kwargs.qurl_int8.rest_dtype=bfloat16`), which the "
             "worker casts it to anyway. Every payload below equals the count from the model's shapes.", "",
             "| model | stream | bytes / sync | ratio to verl's fp32 | buckets | send s | of which quantize s | receive s |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in report["results"]:
        lines.append(f"| {r['model']} | {r['format']} | {r['payload_bytes'] / 1e9:.3f} GB | "
                     f"{r['payload_bytes'] / r['baseline_bytes']:.3f} | {r['buckets']} | {r['send_s']:.2f} | "
                     f"{r['quantize_s']:.2f} | {r['receive_s']:.2f} |")
    fp32 = [r for r in report["results"] if r["format"] == "fp32"]
    eight = [r for r in report["results"] if r["format"] != "fp32"]
    if fp32 and eight:
        rate = sum(r["payload_bytes"] for r in fp32) / sum(r["send_s"] for r in fp32) / 1e9
        wire = [r["send_s"] - r["quantize_s"] for r in eight]
        lines += ["", f"Seconds: the fp32 streams moved {rate:.2f} GB/s through loopback gloo here; send minus quantize "
                  f"of the 8-bit streams: {min(wire):.2f} to {max(wire):.2f} s. The trainer side quantizes on one CPU "
                  "thread, serially with the broadcasts (a bucket is quantized, then sent). These seconds are a shared "
                  f"2-core machine's (load average {env['loadavg'][0]:.1f} at the start, "
                  f"{report.get('loadavg_end', [float('nan')])[0]:.1f} at the last write; every sync's seconds in the "
                  "json): they vary by 2x between repeats and say nothing about a network, where the bytes are the "
                  "cost (below) and the quantizer runs on the trainer's GPU."]
    lines += ["", f"## Bytes per sync from the shapes, and the network time at {LINK_GBPS} Gb/s (one replica)", "",
              "Ratios to verl's fp32 stream. In brackets: the previous accounting (the tied lm_head in neither "
              "stream), then the engine at 0.2.0 (it sends the tied duplicate, which the rollout worker drops); both "
              "differ from the ratio only for tied models.", "",
              "| model | tied | verl fp32 | 8-bit, rest fp32 | ratio (previous; 0.2.0) | 8-bit, rest bf16 | "
              "ratio (previous; 0.2.0) |",
              "|---|---|---:|---:|---:|---:|---:|"]
    for r in report["byte_ratios"]:
        cells = [f"{f['bytes'] / 1e9:.2f} GB, {f['seconds']:.2f} s | {f['ratio']:.3f} ({f['previous_ratio']:.3f}; "
                 f"{f['duplicate_sent_ratio']:.3f})" for f in (r["formats"]["int8"], r["formats"]["int8+bf16"])]
        lines.append(f"| {r['model']} | {'yes' if r['tied'] else 'no'} | {r['fp32_bytes'] / 1e9:.2f} GB, "
                     f"{r['fp32_s']:.2f} s | {cells[0]} | {cells[1]} |")
    lines += ["", "Shapes: " + "; ".join(f"{r['model']}: {r['source']}" for r in report["byte_ratios"]) + ".",
              "", "A broadcast to R replicas costs the same bytes per link in a tree/ring; with one sender NIC "
              "and point-to-point sends it is R times these seconds.", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--formats", nargs="+", default=list(FORMATS))
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args(argv)
    report = {"environment": environment(), "bucket_mb": BUCKET_MB, "repeats": args.repeats, "results": [],
              "byte_ratios": [byte_ratios(m) for m in (*MODELS.values(), *COMPUTED_MODELS)],
              "link_gbps": LINK_GBPS, "tied_lm_head_left_out_by": "bench" if ENGINE_KWARGS_SKIPPING_TIED_LM_HEAD is None
              else "engine"}
    for key in args.models:
        for row in measure(MODEL_SHAPES[MODELS[key]], args.formats, args.repeats, MODELS[key]):
            report["results"].append(row)
            report["loadavg_end"] = loadavg()
            print(f"{key} {row['format']}: {row['payload_bytes'] / 1e9:.3f} GB, send {row['send_s']:.2f}s "
                  f"(quantize {row['quantize_s']:.2f}s), receive {row['receive_s']:.2f}s", flush=True)
        write_result(RESULTS / "int8_sync", report, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
