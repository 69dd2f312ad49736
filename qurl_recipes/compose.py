"""Compose verl's `ppo_trainer` config with Hydra overrides, as `main_ppo` would, without running it.

Used by the recipes' dry-run path and by tests: it gives the exact DictConfig the driver would
receive, so `validate_config` (verl's checks plus qurl-verl's) can run with no Ray and no GPU.
"""
from __future__ import annotations

from collections.abc import Sequence

from omegaconf import DictConfig


def compose_ppo_config(overrides: Sequence[str] = ()) -> DictConfig:
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        return compose(config_name="ppo_trainer", overrides=list(overrides))


def validate_like_main_ppo(cfg: DictConfig) -> None:
    """The driver-side checks `main_ppo.main` runs before starting Ray."""
    import verl  # noqa: F401 - loads the qurl plugin, which hooks its checks into validate_config
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils import config as verl_config
    from verl.utils.device import auto_set_device

    auto_set_device(cfg)
    verl_config.validate_config(config=cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
