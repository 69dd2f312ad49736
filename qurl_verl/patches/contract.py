"""What every patch module declares (``PATCH = Patch(...)``), and the checks all patches share.

A record says what a patch changes upstream (``target``, as ``module:qualname``), for which
versions of which package it was written (matched against the installed one by the version policy,
``qurl_verl/versions.py``), when it applies (``when``, plus an ``applies`` predicate where the condition is a fact of the running process: AMX present, oneDNN saturates,
an environment marker), and how often it runs (``runs``). ``Patch.apply`` is the one way in: it
checks the predicate, runs the change, and on a version the patch was not written for warns once.
Every apply returns what it did as one short string, "" for nothing (not applicable, or already
applied), so a group reports ``{patch name: what it did}`` and callers need no special cases.

``wrap_once`` is the one "already applied" guard: a function or method is wrapped at most once,
recognised by a mark attribute on the wrapper. Nothing here imports the packages patched.
"""
from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from qurl_verl.versions import installed_version, is_targeted

logger = logging.getLogger("qurl_verl")

ONCE = "once per process"
AFTER_RELOAD = "after every weight reload"
AT_INSTALL = "once, at install time"
RUNS = (ONCE, AFTER_RELOAD, AT_INSTALL)


@dataclass(frozen=True)
class Patch:
    module: str  # the patch module's ``__name__``
    target: str  # the upstream ``module:qualname`` it changes
    package: str  # the package that holds the target
    versions: tuple[str, ...]  # the package versions it was written for (prefixes: "0.32.0" covers "0.32.0+cpu")
    when: str  # when it applies, in a few words
    change: Callable[..., str]  # does it; returns what it did, "" for nothing (already done, or absent)
    applies: Callable[[], bool] | None = None  # checked at run time before ``change``; None: always
    runs: str = ONCE

    def __post_init__(self):
        if self.runs not in RUNS:
            raise ValueError(f"{self.module}: runs={self.runs!r}, not one of {RUNS}")

    @property
    def name(self) -> str:
        return self.module.rsplit(".", 1)[-1]

    def apply(self, *args, **kwargs) -> str:
        """Run the change where it applies; what it did ("" = nothing). Warns once per process when
        it did something on a version of ``package`` it was not written for."""
        if self.applies is not None and not self.applies():
            return ""
        did = self.change(*args, **kwargs)
        if did:
            warn_if_untargeted(self)
        return did


_warned: set[str] = set()


def warn_if_untargeted(patch: Patch) -> bool:
    """Warn (once per patch and process) when the installed ``patch.package`` is not a version it targets."""
    version = installed_version(patch.package)
    if version is None or is_targeted(version, patch.versions) or patch.module in _warned:
        return False
    _warned.add(patch.module)
    logger.warning("qurl-verl: %s written for %s %s, running on %s", patch.module, patch.package,
                   ", ".join(patch.versions), version)
    return True


def is_wrapped(fn, mark: str) -> bool:
    return bool(getattr(fn, mark, False))


def wrap_once(owner, name: str, wrapper_for: Callable, mark: str) -> str:
    """Replace ``owner.<name>`` (a module's function or a class's method) by ``wrapper_for(original)``,
    tagged with ``mark``. "" if absent or already wrapped, so applying twice changes nothing."""
    original = getattr(owner, name, None)
    if original is None or is_wrapped(original, mark):
        return ""
    wrapped = wrapper_for(original)
    setattr(wrapped, mark, True)
    setattr(owner, name, wrapped)
    return f"wrapped {getattr(owner, '__name__', type(owner).__name__)}.{name}"


def group_patches(group: str, names: Iterable[str]) -> list[Patch]:
    """The records of a group's modules, in the group's order (imported here, on first use)."""
    return [importlib.import_module(f"{group}.{name}").PATCH for name in names]


def apply_each(patches: Iterable[Patch], *args, **kwargs) -> dict[str, str]:
    """Apply each patch in order: {patch name: what it did}."""
    return {p.name: p.apply(*args, **kwargs) for p in patches}


def describe(results: dict[str, str]) -> str:
    """What a group did, as one line: "name (what), ..." for the patches that did something."""
    return ", ".join(f"{name} ({did})" for name, did in results.items() if did)
