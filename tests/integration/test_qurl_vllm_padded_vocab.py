"""qurl_vllm on a vocabulary that is not a multiple of 64, and what a sync stores and logs.

vLLM pads the rows of ``embed_tokens`` and ``lm_head`` to a multiple of 64 (520 -> 576 here, as for
a checkpoint resized to ``len(tokenizer)``); its loaders copy the checkpoint's rows and zero-fill
the rest, and the reload's element count never sees the padding. The model is the project's tiny
Qwen2 with a 520-token tokenizer and untied embeddings, so both padded layers are streamed.

* In a bf16 engine, pass-through tensors sent in the engine's dtype store the same bits (and give
  the same log-probs) as fp32 tensors vLLM casts itself, without its per-tensor dtype warnings; the
  RoPE cache's "Failed to load weights" line is filtered, and only that.
* INT8 syncs through verl's real sender, checked like ``test_qurl_vllm_reload.py`` against the
  torch W8A8 reference (same bounds, same reasons), with the padding rows poisoned before each
  sync and found zero after it (as vLLM's loader leaves them at load).
* A stream without the embedding still fails the sync.

The engines load ``PaddedVocabProbe`` from this module (the worker finds it on ``PYTHONPATH``).
"""
from __future__ import annotations

import contextlib
import io
import logging

import pytest
import torch
from packaging.version import Version

from qurl_recipes.tiny_model import TinyModelSpec
from qurl_testkit.reload_harness import (
    TrainerWeights,
    abs_diffs,
    build_peaked_tiny_model,
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
from qurl_verl.rollout import layerwise_reload, vllm_versions
from qurl_verl.rollout.worker_extension import QurlWorkerExtension
from qurl_verl.settings import RolloutSettings

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("engine_environment")]

VOCAB = 520  # not a multiple of vLLM's padding of 64: 576 rows in the engine
SPEC = TinyModelSpec(vocab_size=VOCAB, tie_word_embeddings=False)
PROBE = f"{__name__}.PaddedVocabProbe"
INT8 = RolloutSettings(format="int8")
UNQUANTIZED = RolloutSettings(format="bf16")


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


class PaddedVocabProbe(QurlWorkerExtension):
    """Worker side: the vocabulary layers' padding, the stored state, the sync's warnings, and
    switches for the dtype cast and the log filter."""

    def _qurl_param_dtypes(self, model, stream_name):
        return super()._qurl_param_dtypes(model, stream_name) if getattr(self, "_probe_cast", True) else None

    def _probe_vocab_layers(self):
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

        return {n: m for n, m in self.model_runner.model.named_modules() if isinstance(m, VocabParallelEmbedding)}

    def probe_vocab_padding(self) -> dict[str, dict]:
        out = {}
        for name, layer in self._probe_vocab_layers().items():
            rows = layer.shard_indices.num_org_elements
            padding = layer.weight.data[rows:]
            out[name] = {"rows": rows, "padded_rows": layer.weight.shape[0], "padding_is_zero": bool((padding == 0).all())}
        return out

    def probe_poison_padding(self) -> None:
        for layer in self._probe_vocab_layers().values():
            layer.weight.data[layer.shard_indices.num_org_elements :] = float("nan")

    def probe_state(self) -> bytes:
        blob = io.BytesIO()
        torch.save({n: t.detach().clone() for n, t in self.model_runner.model.state_dict().items()}, blob)
        return blob.getvalue()

    def probe_configure(self, cast: bool, quiet: bool) -> None:
        self._probe_cast = cast
        if not hasattr(self, "_probe_quiet"):
            self._probe_quiet = layerwise_reload.quiet_config_only_layers
        layerwise_reload.quiet_config_only_layers = self._probe_quiet if quiet else (lambda model: contextlib.nullcontext())

    def probe_warnings(self) -> list[str]:
        """vLLM's warnings since the previous call (the first call starts listening)."""
        if not hasattr(self, "_probe_lines"):
            self._probe_lines = _Lines()
            logging.getLogger("vllm").addHandler(self._probe_lines)
        lines, self._probe_lines.lines = self._probe_lines.lines, []
        return lines


@pytest.fixture(scope="module")
def padded_model_dir(tmp_path_factory):
    return build_peaked_tiny_model(tmp_path_factory.mktemp("tiny_qwen2_vocab520"), SPEC)


@pytest.fixture(scope="module")
def int8_engine(padded_model_dir, engine_environment):
    require_vllm()
    llm = start_engine(padded_model_dir, INT8, dtype="float32", extension=PROBE)
    yield llm
    stop_engine(llm)


def _reference(model_dir, master, settings, seqs):
    return reference_logprobs(reference_model(model_dir, master, settings, torch.float32), seqs)


