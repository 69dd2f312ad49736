"""The ``qurl_vllm`` server's safety net: it refuses to start a checkpoint without the UAQ record the rollout's
config asks for, which is what a run looks like when the driver's checks were skipped (an entry point started
inside a running Ray), and passes the checkpoints the driver prepares.

The checkpoints are real (the tiny model, converted by the driver's own ``ensure_uaq_checkpoint``); the rollout's
config and the model's HF config are what verl hands the server (``RolloutConfig`` and ``HFModelConfig``,
converted from the composed config as verl's workers convert them).
"""
from __future__ import annotations

import copy

import pytest
from omegaconf import OmegaConf

from qurl_recipes.compose import compose_ppo_config
from qurl_verl.rollout.engine_checks import check_uaq_record, requested_uaq
from qurl_verl.settings import QurlConfigError

pytestmark = pytest.mark.both_stacks  # the server test imports verl's vLLM server, which imports vLLM

RECIPE = ["+qurl_recipe=tiny_cpu", "data.train_files=/data/train.parquet", "data.val_files=/data/val.parquet"]
NO_RECORD = r"qurl.uaq.enable=true, but .* carries no UAQ record \(qurl_uaq in its config.json\): qurl-verl's driver"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(the tiny model, its UAQ conversion as the driver makes it)."""
    from qurl_recipes.tiny_model import build_tiny_model
    from qurl_verl.uaq_checkpoint import ensure_uaq_checkpoint

    model = build_tiny_model(tmp_path_factory.mktemp("m") / "tiny")
    return model, ensure_uaq_checkpoint(model, cache_dir=tmp_path_factory.mktemp("uaq"), log=lambda *_: None)


def server_inputs(cfg):
    """(``RolloutConfig``, ``HFModelConfig``): what verl builds the rollout server with, from a composed config."""
    from verl.utils.config import omega_conf_to_dataclass

    OmegaConf.resolve(cfg)  # as verl's TaskRunner does before it builds the workers
    return omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout), omega_conf_to_dataclass(cfg.actor_rollout_ref.model)


def server_check(cfg) -> None:
    """The server's check, on the inputs it gets (``QurlvLLMHttpServer._apply_quantization``)."""
    rollout, model = server_inputs(cfg)
    check_uaq_record(requested_uaq(rollout), model.hf_config.to_dict(), model=str(model.path))


def composed(preset: str, model, *overrides: str):
    return compose_ppo_config([*RECIPE, f"+qurl={preset}", f"actor_rollout_ref.model.path={model}", *overrides])


def test_a_uaq_preset_on_an_unconverted_checkpoint_is_refused(checkpoints):
    """What the server gets when the driver was skipped: the preset's UAQ request, the checkpoint as given."""
    model, _ = checkpoints
    with pytest.raises(QurlConfigError, match=NO_RECORD) as refused:
        server_check(composed("int8", model))
    text = str(refused.value)
    assert "Start the run from a process without Ray" in text and "qurl.uaq.enable=false" in text
    assert f"python -m qurl_verl.quant.uaq_convert --model {model} --out <folder>" in text


def test_the_converted_checkpoint_passes_and_a_different_scale_is_refused(checkpoints):
    _, converted = checkpoints
    server_check(composed("int8", converted))
    with pytest.raises(QurlConfigError, match=r"carries UAQ \{.*\}, but qurl.uaq.scale=2 .* set them to the checkpoint"):
        server_check(composed("int8", converted, "qurl.uaq.scale=2.0"))


@pytest.mark.parametrize("preset,overrides", [
    pytest.param("tis_int8", (), id="a_preset_without_uaq"),
    pytest.param("int8", ("qurl.uaq.enable=false",), id="uaq_turned_off"),
])
def test_no_uaq_asked_no_record_needed(checkpoints, preset, overrides):
    model, _ = checkpoints
    server_check(composed(preset, model, *overrides))


def test_the_config_the_driver_prepares_passes(checkpoints, tmp_path, monkeypatch):
    """By construction: the driver points the run at the converted copy (and the servers at its record)."""
    from qurl_verl import driver

    model, _ = checkpoints
    monkeypatch.setenv("VERL_PLATFORM", "cpu")
    cfg = composed("int8", model, f"qurl.uaq.cache_dir={tmp_path}")
    driver.on_validate_config(cfg, log=lambda *_: None)
    assert str(tmp_path) in cfg.actor_rollout_ref.model.path
    server_check(cfg)


def test_uaq_left_out_by_the_driver_is_not_asked_of_the_servers(checkpoints, monkeypatch):
    """With LoRA adapters the driver skips UAQ and says why; the servers then load the checkpoint as given."""
    from qurl_verl import driver

    model, _ = checkpoints
    monkeypatch.setenv("VERL_PLATFORM", "cpu")
    cfg = composed("int8", model, "actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora.merge=false")
    with pytest.raises(QurlConfigError, match=NO_RECORD):
        server_check(copy.deepcopy(cfg))  # as the preset asks, before the driver decided
    said = []
    assert driver.on_validate_config(cfg, log=said.append).uaq_skipped in said
    assert cfg.actor_rollout_ref.model.path == str(model)
    server_check(cfg)


def test_the_server_refuses_before_it_builds_the_engine(checkpoints):
    """The check is wired into ``QurlvLLMHttpServer._apply_quantization``, the hook verl's server runs before it
    starts the engine: a server object holding only what verl's constructor stores there."""
    from qurl_verl.rollout.server import QurlvLLMHttpServer

    model, _ = checkpoints
    server = QurlvLLMHttpServer.__new__(QurlvLLMHttpServer)
    server.config, server.model_config = server_inputs(composed("int8", model))
    with pytest.raises(QurlConfigError, match=NO_RECORD):
        server._apply_quantization()
