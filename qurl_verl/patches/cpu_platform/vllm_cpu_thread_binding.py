"""Give each vLLM-CPU rank of a rollout server cores of its own when vLLM's automatic binding cannot.

Targets: verl 0.9.1, ``vLLMHttpServer.launch_server``
(``verl/workers/rollout/vllm_rollout/vllm_async_server.py``), which starts the engine whose CPU
workers vLLM binds to cores (``OMPProcessManager`` in ``vllm/utils/ompmultiprocessing.py``, the same
code in vLLM-CPU 0.24 and 0.32).

Why: with ``VLLM_CPU_OMP_THREADS_BIND`` unset ("auto") vLLM binds rank *r* of a node to the *r*-th
allowed NUMA node and asserts that there are as many NUMA nodes as local ranks. On a one-node CPU
(every laptop and most cloud VMs) rollout TP 2 therefore fails at engine start, inside Ray, a minute
into the run: ``AssertionError: Not enough allowed NUMA nodes to bind threads of 2 local
CPUWorkers``. Here the server splits the CPUs it may run on (NUMA node by node, in order) into one
contiguous group per local rank and sets the variable, which vLLM reads as one CPU list per rank
(``"0|1"`` for two ranks on two CPUs), before the engine starts; its processes inherit it.

When: on the CPU platform, in the rollout server, only if the variable is unset or ``auto`` and the
server's local ranks outnumber its NUMA nodes. A user's value, and every engine vLLM can bind by
itself, are left alone. Fewer CPUs than ranks is an error naming the variable (the driver refuses
it first where it can see the machine).
"""
from __future__ import annotations

import functools
import logging
import os
from collections.abc import Sequence

from qurl_verl.patches.contract import Patch, wrap_once
from qurl_verl.patches.on_import import patch_now_or_on_import

logger = logging.getLogger("qurl_verl")

TARGET_MODULE = "verl.workers.rollout.vllm_rollout.vllm_async_server"
BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
_MARK = "_qurl_thread_binding"


def needs_binding(environ, local_ranks: int, numa_nodes: int) -> bool:
    """vLLM's automatic binding would assert: more ranks than NUMA nodes, no binding of the user's."""
    return environ.get(BIND_ENV, "auto") == "auto" and local_ranks > max(numa_nodes, 1)


def thread_binding(cpus: Sequence[tuple[int, int]], ranks: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``ranks`` ranks over ``cpus`` (``(cpu id, NUMA node)`` pairs):
    contiguous groups in (NUMA node, id) order, the first ``len % ranks`` groups one CPU larger."""
    ids = [cpu for cpu, _ in sorted(cpus, key=lambda c: (c[1], c[0]))]
    if len(ids) < ranks:
        raise RuntimeError(
            f"vLLM-CPU rollout with {ranks} ranks on this node, but this process may run on {len(ids)} CPUs "
            f"({ids}): lower the rollout's tensor/data parallel size, or set {BIND_ENV} to one CPU list per "
            "rank separated by '|' (ranks may share CPUs, e.g. '0|0')"
        )
    size, extra = divmod(len(ids), ranks)
    groups, start = [], 0
    for rank in range(ranks):
        end = start + size + (rank < extra)
        groups.append(",".join(str(i) for i in ids[start:end]))
        start = end
    return "|".join(groups)


def _server_cpus() -> tuple[list[tuple[int, int]], int]:
    """The CPUs this process may run on with their NUMA nodes, and the NUMA nodes vLLM would bind to,
    read through vLLM's own helpers so both sides see the same machine."""
    from vllm.utils import cpu_resource_utils

    cpus = [(c.id, c.numa_node) for c in cpu_resource_utils.get_allowed_cpu_list()]
    return cpus, len(cpu_resource_utils.get_visible_memory_node())


def bind_before_launch(launch_server):
    @functools.wraps(launch_server)
    async def launch(self, *args, **kwargs):
        ranks = int(getattr(self, "gpus_per_node", 1) or 1)
        if ranks > 1 and os.environ.get(BIND_ENV, "auto") == "auto":
            cpus, numa_nodes = _server_cpus()
            if needs_binding(os.environ, ranks, numa_nodes):
                os.environ[BIND_ENV] = thread_binding(cpus, ranks)
                logger.warning("qurl-verl: %d vLLM-CPU ranks on %d NUMA node(s): %s=%s", ranks, numa_nodes,
                               BIND_ENV, os.environ[BIND_ENV])
        return await launch_server(self, *args, **kwargs)

    return launch


def patch_server(module) -> str:
    server = getattr(module, "vLLMHttpServer", None)
    return "" if server is None else wrap_once(server, "launch_server", bind_before_launch, _MARK)


PATCH = Patch(
    module=__name__,
    target=f"{TARGET_MODULE}:vLLMHttpServer.launch_server",
    package="verl",
    versions=("0.9.1",),
    when=f"on the CPU platform, in a rollout server with more local ranks than NUMA nodes and {BIND_ENV} unset",
    change=lambda: patch_now_or_on_import(TARGET_MODULE, patch_server),
)


def apply() -> str:
    return PATCH.apply()
