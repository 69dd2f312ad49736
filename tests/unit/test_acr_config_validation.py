"""Driver-side validation of the settings qurl_acr / qurl_tis need, on verl's real composed config."""
from __future__ import annotations

import re

import pytest
from omegaconf import OmegaConf, open_dict

from qurl_verl.settings import QurlConfigError, QurlSettings
from qurl_verl.settings.loss_config import QurlPolicyLossConfig


def validate_loss_settings(cfg):
    return QurlSettings.from_config(cfg).loss

GOOD = [
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.actor.policy_loss._target_=qurl_verl.settings.loss_config.QurlPolicyLossConfig",
    "actor_rollout_ref.actor.policy_loss.loss_mode=qurl_acr",
    "+actor_rollout_ref.actor.policy_loss.is_cap=2.0",
    "actor_rollout_ref.actor.clip_ratio_high=0.28",
    "algorithm.rollout_correction.rollout_is=token",
    "algorithm.rollout_correction.rollout_is_threshold=1e9",
    "algorithm.rollout_correction.bypass_mode=false",
    "actor_rollout_ref.rollout.calculate_log_probs=true",
]


@pytest.fixture(scope="module")
def good_cfg():
    from hydra import compose, initialize_config_module

    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        yield compose("ppo_trainer", overrides=GOOD)


def with_setting(cfg, key, value):
    cfg = OmegaConf.create(OmegaConf.to_container(cfg))
    with open_dict(cfg):
        OmegaConf.update(cfg, key, value, force_add=True)
    return cfg


def test_good_config_passes(good_cfg):
    validate_loss_settings(good_cfg)


def test_the_earlier_target_names_the_same_config(good_cfg):
    """Configs written before the class moved into ``settings`` name ``qurl_verl.losses.config``: still accepted."""
    from qurl_verl.losses.config import QurlPolicyLossConfig as earlier

    assert earlier is QurlPolicyLossConfig
    validate_loss_settings(with_setting(good_cfg, "actor_rollout_ref.actor.policy_loss._target_",
                                        "qurl_verl.losses.config.QurlPolicyLossConfig"))


def test_other_loss_modes_are_not_checked(good_cfg):
    cfg = with_setting(good_cfg, "actor_rollout_ref.actor.policy_loss.loss_mode", "vanilla")
    cfg = with_setting(cfg, "algorithm.rollout_correction.bypass_mode", True)
    validate_loss_settings(cfg)


