"""What the ``main_ppo`` runs of ``test_main_ppo_runs.py`` assert: one function per feature, each reading the run's
metrics rows (verl's file logger) and log, so that a run can carry the checks of several features."""
from __future__ import annotations

import math
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

FP8_KV = "+actor_rollout_ref.rollout.custom.qurl.kv_cache=fp8"
LORA = ("actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16")
LINEARS = 14  # 7 projections x 2 layers of the tiny dense model, verl's default LoRA target_modules=all-linear
LAYERS = 2  # the tiny models'
MOE_ATTENTION_PROJECTIONS = 2 * 4  # 2 layers x q/k/v/o: all the MoE model runs in 8 bits
KL_BOUND = 0.05  # KL(behav||prox) k3 of an 8-bit rollout of the tiny model: measured ~1e-4, a wrong model is > 0.1


@dataclass(frozen=True)
class RunResult:
    proc: subprocess.CompletedProcess
    rows: list[dict]
    steps: int
    uaq_dir: Path  # where the driver wrote the UAQ-converted checkpoint
    fp8_kv: bool  # the run had the FP8 KV cache
    trained_rows: int | None = None  # the rows of training metrics the trainer logs for ``steps``; None: one a step

    @property
    def log(self) -> str:
        return self.proc.stdout + self.proc.stderr

    @property
    def trained(self) -> list[dict]:
        """The rows of a training step's metrics (a trainer may log other rows: fully_async's timings)."""
        return [row for row in self.rows if "actor/grad_norm" in row]

    def assert_completed(self) -> None:
        assert self.proc.returncode == 0, (self.proc.stdout[-3000:], self.proc.stderr[-6000:])
        expected = self.steps if self.trained_rows is None else self.trained_rows
        assert len(self.trained) == expected and (self.trained_rows is not None or self.trained == self.rows), self.rows
        assert f"[summary] steps: {expected}" in self.proc.stdout


def fp8_kv_cache_on_this_cpu() -> bool:
    """vLLM-CPU's FP8 KV path: x86 with AVX-512 or AMX (``check_fp8_kv_cache``)."""
    return bool(torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported())


def stock_run_trained(r: RunResult) -> None:
    assert all(row["actor/grad_norm"] > 0 for row in r.rows), [row["actor/grad_norm"] for row in r.rows]
    # after the first weight sync the bf16 engine must serve the trainer's weights
    assert r.rows[-1]["training/rollout_probs_diff_max"] < 0.05, r.rows[-1]["training/rollout_probs_diff_max"]


def qurl_int8_trained(r: RunResult) -> None:
    """Every step of an 8-bit run trains, measures a small mismatch and re-quantizes."""
    for row in r.rows:
        assert row["actor/grad_norm"] > 0, row
        assert math.isfinite(row["actor/qurl/kl_behav_prox_k3"]) and 0 <= row["actor/qurl/kl_behav_prox_k3"] < KL_BOUND, row
        assert row["actor/qurl/sync/total_s"] > 0 and row["actor/qurl/sync/quantized"] > 0, row


def acr_truncates(r: RunResult) -> None:
    """ACR's importance weight w = pi_prox / pi_behav, truncated at the preset's bound (2.0): its largest value each
    step is at least 1 (some token's behaviour probability is the lower) and within the bound."""
    for row in r.rows:
        assert 1.0 <= row["actor/qurl/w_max"] < 2.0, row


def int8_acr_uaq_run(r: RunResult) -> None:
    """The README's demo: `+qurl=int8` (INT8 W8A8 rollout re-quantized every step, ACR loss, UAQ)."""
    assert "[qurl] UAQ (s=1.5, q_proj/k_proj/v_proj) applied" in r.log
    assert "skips verl's validate_config" not in r.log  # main_ppo's hook prepared it: the runtime-env wrapper did nothing
    # the rollout server pinned vLLM's V1 model runner before its engine started, and the line reached the console
    # past vLLM's root logger at ERROR (``console_log``)
    assert "[qurl] qurl_vllm: VLLM_USE_V2_MODEL_RUNNER=0, vLLM's V1 model runner" in r.log
    qurl_int8_trained(r)
    acr_truncates(r)
    # verl logs what update_actor returns under actor/; from the second sync on (step 1's loss sees only the
    # initial sync) the code-change rate is there too, and after an optimizer step at lr 1e-3 codes move
    for row in r.rows[1:]:
        assert 0.0 <= row["actor/qurl/update/changed_code_frac"] <= 1.0, row
    assert r.rows[-1]["actor/qurl/update/changed_code_frac"] > 0


