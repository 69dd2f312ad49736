"""The embedded default model: deterministic, loadable offline, and guarded against vLLM-CPU's head_dim limit."""
from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from qurl_recipes.tiny_model import MIN_HEAD_DIM, TinyModelSpec, build_tiny_model


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_same_inputs_same_files(tmp_path):
    a = build_tiny_model(tmp_path / "a")
    b = build_tiny_model(tmp_path / "b")
    assert _digest(a) == _digest(b)
    c = build_tiny_model(tmp_path / "c", TinyModelSpec(seed=1))
    assert _digest(c)["model.safetensors"] != _digest(a)["model.safetensors"]


def test_loads_offline_and_generates(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = build_tiny_model(tmp_path / "m")
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert model.config.model_type == "qwen2"
    assert model.config.hidden_size // model.config.num_attention_heads >= MIN_HEAD_DIM
    text = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    ids = tok(text, return_tensors="pt")["input_ids"]
    assert tok.decode(ids[0]) == text  # the trained BPE round-trips the chat markup
    out = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[1] > ids.shape[1]
    assert tok.eos_token == "<|im_end|>" and model.config.eos_token_id == tok.eos_token_id


def test_head_dim_below_vllm_cpu_minimum_is_refused(tmp_path):
    with pytest.raises(ValueError, match="head_dim 16 < 32"):
        build_tiny_model(tmp_path / "bad", TinyModelSpec(hidden_size=64, num_heads=4))
