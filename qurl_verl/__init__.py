"""qurl-verl: QuRL quantized rollout (INT8/FP8 W8A8, ACR loss, UAQ) as a plugin for verl 0.9.1."""

__version__ = "0.2.0"  # the one version: pyproject.toml reads it from here


def plugin_status() -> dict[str, str]:
    """What the verl plugin registered in this process ({} if verl was never imported)."""
    import sys

    mod = sys.modules.get("qurl_verl._verl_plugin")
    return dict(mod.STATUS) if mod is not None else {}
