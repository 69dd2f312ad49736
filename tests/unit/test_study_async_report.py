"""The staleness x quantization report (qurl_recipes.study_async_report) against hand computations."""
from __future__ import annotations

import json
import math
import statistics

import pytest

from qurl_recipes.study_async import Arm, grid, parse_arm
from qurl_recipes.study_async_report import build_report, load_arms

SETTINGS = {"steps": 4, "weight_bits": 5, "prompts_per_step": 2, "group_size": 2, "mini_batches": 2, "is_cap": 2.0,
            "max_grad_norm": 1.0, "n_val": 64, "n_train": 64}


def _write(runs, lr, k, variant, seed, parts, acc_end, w_share=0.0, settings=None):
    """One finished run: ``parts`` is (total, staleness, quantization) per step; ages follow the grid's rule."""
    folder = runs / f"lr{lr:g}" / f"staleness{k}" / variant / f"seed{seed}"
    folder.mkdir(parents=True)
    rows = []
    for i, (total, stale, quant) in enumerate(parts):
        row = {"step": i, "staleness": min(i, k), "reward": 0.1, "kl_k3": total, "w_max": 1.5,
               "w_frac_above_c": w_share, "clipfrac_upper": 0.0, "sync_s": 0.0, "step_s": 1.0,
               "kl_total": total, "kl_staleness": stale, "kl_quantization": quant}
        if i == 0:
            row.update(val_acc=0.3, val_acc_full=0.3, train_acc_full=0.4)
        rows.append(row)
    rows.append({"step": len(parts), "val_acc": acc_end, "val_acc_full": acc_end, "train_acc_full": acc_end})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = {"variant": variant, "seed": seed, "settings": {**(settings or SETTINGS), "lr": lr, "staleness": k},
           "cpu": {"model": "test", "isa": "avx2"}}
    (folder / "run.json").write_text(json.dumps(run))


def test_parts_average_the_steps_at_full_staleness_and_seeds_combine_as_mean_and_standard_error(tmp_path):
    """Staleness 2: steps 0 and 1 roll out with younger weights and stay out of the parts' means."""
    runs = tmp_path / "runs"
    per_seed = {1: [(9.0, 9.0, 9.0), (9.0, 9.0, 9.0), (3e-3, 1e-3, 2e-3), (5e-3, 2e-3, 2e-3)],
                2: [(9.0, 9.0, 9.0), (9.0, 9.0, 9.0), (4e-3, 2e-3, 2e-3), (6e-3, 3e-3, 2e-3)]}
    for seed, parts in per_seed.items():
        _write(runs, 4e-5, 2, "tis", seed, parts, acc_end=0.5)
    result = build_report(runs, tmp_path / "report")
    arm = result["arms"]["lr4e-05/staleness2/tis"]
    for i, key in enumerate(("kl_total", "kl_staleness", "kl_quantization")):
        seed_means = [statistics.fmean(p[i] for p in parts[2:]) for parts in per_seed.values()]
        assert math.isclose(arm[key], statistics.fmean(seed_means))
        assert math.isclose(arm[f"{key}_se"], statistics.stdev(seed_means) / math.sqrt(2), abs_tol=1e-15)
    # accuracy on 64 questions: the standard error is floored at the binomial one, sqrt(p (1 - p) / (64 x 2))
    assert math.isclose(arm["train_acc_full_last_se"], math.sqrt(0.5 * 0.5 / 128))
    assert (tmp_path / "report" / "results.md").read_text().count("| 4e-05 | 2 | W5A8 | TIS | 2 |") == 1


