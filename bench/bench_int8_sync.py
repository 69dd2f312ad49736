"""Bytes and seconds per weight sync: what verl 0.9.1 streams vs what ``qurl_int8`` sends, side by side.

Two processes on this machine (a trainer side and a rollout side) in the engine's own gloo group, at the
Qwen2.5-0.5B (tied embeddings) and DeepSeek-R1-Distill-Qwen-1.5B (untied) layer shapes, random weights of those
shapes. The streams:

- ``fp32``: what verl 0.9.1 streams in the disaggregated modes, the FSDP engine's ``get_per_tensor_param``: the
  module's ``state_dict`` (with a tied model's ``lm_head.weight``, the duplicate of the embedding) in the trainer's
  dtype, fp32 masters, not cast before sending (``verl/workers/engine/fsdp/transformer_impl.py``,
  ``get_per_tensor_param``; verl's ``nccl`` engine sends the tensors as given). Here: the same engine, buckets and
  group as the 8-bit streams with the quantizer bypassed (same payload as verl's engine; its seconds are gloo's, not
  NCCL's). The bypass is the engine's own configuration, nothing patched: ``FP32_ENGINE_KWARGS`` puts every linear
  in ``ignore`` (``re:.*``: nothing is quantized), keeps the rest as the trainer holds it (``rest_dtype`` float32)
  and sends the tied duplicate (``tie_word_embeddings`` False);
- ``int8`` / ``fp8``: what ``qurl_int8`` sends: trainer-side codes + fp32 per-row scales + the full-precision rest
  (embeddings, an untied lm_head, norms, biases) in fp32, the tied ``lm_head.weight`` left out by the engine
  (``engine_kwargs.qurl_int8.tie_word_embeddings``, which the driver fills from the model's config.json: the bench
  hands every stream the whole state_dict);
- ``int8+bf16`` / ``fp8+bf16``: the same with the rest in the rollout's bf16 (``engine_kwargs.qurl_int8.rest_dtype``,
  which the driver fills from ``rollout.dtype``).

Each sync runs as verl's manager runs it: ``prepare()`` on both sides, ``build_topology`` on both sides' results,
``init_process_group``, send / receive, ``finalize``.

Seconds are the sender's wall time per sync, quantization included (``quantize_s``); the group is rebuilt per sync
as in verl's manager (not timed). Every measured payload must equal the byte count from the model's shapes
(``stream_bytes``: the tensors' bytes plus the wire's 16-byte alignment, a shape header and zero padding for a tensor
whose byte count is not a multiple of 16; none occur at these four models' shapes, ``alignment_bytes``); the same
count gives the Qwen2.5-7B and 32B rows, too big to allocate here (shapes from their published config.json,
``roofline_shapes.MODEL_SHAPES``), with the network time at 400 Gb/s.

Writes ``bench/results/int8_sync.{json,md}`` with the CPU (model name and flag class).
Usage: python bench/bench_int8_sync.py [--models 0.5b 1.5b] [--formats fp32 int8 int8+bf16 fp8+bf16] [--repeats 2]
"""
from __future__ import annotations

import argparse
import asyncio
import math
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
REST_BYTES = {"": 4, "bf16": 2}
REST_DTYPES = {"": "float32", "bf16": "bfloat16"}
TIED_LM_HEAD = "lm_head.weight"
# verl's fp32 stream through the same engine: every linear ignored (kept full precision), the rest as the trainer
# holds it, a tied lm_head sent
FP32_ENGINE_KWARGS = {"quantization": "int8", "ignore": ["re:.*"], "rest_dtype": "float32",
                      "tie_word_embeddings": False}
ALIGN_BYTES = 16  # the wire's alignment (``qurl_int8``'s codec; counted here from its documented rule)