def async_mismatch_beside_staleness(r: RunResult) -> None:
    """``trainer.v1.trainer_mode=colocate_async``: verl pauses the engine before each sync (on vLLM 0.32 through
    the server's ``pause_generation`` keyword patch), the rollout of step 2 was generated before step 1's update
    reached the engine, and the mismatch metrics sit beside verl's staleness of the same batch, which says how
    much of them is staleness rather than quantization."""
    assert "wait_for_inflight_requests" not in r.log
    staleness = [row["training/off_policy/trajectory_staleness/max"] for row in r.rows]
    assert staleness[0] == 0 and all(s >= 1 for s in staleness[1:]), staleness
    for row in r.rows:
        # k3 = E[r - 1 - log r] is >= 0 sample by sample; k1 = E[-log r] may come out below 0 on a batch
        assert row["actor/qurl/kl_behav_prox_k3"] >= 0, row
        # a sync every step, reported by the colocated sync or by the checkpoint engine to a standalone rollout
        assert row.get("actor/qurl/sync/total_s", 0) > 0 or row.get("qurl_sync/seconds", 0) > 0, row


def kv_scales_streamed(r: RunResult) -> None:
    """FP8 KV cache: step 1 generates with scales the engine bounded from the streamed weights (none streamed
    yet); every later sync carries the scales of both layers from the actor's training forwards. All below 1
    (the tiny model's K and V, and their bounds, stay far below 448). Where vLLM-CPU has no FP8 KV cache the
    run went on without it and there is nothing to check."""
    if not r.fp8_kv:
        return
    first = r.rows[0]
    assert first["actor/qurl/sync/kv_scale_layers_streamed"] == 0, first
    assert first["actor/qurl/sync/kv_scale_layers_from_weights"] == LAYERS, first
    for row in r.rows:
        assert row is first or row["actor/qurl/sync/kv_scale_layers_streamed"] == LAYERS, row
        for part in ("k", "v"):
            low, high = row[f"actor/qurl/sync/kv_scale_{part}_min"], row[f"actor/qurl/sync/kv_scale_{part}_max"]
            assert 0 < low <= high < 1, (part, low, high)


def critic_trained(r: RunResult) -> None:
    """PPO with a GAE critic (the paper's first-table setting) beside the INT8 rollout and its loss."""
    qurl_int8_trained(r)
    for row in r.rows:  # the critic is trained every step (critic_warmup 0) and its values feed GAE
        assert math.isfinite(row["critic/vf_loss"]) and row["critic/vf_loss"] >= 0, row
        assert 0.0 <= row["critic/vf_clipfrac"] <= 1.0, row
        assert row["critic/grad_norm"] > 0 and row["critic/lr"] == pytest.approx(1.0e-3), row
        for key in ("critic/values/mean", "critic/vf_explained_var", "critic/returns/mean", "critic/advantages/mean"):
            assert math.isfinite(row[key]), (key, row)


def padded_vocab_synced_quietly(r: RunResult) -> None:
    """A vocabulary that is not a multiple of 64 (vLLM pads the embedding) syncs every step, and the log is free
    of the per-sync loader noise (dtype warnings, the RoPE cache's "Failed to load weights") a user would read as
    errors."""
    for row in r.rows:
        assert row["actor/qurl/sync/total_s"] > 0 and row["actor/qurl/sync/quantized"] > 0, row
    assert "did not cover these layers" not in r.log
    assert "Attempted to load weight" not in r.log and "Failed to load weights" not in r.log


def lora_adapter_syncs(r: RunResult) -> None:
    """Adapters (verl's default, ``lora.merge=false``): the base goes to the engine once, quantized by the qurl
    stream at step 1 (that step's row reports both syncs); every later step syncs only the rank-8 adapters,
    which vLLM's LoRA layers add to the INT8 linears' output. UAQ, which the preset enables, is skipped."""
    assert "[qurl] UAQ skipped: with LoRA adapters" in r.log and "UAQ (s=1.5" not in r.log
    assert "LoRA adapters: the base is quantized once" in r.log and "INT8 linears run" in r.log
    for row in r.rows:
        assert row["actor/grad_norm"] > 0, row
        # INT8 base + adapters against the trainer's base + the same adapters: a small, measured mismatch
        assert 0 < row["actor/qurl/kl_behav_prox_k3"] < KL_BOUND, row
        assert "actor/qurl/update/changed_code_frac" not in row  # the tracker is off: no code ever changes
    first = r.rows[0]
    assert first["actor/qurl/sync/quantized"] == LINEARS and first["actor/qurl/sync/base_frozen"] == 0, first
    assert first["actor/qurl/sync/tensors_in"] > 2 * LINEARS, first
    for row in r.rows[1:]:  # the adapters only (A and B of every linear), the 8-bit base untouched
        assert row["actor/qurl/sync/base_frozen"] == 1 and row["actor/qurl/sync/quantized"] == 0, row
        assert row["actor/qurl/sync/tensors_in"] == 2 * LINEARS, row


