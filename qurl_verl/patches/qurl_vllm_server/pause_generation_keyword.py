"""Let verl 0.9.1 pause a vLLM engine whose ``pause_generation`` no longer takes ``wait_for_inflight_requests``.

Targets: verl 0.9.1 ``vLLMHttpServer.abort_all_requests``
(``verl/workers/rollout/vllm_rollout/vllm_async_server.py``), which calls
``AsyncLLM.pause_generation(wait_for_inflight_requests=False, clear_cache=...)``; vLLM 0.32.0, whose
``pause_generation`` takes ``mode=`` only (0.24 still accepts the deprecated keyword, mapping ``True`` to
``mode="wait"`` and anything else to the default ``"abort"``).

Why: verl calls ``abort_all_requests`` before every weight sync of its asynchronous trainers
(``trainer.v1.trainer_mode=colocate_async``, the fully-async and one-step-off entry points), so on vLLM 0.32
the first sync of such a run dies with ``TypeError: ... unexpected keyword argument
'wait_for_inflight_requests'``.

Fix: on this server's engine object only (an attribute of the instance, not of ``AsyncLLM``), a
``pause_generation`` that translates the keyword the way 0.24 did, ``True`` -> ``mode="wait"``, otherwise
vLLM's default ``mode="abort"``, and passes everything else through. Applied by ``QurlvLLMHttpServer`` when it
aborts; does nothing where the engine's ``pause_generation`` still takes the keyword, or where there is no
engine (a headless node). When verl passes ``mode=`` itself, ``test_qurl_server_pauses_a_vllm_without_the_keyword``
in ``tests/unit/test_trainer_modes.py`` shows the stock call passing, and this module can go.
"""
from __future__ import annotations

import functools
import inspect

from qurl_verl.patches.contract import Patch

KEYWORD = "wait_for_inflight_requests"
_MARK = "_qurl_pause_keyword"


def takes_keyword(pause_generation) -> bool:
    parameters = inspect.signature(pause_generation).parameters
    return KEYWORD in parameters or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


def _adapt(engine) -> str:
    method = getattr(engine, "pause_generation", None)
    if method is None or getattr(method, _MARK, False) or takes_keyword(method):
        return ""

    @functools.wraps(method)
    async def pause_generation(*args, **kwargs):
        if KEYWORD in kwargs:
            wait = kwargs.pop(KEYWORD)
            kwargs.setdefault("mode", "wait" if wait else "abort")
        return await method(*args, **kwargs)

    setattr(pause_generation, _MARK, True)
    engine.pause_generation = pause_generation
    return f"{type(engine).__name__}.pause_generation takes {KEYWORD} (as mode=) for verl's abort"


PATCH = Patch(
    module=__name__,
    target="vllm.v1.engine.async_llm:AsyncLLM.pause_generation",
    package="vllm",
    versions=("0.32.0",),
    when="on a qurl_vllm server's own engine, where pause_generation lacks wait_for_inflight_requests",
    change=_adapt,
)


def apply(engine) -> str:
    return PATCH.apply(engine)
