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


def is_number(v: Any) -> bool:
    """A finite int or float (a bool is not a number here)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
