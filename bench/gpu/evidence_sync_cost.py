"""Step ``sync_cost`` of gpu_evidence.py: one weight sync's quantize work and the code-change tracker."""
from __future__ import annotations

import time

import torch
from evidence_kernels import QWEN25, TOY, hf_linear_shapes, random_weight, wall_ms
from evidence_run_control import Budget, Context

from qurl_verl.quant import (
    INT8_CHANNEL,
    UpdateVisibilityTracker,
    parse_scheme,
    quantize,
    quantize_state_dict,
)

# ----------------------------------------------------------------------------- step 3: sync cost


def sync_models(dry_run: bool) -> list[tuple[str, dict, int]]:
    """(name, shape, layers measured together to check the one-layer extrapolation)."""
    if dry_run:
        return [("toy", TOY, 2)]
    return [("qwen2.5-7b", QWEN25["qwen2.5-7b"], 8), ("qwen2.5-32b", QWEN25["qwen2.5-32b"], 4)]


def make_masters(ctx: Context, spec: dict, n_layers: int, gen) -> list[dict[str, torch.Tensor]]:
    return [{name: random_weight(shape, ctx.device, torch.float32, gen)
             for name, shape in hf_linear_shapes(spec, i).items()} for i in range(n_layers)]


def tensor_bytes_held(obj) -> tuple[int, int]:
    """(bytes, tensors): distinct storages reachable from ``obj``'s attributes, containers walked recursively."""
    storages: dict[tuple, int] = {}
    seen: set[int] = set()

    def visit(o, depth: int) -> None:
        if isinstance(o, torch.Tensor):
            st = o.untyped_storage()
            storages[(str(o.device), st.data_ptr())] = st.nbytes()
            return
        if depth > 8 or id(o) in seen:
            return
        seen.add(id(o))
        if isinstance(o, dict):
            for v in o.values():
                visit(v, depth + 1)
        elif isinstance(o, (list, tuple, set, frozenset)):
            for v in o:
                visit(v, depth + 1)
        elif type(o).__module__.startswith("qurl_verl") and hasattr(o, "__dict__"):
            visit(vars(o), depth + 1)

    visit(obj, 0)
    return sum(storages.values()), len(storages)


def quantize_layers_ms(ctx: Context, layers: list[dict[str, torch.Tensor]], fmt: str, gran: str, reps: int) -> float:
    """Median ms to run one sync's quantize work over ``layers``: quantize_state_dict, outputs held per layer."""
    scheme = parse_scheme(fmt, gran)  # parsed once, outside the timed calls

    def run():
        for named in layers:
            out = list(quantize_state_dict(named.items(), scheme))
            del out

    return wall_ms(ctx, run, reps)


def tracker_cost(ctx: Context, layers: list[dict[str, torch.Tensor]], row_stride: int) -> dict:
    """Two syncs through an INT8 channel tracker, fed the sync's own codes as the rollout worker does."""
    named = [(name, w) for layer in layers for name, w in layer.items()]
    q_first = [quantize(w, INT8_CHANNEL) for _, w in named]
    tracker = UpdateVisibilityTracker(INT8_CHANNEL, row_stride=row_stride)

    def observe_all(weights, quantized) -> float:
        ctx.sync()
        start = time.perf_counter()
        for (name, _), w, q in zip(named, weights, quantized):
            tracker.observe(name, w, q)
        ctx.sync()
        return (time.perf_counter() - start) * 1e3

    allocated_before = torch.cuda.memory_allocated(ctx.device) if ctx.cuda else None
    first_ms = observe_all([w for _, w in named], q_first)
    allocated_after = torch.cuda.memory_allocated(ctx.device) if ctx.cuda else None
    del q_first
    gen = torch.Generator(device=ctx.device).manual_seed(5)
    updated = [w + 1e-4 * torch.randn(w.shape, device=w.device, dtype=torch.float32, generator=gen).to(w.dtype)
               for _, w in named]
    q_second = [quantize(w, INT8_CHANNEL) for w in updated]
    second_ms = observe_all(updated, q_second)
    start = time.perf_counter()
    summary = tracker.end_step()
    end_step_ms = (time.perf_counter() - start) * 1e3
    held_bytes, held_tensors = tensor_bytes_held(tracker)
    return {
        "first_sync_ms": first_ms,
        "steady_sync_ms": second_ms,
        "end_step_ms": end_step_ms,
        "resident_bytes": held_bytes,
        "resident_tensors": held_tensors,
        "cuda_allocated_delta_bytes": (allocated_after - allocated_before) if ctx.cuda else None,
        "changed_fraction": summary["overall"]["changed_fraction"],
    }


def step_sync_cost(ctx: Context, budget: Budget, res: dict, flush) -> None:
    formats = (("int8", "channel"), ("fp8", "channel"), ("fp8", "block"))
    reps_one, reps_many = (5, 3) if ctx.cuda else (2, 1)
    row_stride = 8  # custom.qurl.code_change_row_stride default (DEFAULT_CODE_CHANGE_ROW_STRIDE, qurl_verl/settings/rollout.py)
    res.update(
        what="quantize_state_dict over the 7 targeted linears (q,k,v,o,gate,up,down) per layer, masters on the device",
        tracker_settings={"fmt": "int8", "granularity": "channel", "row_stride": row_stride},
        resident_bytes_method=("sum of untyped_storage().nbytes() over the distinct storages of every tensor "
                               "reachable from the tracker's attributes (dicts, tuples, lists and qurl_verl "
                               "objects walked recursively), after the second sync; cuda_allocated_delta_bytes "
                               "is torch.cuda.memory_allocated() across the first sync, as a cross-check"),
        models={},
    )
    gen = torch.Generator(device=ctx.device).manual_seed(4)
    for model, spec, n_measured in sync_models(ctx.dry_run):
        if budget.expired():
            break
        entry = res["models"][model] = {"layers_full": spec["layers"], "layers_measured": n_measured, "syncs": {}}
        masters = make_masters(ctx, spec, n_measured, gen)
        for master_dtype in (torch.float32, torch.bfloat16):
            if budget.expired():
                break
            dname = str(master_dtype).replace("torch.", "")
            layers = masters if master_dtype == torch.float32 else [
                {n: w.to(torch.bfloat16) for n, w in layer.items()} for layer in masters]
            layer_bytes = sum(w.numel() * w.element_size() for w in layers[0].values())
            for fmt, gran in formats:
                if budget.expired():
                    break
                one = quantize_layers_ms(ctx, layers[:1], fmt, gran, reps_one)
                many = quantize_layers_ms(ctx, layers, fmt, gran, reps_many) / n_measured
                entry["syncs"][f"{fmt}_{gran}_from_{dname}"] = {
                    "input_bytes_per_layer": layer_bytes,
                    "ms_per_layer_one": one,
                    "ms_per_layer_many": many,
                    "many_over_one": many / one,
                    "full_sync_ms_from_one": one * spec["layers"],
                    "full_sync_ms_from_many": many * spec["layers"],
                    "input_gb_per_s": layer_bytes / (many * 1e-3) / 1e9,
                }
            flush()
            if budget.expired():
                break
            cost = tracker_cost(ctx, layers, row_stride)
            scale = spec["layers"] / n_measured
            cost.update(full_model_steady_ms=cost["steady_sync_ms"] * scale,
                        full_model_resident_bytes=int(cost["resident_bytes"] * scale),
                        full_model_resident_gib=cost["resident_bytes"] * scale / 2**30)
            entry[f"tracker_from_{dname}"] = cost
            del layers
            ctx.free()
            flush()
        del masters
        ctx.free()