def test_verdicts_follow_the_numbers(tmp_path):
    """A staleness part 4x the quantization part, beyond noise; parts that add exactly; W5A8 at BF16's
    accuracy; staleness costing accuracy beyond noise (0.30 from 0.70 on 64 questions x 2 seeds)."""
    runs = tmp_path / "runs"
    for seed, jitter in ((1, 0.0), (2, 1e-5)):
        _write(runs, 4e-5, 0, "tis", seed, [(2e-3 + jitter, 0.0, 2e-3 + jitter)] * 3, 0.70)
        _write(runs, 4e-5, 0, "bf16_tis", seed, [(1e-5, 0.0, 0.0)] * 3, 0.70)
        _write(runs, 4e-5, 1, "bf16_tis", seed, [(8e-3 + jitter, 8e-3 + jitter, 0.0)] * 3, 0.30, w_share=1e-3)
        _write(runs, 4e-5, 1, "tis", seed, [(1e-2 + jitter, 8e-3, 2e-3 + jitter)] * 3, 0.30, w_share=1e-3)
    claims = {c["claim"]: c for c in build_report(runs, tmp_path / "report")["claims"]}
    size = claims["lr 4e-05: one step of staleness moves the behaviour policy as much as W{b}A8 does"]
    assert size["verdict"] == "staleness larger beyond seed noise" and "ratio 3.99" in size["measure"]  # 8.005e-3 / 2.005e-3
    assert claims["lr 4e-05, staleness 1: the parts add (total ≈ staleness + quantization), W{b}A8 + TIS"][
        "verdict"] == "add to within 10%"
    assert claims["lr 4e-05: staleness 1 costs accuracy, W{b}A8 + TIS"]["verdict"] == "yes, beyond seed noise"
    assert claims["lr 4e-05: staleness 1 raises the share of tokens with w > C, W{b}A8 + TIS"]["verdict"] == \
        "yes, beyond seed noise"
    assert claims["lr 4e-05, staleness 1: quantized rollout still pays off (W{b}A8 + TIS reaches BF16 rollout + "
                  "TIS's accuracy)"]["verdict"] == "yes, within seed noise"


def test_runs_of_other_settings_are_refused(tmp_path):
    runs = tmp_path / "runs"
    _write(runs, 1e-5, 0, "tis", 1, [(1e-3, 0.0, 1e-3)] * 2, 0.5)
    _write(runs, 1e-5, 1, "tis", 1, [(1e-3, 0.0, 1e-3)] * 2, 0.5, settings={**SETTINGS, "weight_bits": 6})
    assert len(load_arms(runs)) == 2
    with pytest.raises(SystemExit, match="other settings"):
        build_report(runs, tmp_path / "report")


def test_the_grid_runs_the_higher_learning_rate_first_and_refuses_unknown_arms():
    arms = grid(("tis", "bf16_tis"), (0, 1), (1e-5, 4e-5), ((4e-5, 2, "tis"),))
    assert len(arms) == 9 and arms[0] == Arm(4e-5, 0, "bf16_tis") and Arm(4e-5, 2, "tis") in arms[:5]
    assert {a.lr for a in arms[5:]} == {1e-5}
    with pytest.raises(ValueError, match="unknown variant"):
        grid(("tis", "nope"))
    assert parse_arm("4e-5:2:tis") == (4e-5, 2, "tis")
    with pytest.raises(Exception, match="lr:staleness:variant"):
        parse_arm("4e-5:tis")


@pytest.mark.parametrize("at_k2, verdict", [(6.4e-3, "yes, within ×1.5 of quadratic"),
                                            (3.2e-3, "no: not within ×1.5 of quadratic")])
def test_staleness_growth_is_checked_against_lr_times_updates_squared(tmp_path, at_k2, verdict):
    """lr ×4 at staleness 1: ×16 (quadratic in the learning rate); staleness 1 → 2 at lr 4e-5: ×4 is quadratic
    in the updates, ×2 is not."""
    runs = tmp_path / "runs"
    for seed in (1, 2):
        _write(runs, 1e-5, 1, "tis", seed, [(2e-3, 1e-4, 2e-3)] * 3, 0.5)
        _write(runs, 4e-5, 1, "tis", seed, [(3e-3, 1.6e-3, 2e-3)] * 3, 0.5)
        _write(runs, 4e-5, 2, "tis", seed, [(8e-3, at_k2, 2e-3)] * 3, 0.5)
    claims = {c["claim"]: c for c in build_report(runs, tmp_path / "report")["claims"] if "grows" in c["claim"]}
    in_lr = claims["staleness's KL grows as the square of the learning rate, W{b}A8 + TIS"]
    in_updates = claims["staleness's KL grows as the square of the updates, W{b}A8 + TIS"]
    assert in_lr["verdict"] == "yes, within ×1.5 of quadratic"
    assert in_lr["measure"] == "lr ×4 at staleness 1: ×16.0 (quadratic: ×16)"
    assert in_updates["verdict"] == verdict
