"""Hydra search-path plugin: makes `+qurl=<preset>` resolve for any Hydra app once qurl-verl is installed.

Hydra discovers plugins in the `hydra_plugins` namespace package. Without this, `+qurl=int8`
would be silently taken as a plain string (the driver checks for that and says so).
"""
from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin


class QurlVerlSearchPathPlugin(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        search_path.append(provider="qurl-verl", path="pkg://qurl_verl.hydra_configs")
