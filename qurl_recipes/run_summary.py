"""Print a short end-of-run summary from verl's file-logger metrics (VERL_FILE_LOGGER_PATH)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# metric shown -> candidate verl keys, first present wins
SHOWN = {
    "reward": ("critic/score/mean", "critic/rewards/mean"),
    "grad_norm": ("actor/grad_norm",),
    "rollout_probs_diff_max": ("training/rollout_probs_diff_max",),
    "step_s": ("timing_s/step",),
}


def read_metrics(path: str | Path) -> list[dict]:
    rows = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            rows.append({"step": rec["step"], **rec["data"]})
    return rows


def pick(row: dict, keys: tuple[str, ...]):
    for k in keys:
        if k in row:
            return row[k]
    return None


def summarize(rows: list[dict]) -> dict:
    # validation before training logs a row of its own (step 0) with no training metric in it
    rows = [r for r in rows if "timing_s/step" in r]
    if not rows:
        raise ValueError("no training steps were logged")
    first, last = rows[0], rows[-1]
    out = {"steps": len(rows)}
    for name, keys in SHOWN.items():
        out[f"{name}_first"], out[f"{name}_last"] = pick(first, keys), pick(last, keys)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("metrics")
    ap.add_argument("--wall-s", type=float, default=None)
    a = ap.parse_args(argv)
    p = Path(a.metrics)
    if not p.exists():
        print(f"[summary] no metrics file at {p}: the run logged no step", file=sys.stderr)
        return 1
    s = summarize(read_metrics(p))
    fmt = lambda v: "n/a" if v is None else f"{v:.4g}"  # noqa: E731
    print("=" * 60)
    print(f"[summary] steps: {s['steps']}" + (f"   wall time: {a.wall_s:.0f} s" if a.wall_s is not None else ""))
    for name in SHOWN:
        print(f"[summary] {name:>24}: {fmt(s[name + '_first'])} -> {fmt(s[name + '_last'])}")
    print("=" * 60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
