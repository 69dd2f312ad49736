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
from collections.abc import Callable

from qurl_verl.patches.contract import Patch, wrap_once

_MARK = "_qurl_wrapped"


def checks_first(check: Callable[[object], None]):
    def wrapper_for(original):
        @functools.wraps(original)
        def validate_config(config, *args, **kwargs):
            check(config)
            return original(config, *args, **kwargs)

        return validate_config

    return wrapper_for


def _wrap(check: Callable[[object], None]) -> str:
    import verl.utils.config as verl_config

    return wrap_once(verl_config, "validate_config", checks_first(check), _MARK)


PATCH = Patch(
    module=__name__,
    target="verl.utils.config:validate_config",
    package="verl",
    versions=("0.9.1",),
    when="in every process that imports verl (the plugin); the checks return at once for a config without qurl",
    change=_wrap,
)


def apply(check: Callable[[object], None]) -> str:
    """Run ``check`` (the plugin passes the driver's ``on_validate_config``) before verl's own; "" if already
    wrapped. The check comes in as an argument: the patch sits below the driver and imports nothing of it."""
    return PATCH.apply(check)
