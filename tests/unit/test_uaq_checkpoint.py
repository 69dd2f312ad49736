"""The driver's one-time UAQ conversion: applied once, cached, atomic, and function-preserving."""
from __future__ import annotations

import json
import re

import pytest
import torch

from qurl_verl.uaq_checkpoint import ensure_uaq_checkpoint, uaq_record_of


@pytest.fixture
def tiny(tmp_path_factory):
    from qurl_recipes.tiny_model import TinyModelSpec, build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("m") / "tiny", TinyModelSpec(), dtype="float32")


def _logits(path, ids):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits


def test_converted_once_then_cached_and_same_function(tiny, tmp_path):
    logs = []
    first = ensure_uaq_checkpoint(tiny, 1.5, cache_dir=tmp_path / "c", log=logs.append)
    assert first != tiny and uaq_record_of(first)["scale"] == 1.5 and uaq_record_of(tiny) is None
    # progress: the single shard read, then written, then the result
    assert [re.sub(r" \(.+\) in \d+\.\d s$", "", line) for line in logs[:2]] == [
        "[qurl] UAQ: read shard 1/1", "[qurl] UAQ: wrote shard 1/1"]
    assert len(logs) == 3 and "applied to" in logs[2]
    again = ensure_uaq_checkpoint(tiny, 1.5, cache_dir=tmp_path / "c", log=logs.append)
    assert again == first and "cache hit" in logs[-1]
    # a checkpoint that already carries UAQ (a resumed run) is used as it is: never scaled twice
    assert ensure_uaq_checkpoint(first, 1.5, cache_dir=tmp_path / "c", log=logs.append) == first.resolve()
    ids = torch.randint(0, 500, (2, 12))
    torch.testing.assert_close(_logits(first, ids), _logits(tiny, ids), rtol=1e-4, atol=1e-4)
    assert not any(p.name.startswith(".") for p in (tmp_path / "c").iterdir())  # no partial folder left


def test_scale_clash_with_an_already_scaled_checkpoint(tiny, tmp_path):
    scaled = ensure_uaq_checkpoint(tiny, 1.5, cache_dir=tmp_path / "c", log=lambda *_: None)
    with pytest.raises(ValueError, match="already carries UAQ with scale 1.5, but qurl.uaq.scale=2.0"):
        ensure_uaq_checkpoint(scaled, 2.0, cache_dir=tmp_path / "c", log=lambda *_: None)


def test_failed_conversion_leaves_no_cache_entry(tiny, tmp_path):
    cfg = json.loads((tiny / "config.json").read_text())
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    (bad / "model.safetensors").write_bytes((tiny / "model.safetensors").read_bytes())
    with pytest.raises(ValueError):
        ensure_uaq_checkpoint(bad, 1.5, cache_dir=tmp_path / "c", log=lambda *_: None)
    assert list((tmp_path / "c").iterdir()) == []


def test_preset_rewrites_the_actor_path_in_the_driver(tiny, tmp_path, monkeypatch):
    from qurl_recipes.compose import compose_ppo_config
    from qurl_verl.driver.prepare import prepare_config
    from qurl_verl.settings import UaqSettings

    monkeypatch.setenv("QURL_CACHE_DIR", str(tmp_path))
    cfg = compose_ppo_config(["+qurl=int8", f"actor_rollout_ref.model.path={tiny}", f"qurl.uaq.cache_dir={tmp_path}/uaq"])
    prepare_config(cfg, UaqSettings.from_config(cfg), log=lambda *_: None)
    assert cfg.actor_rollout_ref.model.path.startswith(str(tmp_path / "uaq"))
    assert uaq_record_of(cfg.actor_rollout_ref.model.path)["targets"] == ["q_proj", "k_proj", "v_proj"]
    off = compose_ppo_config(["+qurl=tis_int8", f"actor_rollout_ref.model.path={tiny}"])
    prepare_config(off, UaqSettings.from_config(off), log=lambda *_: None)
    assert off.actor_rollout_ref.model.path == str(tiny)


def test_reuse_compares_targets_not_only_the_scale(tiny, tmp_path):
    """A checkpoint converted for q/k/v is not taken for a config that asks for other targets."""
    converted = ensure_uaq_checkpoint(tiny, scale=1.5, cache_dir=tmp_path / "c", log=lambda *_: None)
    assert ensure_uaq_checkpoint(converted, scale=1.5, log=lambda *_: None) == converted
    with pytest.raises(ValueError, match=r"already carries UAQ on \['k_proj', 'q_proj', 'v_proj'\].*qurl.uaq.targets"):
        ensure_uaq_checkpoint(converted, scale=1.5, targets=["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"],
                              log=lambda *_: None)
