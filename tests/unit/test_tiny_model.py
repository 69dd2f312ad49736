"""The embedded default models (dense and MoE): deterministic, loadable offline, and guarded against vLLM-CPU's shape limits."""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from qurl_recipes import tiny_model
from qurl_recipes.tiny_model import (
    BLOCK_FP8_SPEC,
    MIN_HEAD_DIM,
    TinyModelSpec,
    TinyMoeSpec,
    build_tiny_model,
    build_tiny_moe_model,
)

pytestmark = pytest.mark.both_stacks  # reaches vLLM's own code, which differs between the stacks


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


# ------------------------------------------------------------------------------ mixture of experts
MOE_ARCHS = ("qwen3_moe", "qwen2_moe")


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory) -> dict[str, Path]:
    """One default build per architecture, shared: each build trains the tokenizer and inits the weights."""
    root = tmp_path_factory.mktemp("moe")
    return {arch: build_tiny_moe_model(root / arch, TinyMoeSpec(architecture=arch)) for arch in MOE_ARCHS}


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_moe_saved_tensors_are_per_expert(moe_models, arch):
    """vLLM's Qwen MoE loaders read per-expert checkpoint names, whatever layout transformers keeps in memory."""
    from safetensors import safe_open

    spec = TinyMoeSpec(architecture=arch)
    h, i, n = spec.hidden_size, spec.moe_intermediate_size, spec.num_experts
    with safe_open(str(moe_models[arch] / "model.safetensors"), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    for layer in range(spec.num_layers):
        mlp = f"model.layers.{layer}.mlp"
        assert shapes[f"{mlp}.gate.weight"] == (n, h)
        for e in range(n):
            assert shapes[f"{mlp}.experts.{e}.gate_proj.weight"] == (i, h)
            assert shapes[f"{mlp}.experts.{e}.up_proj.weight"] == (i, h)
            assert shapes[f"{mlp}.experts.{e}.down_proj.weight"] == (h, i)
        assert f"{mlp}.experts.{n}.gate_proj.weight" not in shapes
        shared = {k: v for k, v in shapes.items() if k.startswith(f"{mlp}.shared_expert")}
        if arch == "qwen2_moe":
            s = spec.shared_expert_intermediate_size
            assert shared == {
                f"{mlp}.shared_expert.gate_proj.weight": (s, h),
                f"{mlp}.shared_expert.up_proj.weight": (s, h),
                f"{mlp}.shared_expert.down_proj.weight": (h, s),
                f"{mlp}.shared_expert_gate.weight": (1, h),
            }
        else:
            assert shared == {}
    assert not [k for k in shapes if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]  # no fused names
    assert "lm_head.weight" not in shapes  # tied to the embeddings


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_moe_config_has_spec_values(moe_models, arch):
    from transformers import AutoConfig

    from qurl_verl.model_info import moe_experts

    spec = TinyMoeSpec(architecture=arch)
    raw = json.loads((moe_models[arch] / "config.json").read_text())
    assert raw["model_type"] == arch
    assert moe_experts(raw) == (spec.num_experts, spec.num_experts_per_tok)  # read from the raw config.json transformers wrote
    cfg = AutoConfig.from_pretrained(moe_models[arch])
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (
        spec.hidden_size, spec.num_layers, spec.num_heads, spec.num_kv_heads)
    if arch == "qwen3_moe":
        assert cfg.head_dim == spec.head_dim
    else:
        assert cfg.shared_expert_intermediate_size == spec.shared_expert_intermediate_size
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (
        spec.num_experts, spec.num_experts_per_tok, spec.moe_intermediate_size)
    assert cfg.decoder_sparse_step == 1 and cfg.mlp_only_layers == []  # every layer sparse
    assert cfg.vocab_size == spec.vocab_size and cfg.tie_word_embeddings
    record = json.loads((moe_models[arch] / "qurl_tiny_model.json").read_text())
    assert record == {"spec": asdict(spec), "dtype": "bfloat16"}


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_moe_loads_offline_generates_and_round_trips(moe_models, arch, tmp_path, monkeypatch):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = moe_models[arch]
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    assert model.config.model_type == arch
    assert tok.eos_token == "<|im_end|>" and model.config.eos_token_id == tok.eos_token_id
    assert model.generation_config.pad_token_id == tok.pad_token_id
    text = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], tokenize=False, add_generation_prompt=True)
    ids = tok(text, return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[1] > ids.shape[1]
    # Loading fuses the experts in memory; saving again must give back the same per-expert tensors.
    model.save_pretrained(tmp_path / "again")
    before, after = load_file(path / "model.safetensors"), load_file(tmp_path / "again" / "model.safetensors")
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_moe_same_inputs_same_files(moe_models, tmp_path):
    again = build_tiny_moe_model(tmp_path / "again")
    assert _digest(again) == _digest(moe_models["qwen3_moe"])
    assert TinyMoeSpec().fingerprint() == TinyMoeSpec().fingerprint()
    assert TinyMoeSpec().fingerprint() != TinyMoeSpec(seed=1).fingerprint()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"architecture": "mixtral"}, "architecture 'mixtral' is not one of"),
        ({"hidden_size": 64, "num_heads": 4}, "head_dim 16 < 32"),
        ({"hidden_size": 144, "num_heads": 4}, "hidden_size 144 is not a positive multiple of 32: vLLM-CPU's MoE kernels"),
        ({"moe_intermediate_size": 48}, "moe_intermediate_size 48 is not a positive multiple of 32"),
        ({"architecture": "qwen2_moe", "shared_expert_intermediate_size": 40}, "shared_expert_intermediate_size 40"),
        ({"num_experts": 4, "num_experts_per_tok": 5}, "num_experts_per_tok 5 must be between 1 and num_experts 4"),
    ],
)
def test_moe_spec_refuses_shapes_vllm_cpu_cannot_run(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        TinyMoeSpec(**kwargs)


def test_moe_shared_expert_size_is_not_checked_for_qwen3_moe():
    assert TinyMoeSpec(shared_expert_intermediate_size=40).architecture == "qwen3_moe"  # Qwen3-MoE has no shared expert


def test_cli_picks_the_builder(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(tiny_model, "build_tiny_model", lambda out, spec, dtype: calls.append((out, spec, dtype)) or Path(out))
    monkeypatch.setattr(tiny_model, "build_tiny_moe_model", lambda out, spec, dtype: calls.append((out, spec, dtype)) or Path(out))
    tiny_model.main(["--out", "d", "--hidden-size", "256", "--tie-word-embeddings", "false"])
    tiny_model.main(["--moe", "qwen2_moe", "--out", "m", "--num-experts", "4", "--dtype", "float32"])
    assert calls == [
        ("d", TinyModelSpec(hidden_size=256, tie_word_embeddings=False), "bfloat16"),
        ("m", TinyMoeSpec(architecture="qwen2_moe", num_experts=4), "float32"),
    ]
    with pytest.raises(SystemExit):  # MoE-only options stay off the dense command line
        tiny_model.main(["--out", "d", "--num-experts", "4"])


@pytest.mark.parametrize("spec", ["default", "block_fp8"])
def test_block_fp8_spec_passes_vllms_block_shape_rule(spec, monkeypatch):
    """vLLM's own ``validate_fp8_block_shape`` (Python, the same on every CPU and in its CUDA wheel) over the
    tiny model's fused linears with 128 x 128 blocks: the default spec is refused at engine build for its
    64-row k/v partitions (what failed ``test_fp8_block_runs_on_amx`` on AMX CPUs, the only ones that run
    it), ``BLOCK_FP8_SPEC``, the model that test builds, is not."""
    fp8_utils = pytest.importorskip("vllm.model_executor.layers.quantization.utils.fp8_utils")
    import vllm.distributed

    from qurl_verl.quant.formats import DEFAULT_BLOCK_SIZE

    monkeypatch.setattr(vllm.distributed, "get_tensor_model_parallel_world_size", lambda: 1)  # one rank, no group
    model_spec = TinyModelSpec() if spec == "default" else BLOCK_FP8_SPEC
    refused = {}
    for name, (input_size, outputs) in model_spec.linear_partitions().items():
        layer = torch.nn.Module()
        try:
            fp8_utils.validate_fp8_block_shape(layer, input_size, sum(outputs), input_size, outputs,
                                               [DEFAULT_BLOCK_SIZE, DEFAULT_BLOCK_SIZE])
        except ValueError as e:
            refused[name] = str(e)
    if spec == "default":
        assert list(refused) == ["qkv_proj"] and "output_partition_size = 64" in refused["qkv_proj"], refused
    else:
        assert refused == {}
        assert all(n % DEFAULT_BLOCK_SIZE == 0 for i, outs in model_spec.linear_partitions().values() for n in [i, *outs])
