"""Unit tests never reach the model hub: verl's example command lines name hub models, whose
``config.json`` the driver reads (and only that file) to check the architecture before anything is
downloaded. A stand-in hub client serves the public configs of those models (the fields the checks
read, as published) and answers every other request at once as an unreachable hub does."""
from __future__ import annotations

import json

import pytest

# from each model's published config.json
HUB_CONFIGS = {
    "Qwen/Qwen2.5-Math-7B": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584,
        "intermediate_size": 18944, "num_attention_heads": 28, "num_key_value_heads": 4, "num_hidden_layers": 28,
        "vocab_size": 152064, "tie_word_embeddings": False,
    },
    "Qwen/Qwen3-1.7B": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 2048, "head_dim": 128,
        "intermediate_size": 6144, "num_attention_heads": 16, "num_key_value_heads": 8, "num_hidden_layers": 28,
        "vocab_size": 151936, "tie_word_embeddings": True,
    },
    "Qwen/Qwen3-4B": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 2560, "head_dim": 128,
        "intermediate_size": 9728, "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 36,
        "vocab_size": 151936, "tie_word_embeddings": True,
    },
}


@pytest.fixture(autouse=True)
def stand_in_hub(monkeypatch, tmp_path_factory):
    import huggingface_hub
    import huggingface_hub.constants as hub_constants
    from huggingface_hub.errors import LocalEntryNotFoundError

    folder = tmp_path_factory.mktemp("hub")
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(folder / "cache"))

    def hf_hub_download(repo_id, filename, **kwargs):
        if filename != "config.json" or repo_id not in HUB_CONFIGS:
            raise LocalEntryNotFoundError(
                f"{repo_id}/{filename}: the hub cannot be reached from the unit tests")
        path = folder / repo_id.replace("/", "--") / filename
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(HUB_CONFIGS[repo_id]))
        return str(path)

    def snapshot_download(repo_id, *args, **kwargs):
        raise LocalEntryNotFoundError(f"{repo_id}: the unit tests download no checkpoint")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hf_hub_download)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
