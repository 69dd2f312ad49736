"""bench/bench_decode_roofline.py: its byte counts against models built by transformers on the meta
device (parameters counted module by module, not from the script's formulas), the issue's hand
arithmetic, and the shape of its speed-ups (monotone in context and batch)."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))  # the script and its modules import each other as when run by path

import bench_decode_roofline  # noqa: E402
import roofline_bytes  # noqa: E402
import roofline_markdown  # noqa: E402
import roofline_published  # noqa: E402
import roofline_recipes  # noqa: E402
import roofline_shapes  # noqa: E402

BYTES = {"bf16": (2, 2), "w8a8": (1, 2), "w8a8_fp8kv": (1, 1)}  # (decoder linear weight, KV element)
SCALE_BYTES = 4  # one fp32 scale per output channel of an 8-bit linear
DECODER_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def meta_model(shape):
    """The Hugging Face model of this shape, on the meta device (no memory, no init cost)."""
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen3Config

    common = dict(hidden_size=shape.hidden_size, num_hidden_layers=shape.num_layers,
                  num_attention_heads=shape.num_heads, num_key_value_heads=shape.num_kv_heads,
                  intermediate_size=shape.intermediate_size, vocab_size=shape.vocab_size,
                  tie_word_embeddings=shape.tie_word_embeddings)
    config = Qwen3Config(head_dim=shape.head_dim, **common) if shape.qk_norm else Qwen2Config(**common)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def independent_counts(model, seqs: int, setup: str) -> dict:
    """Bytes read per decode step (TP 1), bytes resident and KV bytes per token, from the modules."""
    weight_bytes, kv_bytes = BYTES[setup]
    embed = model.get_input_embeddings().weight
    read = resident = 0.0
    quantized = set()
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in DECODER_LINEARS:
            bytes_here = module.weight.numel() * weight_bytes
            if weight_bytes == 1:
                bytes_here += module.out_features * SCALE_BYTES
            read += bytes_here
            resident += bytes_here
            quantized.add(id(module.weight))
    for p in model.parameters():  # each tensor once: a tied lm_head is the embedding
        if id(p) in quantized:
            continue
        resident += 2 * p.numel()
        if p is not embed:
            read += 2 * p.numel()
    if model.config.tie_word_embeddings:
        read += 2 * embed.numel()  # the one matrix is read whole as lm_head
    read += seqs * embed.shape[1] * 2  # and the rows of the tokens embedded
    kv_per_token = sum((layer.self_attn.k_proj.out_features + layer.self_attn.v_proj.out_features) * kv_bytes
                       for layer in model.model.layers)
    return {"read": read, "resident": resident, "kv_per_token": kv_per_token}


@pytest.mark.parametrize("name", ["deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B", "Qwen/Qwen2.5-0.5B-Instruct",
                                  "Qwen/Qwen3-8B-Base"])
@pytest.mark.parametrize("setup", ["bf16", "w8a8", "w8a8_fp8kv"])
def test_bytes_match_a_model_built_by_transformers(name, setup):
    shape = roofline_shapes.MODEL_SHAPES[name]
    seqs, context = 96, 5000
    ref = independent_counts(meta_model(shape), seqs, setup)
    s = roofline_shapes.SETUP_BY_NAME[setup]
    step = roofline_bytes.decode_step_bytes(shape, s, 1, seqs, context)
    assert step["weight_bytes"] == pytest.approx(ref["read"], rel=1e-12)
    assert roofline_bytes.stored_weight_bytes(shape, s, 1) == pytest.approx(ref["resident"], rel=1e-12)
    assert roofline_bytes.kv_bytes_per_token(shape, s, 1) == ref["kv_per_token"]
    assert step["total_bytes"] == pytest.approx(ref["read"] + seqs * context * ref["kv_per_token"], rel=1e-12)


def test_published_parameter_counts():
    """The table's shapes give the parameter counts the model cards state (1.78B, 7.62B, 32.8B, 8.19B)."""
    stated = {"deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B": 1.78e9, "Qwen/Qwen2.5-7B": 7.62e9,
              "Qwen/Qwen2.5-32B": 32.8e9, "Qwen/Qwen3-8B-Base": 8.19e9, "Qwen/Qwen2.5-14B": 14.8e9,
              "Qwen/Qwen2.5-0.5B-Instruct": 0.49e9}
    for name, count in stated.items():
        params = roofline_bytes.stored_weight_bytes(roofline_shapes.MODEL_SHAPES[name], roofline_shapes.SETUP_BY_NAME["bf16"], 1) / 2
        assert params == pytest.approx(count, rel=0.01), name


def test_tensor_parallel_splits_and_replicates_kv_heads():
    bf16 = roofline_shapes.SETUP_BY_NAME["bf16"]
    m7 = roofline_shapes.MODEL_SHAPES["Qwen/Qwen2.5-7B"]  # 4 KV heads
    for tp in (1, 2, 4):
        assert roofline_bytes.kv_bytes_per_token(m7, bf16, tp) * tp == roofline_bytes.kv_bytes_per_token(m7, bf16, 1)
    m05 = roofline_shapes.MODEL_SHAPES["Qwen/Qwen2.5-0.5B-Instruct"]  # 2 KV heads: at TP 4 each rank keeps one
    assert roofline_bytes.kv_bytes_per_token(m05, bf16, 4) == m05.num_layers * 2 * m05.head_dim * 2
    # weights: everything but the replicated norms, the replicated k/v and the row-parallel layers' scales splits
    one = roofline_bytes.weight_bytes_read_per_step(m7, roofline_shapes.SETUP_BY_NAME["w8a8"], 1, 0)
    four = roofline_bytes.weight_bytes_read_per_step(m7, roofline_shapes.SETUP_BY_NAME["w8a8"], 4, 0)
    replicated_per_rank = 2 * (m7.num_layers * 2 * m7.hidden_size + m7.hidden_size) + 4 * 2 * m7.hidden_size * m7.num_layers
    assert four * 4 == pytest.approx(one + 3 * replicated_per_rank, rel=1e-12)