def merged_lora_requantized(r: RunResult) -> None:
    """``lora.merge=true``: verl merges the adapters into the weights it syncs; W + BA is re-quantized every
    step as in full fine-tuning, and the trained adapters move the 8-bit codes."""
    for row in r.rows:
        assert 0 <= row["actor/qurl/kl_behav_prox_k3"] < KL_BOUND, row
        assert row["actor/qurl/sync/quantized"] == LINEARS and row["actor/grad_norm"] > 0, row
        assert row["actor/qurl/sync/base_frozen"] == 0, row
    assert 0 < r.rows[-1]["actor/qurl/update/changed_code_frac"] <= 1


def moe_rollout(r: RunResult) -> None:
    """The tiny Qwen3-MoE: verl's FSDP2 actor streams its experts per expert; the engine runs INT8 attention with
    full-precision routers and experts, re-built every step. verl's own comparison of the two policies' token
    probabilities, and qurl's KL, stay at quantization scale."""
    assert "[qurl] UAQ (s=1.5, q_proj/k_proj/v_proj) applied" in r.log  # UAQ on MoE: q/k/v only
    assert "[qurl] MoE rollout in int8:" in r.log and "routed experts in full precision" in r.log
    for row in r.rows:
        assert row["actor/grad_norm"] > 0, row
        assert row["actor/qurl/sync/quantized"] == MOE_ATTENTION_PROJECTIONS, row
        assert 0 < row["actor/qurl/sync/quantized_frac"] < 0.5, row  # the experts stay in full precision
        assert row["training/rollout_probs_diff_max"] < 0.05, row
        # INT8 attention alone: < 0.01; an FP8 KV cache adds its own mismatch (vLLM-CPU rounds K and V
        # toward zero), so such a run has the bound of any 8-bit run
        assert 0 <= row["actor/qurl/kl_behav_prox_k3"] < (KL_BOUND if r.fp8_kv else 0.01), row
    assert r.rows[-1]["actor/qurl/update/changed_code_frac"] > 0  # step 2's sync re-quantized new weights


def unsharded_checksum(uaq_dir: Path) -> int:
    """The stream checksum of a run's first sync, computed here from the checkpoint the actor started from (the
    UAQ-converted copy the driver wrote, read whole): what FSDP ranks must have gathered and sent (a MoE's
    experts by verl's own per-expert names, as its FSDP engine streams them)."""
    from transformers import AutoModelForCausalLM
    from verl.workers.engine.fsdp.utils import unfuse_moe_params

    from qurl_verl.rollout.weight_stream import WeightStreamQuantizer
    from qurl_verl.settings import RolloutSettings
    from qurl_verl.tied_lm_head import TIED_LM_HEAD_NAMES

    (checkpoint,) = uaq_dir.iterdir()
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    state = dict(unfuse_moe_params(model.state_dict().items(), model.config.model_type))
    engine_dtypes = {name: torch.bfloat16 for name in state}  # the rollout's dtype, for pass-through tensors
    stream = WeightStreamQuantizer(RolloutSettings(format="int8"), param_dtypes=engine_dtypes,
                                   skip=frozenset(TIED_LM_HEAD_NAMES))
    stream.transform(state.items())
    return stream.stats.checksum


def int8_sync_payload_bytes(uaq_dir: Path) -> int:
    """What one ``qurl_int8`` sync of the starting checkpoint carries, counted from its shapes alone: each
    ``*_proj`` linear as one byte a weight plus an fp32 scale a row, every other tensor in the rollout's bf16, and
    no tied ``lm_head.weight`` (verl's FSDP stream carries it, the engine leaves it out; a tied checkpoint's files
    hold the embedding alone)."""
    from safetensors import safe_open

    (checkpoint,) = uaq_dir.iterdir()
    total = 0
    for file in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            for name in f.keys():
                shape = f.get_slice(name).get_shape()
                numel = math.prod(shape)
                total += numel + 4 * shape[0] if name.endswith("_proj.weight") and len(shape) == 2 else 2 * numel
    return total


