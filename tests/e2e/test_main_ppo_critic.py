"""PPO with a critic (GAE), the paper's first-table setting, through verl's own main_ppo on CPU.

The tiny CPU recipe runs GRPO; here `algorithm.adv_estimator=gae` turns on verl's critic (a value
head on a second copy of the same tiny checkpoint), trained with the actor's CPU settings, while the
rollout is `+qurl=int8`. The harness (deadline, session, leftover processes) is the one of
test_main_ppo_cpu.py.
"""
from __future__ import annotations

import math

import pytest
from test_main_ppo_cpu import run_recipe

STEPS = 2


def critic_overrides(model_path: str) -> list[str]:
    """The critic on the embedded model with what tiny_cpu.yaml sets for the actor on CPU."""
    return [
        "algorithm.adv_estimator=gae",
        f"critic.model.path={model_path}",
        "critic.strategy=fsdp2",
        "critic.model.use_remove_padding=false",  # padding removal needs flash-attn
        "+critic.model.override_config.attn_implementation=sdpa",
        "critic.ppo_micro_batch_size_per_gpu=8",
        "critic.optim.lr=1.0e-3",
    ]


@pytest.mark.e2e
def test_int8_rollout_with_a_gae_critic(tmp_path):
    proc, rows = run_recipe(tmp_path, STEPS, *critic_overrides(str(tmp_path / "model")),
                            preset="int8", timeout=1200)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-5000:])
    assert len(rows) == STEPS
    assert f"[summary] steps: {STEPS}" in proc.stdout
    for r in rows:
        # the critic is trained every step (critic_warmup 0) and its values feed GAE
        assert math.isfinite(r["critic/vf_loss"]) and r["critic/vf_loss"] >= 0, r["critic/vf_loss"]
        assert 0.0 <= r["critic/vf_clipfrac"] <= 1.0
        assert r["critic/grad_norm"] > 0 and r["critic/lr"] == pytest.approx(1.0e-3)
        assert math.isfinite(r["critic/values/mean"])
        assert math.isfinite(r["critic/vf_explained_var"])
        assert math.isfinite(r["critic/returns/mean"]) and math.isfinite(r["critic/advantages/mean"])
        # qurl's INT8 rollout and its loss run alongside the critic as they do under GRPO
        assert r["actor/grad_norm"] > 0
        assert 0 <= r["actor/qurl/kl_behav_prox_k3"] < 0.05
        assert r["actor/qurl/sync/total_s"] > 0 and r["actor/qurl/sync/quantized"] > 0
