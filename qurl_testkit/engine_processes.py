"""Checkpoint-engine tests in several processes, this process in verl's manager's place.

Each side (a trainer or rollout rank) runs ``target(side, *args, inbox, outbox)`` in a spawned process: per
sync it puts ``(side, what prepare() returned)`` on ``outbox`` and waits on ``inbox`` for its
``init_process_group`` arguments; at the end it puts ``(side, pickle.dumps(results))``. The manager's part, the
topology from every side's ``prepare``, is ``route``. Every wait is bounded and no process outlives the call.
"""
from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence

import torch.multiprocessing as mp

TIMEOUT_S = 120


def run_engine_processes(target: Callable, sides: Sequence[str], rounds: int,
                         route: Callable[[dict], dict], args: tuple = ()) -> dict:
    """Start one process per side, hand each round's ``route({side: prepared})`` (``{side: message}``) back to
    the sides, and return ``{side: its unpickled results}``; fails if any process did not exit cleanly."""
    ctx = mp.get_context("spawn")
    inboxes, outbox = {side: ctx.Queue() for side in sides}, ctx.Queue()
    procs = [ctx.Process(target=target, args=(side, *args, inboxes[side], outbox)) for side in sides]
    for p in procs:
        p.start()
    out = {}
    try:
        for _ in range(rounds):
            prepared = dict(outbox.get(timeout=TIMEOUT_S) for _ in sides)
            for side, message in route(prepared).items():
                inboxes[side].put(message)
        for _ in sides:
            side, result = outbox.get(timeout=TIMEOUT_S)
            out[side] = pickle.loads(result)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return out


def manager_topology(engine_cls, trainer: str, rollouts: Sequence[str]) -> Callable[[dict], dict]:
    """verl's manager for one trainer rank and ``rollouts``: ``build_topology`` over every side's ``prepare``,
    each side given its own ``init_process_group`` arguments."""
    sides = (trainer, *rollouts)

    def route(prepared: dict) -> dict:
        actor, rollout = engine_cls.build_topology(1, len(rollouts), [prepared[s] for s in sides])
        return {trainer: {k: v[0] for k, v in actor.items()},
                **{side: {k: v[i] for k, v in rollout.items()} for i, side in enumerate(rollouts)}}

    return route
