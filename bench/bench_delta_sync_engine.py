"""Bytes and seconds per sync through the ``qurl_int8`` engine, side by side on the same snapshots: verl's fp32
stream, the full 8-bit sync and the delta mode, over ``--syncs`` syncs with an optimizer step between them.

Two processes on this machine (a trainer side and a rollout side), each stream its own engine and gloo group, at
Qwen2.5-0.5B-Instruct's shapes (``roofline_shapes``; every layer its own tensors, N(0, 0.02) linears and embedding,
norms around 1, fp32 masters). Between syncs every tensor takes one ``torch.optim.AdamW`` step (verl's actor
defaults: betas 0.9/0.999, eps 1e-8, weight decay 0.01) at ``--lr`` on fresh N(0, 1) gradients (``--update sign``:
a fixed random direction, lr per step). The streams:

- ``fp32``: verl 0.9.1's stream, the state_dict in fp32, a tied lm_head's duplicate included (the engine's
  transport with the codec bypassed: the same buckets and group);
- ``int8 full``: ``qurl_int8`` as it runs by default (codes + fp32 scales + the rest in bf16, the tied lm_head
  not sent);
- ``int8 delta``: ``engine_kwargs.qurl_int8.delta=true``: the first sync full, then the changed elements only.

At every sync the rollout side checks that the delta mode handed on exactly what the full sync did (the stream
checksum of both), and the host memory each side's copy holds is read from the engines. Seconds are this shared
2-core machine's (one thread a side) and say little about a network: the bytes are the cost there, and the
network time from them is in ``bench/results/delta_sync.md``.

Writes ``bench/results/delta_sync_engine.{json,md}`` with the CPU (model name and flag class).
Usage: python bench/bench_delta_sync_engine.py [--syncs 20] [--lr 1e-6] [--update adam]
"""
from __future__ import annotations

import argparse
import asyncio
import pickle
import time

import bench_harness  # noqa: F401 - sys.path first
import torch
import torch.multiprocessing as mp
from bench_harness import RESULTS, environment, loadavg, recorded_args, write_result
from bench_int8_sync import stream_bytes
from roofline_shapes import MODEL_SHAPES, ModelShape

from qurl_verl.checkpoint_engine.int8_engine import QurlInt8CheckpointEngine
from qurl_verl.checkpoint_engine.wire_codec import aligned
from qurl_verl.rollout.sync_stats import StreamStats

MODEL = "Qwen/Qwen2.5-0.5B-Instruct"
BUCKET_MB = 256
STREAMS = ("fp32", "int8 full", "int8 delta")
TIED_LM_HEAD = "lm_head.weight"


class FullPrecisionStream(QurlInt8CheckpointEngine):
    """The engine's transport with the codec bypassed: each tensor as the trainer holds it (verl's fp32 stream)."""

    def encoded(self, weights, stats, delta=None):
        for name, tensor in weights:
            stats.tensors += 1
            yield from aligned(name, tensor.detach().contiguous())


def model_state(s: ModelShape, seed: int = 0) -> dict[str, torch.Tensor]:
    """The module's state_dict order and names (Qwen2), each layer its own tensors."""
    g = torch.Generator().manual_seed(seed)
    h, q, kv, i = s.hidden_size, s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim, s.intermediate_size

    def r(*shape, mean=0.0, std=0.02):
        return torch.randn(*shape, generator=g) * std + mean

    state = {"model.embed_tokens.weight": r(s.vocab_size, h)}
    for layer in range(s.num_layers):
        p = f"model.layers.{layer}."
        state.update({
            p + "self_attn.q_proj.weight": r(q, h), p + "self_attn.q_proj.bias": r(q, std=0.2),
            p + "self_attn.k_proj.weight": r(kv, h), p + "self_attn.k_proj.bias": r(kv, std=0.2),
            p + "self_attn.v_proj.weight": r(kv, h), p + "self_attn.v_proj.bias": r(kv, std=0.2),
            p + "self_attn.o_proj.weight": r(h, q),
            p + "mlp.gate_proj.weight": r(i, h), p + "mlp.up_proj.weight": r(i, h), p + "mlp.down_proj.weight": r(h, i),
            p + "input_layernorm.weight": r(h, mean=1.0, std=0.1),
            p + "post_attention_layernorm.weight": r(h, mean=1.0, std=0.1)})
    state["model.norm.weight"] = r(h, mean=1.0, std=0.1)
    return state