def test_the_issues_arithmetic():
    """DeepScaleR, 128 sequences per GPU at 3k context, as the issue works it out by hand."""
    s = roofline_published.issue_sanity_check()
    assert s["kv_kib_per_token_bf16"] == 28
    assert s["kv_gb_bf16"] == pytest.approx(11, abs=0.5)
    assert s["weights_gb"]["bf16"] == pytest.approx(3.1, abs=0.05)
    assert s["weights_gb"]["w8a8"] == pytest.approx(1.8, abs=0.05)
    assert s["speedup"]["w8a8"] == pytest.approx(1.10, abs=0.01)
    assert s["speedup"]["w8a8_fp8kv"] == pytest.approx(1.9, abs=0.05)


@pytest.mark.parametrize("name", sorted(roofline_shapes.MODEL_SHAPES))
def test_speedups_are_monotone_in_context_and_batch(name):
    """More KV per step: 8-bit weights alone matter less, an 8-bit KV cache more, never below 1x."""
    shape = roofline_shapes.MODEL_SHAPES[name]
    for seqs in (1, 32, 256):
        w8, fp8kv = [], []
        for context in range(0, 33000, 1000):
            row = roofline_bytes.compare_setups(shape, 1, seqs, context)
            w8.append(row["w8a8"]["speedup_over_bf16"])
            fp8kv.append(row["w8a8_fp8kv"]["speedup_over_bf16"])
        assert all(a >= b for a, b in zip(w8, w8[1:])), (seqs, w8)
        assert all(a <= b for a, b in zip(fp8kv, fp8kv[1:])), (seqs, fp8kv)
        assert all(1 <= a <= b <= 2 for a, b in zip(w8, fp8kv))
    by_batch = [roofline_bytes.compare_setups(shape, 1, seqs, 4096)["w8a8"]["speedup_over_bf16"] for seqs in (1, 8, 64, 512)]
    assert all(a >= b for a, b in zip(by_batch, by_batch[1:]))


def test_step_time_is_bytes_over_bandwidth():
    shape = roofline_shapes.MODEL_SHAPES["Qwen/Qwen2.5-7B"]
    row = roofline_bytes.compare_setups(shape, 1, 64, 2048)
    for acc in roofline_shapes.ACCELERATORS:
        for s in ("bf16", "w8a8", "w8a8_fp8kv"):
            assert row[s]["step_ms"][acc.name] * acc.bandwidth_bytes_per_s / 1e3 == pytest.approx(row[s]["total_bytes"])


def test_recipes_resolve_with_their_own_defaults(monkeypatch):
    """Hydra defaults are merged (dapo takes _dapo's batch and TP) and the shell's environment does not leak in."""
    monkeypatch.setenv("MODEL_PATH", "/somewhere/else")
    monkeypatch.setenv("NNODES", "3")
    dapo = roofline_recipes.recipe_inputs(roofline_recipes.RECIPE_DIR / "dapo.yaml")["inputs"]
    assert dapo["model"] == "Qwen/Qwen2.5-Math-7B" and dapo["nnodes"] == 8
    assert dapo["train_batch_size"] == 512 and dapo["rollout_n"] == 16 and dapo["tensor_model_parallel_size"] == 4
    gsm8k = roofline_recipes.recipe_inputs(roofline_recipes.RECIPE_DIR / "gsm8k_ppo.yaml")
    assert gsm8k["inputs"]["max_num_seqs"] == roofline_recipes.VERL_DEFAULTS["max_num_seqs"]
    assert any("max_num_seqs" in d for d in gsm8k["defaults_taken"])


def test_verl_defaults_are_verls():
    found = importlib.util.find_spec("verl")
    if found is None:
        pytest.skip("verl is not installed")
    from omegaconf import OmegaConf

    generated = OmegaConf.load(Path(found.origin).parent / "trainer" / "config" / "_generated_ppo_trainer.yaml")
    for key, value in roofline_recipes.VERL_DEFAULTS.items():
        assert OmegaConf.select(generated, roofline_recipes.RECIPE_KEYS[key]) == value, key


def test_report_covers_every_recipe_and_renders_from_its_json(tmp_path):
    paths = sorted(p for p in roofline_recipes.RECIPE_DIR.glob("*.yaml") if not p.stem.startswith("_"))
    report = json.loads(json.dumps(bench_decode_roofline.build_report(paths, [1024, 3072], 32)))
    assert {r["file"] for r in report["recipes"]} == {str(p.relative_to(REPO)) for p in paths}
    md = roofline_markdown.markdown(report)
    for r in report["recipes"]:
        assert f"## {r['name']} " in md
    for p in report["published"]:
        assert p["name"] in md
