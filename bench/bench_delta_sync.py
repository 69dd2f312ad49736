"""How much of an 8-bit weight sync changes from one sync to the next, and what a delta of it would send.

Offline, no engine: weights of Qwen2.5-0.5B-Instruct's and Qwen2.5-7B's shapes (``roofline_shapes``) take
``--steps`` optimizer steps at ``--lr``; after each step ("a sync") the snapshot is quantized as the rollout's
``RolloutSettings`` says (INT8 and FP8 codes, per-channel fp32 scales; the rest in the rollout's bf16), and
every element whose bits changed since the previous snapshot is counted. From those counts, per sync:

- ``verl fp32``: what verl 0.9.1 streams in the disaggregated modes (``bench_int8_sync.stream_bytes``);
- ``delta_sharded``: what verl's ``delta_sharded`` engine would send on the same snapshots: an int32 position
  and a bf16 value per changed bf16 element of the whole bf16 model (the tied lm_head not sent). It needs
  CUDA and refuses quantized models, so this is a computed count;
- ``8-bit full``: ``qurl_int8``'s full sync (codes + fp32 scales + the rest in bf16);
- ``8-bit delta``: per tensor the smallest of the full tensor, bitmap + changed values and LEB128 gap
  varints + changed values (``qurl_verl.checkpoint_engine.delta_codec``, sizes of the real encoder), the
  per-channel scales always in full; the same with one index encoding forced (``bitmap``, ``gaps``,
  ``int32``: 4-byte positions as delta_sharded) says what the choice by density is worth.

Weights: N(0, std) per tensor type (``TENSOR_STD``: the HF ``initializer_range`` 0.02 of Qwen2 for the
linears and the embedding, assumed, not read from a checkpoint; biases N(0, 0.2); norms N(1, 0.1)). Gaussian
rows have few outliers, so their absmax scales are tight and more codes flip than in a trained checkpoint's
heavier-tailed rows: a pessimistic choice for the 8-bit delta. A change fraction scales about as lr / std.

Updates (``--update``): ``adam``: a real ``torch.optim.AdamW`` (verl's actor defaults: betas 0.9/0.999,
eps 1e-8, weight decay 0.01) on fresh N(0, 1) gradients every step, on fp32 masters; ``sign``: every element
moves by lr each step in a fixed random direction (a gradient whose sign never changes: the most drift a
step of lr allows, the worst case for a delta). With ``--uaq``, q/k/v are divided by 1.5 (and
input_layernorm multiplied) before training, as the presets' UAQ does: Adam moves each element by the
same amount, so codes of a 1.5x finer grid flip more.

Sampling: per-channel codes and scales, bf16 values and Adam are all per row, so rows are independent:
each tensor type is run on at most ``--max-rows-elements`` elements of whole rows, and its counts are
multiplied by (rows of the model / rows run) x (number of such tensors: one decoder layer stands for all
``num_hidden_layers``). The embedding (and 7B's untied lm_head) is sampled the same way. Gradients are
dense, so every embedding row moves: a real batch touches only the rows of its tokens, so the rest's
share here is an upper bound.

Writes ``bench/results/delta_sync.{json,md}`` with the CPU (model name and flag class).
Usage: python bench/bench_delta_sync.py [--models 0.5b 7b] [--steps 19] [--lr 1e-6] [--update adam sign]
"""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import bench_harness  # noqa: F401 - sys.path first
import torch
from bench_harness import RESULTS, environment, loadavg, recorded_args, write_result
from bench_int8_sync import model_tensors, stream_bytes
from roofline_shapes import MODEL_SHAPES, ModelShape

from qurl_verl.checkpoint_engine import delta_codec
from qurl_verl.quant.quantizer import quantize
from qurl_verl.quant.uaq import DEFAULT_UAQ_SCALE
from qurl_verl.settings import RolloutSettings