# one bad setting each: (key, bad value, the fix the message must name)
BAD = {
    "bypass_mode": ("algorithm.rollout_correction.bypass_mode", True, "set algorithm.rollout_correction.bypass_mode=false"),
    "no_is": ("algorithm.rollout_correction.rollout_is", None, "set algorithm.rollout_correction.rollout_is=token"),
    "sequence_is": ("algorithm.rollout_correction.rollout_is", "sequence", "set algorithm.rollout_correction.rollout_is=token"),
    "no_rollout_logprobs": ("actor_rollout_ref.rollout.calculate_log_probs", False, "set actor_rollout_ref.rollout.calculate_log_probs=true"),
    "icepop": ("algorithm.rollout_correction.rollout_is_threshold", "0.5_5.0", "IcePop"),
    "low_threshold": ("algorithm.rollout_correction.rollout_is_threshold", 2.0, "set algorithm.rollout_correction.rollout_is_threshold=1e9"),
    "null_threshold": ("algorithm.rollout_correction.rollout_is_threshold", None, "sends no IS weights"),
    "rejection_sampling": ("algorithm.rollout_correction.rollout_rs", "token_k1", "set algorithm.rollout_correction.rollout_rs=null"),
    "batch_normalize": ("algorithm.rollout_correction.rollout_is_batch_normalize", True, "set algorithm.rollout_correction.rollout_is_batch_normalize=false"),
    "plain_target": ("actor_rollout_ref.actor.policy_loss._target_", "verl.workers.config.PolicyLossConfig",
                     "set actor_rollout_ref.actor.policy_loss._target_=qurl_verl.settings.loss_config.QurlPolicyLossConfig"),
    "c_below_one": ("actor_rollout_ref.actor.policy_loss.is_cap", 0.5, "set actor_rollout_ref.actor.policy_loss.is_cap=2.0"),
    "cap_below_eps_high": ("actor_rollout_ref.actor.policy_loss.acr_upper_cap", 1.1, "1 + clip_ratio_high = 1.28"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_each_bad_setting_fails_with_its_message(good_cfg, case):
    key, value, fix = BAD[case]
    cfg = with_setting(good_cfg, key, value)
    with pytest.raises(QurlConfigError) as err:
        validate_loss_settings(cfg)
    lines = str(err.value).splitlines()[1:]
    assert len(lines) == 1, str(err.value)  # exactly this one problem is reported
    assert lines[0].strip().startswith(f"{key}=")
    assert fix in lines[0]


def test_several_problems_are_reported_together(good_cfg):
    cfg = with_setting(good_cfg, "algorithm.rollout_correction.bypass_mode", True)
    cfg = with_setting(cfg, "actor_rollout_ref.rollout.calculate_log_probs", False)
    with pytest.raises(QurlConfigError, match=re.compile("bypass_mode=false.*calculate_log_probs=true", re.S)):
        validate_loss_settings(cfg)


def test_bad_values_are_refused_where_workers_build_the_config():
    with pytest.raises(QurlConfigError, match="is_cap"):
        QurlPolicyLossConfig(loss_mode="qurl_acr", is_cap=0.5)
    assert QurlPolicyLossConfig(loss_mode="qurl_acr").is_cap == 2.0


def test_a_verl_loss_over_a_quantized_preset_is_refused_unless_verl_truncates(tmp_path, monkeypatch):
    """``+qurl=<preset>`` then a verl example's ``loss_mode`` (``vanilla``, ``gspo``): the preset's untruncated
    ``rollout_is_threshold`` (1e9, there for the qurl losses, which truncate at C) would reach a loss that
    multiplies by the weights as they come. Refused in the driver, naming both fixes; each fix passes. Presets
    without verl's IS weights (bf16, naive_int8) and a stock-rollout run with the same settings are not refused:
    nothing of theirs is overridden."""
    from qurl_recipes.compose import compose_ppo_config
    from qurl_recipes.tiny_model import build_tiny_model
    from qurl_verl.driver import check_config
    from qurl_verl.settings import LOSS_MODE_KEY

    monkeypatch.setenv("VERL_PLATFORM", "cpu")
    model = build_tiny_model(tmp_path / "tiny")
    recipe = ["+qurl_recipe=tiny_cpu", f"actor_rollout_ref.model.path={model}"]
    fixes = r"remove the actor_rollout_ref.actor.policy_loss.loss_mode override.*rollout_correction.rollout_is_threshold=2.0"
    for preset, loss_mode in (("int8", "vanilla"), ("tis_int8", "gspo"), ("fp8", "vanilla")):
        command = [*recipe, f"+qurl={preset}", f"{LOSS_MODE_KEY}={loss_mode}"]
        with pytest.raises(QurlConfigError, match=rf"loss_mode={loss_mode} with .*rollout_is_threshold=1e\+09.*{fixes}"):
            check_config(compose_ppo_config(command))
        check_config(compose_ppo_config([*command, "algorithm.rollout_correction.rollout_is_threshold=2.0"]))
    for preset in ("bf16", "naive_int8"):
        check_config(compose_ppo_config([*recipe, f"+qurl={preset}", f"{LOSS_MODE_KEY}=gspo"]))
    stock = [*recipe, "actor_rollout_ref.rollout.name=vllm", "algorithm.rollout_correction.rollout_is=token",
             "algorithm.rollout_correction.rollout_is_threshold=1e9", f"{LOSS_MODE_KEY}=vanilla"]
    check_config(compose_ppo_config(stock))
