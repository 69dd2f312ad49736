"""The registered qurl losses inside verl: real composed config, verl's own ppo_loss, backward, metrics."""
from __future__ import annotations

import math

import pytest
import torch
from omegaconf import OmegaConf, open_dict
from tensordict import TensorDict
from verl.trainer.ppo.core_algos import agg_loss, get_policy_loss_fn
from verl.utils import tensordict_utils as tu
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.utils.losses import ppo_loss

from qurl_verl.losses import verl_losses
from qurl_verl.settings.loss_config import QurlPolicyLossConfig

EPS_LOW, EPS_HIGH, DUAL_C, C = 0.2, 0.28, 3.0, 2.0

QURL_OVERRIDES = [
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.actor.policy_loss._target_=qurl_verl.settings.loss_config.QurlPolicyLossConfig",
    f"+actor_rollout_ref.actor.policy_loss.is_cap={C}",
    f"actor_rollout_ref.actor.clip_ratio_low={EPS_LOW}",
    f"actor_rollout_ref.actor.clip_ratio_high={EPS_HIGH}",
    f"actor_rollout_ref.actor.clip_ratio_c={DUAL_C}",
    "algorithm.rollout_correction.rollout_is=token",
    "algorithm.rollout_correction.rollout_is_threshold=1e9",
    "algorithm.rollout_correction.bypass_mode=false",
    "actor_rollout_ref.rollout.calculate_log_probs=true",
]


@pytest.fixture(scope="module")
def composed():
    """verl's real ppo_trainer.yaml composed with the qurl overrides (composition is slow: do it once)."""
    from hydra import compose, initialize_config_module

    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        yield compose("ppo_trainer", overrides=QURL_OVERRIDES + ["actor_rollout_ref.actor.policy_loss.loss_mode=qurl_acr"])


def actor_node(composed, loss_mode, agg_mode):
    node = OmegaConf.create(OmegaConf.to_container(composed.actor_rollout_ref.actor, resolve=True))
    node.policy_loss.loss_mode = loss_mode
    node.loss_agg_mode = agg_mode
    return node


def actor_config(composed, loss_mode, agg_mode):
    """The FSDPActorConfig an actor worker builds from that config (same call as engine_workers.init_model)."""
    return omega_conf_to_dataclass(actor_node(composed, loss_mode, agg_mode))


def test_composed_config_builds_the_subclass_and_passes_verl_validation(composed):
    import verl.utils.config as verl_config
    from hydra import compose

    from qurl_verl.settings import QurlSettings

    # a second composition (inside the fixture's Hydra context) with a new key that needs '+'
    cfg = compose("ppo_trainer", overrides=QURL_OVERRIDES + [
        "actor_rollout_ref.actor.policy_loss.loss_mode=qurl_acr", "+actor_rollout_ref.actor.policy_loss.acr_upper_cap=50"])
    assert QurlSettings.from_config(cfg).loss.acr_upper_cap == 50
    # verl's own function, without any wrapper another plugin module may have installed
    verl_validate = getattr(verl_config.validate_config, "__wrapped__", verl_config.validate_config)
    verl_validate(cfg, use_reference_policy=False, use_critic=False)
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert type(actor).__name__ == "FSDPActorConfig"
    assert isinstance(actor.policy_loss, QurlPolicyLossConfig)
    assert (actor.policy_loss.is_cap, actor.policy_loss.acr_upper_cap, actor.policy_loss.loss_mode) == (C, 50, "qurl_acr")


def test_importing_the_module_registers_both_names_in_verls_registry(monkeypatch):
    """Registration happens at the definitions (verl's decorator), when the plugin imports the module."""
    import importlib

    from verl.trainer.ppo import core_algos

    monkeypatch.setattr(core_algos, "POLICY_LOSS_REGISTRY", {"vanilla": core_algos.compute_policy_loss_vanilla})
    with pytest.raises(ValueError, match="Unsupported loss mode"):
        get_policy_loss_fn("qurl_acr")
    importlib.reload(verl_losses)
    assert get_policy_loss_fn("qurl_acr").__name__ == "qurl_acr_policy_loss"
    assert get_policy_loss_fn("qurl_tis").__name__ == "qurl_tis_policy_loss"