def disaggregated_int8_sync(r: RunResult, start_resent: bool = False) -> None:
    """``checkpoint_engine.backend=qurl_int8`` to a standalone rollout (verl's ``separate_async``,
    ``one_step_off_policy``): the trainer quantized the 14 linears and sent codes + scales + the rest; the rollout
    loaded the codes as they came, quantizing nothing itself, and its report of each sync reached the logger with
    the next one. The init sync's own return value reaches no row (verl drops it), so step k's row carries the
    sender's checksum of sync k and the rollout's report of sync k - 1, the first of them the init sync's: the
    starting checkpoint quantized directly here. ``start_resent``: the trainer's step 1 syncs before its first
    update (one_step_off), so that sync sends the starting weights again, the same codes."""
    for row in r.rows:  # step 2's batch is one update stale: measured k3 ~2e-2 (one_step_off), within the bound
        assert row["actor/grad_norm"] > 0 and 0 <= row["actor/qurl/kl_behav_prox_k3"] < KL_BOUND, row
    int8_syncs_reported(r.rows, unsharded_checksum(r.uaq_dir), start_resent)
    # the bytes sent: codes, scales and the bf16 rest, without the tied lm_head's duplicate
    assert {row["qurl_sync/payload_bytes"] for row in r.rows} == {int8_sync_payload_bytes(r.uaq_dir)}, r.rows


def int8_syncs_reported(rows: list[dict], first_reported: float, start_resent: bool = False) -> None:
    """Rows that each carry a ``qurl_int8`` sync's return value, in order: the sender's checksum of that sync and
    the rollout's report of the sync before it (``first_reported``: the sender's checksum of the sync the first row
    reports). At every sync every replica held exactly the codes that were sent, and a sync after an optimizer
    step sent new codes (``start_resent``: except the first row's, which sent the starting weights again)."""
    for row in rows:
        assert row["qurl_sync/quantized_tensors"] == LINEARS and row["qurl_sync/payload_bytes"] > 0, row
        assert row["qurl_sync/rollout_reports"] == 1, row
        assert row["qurl_sync/rollout/quantized"] == 0 and row["qurl_sync/rollout/tensors_in"] > 2 * LINEARS, row
        # the rollout's report under qurl_sync/, the loss's metrics under actor/qurl/: no key shared
        assert not [k for k in row if k.startswith(COLOCATED_REPORTS)], row
    sent = [first_reported] + [row["qurl_sync/checksum"] for row in rows]  # by sync, the first reported first
    assert [row["qurl_sync/rollout/sync"] for row in rows] == list(range(1, len(rows) + 1)), rows
    for sync, row in enumerate(rows):
        assert replica_checksums(row, DISAGGREGATED_REPORTS) == {"replica_0": sent[sync]}, (sync, row, sent)
    for sync in range(1, len(sent)):
        if start_resent and sync == 1:
            assert sent[1] == sent[0], sent
        else:
            assert sent[sync] != sent[sync - 1], (sync, sent)


def fully_async_int8_sync(r: RunResult) -> None:
    """verl's ``fully_async_policy``: each sync's return value is a row of its own (``qurl_verl.patches.always.
    fully_async_sync_metrics``; verl drops it), the init sync's included: it sent the starting checkpoint quantized
    directly here, and every later sync's row carries the rollout's report of the one before. verl logs a step's
    training metrics with the next sync, so the last step's never reach the logger (``trained_rows``)."""
    syncs = [row for row in r.rows if "qurl_sync/checksum" in row]
    assert len(syncs) == r.steps + 1, r.rows  # the init sync, then one after each step
    init, *later = syncs
    assert init["qurl_sync/checksum"] == unsharded_checksum(r.uaq_dir), init
    assert init["qurl_sync/quantized_tensors"] == LINEARS and init["qurl_sync/payload_bytes"] > 0, init
    int8_syncs_reported(later, init["qurl_sync/checksum"])
    for row in r.trained:
        assert row["actor/grad_norm"] > 0 and not [k for k in row if k.startswith(COLOCATED_REPORTS)], row


def delta_int8_sync(r: RunResult) -> None:
    """``engine_kwargs.qurl_int8.delta=true`` (each sync's return value a row: ``fully_async_policy``): the init sync
    is full (its bytes the count from the checkpoint's shapes and the delta mode's sync header, four int64), every
    later one a delta of the changed elements, fewer
    bytes than the full one, none forced full. That every replica then held the sender's codes bit for bit is
    ``int8_syncs_reported``'s checksum check."""
    init, *later = [row for row in r.rows if "qurl_sync/checksum" in row]
    assert init["qurl_sync/full_sync"] == 1 and init["qurl_sync/delta_fraction"] == 1, init
    assert init["qurl_sync/payload_bytes"] == int8_sync_payload_bytes(r.uaq_dir) + 4 * 8, init
    assert later, r.rows
    for row in later:
        assert row["qurl_sync/full_sync"] == 0 and row["qurl_sync/full_resyncs"] == 0, row
        assert 0 < row["qurl_sync/delta_fraction"] < 1 and row["qurl_sync/delta_tensors"] > 0, row
        assert row["qurl_sync/payload_bytes"] < init["qurl_sync/payload_bytes"], (row, init)


