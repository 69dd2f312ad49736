"""GPU evidence for QuRL's pure-torch layer, in one command on one CUDA device (written for an H200).

The GPU machine has no network, no vLLM and no verl, so everything here runs on torch alone plus
``qurl_verl.quant`` and ``qurl_verl.losses.acr`` (neither imports verl or vLLM). Four steps, each
under its own time budget; the JSON is rewritten after every step so a killed run keeps what it had:

numerics     INT8 / FP8 E4M3 quantizer codes and scales on CUDA vs CPU (channel, token, 128x128
             block, 1x128 group), and the W8A8 products of ``torch._int_mm`` / ``torch._scaled_mm``
             against an exactly accumulated float64 reference of the dequantized operands.
w8a8_decode  BF16 ``x @ w.T`` vs INT8 (``_int_mm`` + per-token / per-channel scales) vs FP8
             (``_scaled_mm``, row-wise scales) at decode batch sizes for the linears of
             Qwen2.5-1.5B / 7B / 32B (32B also at TP=2 shard shapes). These are torch's kernels,
             not vLLM's CUTLASS ones, and the activation quantization is unfused torch ops: the
             "gemm" columns bound what 8-bit GEMMs can give, the "total" columns what plain torch gives.
sync_cost    Re-quantizing every targeted linear of 7B- and 32B-shaped decoder layers from fp32 and
             bf16 masters (one weight sync), and the code-change tracker's time and memory.
acr_loss     Forward+backward of ``acr_token_loss`` vs a plain PPO clipped loss at 256 x 8192 tokens.

    PYTHONPATH=. python bench/gpu/gpu_evidence.py --out $OUT/gpu_evidence.json
    python bench/gpu/gpu_evidence.py --dry-run --out gpu_evidence_dry_run.json   # toy sizes on CPU, < 60 s
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
# Run by path on the GPU machine with PYTHONPATH=. (or through runpy, which adds no folder): the
# repository root for qurl_verl.quant, this folder for the step modules beside this file.
for folder in (REPO, HERE):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

from evidence_acr_loss import step_acr_loss  # noqa: E402
from evidence_numerics import step_numerics  # noqa: E402
from evidence_run_control import (  # noqa: E402
    DRY_RUN_BUDGET_S,
    GPU_BUDGET_S,
    HARD_GRACE_S,
    STEP_NAMES,
    Budget,
    Context,
    StepTimeout,
    environment,
    hard_time_limit,
    write_json,
)
from evidence_sync_cost import step_sync_cost  # noqa: E402
from evidence_w8a8_decode import step_w8a8_decode  # noqa: E402

STEPS = {
    "numerics": step_numerics,
    "w8a8_decode": step_w8a8_decode,
    "sync_cost": step_sync_cost,
    "acr_loss": step_acr_loss,
}


# ----------------------------------------------------------------------------- driver


def num(value, spec: str = ".2e") -> str:
    return "n/a" if value is None else format(value, spec)


def summary_lines(report: dict) -> list[str]:
    env = report["env"]
    lines = [f"device: {env.get('device_name')} (capability {env.get('capability')}), torch {env['torch']}, "
             f"CUDA {env['cuda']}, dry_run={env['dry_run']}"]
    for name, step in report["steps"].items():
        lines.append(f"[{name}] {step['status']} in {step.get('seconds', 0):.1f} s"
                     + (f": {step['error'].splitlines()[0]}" if step.get("error") else ""))
        res = step.get("result", {})
        try:
            if name == "numerics" and "summary" in res:
                s = res["summary"]
                lines.append(f"  codes vs CPU: int8 mismatches {s['int8_code_mismatches']}, fp8 mismatches "
                             f"{s['fp8_code_mismatches']}, scale mismatches {s['scale_mismatches']} "
                             f"(max rel {s['max_scale_rel_diff']:.1e}) over {s['elements']} elements")
                lines.append(f"  W8A8 vs exact: int8 max rel {num(s['int8_max_rel_err'])}, fp8 max err/abs-sum "
                             f"{num(s['fp8_max_err_over_abs_sum'])}, all within bound: {s['products_within_bound']}")
            elif name == "w8a8_decode":
                for model, entry in res.get("models", {}).items():
                    cells = [f"M={m}: int8 {t['speedup_vs_bf16'].get('int8_total', float('nan')):.2f}x "
                             f"(gemm {t['speedup_vs_bf16'].get('int8_gemm', float('nan')):.2f}x), "
                             f"fp8 {t['speedup_vs_bf16'].get('fp8_total', float('nan')):.2f}x"
                             for m, t in entry.get("per_decoder_layer", {}).items()]
                    lines.append(f"  {model} per layer vs bf16: " + "; ".join(cells))
            elif name == "sync_cost":
                for model, entry in res.get("models", {}).items():
                    for key, s in entry["syncs"].items():
                        lines.append(f"  {model} {key}: {s['full_sync_ms_from_many']:.1f} ms/sync "
                                     f"({s['input_gb_per_s']:.0f} GB/s in; many/one {s['many_over_one']:.2f})")
                    for key in ("tracker_from_float32", "tracker_from_bfloat16"):
                        if key in entry:
                            t = entry[key]
                            lines.append(f"  {model} {key}: {t['full_model_steady_ms']:.1f} ms/sync, "
                                         f"{t['full_model_resident_gib']:.2f} GiB resident")
            elif name == "acr_loss" and "median_ms" in res:
                lines.append("  " + ", ".join(f"{k} {v:.2f} ms ({res['ratio_to_vanilla_tis'][k]:.2f}x tis)"
                                              for k, v in res["median_ms"].items()))
        except (KeyError, TypeError, ValueError) as exc:
            lines.append(f"  (summary incomplete: {type(exc).__name__}: {exc})")
    lines.append(f"total {report.get('total_seconds', 0):.1f} s")
    return lines


def default_out(ctx: Context, env: dict) -> Path:
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"]) / "gpu_evidence.json"
    if ctx.dry_run:
        return Path(tempfile.gettempdir()) / "gpu_evidence_dry_run.json"
    slug = "".join(c if c.isalnum() else "_" for c in str(env.get("device_name", "gpu")).lower()).strip("_")
    return REPO / "bench" / "results" / f"gpu_{slug}.json"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="toy sizes on CPU: every step's code path, < 60 s")
    ap.add_argument("--steps", nargs="+", choices=STEP_NAMES, default=list(STEP_NAMES))
    ap.add_argument("--out", type=Path, default=None, help="JSON path (default $OUT/gpu_evidence.json)")
    args = ap.parse_args(argv)

    if args.dry_run:
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        print("no CUDA device; use --dry-run for the CPU code-path check", file=sys.stderr)
        return 2
    ctx = Context(device, args.dry_run)
    started = time.perf_counter()
    env = environment(ctx)
    out = args.out or default_out(ctx, env)
    budgets = DRY_RUN_BUDGET_S if args.dry_run else GPU_BUDGET_S
    report = {"script": "bench/gpu/gpu_evidence.py", "argv": sys.argv[1:], "env": env,
              "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "steps": {}}
    torch.manual_seed(0)
    for name in args.steps:
        entry = report["steps"][name] = {"status": "running", "budget_s": budgets[name], "result": {}}
        write_json(out, report)
        budget = Budget(budgets[name])
        start = time.perf_counter()
        try:
            grad_mode = torch.enable_grad() if name == "acr_loss" else torch.no_grad()
            with grad_mode, hard_time_limit(budgets[name] + HARD_GRACE_S):
                STEPS[name](ctx, budget, entry["result"], lambda: write_json(out, report))
            entry["status"] = "partial" if budget.truncated else "ok"
        except StepTimeout as exc:
            entry.update(status="timeout", error=str(exc))
        except Exception as exc:
            entry.update(status="error", error=f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}")
        entry["seconds"] = time.perf_counter() - start
        ctx.free()
        report["total_seconds"] = time.perf_counter() - started
        write_json(out, report)
    print("\n".join(summary_lines(report)))
    print(f"wrote {out}")
    return 0 if all(s["status"] == "ok" for s in report["steps"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
