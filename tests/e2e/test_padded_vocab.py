"""`+qurl=int8` through verl's main_ppo on a checkpoint whose vocabulary is not a multiple of 64.

The tiny model with a 520-token tokenizer and ``vocab_size=520`` (what a checkpoint resized to
``len(tokenizer)`` looks like): vLLM pads the embedding to 576 rows, which the weight sync must
accept on every step. The run's log must also be free of the per-sync loader noise (dtype
warnings, the RoPE cache's "Failed to load weights") a user would read as errors.
"""
from __future__ import annotations

import json

import pytest
from test_main_ppo_cpu import run_recipe

from qurl_recipes.tiny_model import TinyModelSpec, build_tiny_model

VOCAB = 520


@pytest.mark.e2e
def test_int8_recipe_on_a_padded_vocabulary(tmp_path, monkeypatch):
    model = build_tiny_model(tmp_path / "model_vocab520", TinyModelSpec(vocab_size=VOCAB))
    assert json.loads((model / "config.json").read_text())["vocab_size"] == VOCAB
    monkeypatch.setenv("MODEL_DIR", str(model))
    proc, rows = run_recipe(tmp_path, 2, preset="int8")
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-5000:])
    assert len(rows) == 2 and "[summary] steps: 2" in proc.stdout
    for r in rows:
        assert r["actor/qurl/sync/total_s"] > 0 and r["actor/qurl/sync/quantized"] > 0, r
    assert "did not cover these layers" not in log
    assert "Attempted to load weight" not in log and "Failed to load weights" not in log
