"""Rollout TP > 1 on a one-NUMA-node CPU: vLLM's automatic binding refuses it, the server's split binds it.

vLLM's own ``OMPProcessManager`` methods are the reference: its automatic binding is run on a forced
one-node machine (it asserts), and its parser reads the binding the patch writes (each rank gets
the CPUs the patch meant). The machine is forced, so every branch runs on any CPU.
"""
from __future__ import annotations

import asyncio
import types

import pytest
from omegaconf import OmegaConf

from qurl_verl.driver.cpu_platform_checks import check_cpu_for_each_rank, rollout_ranks_per_node
from qurl_verl.patches.cpu_platform import vllm_cpu_thread_binding as binding
from qurl_verl.platform.host import Host
from qurl_verl.settings import QurlConfigError

pytestmark = pytest.mark.both_stacks  # reaches vLLM's own code, which differs between the stacks

BIND = binding.BIND_ENV


@pytest.fixture
def omp(monkeypatch):
    """vLLM's binding code on a forced machine: 4 CPUs (two cores of two threads) on one NUMA node."""
    ompmp = pytest.importorskip("vllm.utils.ompmultiprocessing")
    from vllm.utils import cpu_resource_utils as cr

    cpus = [cr.LogicalCPUInfo(id=i, physical_core=i // 2, numa_node=0) for i in range(4)]
    monkeypatch.setattr(cr, "get_allowed_cpu_list", lambda: cpus)
    monkeypatch.setattr(cr, "get_visible_memory_node", lambda: [0])
    monkeypatch.delenv(BIND, raising=False)
    return ompmp.OMPProcessManager, cpus


def manager(cls, local_world_size: int):
    """An ``OMPProcessManager`` as vLLM builds it for one engine, without a VllmConfig."""
    m = object.__new__(cls)
    m.local_world_size, m.local_dp_rank, m.internal_dp_size = local_world_size, None, 1
    m.simulate_multi_node, m.reserve_cpu_num = False, local_world_size
    return m


def test_vllm_auto_binding_refuses_two_ranks_on_one_numa_node(omp):
    cls, _ = omp
    with pytest.raises(AssertionError, match="Not enough allowed NUMA nodes"):
        cls._parse_omp_threads_bind_env(manager(cls, 2))


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_vllm_reads_the_split_as_one_cpu_list_per_rank(omp, monkeypatch, ranks):
    cls, cpus = omp
    value = binding.thread_binding([(c.id, c.numa_node) for c in cpus], ranks)
    monkeypatch.setenv(BIND, value)
    m = manager(cls, ranks)
    cls._parse_omp_threads_bind_env(m)
    assert len(m.cpu_lists) == ranks
    assert sorted(c for lst in m.cpu_lists for c in lst) == [0, 1, 2, 3]  # every CPU, each once
    assert max(map(len, m.cpu_lists)) - min(map(len, m.cpu_lists)) <= 1
    assert all(lst == list(range(lst[0], lst[0] + len(lst))) for lst in m.cpu_lists)  # contiguous


def test_the_split_keeps_numa_nodes_together():
    cpus = [(0, 0), (1, 1), (2, 0), (3, 1)]
    assert binding.thread_binding(cpus, 2) == "0,2|1,3"


def test_fewer_cpus_than_ranks_names_the_variable():
    with pytest.raises(RuntimeError, match=BIND):
        binding.thread_binding([(0, 0)], 2)


class FakeServer:
    def __init__(self, gpus_per_node):
        self.gpus_per_node = gpus_per_node

    async def launch_server(self, *args, **kwargs):
        import os

        return os.environ.get(BIND)


@pytest.fixture
def patched_server(monkeypatch):
    cls = type("vLLMHttpServer", (FakeServer,), {})
    assert binding.patch_server(types.SimpleNamespace(vLLMHttpServer=cls))
    assert binding.patch_server(types.SimpleNamespace(vLLMHttpServer=cls)) == ""  # once
    monkeypatch.delenv(BIND, raising=False)
    return cls


@pytest.mark.parametrize("ranks, numa_nodes, user, want", [
    (2, 1, None, "0|1"),  # the TP 2 case that fails in vLLM: split
    (2, 2, None, None),  # vLLM binds one rank per NUMA node by itself
    (1, 1, None, None),  # one rank: nothing to split
    (2, 1, "0|0", "0|0"),  # the user's binding wins
])
def test_the_server_binds_before_launch_only_where_vllm_cannot(patched_server, monkeypatch, ranks, numa_nodes, user, want):
    monkeypatch.setattr(binding, "_server_cpus", lambda: ([(0, 0), (1, 0)], numa_nodes))
    if user is not None:
        monkeypatch.setenv(BIND, user)
    assert asyncio.run(patched_server(ranks).launch_server()) == want


def rollout_cfg(tp=1, dp=1, gpus=8, nnodes=1):
    return OmegaConf.create({
        "trainer": {"n_gpus_per_node": gpus, "nnodes": nnodes},
        "actor_rollout_ref": {"rollout": {"tensor_model_parallel_size": tp, "data_parallel_size": dp,
                                          "pipeline_model_parallel_size": 1}},
    })


def test_ranks_per_node_are_the_replicas_at_most_a_node():
    assert rollout_ranks_per_node(rollout_cfg(tp=2)) == 2
    assert rollout_ranks_per_node(rollout_cfg(tp=2, dp=2)) == 4
    assert rollout_ranks_per_node(rollout_cfg(tp=4, gpus=2)) == 2


def test_the_driver_refuses_more_ranks_than_cpus_and_names_the_variable():
    host = Host(cpu_platform=True, usable_cpus=2)
    check_cpu_for_each_rank(rollout_cfg(tp=2), host, {})
    with pytest.raises(QurlConfigError, match=f"tensor_model_parallel_size=4.*{BIND}"):
        check_cpu_for_each_rank(rollout_cfg(tp=4), host, {})
    check_cpu_for_each_rank(rollout_cfg(tp=4), host, {BIND: "0|0|1|1"})  # the user's binding