def engine_kwargs(s: ModelShape, fmt: str) -> dict:
    """``engine_kwargs.qurl_int8`` of one stream, as the driver fills it for the model."""
    if fmt == "fp32":
        return dict(FP32_ENGINE_KWARGS)
    quantization, _, rest = fmt.partition("+")
    return {"quantization": quantization, "rest_dtype": REST_DTYPES[rest],
            "tie_word_embeddings": s.tie_word_embeddings}


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


def model_tensors(s: ModelShape, fmt: str, tied_lm_head_sent: bool | None = None):
    """``(shape, bytes per element)`` of every tensor one stream carries, from the shapes. ``fp32``: verl's stream,
    every state_dict tensor (a tied lm_head's duplicate included) at 4 bytes; 8-bit: each decoder linear as 1-byte
    codes of its shape and an fp32 ``[rows, 1]`` scale, the rest (embedding, untied lm_head, norms, biases; Qwen3's
    q/k norms) at its dtype, a tied lm_head not sent. ``tied_lm_head_sent`` overrides whether a tied model's
    duplicate is counted (the previous accounting: never)."""
    quantization, _, rest = fmt.partition("+")
    if quantization not in ("fp32", "int8", "fp8"):
        raise ValueError(f"{fmt}: bytes are counted for fp32 and the channel schemes (int8, fp8), with +bf16")
    sent = (quantization == "fp32") if tied_lm_head_sent is None else tied_lm_head_sent
    rest_size = 4 if quantization == "fp32" else REST_BYTES[rest]
    h, q, kv, i = s.hidden_size, s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim, s.intermediate_size
    linears = [(q, h), (kv, h), (kv, h), (h, q), (i, h), (i, h), (h, i)]
    rest_shapes = [(h,), (h,)] + ([(q,), (kv,), (kv,)] if s.qkv_bias else []) + (
        [(s.head_dim,), (s.head_dim,)] if s.qk_norm else [])
    out = [((s.vocab_size, h), rest_size)]
    for _ in range(s.num_layers):
        out += [(shape, rest_size) for shape in rest_shapes]
        if quantization == "fp32":
            out += [(shape, 4) for shape in linears]
        else:
            out += [t for rows, cols in linears for t in (((rows, cols), 1), ((rows, 1), 4))]
    out.append(((h,), rest_size))
    if not (s.tie_word_embeddings and not sent):
        out.append(((s.vocab_size, h), rest_size))
    return out


def wire_bytes(shape: tuple[int, ...], element_size: int) -> int:
    """A tensor's bytes on the wire: its own when a non-zero multiple of ALIGN_BYTES, else rounded up to one (at
    least one) plus the shape header, an int64 ``[ndim, *shape]`` padded to an even count."""
    nbytes = element_size * math.prod(shape)
    if nbytes and nbytes % ALIGN_BYTES == 0:
        return nbytes
    header = len(shape) + 1
    return 8 * (header + header % 2) + max(ALIGN_BYTES, -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES)


def stream_bytes(s: ModelShape, fmt: str, tied_lm_head_sent: bool | None = None, aligned: bool = True) -> int:
    """Payload bytes of one sync (``model_tensors``), with the wire's alignment (``aligned=False``: without)."""
    size = wire_bytes if aligned else (lambda shape, element_size: element_size * math.prod(shape))
    return sum(size(shape, e) for shape, e in model_tensors(s, fmt, tied_lm_head_sent))