def one_step_off_int8_sync(r: RunResult) -> None:
    """verl's ``one_step_off_policy``: step k syncs before its update (the rollout of step k + 1 starts with it), so
    step 1 sends the starting weights again; its row and every later one carry the 8-bit sync's metrics."""
    disaggregated_int8_sync(r, start_resent=True)


def standalone_rollout_trained(r: RunResult) -> None:
    """What the ACR loss logs under a trainer whose rollout runs ahead of the update (one_step_off, fully_async):
    step 1's batch came from the starting weights, so its mismatch is the 8-bit rollout's alone; later batches add
    a step of staleness, so only the sign and ACR's truncation hold there."""
    first = r.trained[0]
    assert 0 <= first["actor/qurl/kl_behav_prox_k3"] < KL_BOUND, first
    for row in r.trained:
        assert row["actor/grad_norm"] > 0 and math.isfinite(row["actor/qurl/kl_behav_prox_k3"]), row
        assert row["actor/qurl/kl_behav_prox_k3"] >= 0 and 1.0 <= row["actor/qurl/w_max"] <= 2.0, row


def uaq_prepared_by_the_runtime_env(r: RunResult) -> None:
    """An entry point that skips verl's ``validate_config`` in the driver (one_step_off, fully_async): the
    runtime-env wrapper ran the qurl checks and UAQ before Ray started, and the workers found the converted
    checkpoint the driver wrote."""
    assert "this entry point skips verl's validate_config: running qurl-verl's driver checks" in r.log
    assert "[qurl] UAQ (s=1.5, q_proj/k_proj/v_proj) applied" in r.log
    assert "[qurl] qurl_vllm: VLLM_USE_V2_MODEL_RUNNER=0, vLLM's V1 model runner" in r.log
    (checkpoint,) = r.uaq_dir.iterdir()
    assert checkpoint.name.startswith("model-uaq1.5-"), checkpoint


# where a row carries the rollout's report of a sync: the colocated sync's in the actor's metrics (verl's
# ``actor/`` prefix), a checkpoint engine's to a standalone rollout in the sender's return value
COLOCATED_REPORTS = "actor/qurl/sync/"
DISAGGREGATED_REPORTS = "qurl_sync/rollout/"


def replica_checksums(row: dict, reports: str = COLOCATED_REPORTS) -> dict[str, float]:
    """``replica_<i>``: the checksum that rollout replica reported for what it loaded."""
    return {k.rsplit("/", 1)[1]: v for k, v in row.items() if k.startswith(f"{reports}checksum/")}


def tp2_ranks_agree(r: RunResult) -> None:
    """One replica of two TP ranks fed by two FSDP ranks: no ``VLLM_CPU_OMP_THREADS_BIND`` from the user (the
    server binds its ranks); each sync reports two ranks that received the same bits (``combine_ranks`` logs
    any disagreement; with the FP8 KV cache the two FSDP ranks' K/V ranges differ until all-reduced, so the
    same scales on both TP ranks is the all-reduce at work), at step 1 those of the whole checkpoint."""
    qurl_int8_trained(r)
    assert all(row["actor/qurl/sync/ranks"] == 2 for row in r.rows), [row.get("actor/qurl/sync/ranks") for row in r.rows]
    assert "VLLM_CPU_OMP_THREADS_BIND=0|1" in r.log  # the server bound its two ranks
    assert "ranks disagree" not in r.log
    assert replica_checksums(r.rows[0]) == {"replica_0": unsharded_checksum(r.uaq_dir)}


def replicas_agree_across_nodes(r: RunResult) -> None:
    """Two Ray nodes, one FSDP rank and one rollout replica each: the CPU platform reached the workers and the
    metrics the driver's shell named were written; both replicas hold the same codes at every sync, new ones
    at the next, and at step 1 those of the whole masters (FSDP2 gathered them)."""
    qurl_int8_trained(r)
    sums = [replica_checksums(row) for row in r.rows]
    assert all(set(s) == {"replica_0", "replica_1"} for s in sums), sums
    assert all(s["replica_0"] == s["replica_1"] for s in sums), sums
    assert sums[0]["replica_0"] != sums[1]["replica_0"], sums
    assert sums[0]["replica_0"] == unsharded_checksum(r.uaq_dir), sums
    assert all(row["actor/qurl/sync/ranks"] == 1 for row in r.rows)
