"""pip as on a user's machine: this machine's local package folders and extra indexes switched off."""
from __future__ import annotations

import os
import subprocess
import sys
import urllib.request

import pytest

PUBLIC_INDEX = "https://pypi.org/simple/"


def public_index_env() -> dict[str, str]:
    """The environment with pip's configuration off (``PIP_CONFIG_FILE=/dev/null``, ``PIP_FIND_LINKS=``) and no
    ``PYTHONPATH``, which would make a scratch environment see a source tree (and its egg-info) as installed."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_FIND_LINKS="", PIP_DISABLE_PIP_VERSION_CHECK="1", PYTHON=sys.executable)
    return env


def skip_unless_reachable() -> None:
    try:
        urllib.request.urlopen(PUBLIC_INDEX + "pip/", timeout=10)
    except OSError as e:
        pytest.skip(f"the public package index is not reachable from here ({e})")


def run_pip(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", *args], env=public_index_env(), capture_output=True,
                          text=True, timeout=timeout)
