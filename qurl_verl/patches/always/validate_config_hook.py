"""Run qurl-verl's configuration checks inside verl's own `validate_config`.

Targets: verl 0.9.1 (`verl/utils/config.py::validate_config`, called by
`verl/trainer/main_ppo.py::main` in the driver before Ray starts).

Why: verl has no hook for a plugin to check the composed configuration in the driver. Without
one, a bad qurl setting surfaces minutes later as a traceback inside a Ray worker. verl's
`main_ppo` binds `validate_config` with `from verl.utils.config import validate_config` *after*
`import verl` has loaded our plugin, so replacing the module attribute at plugin load is enough
for it (and for any recipe that calls the function through the module). The wrapper runs the
qurl checks first, then verl's unchanged function.
"""
from __future__ import annotations

import functools
from typing import Callable

_MARK = "_qurl_wrapped"


def apply(check: Callable[[object], None]) -> bool:
    import verl.utils.config as verl_config

    original = verl_config.validate_config
    if getattr(original, _MARK, False):
        return False

    @functools.wraps(original)
    def validate_config(config, *args, **kwargs):
        check(config)
        return original(config, *args, **kwargs)

    setattr(validate_config, _MARK, True)
    verl_config.validate_config = validate_config
    return True
