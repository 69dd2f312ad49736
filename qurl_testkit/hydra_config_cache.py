"""Hydra's config files, parsed once per test process.

Every ``compose`` re-reads and re-parses verl's ``ppo_trainer`` tree (about 170 YAML files, in PyYAML's
pure-Python loader): about half of the 1.2 s a composition costs. The suite composes hundreds of configs
(the driver's checks, the recipes, the presets), so the tests memoize what Hydra's config sources return and
hand each caller a deep copy: the composition itself, the defaults list, the merges and the overrides, runs as
Hydra does it. Packaged files do not change during a test run; a file source's entry is also keyed by the
file's modification time.
"""
from __future__ import annotations

import copy
import functools
import os

_MARK = "_qurl_test_cache"


def cache_config_sources() -> None:
    """Memoize ``load_config`` of Hydra's package and file config sources in this process (idempotent)."""
    from hydra._internal.core_plugins.file_config_source import FileConfigSource
    from hydra._internal.core_plugins.importlib_resources_config_source import ImportlibResourcesConfigSource

    for source in (ImportlibResourcesConfigSource, FileConfigSource):
        load = source.load_config
        if getattr(load, _MARK, False):
            continue
        source.load_config = _memoized(load, stamp=source is FileConfigSource)


def _memoized(load, stamp: bool):
    cache: dict = {}

    @functools.wraps(load)
    def load_config(self, config_path: str):
        key = (type(self), self.path, config_path)
        if stamp:
            try:
                key += (os.stat(os.path.join(self.path, self._normalize_file_name(config_path))).st_mtime_ns,)
            except OSError:
                return load(self, config_path)
        if key not in cache:
            cache[key] = load(self, config_path)
        return copy.deepcopy(cache[key])

    setattr(load_config, _MARK, True)
    return load_config
