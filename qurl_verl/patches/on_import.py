"""Patch a module of an upstream package whether or not it is imported yet, without importing it.

A patch that must not depend on import order calls ``patch_now_or_on_import(name, patch)``: if
the module is loaded, ``patch(module)`` runs at once; otherwise a one-shot ``sys.meta_path``
finder runs it right after the module executes, then removes itself. Nothing is imported here,
and if no finder knows the module (the package is not installed), nothing happens.
"""
from __future__ import annotations

import importlib.abc
import sys


class _PatchingLoader(importlib.abc.Loader):
    """Runs the real loader, patches the module, then hands it back to the real loader."""

    def __init__(self, loader, finder: PatchOnImport):
        self.loader, self.finder = loader, finder

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        module.__loader__ = self.loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self.loader
        self.finder.patch(module)
        self.finder.remove()


class PatchOnImport(importlib.abc.MetaPathFinder):
    """One-shot ``sys.meta_path`` entry: runs ``patch(module)`` right after ``target`` executes.
    Every other import passes through; if no finder has ``target``, nothing happens."""

    def __init__(self, target: str, patch):
        self.target, self.patch = target, patch

    def find_spec(self, fullname, path, target=None):
        if fullname != self.target:
            return None
        for finder in list(sys.meta_path):
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _PatchingLoader(spec.loader, self)
        return spec

    def remove(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)


def import_hook_installed(target: str) -> bool:
    return any(isinstance(f, PatchOnImport) and f.target == target for f in sys.meta_path)


def patch_now_or_on_import(target: str, patch) -> str:
    """"patched" if ``target`` is loaded and ``patch`` changed it, "on import" if a hook will
    patch it when it loads, "" if already done. Never imports ``target``."""
    module = sys.modules.get(target)
    if module is not None:
        return "patched" if patch(module) else ""
    if import_hook_installed(target):
        return ""
    sys.meta_path.insert(0, PatchOnImport(target, patch))
    return "on import"