def test_building_the_config_registers_nothing(monkeypatch, composed):
    """Building a config has no side effect on verl's registries (only the plugin registers)."""
    from verl.trainer.ppo import core_algos

    monkeypatch.setattr(core_algos, "POLICY_LOSS_REGISTRY", {"vanilla": core_algos.compute_policy_loss_vanilla})
    actor_config(composed, "qurl_acr", "token-mean")
    assert set(core_algos.POLICY_LOSS_REGISTRY) == {"vanilla"}


# ---- verl's ppo_loss with the TensorDict layout the FSDP engine hands it -------------------------------------------


def make_engine_batch(seed, *, dp_size, extra_tokens, extra_seqs):
    """Nested (jagged) per-sequence tensors, as ppo_loss receives them, plus a flat log_probs over prompt+response."""
    g = torch.Generator().manual_seed(seed)
    prompt_lens = [3, 5, 2, 4, 6, 3]
    resp_lens = [7, 1, 12, 9, 4, 10]
    seqs = []
    for p, r in zip(prompt_lens, resp_lens):
        old = -torch.rand(r, generator=g) * 4
        seqs.append(
            dict(
                prompt=torch.randint(0, 50, (p,), generator=g),
                response=torch.randint(0, 50, (r,), generator=g),
                mask=(torch.rand(r, generator=g) > 0.15).to(torch.int64),
                old=old,
                logp=old + torch.randn(r, generator=g) * 0.6,
                log_w=torch.randn(r, generator=g) * 2.5,  # many tokens with w > C
                adv=torch.full((r,), torch.randn(1, generator=g).item()),
            )
        )
    seqs[2]["mask"][0] = 1

    def nested(key, dtype=None):
        ts = [s[key] if dtype is None else s[key].to(dtype) for s in seqs]
        return torch.nested.as_nested_tensor(ts, layout=torch.jagged)

    # verl's weights: exp(clamp(old - rollout, +-20)) * response_mask
    for s in seqs:
        s["w"] = torch.exp(torch.clamp(s["log_w"], -20, 20)) * s["mask"]
    local_tokens = int(sum(s["mask"].sum() for s in seqs))
    td = TensorDict(
        {
            "prompts": nested("prompt"),
            "responses": nested("response"),
            "response_mask": nested("mask"),
            "old_log_probs": nested("old"),
            "advantages": nested("adv"),
            "rollout_is_weights": nested("w"),
        },
        batch_size=[len(seqs)],
    )
    # the global batch this micro-batch belongs to is bigger than the micro-batch itself
    tu.assign_non_tensor(td, dp_size=dp_size, batch_num_tokens=local_tokens + extra_tokens, global_batch_size=len(seqs) + extra_seqs)

    # flat model output: log-prob of response token j of sequence i sits one position before the token
    flat = torch.zeros(sum(prompt_lens) + sum(resp_lens))
    where = []
    start = 0
    for p, r, s in zip(prompt_lens, resp_lens, seqs):
        idx = torch.arange(start + p - 1, start + p - 1 + r)
        flat[idx] = s["logp"]
        where.append(idx)
        start += p + r
    return td, flat, seqs, where


def reference_pg_loss(seqs, logps, agg_mode, *, adaptive, dp_size, batch_num_tokens, global_batch_size):
    """Float64 per-sequence re-derivation of Eq. 9 / Eq. 5 and verl's aggregation rules."""
    per_seq = []
    for s, logp in zip(seqs, logps):
        m = s["mask"].bool()
        w = torch.exp(s["log_w"].double())
        r = torch.clamp(C / w, max=1.0)
        big_r = torch.exp(torch.clamp(logp - s["old"].double(), -20, 20))
        a = s["adv"].double()
        upper = (1 + EPS_HIGH) / r if adaptive else torch.full_like(r, 1 + EPS_HIGH)
        clipped = torch.maximum(torch.minimum(big_r, upper), torch.full_like(r, 1 - EPS_LOW))
        obj = torch.minimum(big_r * a, clipped * a)
        obj = torch.where(a < 0, torch.maximum(obj, DUAL_C * a), obj)
        tok = -torch.clamp(w, max=C) * obj
        per_seq.append((tok[m].sum(), m.sum()))
    if agg_mode == "token-mean":
        return sum(t for t, _ in per_seq) / batch_num_tokens * dp_size
    if agg_mode == "seq-mean-token-mean":
        return sum(t / n for t, n in per_seq if n > 0) / global_batch_size * dp_size
    if agg_mode == "seq-mean-token-sum":
        return sum(t for t, _ in per_seq) / global_batch_size * dp_size
    raise AssertionError(agg_mode)