MODELS = {"0.5b": "Qwen/Qwen2.5-0.5B-Instruct", "7b": "Qwen/Qwen2.5-7B"}
ROOFLINE_MODELS = ("Qwen/Qwen2.5-7B", "Qwen/Qwen2.5-32B")
LINKS_GBPS = (400, 10)
TENSOR_STD = {"linear": 0.02, "embedding": 0.02, "bias": 0.2, "norm": 0.1}
FORMATS = ("int8", "fp8")
DELTA_SHARDED_BYTES_PER_CHANGE = 4 + 2  # int32 position + bf16 value (verl/checkpoint_engine/delta_sync/encode.py)
INDEX_ENCODINGS = ("chosen", "bitmap", "gaps", "int32")


@dataclass(frozen=True)
class SampledTensor:
    name: str
    kind: str  # linear, embedding, bias, norm
    rows: int  # rows run here
    cols: int
    weight: float  # how many elements of the model each element run here stands for
    uaq: float  # 1/UAQ scale on q/k/v, UAQ scale on input_layernorm, else 1

    @property
    def quantized(self) -> bool:
        return self.kind == "linear"


def sampled_tensors(s: ModelShape, max_elements: int, uaq: bool) -> list[SampledTensor]:
    """One decoder layer's tensors (each standing for ``num_layers``), the embedding, the final norm and an
    untied lm_head; linears and embeddings cut to whole rows within ``max_elements``."""
    h, q, kv, i = s.hidden_size, s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim, s.intermediate_size
    per_layer = [("input_layernorm.weight", "norm", 1, h), ("post_attention_layernorm.weight", "norm", 1, h),
                 ("self_attn.q_proj.weight", "linear", q, h), ("self_attn.k_proj.weight", "linear", kv, h),
                 ("self_attn.v_proj.weight", "linear", kv, h), ("self_attn.o_proj.weight", "linear", h, q),
                 ("mlp.gate_proj.weight", "linear", i, h), ("mlp.up_proj.weight", "linear", i, h),
                 ("mlp.down_proj.weight", "linear", h, i)]
    if s.qkv_bias:
        per_layer += [("self_attn.q_proj.bias", "bias", 1, q), ("self_attn.k_proj.bias", "bias", 1, kv),
                      ("self_attn.v_proj.bias", "bias", 1, kv)]
    whole = [(f"model.layers.0.{n}", k, r, c, s.num_layers) for n, k, r, c in per_layer]
    whole += [("model.embed_tokens.weight", "embedding", s.vocab_size, h, 1), ("model.norm.weight", "norm", 1, h, 1)]
    if not s.tie_word_embeddings:  # lm_head stays bf16 (ignored by the 8-bit scheme)
        whole.append(("lm_head.weight", "embedding", s.vocab_size, h, 1))
    out = []
    for name, kind, rows, cols, copies in whole:
        run = max(1, min(rows, max_elements // cols))
        factor = 1.0
        if uaq and any(p in name for p in ("q_proj.weight", "k_proj.weight", "v_proj.weight")):
            factor = 1 / DEFAULT_UAQ_SCALE
        elif uaq and "input_layernorm" in name:
            factor = DEFAULT_UAQ_SCALE
        out.append(SampledTensor(name, kind, run, cols, copies * rows / run, factor))
    return out


def initial_weights(t: SampledTensor, g: torch.Generator) -> torch.Tensor:
    w = torch.randn(t.rows, t.cols, generator=g) * TENSOR_STD[t.kind]
    if t.kind == "norm":
        w += 1.0
    return (w * t.uaq).squeeze(0) if t.rows == 1 else w * t.uaq


def snapshots(w: torch.Tensor, t: SampledTensor, schemes: dict) -> dict[str, torch.Tensor]:
    """What a sync sends of this tensor: its bf16 value (verl's delta and our rest), and, for a linear, its
    codes and scales in each format."""
    snap = {"bf16": w.to(torch.bfloat16)}
    if t.quantized:
        for fmt, scheme in schemes.items():
            q = quantize(w, scheme)
            snap[fmt], snap[f"{fmt}_scale"] = q.data, q.scale
    return snap


def delta_sizes(old: torch.Tensor, new: torch.Tensor) -> dict[str, float]:
    """Changed elements and the bytes each index encoding would send (values included)."""
    positions = delta_codec.changed_positions(old, new)
    sizes = delta_codec.encoded_sizes(positions, new.numel(), new.element_size())
    chosen = delta_codec.choose_encoding(positions, new.numel(), new.element_size())
    return {"changed": positions.numel(), "numel": new.numel(), "chosen": sizes[chosen],
            "chosen_full": int(chosen is delta_codec.Encoding.FULL),
            "bitmap": sizes[delta_codec.Encoding.BITMAP], "gaps": sizes[delta_codec.Encoding.GAPS],
            "int32": positions.numel() * (4 + new.element_size()), "full": sizes[delta_codec.Encoding.FULL]}


def run_tensor(t: SampledTensor, steps: int, lr: float, update: str, seed: int) -> list[dict]:
    """Per sync after the first: what changed in each of the tensor's snapshots (scaled to the model)."""
    g = torch.Generator().manual_seed(seed)
    w = initial_weights(t, g)
    schemes = {fmt: RolloutSettings(format=fmt).quant_scheme for fmt in FORMATS}
    if update == "adam":
        w.requires_grad_(True)
        opt = torch.optim.AdamW([w], lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    else:
        direction = torch.randint(0, 2, w.shape, generator=g).to(w.dtype) * 2 - 1
    prev = snapshots(w.detach(), t, schemes)
    per_sync = []
    for _ in range(steps):
        if update == "adam":
            w.grad = torch.randn(w.shape, generator=g)
            opt.step()
        else:
            w.add_(direction, alpha=lr)
        snap = snapshots(w.detach(), t, schemes)
        row = {key: delta_sizes(prev[key], snap[key]) for key in snap}
        per_sync.append({k: {m: v * t.weight for m, v in sizes.items()} for k, sizes in row.items()})
        prev = snap
    return per_sync


def combine(per_tensor: dict[str, list[dict]], tensors: list[SampledTensor]) -> list[dict]:
    """Per sync: the model's counts by stream (``int8``/``fp8`` codes, their scales, the bf16 rest, the whole
    bf16 model)."""
    kinds = {t.name: t for t in tensors}
    out = []
    for i in range(len(next(iter(per_tensor.values())))):
        acc: dict[str, dict[str, float]] = {}

        def add(key, sizes):
            into = acc.setdefault(key, {})
            for m, v in sizes.items():
                into[m] = into.get(m, 0.0) + v

        for name, syncs in per_tensor.items():
            row = syncs[i]
            add("bf16_model", row["bf16"])
            if kinds[name].quantized:
                for fmt in FORMATS:
                    add(fmt, row[fmt])
                    if any(p in name for p in ("q_proj", "k_proj", "v_proj")):
                        add(f"{fmt}_qkv", row[fmt])
                    add(f"{fmt}_scale", row[f"{fmt}_scale"])
            else:
                add("rest_bf16", row["bf16"])
        out.append(acc)
    return out


def sync_bytes(s: ModelShape, row: dict, fmt: str, encoding: str) -> float:
    """Bytes of one 8-bit delta sync: codes and the bf16 rest in ``encoding`` (``chosen``: the smallest
    per tensor), every scale in full."""
    return row[fmt][encoding] + row["rest_bf16"][encoding] + row[f"{fmt}_scale"]["full"]


def summarize(s: ModelShape, syncs: list[dict]) -> dict:
    fp32, full8 = stream_bytes(s, "fp32"), stream_bytes(s, "int8+bf16")
    n = len(syncs)
    mean = lambda f: sum(f(r) for r in syncs) / n  # noqa: E731
    out = {
        "syncs_averaged": n,
        "verl_fp32_bytes": fp32,
        "full_8bit_bytes": full8,
        "delta_sharded_bytes": mean(lambda r: DELTA_SHARDED_BYTES_PER_CHANGE * r["bf16_model"]["changed"]),
        "changed_fraction": {
            "int8_codes": mean(lambda r: r["int8"]["changed"] / r["int8"]["numel"]),
            "fp8_codes": mean(lambda r: r["fp8"]["changed"] / r["fp8"]["numel"]),
            "int8_qkv_codes": mean(lambda r: r["int8_qkv"]["changed"] / r["int8_qkv"]["numel"]),
            "fp8_qkv_codes": mean(lambda r: r["fp8_qkv"]["changed"] / r["fp8_qkv"]["numel"]),
            "int8_scales": mean(lambda r: r["int8_scale"]["changed"] / r["int8_scale"]["numel"]),
            "fp8_scales": mean(lambda r: r["fp8_scale"]["changed"] / r["fp8_scale"]["numel"]),
            "rest_bf16": mean(lambda r: r["rest_bf16"]["changed"] / r["rest_bf16"]["numel"]),
            "bf16_model": mean(lambda r: r["bf16_model"]["changed"] / r["bf16_model"]["numel"]),
        },
    }
    for fmt in FORMATS:
        for enc in INDEX_ENCODINGS:
            out[f"{fmt}_delta_bytes_{enc}"] = mean(lambda r, f=fmt, e=enc: sync_bytes(s, r, f, e))
        chosen = out[f"{fmt}_delta_bytes_chosen"]
        out[f"{fmt}_delta_vs_delta_sharded"] = chosen / out["delta_sharded_bytes"]
        out[f"{fmt}_delta_vs_verl_fp32"] = chosen / fp32
        out[f"{fmt}_delta_vs_full_8bit"] = chosen / full8
        out[f"{fmt}_codes_bytes"] = mean(lambda r, f=fmt: r[f]["chosen"])
        out[f"{fmt}_scales_bytes"] = mean(lambda r, f=fmt: r[f"{f}_scale"]["full"])
    out["rest_bytes"] = mean(lambda r: r["rest_bf16"]["chosen"])
    return out


def element_counts(s: ModelShape) -> dict[str, int]:
    """Elements of a full 8-bit sync by part, from ``bench_int8_sync.model_tensors``: the decoder linears' codes,
    their rows (one fp32 scale each) and the rest (embedding, an untied lm_head, norms, biases; in bf16)."""
    n = {1: 0, 4: 0, 2: 0}
    for shape, element_size in model_tensors(s, "int8+bf16"):
        numel = 1
        for size in shape:
            numel *= size
        n[element_size] += numel
    return {"linear": n[1], "rows": n[4], "rest": n[2]}


def bytes_per_element(s: ModelShape, summary: dict, fmt: str) -> dict[str, float]:
    """The measured delta's bytes per element of each part, to carry the fractions to another shape."""
    n = element_counts(s)
    rest = n["rest"]
    return {"codes": summary[f"{fmt}_codes_bytes"] / n["linear"], "rest": summary["rest_bytes"] / rest,
            "bf16_model_changed": summary["changed_fraction"]["bf16_model"]}


def roofline(per_element: dict[str, float], target: ModelShape) -> dict:
    """Bytes per sync of ``target`` from the measured per-element delta bytes, and seconds on each link."""
    n = element_counts(target)
    rest = n["rest"]
    delta = per_element["codes"] * n["linear"] + per_element["rest"] * rest + 4 * n["rows"]
    model = n["linear"] + rest
    streams = {"verl fp32": stream_bytes(target, "fp32"),
               "delta_sharded": DELTA_SHARDED_BYTES_PER_CHANGE * per_element["bf16_model_changed"] * model,
               "8-bit full": stream_bytes(target, "int8+bf16"), "8-bit delta": delta}
    return {name: {"bytes": b, **{f"s_at_{g}gbps": b * 8 / (g * 1e9) for g in LINKS_GBPS}}
            for name, b in streams.items()}


def run_model(key: str, args) -> dict:
    s = MODEL_SHAPES[MODELS[key]]
    results = {}
    for update in args.update:
        base: dict[str, list[dict]] = {}
        for uaq in (False, True):
            tensors = sampled_tensors(s, args.max_rows_elements, uaq)
            per_tensor, began = {}, time.perf_counter()
            for j, t in enumerate(tensors):
                if uaq and t.uaq == 1.0:
                    per_tensor[t.name] = base[t.name]  # UAQ leaves it as it is: the same trajectory
                    continue
                per_tensor[t.name] = run_tensor(t, args.steps, args.lr, update, seed=1000 + j)
            if not uaq:
                base = per_tensor
            label = f"{key}/{update}/{'uaq' if uaq else 'no_uaq'}"
            syncs = combine(per_tensor, tensors)
            results[label] = {"model": MODELS[key], "update": update, "uaq": uaq,
                              "summary": summarize(s, syncs), "per_sync": syncs,
                              "seconds": time.perf_counter() - began,
                              "sampled": {t.name: {"rows_run": t.rows, "cols": t.cols, "weight": t.weight}
                                          for t in tensors}}
            print(f"[delta_sync] {label}: {results[label]['seconds']:.0f} s, "
                  f"int8 codes {results[label]['summary']['changed_fraction']['int8_codes']:.2e}", flush=True)
    return results


def fmt_bytes(b: float) -> str:
    return f"{b / 1e9:.3f} GB" if b >= 1e8 else f"{b / 1e6:.2f} MB"


def markdown(report: dict) -> str:
    env = report["environment"]
    a = report["args"]
    lines = [
        "# Delta weight sync: how much of each 8-bit sync changes, and what a delta sends", "",
        f"{env['cpu_model']} (class `{env['cpu_class']}`, {env['cores']} cores, load {env['loadavg']}), "
        f"torch {env['torch']}; offline, no engine. {a['steps']} optimizer steps at lr {a['lr']} after the first "
        f"(full) sync: syncs 2-{a['steps'] + 1} averaged. Weights N(0, std) per tensor type "
        f"({', '.join(f'{k} {v}' for k, v in TENSOR_STD.items())}; norms around 1), fp32 masters; INT8 and FP8 "
        "codes per output channel as `RolloutSettings(format=...)` quantizes them, the rest in bf16. Rows sampled "
        f"per tensor type (at most {a['max_rows_elements']:,} elements each, whole rows; one decoder layer stands "
        "for all). `adam`: torch.optim.AdamW (0.9/0.999, eps 1e-8, wd 0.01) on fresh N(0,1) gradients each step; "
        "`sign`: every element moves lr a step in a fixed direction (worst case). Dense gradients: every "
        "embedding row moves (a real batch moves only its tokens' rows). See the script's docstring.", "",
        "## Share of elements whose bits change per sync", "",
        "| model | update | UAQ | INT8 codes | of q/k/v | FP8 codes | of q/k/v | INT8 scales | FP8 scales | bf16 rest "
        "| whole bf16 model |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["runs"].values():
        c = r["summary"]["changed_fraction"]
        lines.append(f"| {r['model']} | {r['update']} | {'1.5 q/k/v' if r['uaq'] else 'off'} | "
                     + " | ".join(f"{c[k]:.2e}" for k in ("int8_codes", "int8_qkv_codes", "fp8_codes", "fp8_qkv_codes", "int8_scales", "fp8_scales",
                                                         "rest_bf16", "bf16_model")) + " |")
    lines += ["", "## Bytes per sync (syncs after the first, averaged)", "",
              "`8-bit delta` is the smallest encoding per tensor (bitmap or gap varints, else the full tensor; "
              "scales always in full); in brackets the same with every tensor's positions as a bitmap / as gap "
              "varints / as int32 (delta_sharded's encoding). Ratios of the chosen delta.", "",
              "| model | update | UAQ | verl fp32 | delta_sharded | 8-bit full | INT8 delta (bitmap / gaps / int32) "
              "| x delta_sharded | x verl fp32 | x 8-bit full | FP8 delta | x delta_sharded |",
              "|---|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    for r in report["runs"].values():
        m = r["summary"]
        lines.append(
            f"| {r['model']} | {r['update']} | {'1.5 q/k/v' if r['uaq'] else 'off'} | {fmt_bytes(m['verl_fp32_bytes'])} "
            f"| {fmt_bytes(m['delta_sharded_bytes'])} | {fmt_bytes(m['full_8bit_bytes'])} | "
            f"{fmt_bytes(m['int8_delta_bytes_chosen'])} ({fmt_bytes(m['int8_delta_bytes_bitmap'])} / "
            f"{fmt_bytes(m['int8_delta_bytes_gaps'])} / {fmt_bytes(m['int8_delta_bytes_int32'])}) | "
            f"{m['int8_delta_vs_delta_sharded']:.3f} | {m['int8_delta_vs_verl_fp32']:.4f} | "
            f"{m['int8_delta_vs_full_8bit']:.3f} | {fmt_bytes(m['fp8_delta_bytes_chosen'])} | "
            f"{m['fp8_delta_vs_delta_sharded']:.3f} |")
    lines += ["", "Where the INT8 delta's bytes go (chosen encoding): codes / per-channel scales (always full) / "
              "bf16 rest:", ""]
    for r in report["runs"].values():
        m = r["summary"]
        lines.append(f"- {r['model']} {r['update']} {'UAQ' if r['uaq'] else 'no UAQ'}: "
                     f"{fmt_bytes(m['int8_codes_bytes'])} / {fmt_bytes(m['int8_scales_bytes'])} / "
                     f"{fmt_bytes(m['rest_bytes'])}")
    lines += ["", "## Index encodings by density", "",
              "Per changed element, its position costs 4 bytes as an int32 (delta_sharded), 1/(8p) bytes in a bitmap "
              "at density p, and ceil(log2(1/p)/7) or so as a gap varint (1 byte for gaps below 128, 2 below 16,384). "
              "A bitmap beats gap varints only where gaps are 1 byte and p > 1/8, and a delta beats the tensor up to "
              "p = 7/8 (int8) or 15/16 (bf16) in a bitmap. At the densities measured here gap varints win everywhere "
              "(the chosen and the `gaps` columns agree); bytes per changed element, position and value, measured:", "",
              "| model | update | UAQ | INT8 code | bf16 rest | delta_sharded (int32 + bf16) |",
              "|---|---|---|---:|---:|---:|"]
    for r in report["runs"].values():
        syncs = r["per_sync"]
        code = sum(x["int8"]["chosen"] for x in syncs) / max(1.0, sum(x["int8"]["changed"] for x in syncs))
        rest = sum(x["rest_bf16"]["chosen"] for x in syncs) / max(1.0, sum(x["rest_bf16"]["changed"] for x in syncs))
        lines.append(f"| {r['model']} | {r['update']} | {'1.5 q/k/v' if r['uaq'] else 'off'} | {code:.2f} | {rest:.2f} "
                     f"| {DELTA_SHARDED_BYTES_PER_CHANGE} |")
    if report.get("roofline"):
        lines += ["", f"## Network time per sync from these fractions (one replica; {report['roofline_from']})", "",
                  "| model | stream | bytes / sync | " + " | ".join(f"s at {g} Gb/s" for g in LINKS_GBPS) + " |",
                  "|---|---|---:|" + "---:|" * len(LINKS_GBPS)]
        for model, streams in report["roofline"].items():
            for name, v in streams.items():
                lines.append(f"| {model} | {name} | {fmt_bytes(v['bytes'])} | "
                             + " | ".join(f"{v[f's_at_{g}gbps']:.3f}" for g in LINKS_GBPS) + " |")
    lines.append("")
    return "\n".join(lines)



def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--steps", type=int, default=19, help="optimizer steps, one sync after each (plus the first)")
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--update", nargs="+", default=["adam", "sign"], choices=["adam", "sign"])
    p.add_argument("--max-rows-elements", type=int, default=16_000_000)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(RESULTS / "delta_sync"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    report = {"environment": environment(), "args": recorded_args(args), "tensor_std": TENSOR_STD, "runs": {}}
    for key in args.models:
        report["runs"].update(run_model(key, args))
        report["loadavg_end"] = loadavg()
        write_result(args.out, report, markdown(report))
    source = next((k for k in (f"7b/{u}/no_uaq" for u in ("adam", "sign")) if k in report["runs"]), None)
    if source:
        per_element = bytes_per_element(MODEL_SHAPES[MODELS["7b"]], report["runs"][source]["summary"], "int8")
        report["roofline_from"] = f"INT8, the {source} run's bytes per element carried to each shape"
        report["roofline"] = {m: roofline(per_element, MODEL_SHAPES[m]) for m in ROOFLINE_MODELS}
    write_result(args.out, report, markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