def stream_of(s: ModelShape, state: dict[str, torch.Tensor], fp32: bool):
    """verl's FSDP stream (a tied lm_head is the embedding under a second name); the 8-bit engine is built with
    ``tie_word_embeddings`` and leaves it out itself."""
    yield from state.items()
    if s.tie_word_embeddings:
        yield TIED_LM_HEAD, state["model.embed_tokens.weight"]


class Optimizer:
    """One AdamW per tensor, its gradient made and dropped tensor by tensor (peak memory: one gradient)."""

    def __init__(self, state: dict[str, torch.Tensor], lr: float, update: str, seed: int = 1):
        self.state, self.lr, self.update = state, lr, update
        self.g = torch.Generator().manual_seed(seed)
        if update == "adam":
            for t in state.values():
                t.requires_grad_(True)
            self.opts = {n: torch.optim.AdamW([t], lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
                         for n, t in state.items()}
        else:
            self.directions = {n: torch.randint(0, 2, t.shape, generator=self.g).to(torch.int8) for n, t in state.items()}

    @torch.no_grad()
    def step(self) -> None:
        for name, t in self.state.items():
            if self.update == "adam":
                t.grad = torch.randn(t.shape, generator=self.g)
                self.opts[name].step()
                t.grad = None
            else:
                t.add_(self.directions[name].to(t.dtype) * 2 - 1, alpha=self.lr)


def _side(side: str, args, queue, results) -> None:
    torch.set_num_threads(1)  # two processes on a 2-core machine
    s = MODEL_SHAPES[MODEL]
    kinds = {"fp32": (FullPrecisionStream, {}), "int8 full": (QurlInt8CheckpointEngine, {}),
             "int8 delta": (QurlInt8CheckpointEngine, {"delta": True})}
    engines = {name: cls(BUCKET_MB << 20, is_master=side == "trainer", device="cpu",
                         tie_word_embeddings=name != "fp32" and s.tie_word_embeddings, **kw)
               for name, (cls, kw) in kinds.items()}
    if side == "trainer":
        state = model_state(s)
        optimizer = Optimizer(state, args.lr, args.update)

    async def sync(name: str) -> dict:
        engine = engines[name]
        mine, other = ("trainer", "rollout") if side == "trainer" else ("rollout", "trainer")
        queue[other].put(engine.prepare())  # each side hands the other its metadata, as verl's manager gathers it
        metadata = {side: None, other: queue[mine].get(timeout=600)}
        metadata[side] = engine.transport.prepare()
        actor, rollout = type(engine).build_topology(1, 1, [metadata["trainer"], metadata["rollout"]])
        engine.init_process_group(**{k: v[0] for k, v in (actor if side == "trainer" else rollout).items()})
        start = time.perf_counter()
        row = {}
        if side == "trainer":
            with torch.no_grad():
                metrics = await engine.send_weights(stream_of(s, state, name == "fp32"))
            row.update({k.removeprefix("qurl_sync/"): v for k, v in metrics.items()
                        if k in ("qurl_sync/full_sync", "qurl_sync/delta_fraction", "qurl_sync/full_resyncs")})
            if engine.delta_sender is not None:
                row["host_bytes"] = engine.delta_sender.host_bytes()
        else:
            checksum = StreamStats()
            async for tensor_name, tensor in engine.receive_weights():
                checksum.add_checksum(((tensor_name, tensor),))
            row["checksum"] = checksum.checksum
            if engine.delta_receiver is not None:
                row["host_bytes"] = engine.delta_receiver.host_bytes()
        row.update(seconds=time.perf_counter() - start, payload_bytes=engine.last_stats.payload_bytes,
                   meta_bytes=engine.last_stats.meta_bytes)
        engine.finalize()
        return row

    async def main():
        out = {name: [] for name in STREAMS}
        for k in range(args.syncs):
            for name in STREAMS:
                out[name].append(await sync(name))
            if side == "trainer":
                began = time.perf_counter()
                optimizer.step()
                print(f"[delta_sync_engine] sync {k + 1}: {[out[n][-1]['seconds'] for n in STREAMS]} s, "
                      f"step {time.perf_counter() - began:.1f} s", flush=True)
        results.put(pickle.dumps((side, out)))

    asyncio.run(main())


def measure(args) -> dict:
    ctx = mp.get_context("spawn")
    queue, results = {"trainer": ctx.Queue(), "rollout": ctx.Queue()}, ctx.Queue()
    procs = [ctx.Process(target=_side, args=(side, args, queue, results)) for side in ("trainer", "rollout")]
    for p in procs:
        p.start()
    out = {}
    for _ in procs:
        side, rows = pickle.loads(results.get(timeout=7200))
        out[side] = rows
    for p in procs:
        p.join(timeout=120)
    return out


def summarize(out: dict) -> dict:
    s = MODEL_SHAPES[MODEL]
    trainer, rollout = out["trainer"], out["rollout"]
    for k, (full, delta) in enumerate(zip(rollout["int8 full"], rollout["int8 delta"]), start=1):
        assert full["checksum"] == delta["checksum"], f"sync {k}: the delta mode handed on other tensors"
    assert trainer["fp32"][0]["payload_bytes"] == stream_bytes(s, "fp32")
    summary = {}
    for name in STREAMS:
        rows = trainer[name]
        later = rows[1:]
        forced = [r for r in later if r.get("full_sync")] if name == "int8 delta" else []
        steady = [r for r in later if r not in forced]
        mean = lambda rs, key: sum(r[key] for r in rs) / len(rs) if rs else None  # noqa: E731
        summary[name] = {
            "first_bytes": rows[0]["payload_bytes"], "first_s": rows[0]["seconds"],
            "later_bytes": mean(steady, "payload_bytes"), "later_send_s": mean(steady, "seconds"),
            "later_receive_s": mean(rollout[name][1:], "seconds"), "forced_full_syncs": len(forced),
            "later_meta_bytes": mean(steady, "meta_bytes"),
            "delta_fraction": mean(steady, "delta_fraction") if name == "int8 delta" else None,
            "sender_host_bytes": rows[-1].get("host_bytes"), "receiver_host_bytes": rollout[name][-1].get("host_bytes"),
        }
    fp32 = summary["fp32"]["later_bytes"]
    for name in STREAMS:
        summary[name]["x_fp32"] = summary[name]["later_bytes"] / fp32
    return summary


def markdown(report: dict) -> str:
    env, a, m = report["environment"], report["args"], report["summary"]
    lines = [
        "# Delta sync through the engine: bytes and seconds per sync, side by side", "",
        f"{env['cpu_model']} (class `{env['cpu_class']}`, {env['cores']} cores, load {env['loadavg']}), torch "
        f"{env['torch']}, verl {env['verl']}; two processes over each engine's own gloo group on loopback, "
        f"{BUCKET_MB} MiB buckets, one thread a side. {MODEL} shapes, fp32 masters; {a['syncs']} syncs, one "
        f"{'AdamW step on random gradients' if a['update'] == 'adam' else 'sign-like step'} at lr {a['lr']} between "
        "them. Syncs 2 and later averaged (forced full syncs of the delta mode counted apart). At every sync the "
        "delta mode handed the rollout the same tensors as the full sync (stream checksums).", "",
        "| stream | first sync | later syncs, bytes | x verl fp32 | send s | receive s | changed share | forced full "
        "| host memory (sender / each receiver) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name in STREAMS:
        r = m[name]
        host = ("-" if r["sender_host_bytes"] is None
                else f"{r['sender_host_bytes'] / 1e9:.3f} / {r['receiver_host_bytes'] / 1e9:.3f} GB")
        lines.append(f"| {name} | {r['first_bytes'] / 1e9:.3f} GB | {r['later_bytes'] / 1e6:.2f} MB | "
                     f"{r['x_fp32']:.4f} | {r['later_send_s']:.2f} | {r['later_receive_s']:.2f} | "
                     f"{'-' if r['delta_fraction'] is None else format(r['delta_fraction'], '.2e')} | "
                     f"{r['forced_full_syncs']} | {host} |")
    lines += ["", "Bytes are the buckets' payload (alignment and headers included; the JSON bucket metadata apart: "
              f"{m['int8 delta']['later_meta_bytes'] / 1e3:.0f} kB a delta sync). Seconds include quantizing, the "
              "delta's compare and encode on the sender and its decode on the receiver; every sync's in the json.", ""]
    return "\n".join(lines)



def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--syncs", type=int, default=20)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--update", default="adam", choices=["adam", "sign"])
    p.add_argument("--out", default=str(RESULTS / "delta_sync_engine"))
    args = p.parse_args()
    report = {"environment": environment(), "args": recorded_args(args)}
    out = measure(args)
    report.update(loadavg_end=loadavg(), summary=summarize(out), per_sync=out)
    write_result(args.out, report, markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