def test_pass_through_dtype_cast_stores_the_same_bits_without_warnings(padded_model_dir, engine_environment):
    """A bf16 engine fed fp32 masters. Sending pass-through tensors in bf16 stores bit for bit what
    vLLM's own cast stores (the same ``copy_`` rounding), and the sync logs no dtype warnings; the
    other run (no cast, no filter) shows both kinds of warning, so the listener hears them."""
    require_vllm()
    llm = start_engine(padded_model_dir, INT8, dtype="bfloat16", extension=PROBE)
    try:
        trainer = TrainerWeights(padded_model_dir)
        prompts = prompt_ids(padded_model_dir)
        llm.collective_rpc("probe_warnings")
        runs = {}
        for cast in (True, False):
            llm.collective_rpc("probe_configure", kwargs={"cast": cast, "quiet": cast})
            sync_weights(llm, trainer.named_tensors())
            (warnings,) = llm.collective_rpc("probe_warnings")
            (blob,) = llm.collective_rpc("probe_state")
            (layers,) = llm.collective_rpc("probe_vocab_padding")
            assert all(v["padding_is_zero"] for v in layers.values()), layers
            runs[cast] = (warnings, torch.load(io.BytesIO(blob)), engine_logprobs(llm, prompts))

        (warnings, state, (seqs, lps)), (raw_warnings, raw_state, (raw_seqs, raw_lps)) = runs[True], runs[False]
        print("\nsync warnings with the cast and filter:", warnings, "\nwithout:", *raw_warnings, sep="\n")
        assert not [w for w in warnings if "load weight" in w], warnings
        dtype_warnings = [w for w in raw_warnings if w.startswith("Attempted to load weight")]
        # vLLM 0.32's AutoWeightsLoader (vllm/model_executor/models/utils.py) warns for each tensor it
        # casts: embed_tokens, 2 x 2 layer norms, the final norm, lm_head. vLLM 0.24 casts silently.
        emits_dtype_warnings = Version(vllm_versions.vllm_version()).release >= (0, 32)
        assert len(dtype_warnings) == (7 if emits_dtype_warnings else 0), raw_warnings
        assert all("torch.float32 into parameter with dtype torch.bfloat16" in w for w in dtype_warnings), raw_warnings
        # both versions warn for the RoPE cache, which no stream carries (finalize_layerwise_reload)
        assert "RotaryEmbedding: Failed to load weights" in raw_warnings, raw_warnings

        assert state.keys() == raw_state.keys()
        differ = [n for n in state if state[n].dtype != raw_state[n].dtype or not torch.equal(state[n], raw_state[n])]
        assert not differ, differ
        assert seqs == raw_seqs and all(torch.equal(a, b) for a, b in zip(lps, raw_lps))
    finally:
        llm.collective_rpc("probe_configure", kwargs={"cast": True, "quiet": True})
        stop_engine(llm)


def test_int8_syncs_with_a_padded_vocabulary(int8_engine, padded_model_dir):
    """Two syncs: each completes, zeroes the padding rows, and the engine tracks the W8A8
    reference (bounds of ``test_qurl_vllm_reload.py``: median <= 1e-5, p75 <= 1e-4, max <= 0.1,
    activation rounding ties only; the quantization itself moves a median >= 5e-3)."""
    (layers,) = int8_engine.collective_rpc("probe_vocab_padding")
    assert {n: (v["rows"], v["padded_rows"]) for n, v in layers.items()} == {
        "model.embed_tokens": (VOCAB, 576),
        "lm_head": (VOCAB, 576),
    }
    trainer = TrainerWeights(padded_model_dir)
    prompts = prompt_ids(padded_model_dir)
    for sync in range(2):
        if sync:
            trainer.step()
        int8_engine.collective_rpc("probe_poison_padding")
        (stats,) = sync_weights(int8_engine, trainer.named_tensors())
        assert stats["sync"] == sync + 1 and stats["quantized"] == 14, stats  # 7 projections x 2 layers
        (layers,) = int8_engine.collective_rpc("probe_vocab_padding")
        assert all(v["padding_is_zero"] for v in layers.values()), layers

        seqs, got = engine_logprobs(int8_engine, prompts)
        vs_ref = summary(abs_diffs(got, _reference(padded_model_dir, trainer.master, INT8, seqs)))
        vs_unquantized = summary(abs_diffs(got, _reference(padded_model_dir, trainer.master, UNQUANTIZED, seqs)))
        row = {"sync": sync + 1, "vs_w8a8_ref": vs_ref, "vs_unquantized": vs_unquantized}
        print(row)
        assert vs_ref["median"] <= 1e-5 and vs_ref["p75"] <= 1e-4 and vs_ref["max"] <= 0.1, row
        assert vs_unquantized["median"] >= 5e-3, row


def test_a_stream_without_the_embedding_still_fails(int8_engine, padded_model_dir):
    """The padding allowance does not hide a missing layer. Runs last: it breaks the engine."""
    trainer = TrainerWeights(padded_model_dir)
    without = [(n, t) for n, t in trainer.named_tensors() if n != "model.embed_tokens.weight"]
    with pytest.raises(Exception, match=r"did not cover these layers: model\.embed_tokens \(0/66560\)"):
        sync_weights(int8_engine, iter(without))
