"""Carry the environment a qurl-verl run is configured by to every Ray worker, local cluster or not.

Targets: verl 0.9.1, ``get_ppo_ray_runtime_env`` (``verl/trainer/constants_ppo.py``), which
``main_ppo.run_ppo`` passes to ``ray.init`` (``verl/trainer/main_ppo.py:62-73``) before the
``TaskRunner`` starts.

Why: when ``main_ppo`` starts Ray itself, every worker inherits the driver's environment. When it
joins a cluster started outside it (``RAY_ADDRESS``, ``trainer.nnodes=2``), the workers inherit
the environment of ``ray start`` instead, and only the runtime environment's ``env_vars`` travel.
verl's list has neither ``VERL_PLATFORM`` nor the project's variables, so on such a cluster a CPU
run builds an NCCL process group (``ProcessGroupNCCL is only supported with GPUs``) and the
metrics file named by ``VERL_FILE_LOGGER_PATH`` is never written (the file logger runs in the
``TaskRunner``). The wrapper adds, for a config that uses qurl-verl (``settings.uses_qurl``), the
variables of ``FORWARDED`` and every ``QURL_*`` and ``VLLM_CPU_*`` variable set in the driver,
with ``VERL_FILE_LOGGER_PATH`` made absolute against the driver's directory. A value the user put
in ``ray_kwargs.ray_init.runtime_env.env_vars`` still wins: verl merges it over this default.

The same call is also the one place every verl 0.9.1 entry point passes in the driver before Ray starts:
``fully_async_policy.fully_async_main`` calls ``run_ppo`` without verl's ``validate_config``, so neither the
qurl checks nor UAQ would run. For a qurl config the driver's hook has not prepared
(the driver's ``ensure_prepared``, which the plugin hands to ``apply``), the wrapper runs it first; after ``main_ppo``'s ``validate_config``
it does nothing more.

When: in every process that imports verl (the plugin), whether or not verl's module is imported
yet; for any other config verl's function returns exactly what it did before.
"""
from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable, Mapping

from qurl_verl.patches.contract import Patch, wrap_once
from qurl_verl.patches.on_import import patch_now_or_on_import
from qurl_verl.settings import PLATFORM_ENV, uses_qurl

TARGET_MODULE = "verl.trainer.constants_ppo"
FILE_LOGGER_ENV = "VERL_FILE_LOGGER_PATH"
# verl's own variables a qurl-verl run sets in the driver's shell (the tiny_cpu recipe sets them all):
# the platform, the training-engine lookup key the CPU platform sets, the metrics file, offline hub.
FORWARDED = (PLATFORM_ENV, "VERL_ENGINE_DEVICE", FILE_LOGGER_ENV, "HF_HUB_OFFLINE")
FORWARDED_PREFIXES = ("QURL_", "VLLM_CPU_")
_MARK = "_qurl_forwards_env"


def forwarded_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The driver's variables a qurl-verl run needs in its Ray workers (absolute metrics path)."""
    env = {k: v for k, v in environ.items() if k in FORWARDED or k.startswith(FORWARDED_PREFIXES)}
    if env.get(FILE_LOGGER_ENV):
        env[FILE_LOGGER_ENV] = os.path.abspath(env[FILE_LOGGER_ENV])
    return env


def forwarding_for(prepare: Callable[[object], None]):
    """``wrapper_for`` of ``wrap_once``: ``get_ppo_ray_runtime_env`` that first runs ``prepare`` (the driver's
    ``ensure_prepared``, handed in by the plugin) and then adds the forwarded variables, for a qurl config."""
    def wrapper_for(original):
        @functools.wraps(original)
        def get_ppo_ray_runtime_env(config=None, *args, **kwargs):
            if config is not None and uses_qurl(config):
                prepare(config)  # the checks and UAQ, where the entry point skipped validate_config
            runtime_env = original(config, *args, **kwargs)
            if config is not None and uses_qurl(config):
                runtime_env.setdefault("env_vars", {}).update(forwarded_env(os.environ))
            return runtime_env

        return get_ppo_ray_runtime_env

    return wrapper_for


def patch_runtime_env(module, prepare: Callable[[object], None]) -> str:
    """Wrap ``get_ppo_ray_runtime_env`` in verl's module and in ``main_ppo`` if it already bound the name."""
    did = [wrap_once(module, "get_ppo_ray_runtime_env", forwarding_for(prepare), _MARK)]
    main_ppo = sys.modules.get("verl.trainer.main_ppo")
    bound = getattr(main_ppo, "get_ppo_ray_runtime_env", None)
    if bound is not None and bound is not module.get_ppo_ray_runtime_env:
        main_ppo.get_ppo_ray_runtime_env = module.get_ppo_ray_runtime_env
        did.append("rebound in verl.trainer.main_ppo")
    return ", ".join(d for d in did if d)


PATCH = Patch(
    module=__name__,
    target=f"{TARGET_MODULE}:get_ppo_ray_runtime_env",
    package="verl",
    versions=("0.9.1",),
    when="in every process that imports verl; adds variables only for a config that uses qurl-verl",
    change=lambda prepare: patch_now_or_on_import(TARGET_MODULE, functools.partial(patch_runtime_env, prepare=prepare)),
)


def apply(prepare: Callable[[object], None]) -> str:
    """``prepare``: the driver's ``ensure_prepared`` (the plugin passes it; the patch imports nothing of the driver)."""
    return PATCH.apply(prepare)
