"""CPU stand-ins for what verl's ``NCCLCheckpointEngine`` (verl 0.9.1) touches on a GPU, so that its real code
path (buckets, zmq metadata channel, relays, the group's life) runs in CPU processes.

* ``cupy``: a module whose ``zeros``/``uint8``/``asarray``/``ndarray`` are torch's (verl's sender fills a cupy
  bucket by slice assignment and hands it to the collective);
* ``ray.util.collective``: a gloo group per name over a ``FileStore`` (``init_collective_group``,
  ``is_group_initialized``, ``broadcast``, ``allgather``, ``barrier``, ``destroy_collective_group``);
* ``torch.cuda.synchronize``/``empty_cache``: no-ops; ``torch.zeros(..., device="cuda")``: a CPU tensor;
* the node: ``NCCLCheckpointEngine.get_node_id`` returns the given id, the node IP is the loopback address;
* the ``qurl_int8`` CUDA transport's device: the CPU.

Install them in a fresh process (they replace module attributes for the process's life), before anything
imports verl's NCCL engine module.
"""
from __future__ import annotations

import datetime
import os
import sys
import time
import types

import torch
import torch.distributed as dist

GROUP_TIMEOUT = datetime.timedelta(seconds=30)
SUBSCRIPTION_SETTLE_S = 0.5


def cupy_stand_in() -> types.ModuleType:
    cupy = types.ModuleType("cupy")
    cupy.uint8 = torch.uint8
    cupy.ndarray = torch.Tensor
    cupy.zeros = lambda shape, dtype=torch.uint8: torch.zeros(shape, dtype=dtype)
    cupy.asarray = lambda array: array if isinstance(array, torch.Tensor) else torch.as_tensor(array)
    return cupy


class GlooCollective:
    """``ray.util.collective``'s calls verl's engine and ``qurl_int8`` make, on gloo groups over files in
    ``store_dir``. ``generation`` names a fresh set of groups (one test case after another in one process)."""

    def __init__(self, store_dir: str) -> None:
        self.store_dir = store_dir
        self.generation = 0
        self.groups: dict[str, dist.ProcessGroup] = {}

    def init_collective_group(self, world_size: int, rank: int, backend: str = "nccl",
                              group_name: str = "default") -> None:
        assert group_name not in self.groups, f"group {group_name} built twice"
        store = dist.FileStore(os.path.join(self.store_dir, f"{group_name}-{self.generation}"), world_size)
        self.groups[group_name] = dist.ProcessGroupGloo(store, rank, world_size, GROUP_TIMEOUT)

    def is_group_initialized(self, group_name: str = "default") -> bool:
        return group_name in self.groups

    def destroy_collective_group(self, group_name: str = "default") -> None:
        self.groups.pop(group_name, None)

    def broadcast(self, tensor: torch.Tensor, src_rank: int = 0, group_name: str = "default") -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = src_rank
        self.groups[group_name].broadcast([tensor], opts).wait()

    def allgather(self, tensor_list: list[torch.Tensor], tensor: torch.Tensor, group_name: str = "default") -> None:
        self.groups[group_name].allgather([tensor_list], [tensor]).wait()

    def barrier(self, group_name: str = "default") -> None:
        self.groups[group_name].barrier().wait()
        # verl's consumers connect their zmq SUB socket just before this barrier, and the sender publishes the
        # first bucket's metadata soon after it: a subscription still on its way is a dropped message (zmq's
        # slow joiner) and a hang until the group's timeout. On a machine whose cores are shared the gap can be
        # too short; this gives the subscription time to arrive
        time.sleep(SUBSCRIPTION_SETTLE_S)

    def next_case(self) -> None:
        """Forget every group: the next case builds its own."""
        self.groups.clear()
        self.generation += 1


def _on_cpu(factory):
    def wrapper(*args, device=None, **kwargs):
        if device is not None and torch.device(device).type == "cuda":
            device = "cpu"
        return factory(*args, device=device, **kwargs)

    return wrapper


def install(node_id: str, store_dir: str) -> GlooCollective:
    """Every stand-in, in this process; returns the collective (``next_case`` between cases)."""
    sys.modules["cupy"] = cupy_stand_in()
    import ray
    import ray.util.collective as collective

    stand_in = GlooCollective(store_dir)
    for name in ("init_collective_group", "is_group_initialized", "destroy_collective_group", "broadcast",
                 "allgather", "barrier"):
        setattr(collective, name, getattr(stand_in, name))
    ray.util.get_node_ip_address = lambda *args, **kwargs: "127.0.0.1"
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.empty_cache = lambda: None
    torch.zeros = _on_cpu(torch.zeros)

    from verl.checkpoint_engine.nccl_checkpoint_engine import NCCLCheckpointEngine

    NCCLCheckpointEngine.get_node_id = staticmethod(lambda: node_id)

    from qurl_verl.checkpoint_engine import nccl_transport

    nccl_transport.transport_device = lambda: torch.device("cpu")
    nccl_transport.synchronize = lambda: None
    return stand_in
