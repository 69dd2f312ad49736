"""The one error class of a refused config, and requirement tables: a refused config lists every
problem at once, one line each, with the override that fixes it."""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from .keys import select, show


class QurlConfigError(ValueError):
    """A configuration qurl-verl cannot run; the message names each key and the override that fixes it."""


@dataclass(frozen=True)
class Requirement:
    """One key a setting depends on: the check, why, and the override that fixes it."""

    key: str
    ok: Callable[[Any], bool]
    fix: Any  # the value to set
    why: str

    def problem(self, cfg: Any) -> str | None:
        value = select(cfg, self.key)
        if self.ok(value):
            return None
        return f"{self.key}={show(value)}: {self.why}; set {self.key}={show(self.fix)}"


def problems(cfg: Any, table: Iterable[Requirement]) -> list[str]:
    return [p for p in (r.problem(cfg) for r in table) if p is not None]


def raise_problems(headline: str, found: list[str]) -> None:
    if found:
        raise QurlConfigError(headline + "\n  " + "\n  ".join(found))


@dataclass(frozen=True)
class Check:
    """One driver check: the rule as one line, whether a run is subject to it, the check (raises
    ``QurlConfigError`` naming the fix), and that fix (tests find it in the message). The driver's table
    (``driver.checks``) and each sync feature's rows (``rollout.features``) are made of these."""

    what: str
    applies: Callable[[Any], bool]
    check: Callable[[Any], None]
    fix: str


def refuse_first(table: Iterable[Check], subject: Any) -> None:
    """Run each row that applies, in order; the first refusal stops the run."""
    for row in table:
        if row.applies(subject):
            row.check(subject)


def is_number(v: Any) -> bool:
    """A finite int or float (a bool is not a number here)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
