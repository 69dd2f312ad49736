"""The qurl losses' verl config under the name earlier configs give as their ``_target_``,

    actor_rollout_ref.actor.policy_loss._target_=qurl_verl.losses.config.QurlPolicyLossConfig

the same class as ``qurl_verl.settings.loss_config.QurlPolicyLossConfig`` (where it lives, beside the
settings it checks), so a config naming either target builds the same object and passes the same checks.
"""
from __future__ import annotations

from qurl_verl.settings.loss_config import QurlPolicyLossConfig

__all__ = ["QurlPolicyLossConfig"]
