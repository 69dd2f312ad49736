"""The topologies users run, as verl's own main_ppo on CPU with `+qurl=int8`: two FSDP ranks with
rollout TP 2, and two Ray nodes joined through ``RAY_ADDRESS`` with a rollout replica on each.

Each run is the tiny CPU recipe for two steps under the deadline and clean-up of
``test_main_ppo_cpu.py``. What each one checks:

* TP 2 (one replica of two ranks, two FSDP ranks): no ``VLLM_CPU_OMP_THREADS_BIND`` from the user
  (the rollout server binds its ranks); each sync reports two ranks; both ranks received the same
  bits from their FSDP2 rank's full-tensor gather (``combine_ranks`` logs any disagreement), and at
  the first sync those are the bits of the whole checkpoint, streamed here without FSDP. With the FP8
  KV cache where vLLM-CPU has one (AVX-512, AMX): the two FSDP ranks train on different halves of
  the batch, so their K/V ranges differ until all-reduced, and each sends to its own TP rank: both TP
  ranks loading the same scales (no disagreement logged) is the all-reduce at work. (This run is the
  FP8 KV cache's e2e test on the vLLM 0.32 stack; ``test_main_ppo_fp8_kv_cache.py`` runs it with one
  rank on the 0.24 stack.)
* two Ray nodes (``ray.cluster_utils.Cluster``, one logical GPU each, started without any of the
  run's variables): ``trainer.nnodes=2`` with a shared UAQ directory; the CPU platform reaches the
  workers and the metrics reach the file named in the driver's shell. Each node runs one FSDP rank
  and one rollout replica (TP 1): both replicas report the same stream checksum at every sync, and
  a new one at the next, and the first is the whole checkpoint's. The cluster is stopped, and no
  process of it left, whatever the run did. (Two replicas on one node differ from this only in
  where Ray places them; a run of that shape trained the same way, with equal checksums, and is not
  repeated in ``make test`` to keep its time.)
"""
from __future__ import annotations

import math
import os

import psutil
import pytest
from test_main_ppo_cpu import end_processes, run_recipe
from test_main_ppo_fp8_kv_cache import FP8_KV, assert_kv_scales_streamed, fp8_kv_cache_on_this_cpu

STEPS = 2
TWO_RANKS = ["trainer.n_gpus_per_node=2", "ray_kwargs.ray_init.num_gpus=2"]
# the run's own variables, which the test process must not hand the Ray nodes it starts
RUN_VARIABLES = ("VERL_PLATFORM", "VERL_ENGINE_DEVICE", "VERL_FILE_LOGGER_PATH", "VLLM_CPU_OMP_THREADS_BIND")


@pytest.fixture
def clean_env(monkeypatch):
    for key in list(os.environ):
        if key in RUN_VARIABLES or key.startswith("QURL_"):
            monkeypatch.delenv(key)


def assert_trained(proc, rows):
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-6000:])
    assert len(rows) == STEPS, rows
    for r in rows:
        assert math.isfinite(r["actor/qurl/kl_behav_prox_k3"]) and 0 <= r["actor/qurl/kl_behav_prox_k3"] < 0.05, r
        assert r["actor/qurl/sync/quantized"] > 0, r


@pytest.mark.e2e
def test_two_fsdp_ranks_with_rollout_tp2(tmp_path, clean_env):
    fp8_kv = fp8_kv_cache_on_this_cpu()
    proc, rows = run_recipe(tmp_path, STEPS, *TWO_RANKS, "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
                            *([FP8_KV] if fp8_kv else []), timeout=1200)
    assert_trained(proc, rows)
    if fp8_kv:
        assert_kv_scales_streamed(rows)
    assert all(r["actor/qurl/sync/ranks"] == 2 for r in rows), [r.get("actor/qurl/sync/ranks") for r in rows]
    log = proc.stdout + proc.stderr
    assert "VLLM_CPU_OMP_THREADS_BIND=0|1" in log  # the server bound its two ranks
    assert "ranks disagree" not in log  # both TP ranks streamed the same bits (and KV scales) ...
    assert replica_checksums(rows[0]) == {"replica_0": unsharded_checksum(tmp_path / "cache" / "uaq")}  # ... whole


def unsharded_checksum(uaq_dir) -> int:
    """The stream checksum of the run's first sync, computed here from the checkpoint the actor started from
    (the UAQ-converted copy the driver wrote, read whole): what two FSDP ranks must have gathered and sent."""
    import torch
    from transformers import AutoModelForCausalLM

    from qurl_verl.rollout.weight_stream import WeightStreamQuantizer
    from qurl_verl.settings import RolloutSettings
    from qurl_verl.tied_lm_head import TIED_LM_HEAD_NAMES

    (checkpoint,) = uaq_dir.iterdir()
    state = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).state_dict()
    engine_dtypes = {name: torch.bfloat16 for name in state}  # the rollout's dtype, for pass-through tensors
    stream = WeightStreamQuantizer(RolloutSettings(format="int8"), param_dtypes=engine_dtypes,
                                   skip=frozenset(TIED_LM_HEAD_NAMES))
    stream.transform(state.items())
    return stream.stats.checksum


def replica_checksums(row: dict) -> dict[str, float]:
    return {k.rsplit("/", 1)[1]: v for k, v in row.items() if k.startswith("actor/qurl/sync/checksum/")}


def cluster_processes(root: psutil.Process) -> list[psutil.Process]:
    try:
        return [p for p in root.children(recursive=True) if p.is_running()]
    except psutil.Error:
        return []


@pytest.mark.e2e
def test_two_ray_nodes_joined_through_ray_address(tmp_path, clean_env, monkeypatch):
    from ray.cluster_utils import Cluster

    before = {p.pid for p in cluster_processes(psutil.Process())}
    cluster = Cluster(initialize_head=True, connect=False,
                      head_node_args={"num_cpus": 8, "num_gpus": 1, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=8, num_gpus=1)
        cluster.wait_for_nodes(timeout=120)
        monkeypatch.setenv("RAY_ADDRESS", cluster.address)
        proc, rows = run_recipe(
            tmp_path, STEPS, "trainer.nnodes=2", "trainer.n_gpus_per_node=1",
            "ray_kwargs.ray_init.num_cpus=null", "ray_kwargs.ray_init.num_gpus=null",
            f"qurl.uaq.cache_dir={tmp_path / 'uaq'}", timeout=1200,
        )
    finally:
        cluster.shutdown()
        left = [p for p in cluster_processes(psutil.Process()) if p.pid not in before]
        end_processes(left, grace_s=15)
    assert_trained(proc, rows)  # the metrics file the driver's shell named was written
    assert not [p for p in cluster_processes(psutil.Process()) if p.pid not in before]
    # one rollout replica per node: both hold the same codes at every sync, and the trainer's new ones
    sums = [replica_checksums(r) for r in rows]
    assert all(set(s) == {"replica_0", "replica_1"} for s in sums), sums
    assert all(s["replica_0"] == s["replica_1"] for s in sums), sums
    assert sums[0]["replica_0"] != sums[1]["replica_0"], sums  # the second sync brought new weights
    assert sums[0]["replica_0"] == unsharded_checksum(tmp_path / "uaq"), sums  # FSDP2 gathered the whole masters
    assert all(r["actor/qurl/sync/ranks"] == 1 for r in rows)