@pytest.mark.parametrize("loss_mode", ["qurl_acr", "qurl_tis"])
@pytest.mark.parametrize("agg_mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_registered_loss_through_verl_ppo_loss_with_backward(composed, loss_mode, agg_mode):
    config = actor_config(composed, loss_mode, agg_mode)
    dp_size, extra_tokens, extra_seqs = 2, 17, 3
    td, flat, seqs, where = make_engine_batch(11, dp_size=dp_size, extra_tokens=extra_tokens, extra_seqs=extra_seqs)
    flat.requires_grad_(True)

    loss, metrics = ppo_loss(config, {"log_probs": flat}, td)
    loss.backward()

    ref_flat = flat.detach().double().clone().requires_grad_(True)
    ref = reference_pg_loss(
        seqs, [ref_flat[idx] for idx in where], agg_mode, adaptive=loss_mode == "qurl_acr",
        dp_size=dp_size, batch_num_tokens=td["batch_num_tokens"], global_batch_size=td["global_batch_size"],
    )
    ref.backward()
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(flat.grad.double(), ref_flat.grad, rtol=1e-5, atol=1e-8)
    assert flat.grad.abs().sum() > 0

    values = {k: m.aggregate() for k, m in metrics.items()}
    for key in ("actor/qurl/kl_behav_prox_k1", "actor/qurl/kl_behav_prox_k3", "actor/qurl/w_max",
                "actor/qurl/w_frac_above_c", "actor/qurl/w_truncated_ess", "actor/qurl/upper_bound_mean", "actor/qurl/upper_bound_max",
                "actor/qurl/clipfrac_upper", "actor/qurl/clipfrac_lower", "actor/qurl/clipfrac_dual",
                "actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/ppo_kl", "actor/pg_loss"):
        assert key in values and math.isfinite(values[key]), key
    masked_log_w = torch.cat([s["log_w"][s["mask"].bool()] for s in seqs])
    assert values["actor/qurl/w_max"] == pytest.approx(masked_log_w.exp().max().item(), rel=1e-5)
    assert values["actor/qurl/kl_behav_prox_k1"] == pytest.approx((-masked_log_w).mean().item(), rel=1e-5)
    if loss_mode == "qurl_tis":
        assert values["actor/qurl/upper_bound_max"] == pytest.approx(1 + EPS_HIGH)
    else:
        assert values["actor/qurl/upper_bound_max"] > 1 + EPS_HIGH


def test_verl_reduces_policy_loss_metrics_as_the_w_max_docstring_says():
    """verl 0.9.1 offers no max aggregation to a policy loss: it wraps the loss's metrics as means
    (a max Metric is refused) and takes np.max only across mini-batches, for a key holding "max"."""
    from verl.utils.metric import AggregationType, Metric, reduce_metrics

    with pytest.raises(ValueError, match="mismatch"):
        Metric.from_dict({"actor/qurl/w_max": Metric(AggregationType.MAX, 3.0)}, aggregation=AggregationType.MEAN)
    micro_batches = Metric(AggregationType.MEAN)  # one mini-batch: its micro-batch maxima, averaged
    micro_batches.extend([1.5, 2.5])
    per_mini_batch = [micro_batches.aggregate(), 1.8]
    reduced = reduce_metrics({"actor/qurl/w_max": list(per_mini_batch), "actor/qurl/w_truncated_ess": list(per_mini_batch)})
    assert reduced["actor/qurl/w_max"] == pytest.approx(2.0)  # max over mini-batches of the mean of maxima
    assert reduced["actor/qurl/w_truncated_ess"] == pytest.approx(1.9)  # a mean, no "max" in the name


def test_acr_and_tis_differ_through_ppo_loss(composed):
    """Guards the test above: the batch really has tokens where the adaptive bound changes the loss."""
    losses = {}
    for mode in ("qurl_acr", "qurl_tis"):
        td, flat, _, _ = make_engine_batch(11, dp_size=1, extra_tokens=0, extra_seqs=0)
        losses[mode] = ppo_loss(actor_config(composed, mode, "token-mean"), {"log_probs": flat}, td)[0].item()
    assert abs(losses["qurl_acr"] - losses["qurl_tis"]) > 1e-4


@pytest.mark.parametrize("agg_mode", ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_every_verl_agg_mode_uses_global_batch_info(composed, agg_mode):
    """The registered loss aggregates exactly like verl's agg_loss on the same loss matrix, for every mode verl has."""
    from qurl_verl.losses.acr import acr_token_loss, log_weight_from_is_weights

    config = actor_config(composed, "qurl_acr", agg_mode)
    td, flat, _, _ = make_engine_batch(12, dp_size=4, extra_tokens=40, extra_seqs=5)
    loss, _ = ppo_loss(config, {"log_probs": flat}, td)

    from verl.workers.utils.padding import no_padding_2_padding

    padded = td.select("response_mask", "old_log_probs", "advantages", "rollout_is_weights").to_padded_tensor()
    mask = padded["response_mask"].bool()
    loss_mat, _ = acr_token_loss(
        no_padding_2_padding(flat, td), padded["old_log_probs"], log_weight_from_is_weights(padded["rollout_is_weights"], mask),
        padded["advantages"], mask, is_cap=C, clip_ratio_low=EPS_LOW, clip_ratio_high=EPS_HIGH, clip_ratio_c=DUAL_C,
    )
    expected = agg_loss(loss_mat, mask, agg_mode, dp_size=4, batch_num_tokens=td["batch_num_tokens"],
                        global_batch_size=td["global_batch_size"], loss_scale_factor=None)
    unnormalised = agg_loss(loss_mat, mask, agg_mode)
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-8)
    if agg_mode != "token-sum":
        assert not torch.allclose(loss, unnormalised)


def test_missing_is_weights_is_a_clear_error(composed):
    config = actor_config(composed, "qurl_acr", "token-mean")
    td, flat, _, _ = make_engine_batch(13, dp_size=1, extra_tokens=0, extra_seqs=0)
    del td["rollout_is_weights"]
    with pytest.raises(ValueError, match="got no rollout_is_weights.*rollout_is=token"):
        ppo_loss(config, {"log_probs": flat}, td)


def test_plain_policy_loss_config_is_a_clear_error(composed):
    node = actor_node(composed, "qurl_tis", "token-mean")
    node.policy_loss._target_ = "verl.workers.config.PolicyLossConfig"
    with open_dict(node):
        del node.policy_loss["is_cap"]
    config = omega_conf_to_dataclass(node)
    td, flat, _, _ = make_engine_batch(14, dp_size=1, extra_tokens=0, extra_seqs=0)
    with pytest.raises(ValueError, match="_target_=qurl_verl.settings.loss_config.QurlPolicyLossConfig"):
        ppo_loss(config, {"log_probs": flat}, td)


def test_any_loss_carries_the_sync_metrics_once_the_channel_is_installed(composed, monkeypatch):
    """verl's own vanilla loss, through verl's ppo_loss: bit for bit the same loss and gradient with the
    channel installed, plus the metrics the qurl_vllm adapter published; nothing added without it."""
    import verl.workers.utils.losses as verl_loss_module

    from qurl_verl.patches.qurl_vllm import loss_metrics_channel

    def run(mode):
        td, flat, _, _ = make_engine_batch(11, dp_size=1, extra_tokens=0, extra_seqs=0)
        flat.requires_grad_(True)
        loss, metrics = ppo_loss(actor_config(composed, mode, "token-mean"), {"log_probs": flat}, td)
        loss.backward()
        return loss.detach(), flat.grad.clone(), {k: m.aggregate() for k, m in metrics.items()}

    loss_metrics_channel.clear()
    loss_metrics_channel.publish({"qurl/sync/total_s": 0.25, "qurl/update/changed_code_frac": 0.125})
    try:
        stock = run("vanilla")
        assert "qurl/sync/total_s" not in stock[2]  # not installed: verl's lookup is untouched
        monkeypatch.setattr(verl_loss_module, "get_policy_loss_fn", verl_loss_module.get_policy_loss_fn)
        assert loss_metrics_channel.apply() and loss_metrics_channel.apply() == ""  # once: the second changes nothing
        carried = run("vanilla")
        assert torch.equal(stock[0], carried[0]) and torch.equal(stock[1], carried[1])
        assert {k: v for k, v in carried[2].items() if not k.startswith("qurl/")} == stock[2]
        assert carried[2]["qurl/sync/total_s"] == pytest.approx(0.25)
        assert carried[2]["qurl/update/changed_code_frac"] == pytest.approx(0.125)
        assert run("qurl_acr")[2]["qurl/sync/total_s"] == pytest.approx(0.25)  # the ACR loss carries them too
    finally:
        loss_metrics_channel.clear()
