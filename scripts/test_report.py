"""Per-stack totals and the slowest tests of a `make test` run, from the JUnit XML files pytest wrote.

Usage: python scripts/test_report.py [--slowest N] REPORT.xml [REPORT.xml ...]
Each stack is the files whose names start with its label before the first dot (``vllm032.xml`` and
``vllm032.unit.xml``: the stack's serial and parallel runs); a missing file is reported as not run.
Prints, per stack: tests, failures, errors, skipped and seconds, split by layer (tests/<layer>/...);
then the N slowest tests of all stacks together, and one closing line with the counts of all stacks. Standard library only (any Python runs it).
"""
from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path


def read_cases(path: Path) -> list[dict]:
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            if case.find(tag) is not None:
                outcome = tag
        classname = case.get("classname", "")
        layer = classname.split(".")[1] if classname.startswith("tests.") and "." in classname[6:] else "other"
        cases.append({"id": f"{classname}::{case.get('name')}", "layer": layer,
                      "seconds": float(case.get("time") or 0.0), "outcome": outcome})
    return cases


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="+", type=Path)
    parser.add_argument("--slowest", type=int, default=20)
    args = parser.parse_args(argv)
    everything = []
    print("[tests] per stack (seconds in tests; installs and start-up not included)")
    stacks: dict[str, list[Path]] = {}
    for path in args.reports:
        stacks.setdefault(path.name.split(".")[0], []).append(path)
    for stack, paths in stacks.items():
        missing = [p for p in paths if not p.exists()]
        if missing:
            print(f"[tests] {stack}: not run (no {', '.join(map(str, missing))})")
            if len(missing) == len(paths):
                continue
        cases = [c for p in paths if p.exists() for c in read_cases(p)]
        everything += [{**c, "stack": stack} for c in cases]
        counts = defaultdict(int)
        layers = defaultdict(float)
        for c in cases:
            counts[c["outcome"]] += 1
            layers[c["layer"]] += c["seconds"]
        total = sum(layers.values())
        split = ", ".join(f"{layer} {s:.0f} s" for layer, s in sorted(layers.items(), key=lambda kv: -kv[1]))
        print(f"[tests] {stack}: {counts['passed']} passed, {counts['failure']} failed, {counts['error']} errors, "
              f"{counts['skipped']} skipped; {total:.0f} s ({total / 60:.1f} min): {split}")
    if everything:
        print(f"[tests] slowest {args.slowest}:")
        for c in sorted(everything, key=lambda c: -c["seconds"])[: args.slowest]:
            print(f"  {c['seconds']:7.1f} s  {c['stack']:8s} {c['outcome']:7s} {c['id']}")
    outcomes = [c["outcome"] for c in everything]
    failed = outcomes.count("failure") + outcomes.count("error")
    print(f"total: {outcomes.count('passed')} passed, {failed} failed, {outcomes.count('skipped')} skipped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