def _side(side: str, s: ModelShape, formats: list[str], repeats: int, queues, results) -> None:
    """One side, every stream in turn (an engine per stream, as a run has one), ``repeats`` syncs each."""
    torch.set_num_threads(1)  # two processes on a 2-core machine
    if side == "trainer":
        layer, embed = layer_tensors(s), torch.randn(s.vocab_size, s.hidden_size) * 0.02
        lm_head = embed  # untied: a head of the embedding's shape and bytes (its values do not matter here)

    mine, theirs = queues if side == "trainer" else queues[::-1]

    async def sync(engine) -> dict:
        meta = engine.prepare()  # each side's, exchanged: build_topology reads both, as verl's manager calls it
        mine.put(meta)
        other = theirs.get(timeout=300)
        actor, rollout = type(engine).build_topology(1, 1, [meta, other] if side == "trainer" else [other, meta])
        kwargs = actor if side == "trainer" else rollout
        engine.init_process_group(**{k: v[0] for k, v in kwargs.items()})
        start = time.perf_counter()
        names = []
        if side == "trainer":
            await engine.send_weights(model_stream(s, layer, embed, lm_head))
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
            engine = QurlInt8CheckpointEngine(BUCKET_MB << 20, is_master=side == "trainer", device="cpu",
                                              **engine_kwargs(s, fmt))
            out[fmt] = [await sync(engine) for _ in range(repeats)]
        results.put(pickle.dumps((side, out)))

    asyncio.run(main())


def measure(s: ModelShape, formats: list[str], repeats: int, model: str) -> list[dict]:
    """Every stream of one model between the same two processes; a row per stream, its best sync's seconds."""
    ctx = mp.get_context("spawn")
    queues, results = (ctx.Queue(), ctx.Queue()), ctx.Queue()
    procs = [ctx.Process(target=_side, args=(side, s, list(formats), repeats, queues, results))
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
            "fp32_s": base / link, "bf16_bytes": base // 2, "formats": {},
            "alignment_bytes": {fmt: stream_bytes(s, fmt) - stream_bytes(s, fmt, aligned=False)
                                for fmt in ("fp32", *formats)}}
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
             "scales + the rest (embedding, an untied lm_head, norms, biases) in fp32, the tied lm_head left out by the "
             "engine (`engine_kwargs.qurl_int8.tie_word_embeddings`, from the model's config.json); "
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
              "stream), then the engine at 0.2.0 or without `tie_word_embeddings` in its engine_kwargs (it sends the tied "
              "duplicate, which the rollout worker drops); both "
              "differ from the ratio only for tied models.", "",
              "| model | tied | verl fp32 | 8-bit, rest fp32 | ratio (previous; 0.2.0) | 8-bit, rest bf16 | "
              "ratio (previous; 0.2.0) |",
              "|---|---|---:|---:|---:|---:|---:|"]
    for r in report["byte_ratios"]:
        cells = [f"{f['bytes'] / 1e9:.2f} GB, {f['seconds']:.2f} s | {f['ratio']:.3f} ({f['previous_ratio']:.3f}; "
                 f"{f['duplicate_sent_ratio']:.3f})" for f in (r["formats"]["int8"], r["formats"]["int8+bf16"])]
        lines.append(f"| {r['model']} | {'yes' if r['tied'] else 'no'} | {r['fp32_bytes'] / 1e9:.2f} GB, "
                     f"{r['fp32_s']:.2f} s | {cells[0]} | {cells[1]} |")
    padding = {r["model"]: sum(r["alignment_bytes"].values()) for r in report["byte_ratios"]}
    lines += ["", "Alignment: the wire carries a tensor whose byte count is not a multiple of 16 as a shape header and "
              "its zero-padded flat form; the counts above include it. At these shapes: "
              + ("none in any stream." if not any(padding.values()) else
                 "; ".join(f"{m}: {b} bytes" for m, b in padding.items()) + "."),
              "", "Streams as configured (`engine_kwargs.qurl_int8`; the tied model's): "
              + "; ".join(f"`{fmt}` {kw}" for fmt, kw in report["engine_kwargs"].items()) + ". The fp32 baseline is the "
              "same engine with every linear ignored, the rest in fp32 and the tied duplicate sent.",
              "", "Shapes: " + "; ".join(f"{r['model']}: {r['source']}" for r in report["byte_ratios"]) + ".",
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
              "link_gbps": LINK_GBPS, "tied_lm_head_left_out_by": "engine",
              "engine_kwargs": {fmt: engine_kwargs(MODEL_SHAPES[MODELS["0.5b"]], fmt) for fmt in FORMATS}}
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
