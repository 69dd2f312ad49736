"""`+qurl=<preset>` resolves from any working directory in the installed environment."""
from __future__ import annotations

import subprocess
import sys
import textwrap


def test_preset_resolves_outside_the_repository(tmp_path):
    """Hydra finds the presets through the installed `hydra_plugins` package, not through the
    current directory (the default editable install mapped only regular packages)."""
    code = textwrap.dedent("""
        import sys
        from hydra import compose, initialize_config_module
        with initialize_config_module(config_module="verl.trainer.config", version_base=None):
            cfg = compose("ppo_trainer", overrides=["+qurl=int8"])
        print("RESOLVED", type(cfg.qurl).__name__, cfg.qurl.preset, cfg.actor_rollout_ref.rollout.name)
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert "RESOLVED DictConfig int8 qurl_vllm" in p.stdout, p.stderr[-3000:]
