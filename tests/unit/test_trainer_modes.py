"""What verl's asynchronous trainers ask of the ``qurl_vllm`` server, on the installed vLLM.

verl 0.9.1 pauses the engine before every sync of an asynchronous trainer (``abort_all_requests``) with
``pause_generation(wait_for_inflight_requests=False, ...)``. The engine here is a stand-in that holds the
installed vLLM's own ``AsyncLLM.pause_generation`` function and records what that function asks of the
engine core, so the keyword handling under test is vLLM's code, not a copy.
"""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.both_stacks  # vLLM 0.24 takes verl's keyword, 0.32 does not

vllm_async_llm = pytest.importorskip("vllm.v1.engine.async_llm", reason="needs vLLM")


class EngineStandIn:
    """``AsyncLLM`` as far as ``pause_generation`` reaches: the real method over recorded engine-core calls."""

    pause_generation = vllm_async_llm.AsyncLLM.pause_generation

    def __init__(self):
        self.paused: list[dict] = []
        self.output_processor = SimpleNamespace(request_states={"request-1": None})

        async def clear_mm_cache_async():
            return None

        async def pause_scheduler_async(**kwargs):
            self.paused.append(kwargs)

        self.renderer = SimpleNamespace(clear_mm_cache_async=clear_mm_cache_async)
        self.engine_core = SimpleNamespace(pause_scheduler_async=pause_scheduler_async)


def server_over(engine, cls):
    """A server object with only what verl's ``abort_all_requests`` reads (no Ray actor, no engine start)."""
    server = cls.__new__(cls)
    server.node_rank, server.engine = 0, engine
    server._submission_paused, server._admitting, server._rejecting = False, 0, False
    server._resume_event = asyncio.Event()
    return server


async def test_qurl_server_pauses_a_vllm_without_the_keyword():
    from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer

    from qurl_verl.patches.qurl_vllm_server.pause_generation_keyword import takes_keyword
    from qurl_verl.rollout.server import QurlvLLMHttpServer

    stock_engine = EngineStandIn()
    try:
        await vLLMHttpServer.abort_all_requests(server_over(stock_engine, vLLMHttpServer))
        stock_error = None
    except TypeError as e:
        stock_error = e
    # the stock call fails exactly where vLLM's pause_generation lacks verl's keyword (0.32), and passes on 0.24
    assert (stock_error is None) == takes_keyword(vllm_async_llm.AsyncLLM.pause_generation), stock_error

    engine = EngineStandIn()
    result = await QurlvLLMHttpServer.abort_all_requests(server_over(engine, QurlvLLMHttpServer))
    assert result == {"aborted_count": 1, "request_ids": ["request-1"]}
    assert engine.paused == [{"mode": "abort", "clear_cache": True}]  # verl's False: abort, as 0.24 read it
    assert "pause_generation" not in vars(EngineStandIn()) and vllm_async_llm.AsyncLLM.pause_generation is (
        EngineStandIn.pause_generation)  # this engine object only: vLLM's class is unchanged


async def test_the_keyword_translation_keeps_what_verl_asked_for():
    from qurl_verl.patches.qurl_vllm_server import pause_generation_keyword

    calls = []

    class ModeOnly:  # vLLM 0.32's signature, a keyword-only mode
        async def pause_generation(self, *, mode: str = "abort", clear_cache: bool = True):
            calls.append((mode, clear_cache))

    engine = ModeOnly()
    assert pause_generation_keyword.apply(engine)
    assert pause_generation_keyword.apply(engine) == ""  # once
    await engine.pause_generation(wait_for_inflight_requests=True, clear_cache=False)
    await engine.pause_generation(wait_for_inflight_requests=False)
    await engine.pause_generation(mode="keep")
    assert calls == [("wait", False), ("abort", True), ("keep", True)]
