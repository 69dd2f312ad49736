"""The GRPO study's report maths (qurl_recipes.study_report) against hand computations."""
from __future__ import annotations

import json
import math
import statistics

import pytest

from qurl_recipes.study_claims import claim_checks
from qurl_recipes.study_report import build_long_horizon, build_report, main
from qurl_recipes.study_statistics import mean_se, seed_statistics, variant_summary
from qurl_recipes.study_tables import long_markdown

C = 2.0


def _rows(rewards, kls, w_maxes, changed=0.01, val=(0.1, 0.3)):
    rows = []
    for i, (r, k, w) in enumerate(zip(rewards, kls, w_maxes)):
        row = {"step": i, "reward": r, "kl_k3": k, "w_max": w, "w_frac_above_c": 0.001 if w > C else 0.0,
               "clipfrac_upper": 0.01, "sync_s": 0.01, "step_s": 1.0, "changed_code_share_qkv": changed}
        if i:
            row["changed_code_share"] = changed
        if i == 0:
            row.update(val_acc=val[0], val_acc_full=val[0] + 0.1, train_acc_full=val[0] + 0.2)
        rows.append(row)
    rows.append({"step": len(rewards), "val_acc": val[1], "val_acc_full": val[1] + 0.1, "train_acc_full": val[1] + 0.2})
    return rows


def test_seed_statistics_by_hand():
    rewards = [0.1 * i for i in range(20)]
    kls = [1e-3] * 10 + [3e-3] * 10
    w = [1.5] * 15 + [2.5] * 5
    s = seed_statistics(_rows(rewards, kls, w), C)
    assert s["steps"] == 20
    assert math.isclose(s["reward_first"], (0.0 + 0.1) / 2)  # a tenth of 20 steps: 2
    assert math.isclose(s["reward_last"], (1.8 + 1.9) / 2)
    assert math.isclose(s["kl_first_half"], 1e-3) and math.isclose(s["kl_second_half"], 3e-3)
    assert s["w_max"] == 2.5 and s["w_above_c_step_share"] == 5 / 20
    assert (s["val_acc_first"], s["val_acc_last"]) == (0.1, 0.3)
    assert math.isclose(s["train_acc_full_first"], 0.3) and math.isclose(s["train_acc_full_last"], 0.5)
    assert math.isnan(s["grad_clipped_step_share"])  # not logged, not invented


def test_grad_clipped_share_counts_steps_above_the_clip():
    rows = _rows([0.1] * 4, [1e-3] * 4, [1.0] * 4)
    for r, g in zip(rows, (0.5, 1.5, 2.0, 0.9)):
        r["grad_norm_max"] = g
    assert seed_statistics(rows, C, max_grad_norm=1.0)["grad_clipped_step_share"] == 2 / 4


def test_accuracy_error_is_floored_at_the_binomial_one():
    same = {seed: {**seed_statistics(_rows([0.1] * 10, [1e-3] * 10, [1.0] * 10), C)} for seed in (1, 2)}
    summary = variant_summary(same, {"val": 64, "train": 64})
    p = 0.5  # train_acc_full_last of both seeds
    assert math.isclose(summary["train_acc_full_last_se"], math.sqrt(p * (1 - p) / (64 * 2)))
    assert variant_summary(same)["train_acc_full_last_se"] == 0.0  # seeds agree: zero without the floor


def test_mean_se_is_the_across_seed_standard_error():
    m, se = mean_se([0.2, 0.4, 0.9])
    assert math.isclose(m, 0.5)
    assert math.isclose(se, statistics.stdev([0.2, 0.4, 0.9]) / math.sqrt(3))
    assert math.isnan(mean_se([0.3])[1])  # one seed: no seed-to-seed error, never a fake zero


def _summary(final_acc, se, kl_drift=0.0, changed=0.01, share=0.5, **extra):
    s = {"seeds": [1, 2], "steps": 150, "w_max": 3.0}
    base = dict(reward_first=0.1, reward_last=0.3, reward_gain=0.2, train_acc_full_last=final_acc, kl_mean=2e-3,
                kl_first_half=2e-3,
                kl_second_half=2e-3 + kl_drift, kl_drift=kl_drift, w_above_c_step_share=share,
                w_frac_above_c_mean=1e-3, clipfrac_upper_mean=0.01, changed_code_share=changed,
                changed_code_share_qkv=changed, val_acc_first=0.1, val_acc_last=0.2, sync_s=0.01, step_s=1.0)
    base.update(extra)
    for k, v in base.items():
        s[k], s[f"{k}_se"] = v, se if k == "train_acc_full_last" else 1e-4
    return s


def _verdicts(summaries):
    return {c["claim"].split(" (")[0]: c["verdict"] for c in claim_checks(summaries)}


def test_claims_follow_the_two_standard_error_rule():
    s = {"bf16": _summary(0.50, 0.01), "naive": _summary(0.40, 0.01), "tis": _summary(0.42, 0.01, kl_drift=1e-3),
         "acr_no_uaq": _summary(0.45, 0.01, changed=0.010), "acr_uaq": _summary(0.49, 0.01, changed=0.015),
         "acr_per_group_lr": _summary(0.485, 0.01, changed=0.0151)}
    v = _verdicts(s)
    assert v["naive quantized rollout degrades"] == "reproduced"  # -0.10 vs 2 x 0.014
    assert v["TIS drifts"] == "reproduced"
    assert v["ACR stays stable where TIS drifts"] == "reproduced"  # +0.03 > 2 x 0.0141
    assert v["UAQ makes more weight updates visible"] == "reproduced"
    assert v["UAQ closes the gap to BF16"] == "reproduced"  # ACR -0.05 beyond noise, ACR+UAQ -0.01 within
    assert v["UAQ ≈ per-group learning rate"] == "agree within seed noise"
    assert "UAQ ≈ per-group learning rate with the gradient clipped as UAQ clips it" not in v  # no runs, no claim
    s["acr_per_group_lr_uaq_clip"] = _summary(0.49, 0.01, changed=0.015)
    assert _verdicts(s)["UAQ ≈ per-group learning rate with the gradient clipped as UAQ clips it"] == \
        "agree within seed noise"

    s["naive"] = _summary(0.48, 0.01)  # -0.02 is within 2 x 0.0141
    s["tis"] = _summary(0.42, 0.01, share=0.0)
    s["acr_no_uaq"] = _summary(0.49, 0.01)
    s["acr_per_group_lr"] = _summary(0.40, 0.01)
    v = _verdicts(s)
    assert v["naive quantized rollout degrades"] == "not reproduced"
    assert v["TIS drifts"] == "not reproduced"
    assert v["ACR stays stable where TIS drifts"].startswith("not testable (no w > C")
    assert v["UAQ closes the gap to BF16"].startswith("no gap to close")
    # accuracy 0.40 vs 0.49 and codes 0.01 vs 0.015 differ; reward and KL are equal
    assert v["UAQ ≈ per-group learning rate"] == ("differ beyond seed noise in train_acc_full_last, changed_code_share; "
                                                  "agree in reward_last, kl_mean")

    s["tis"] = _summary(0.42, 0.01, share=0.5)  # w > C occurs, but TIS does not drift and ACR is no better
    s["acr_no_uaq"] = _summary(0.43, 0.01)
    assert _verdicts(s)["ACR stays stable where TIS drifts"].startswith("not testable (TIS does not drift")
    s["tis"] = _summary(0.42, 0.01, share=0.5, kl_drift=1e-3)  # TIS drifts and ACR drifts as much
    s["acr_no_uaq"] = _summary(0.43, 0.01, kl_drift=1e-3)
    assert _verdicts(s)["ACR stays stable where TIS drifts"] == "not reproduced"


def test_build_report_writes_results_and_figures(tmp_path):
    settings = {"steps": 20, "weight_bits": 5, "lr": 1e-4, "prompts_per_step": 4, "group_size": 2, "mini_batches": 2,
                "is_cap": C}
    for variant, offset in (("bf16", 0.0), ("acr_uaq", 0.05), ("acr_per_group_lr", 0.04)):
        for seed in (1, 2):
            folder = tmp_path / "runs" / variant / f"seed{seed}"
            folder.mkdir(parents=True)
            rows = _rows([offset + 0.01 * (i + seed) for i in range(20)], [1e-3 * seed] * 20, [1.0 + 0.1 * seed] * 20)
            (folder / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
            (folder / "run.json").write_text(json.dumps({"seed": seed, "variant": variant, "settings": settings,
                                                         "cpu": {"model": "x", "isa": "avx2"}}))
    result = build_report(tmp_path / "runs", ["bf16", "acr_uaq", "acr_per_group_lr", "naive"], tmp_path / "out")
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    bf16 = saved["variants"]["bf16"]
    assert bf16["seeds"] == [1, 2] and bf16["steps"] == 20
    per_seed_last = [statistics.fmean([0.01 * (i + s) for i in range(18, 20)]) for s in (1, 2)]
    assert math.isclose(bf16["reward_last"], statistics.fmean(per_seed_last))
    assert math.isclose(bf16["reward_last_se"], statistics.stdev(per_seed_last) / math.sqrt(2))
    assert math.isclose(bf16["kl_mean"], 1.5e-3) and bf16["w_above_c_step_share"] == 0.0
    assert len(result["figures"]) >= 6 and all((tmp_path / "out" / f).exists() for f in result["figures"])
    assert "uaq_vs_per_group_lr.png" in result["figures"]
    assert "naive" not in saved["variants"]  # no runs, no row


def test_report_refuses_runs_with_different_settings(tmp_path):
    for seed, steps in ((1, 20), (2, 30)):
        folder = tmp_path / "bf16" / f"seed{seed}"
        folder.mkdir(parents=True)
        (folder / "metrics.jsonl").write_text(json.dumps(_rows([0.1], [1e-3], [1.0])[0]) + "\n")
        (folder / "run.json").write_text(json.dumps({"seed": seed, "settings": {"steps": steps, "is_cap": C,
                                                     "weight_bits": 5}, "cpu": {}}))
    with pytest.raises(SystemExit, match="other settings"):
        build_report(tmp_path, ["bf16"], tmp_path / "out")


# --- long horizon (paper Fig. 3) ---------------------------------------------------------------

LONG_SETTINGS = {"steps": 1000, "weight_bits": 5, "lr": 1e-5, "prompts_per_step": 4, "group_size": 2,
                 "mini_batches": 2, "is_cap": C, "n_val": 64, "n_train": 64, "val_every": 25}


def _entropy(i):  # a policy that sharpens as it trains
    return 0.5 / (1 + i / 200)


def _long_rows(n_steps, kl, reward, val_every=25):
    """Per-step records as grpo_study writes them; ``kl``/``reward`` map a step to its value."""
    rows = []
    for i in range(n_steps):
        row = {"step": i, "reward": reward(i), "kl_k3": kl(i), "w_max": 3.0, "w_frac_above_c": 1e-3 * (1 + i % 3),
               "clipfrac_upper": 1e-2 * (1 + i % 5), "entropy": _entropy(i), "sync_s": 0.01, "step_s": 1.0}
        if i % val_every == 0:
            row.update(val_acc=0.2 + i / 1e4, val_acc_full=0.3 + i / 1e4, train_acc_full=0.4 + i / 1e4)
        rows.append(row)
    rows.append({"step": n_steps, "val_acc": 0.25, "val_acc_full": 0.35, "train_acc_full": 0.45})
    return rows


def _rising(seed):  # flat to step 500, then climbing about 10x by step 1,000
    return lambda i: 2e-3 * (1 + 0.05 * seed) * (1 + (i >= 500) * (i - 500) / 50) * (1 + 0.1 * (i % 2))


def _flat(seed, level=2e-3):
    return lambda i: level * (1 + 0.05 * seed) * (1 + 0.1 * (i % 2))


def _improving(seed):
    return lambda i: 0.1 + 2e-4 * i + 0.01 * seed


def _write_long(root, variant, kl_of_seed, reward_of_seed, n_steps=1000, settings=LONG_SETTINGS):
    for seed in (1, 2):
        folder = root / variant / f"seed{seed}"
        folder.mkdir(parents=True)
        rows = _long_rows(n_steps, kl_of_seed(seed), reward_of_seed(seed))
        (folder / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
        (folder / "run.json").write_text(json.dumps({"seed": seed, "variant": variant,
                                                     "settings": {**settings, "steps": n_steps},
                                                     "cpu": {"model": "x", "isa": "avx2"}}))
    return root


def _long_verdicts(long):
    return {c["claim"]: c["verdict"] for c in long["verdicts"]}


def test_long_horizon_reproduced_when_tis_drifts_and_acr_does_not(tmp_path):
    runs = tmp_path / "long"
    _write_long(runs, "tis", _rising, lambda s: (lambda i: 0.3 - 2e-4 * max(0, i - 600) + 0.01 * s))
    _write_long(runs, "acr_no_uaq", _flat, _improving)
    _write_long(runs, "bf16", lambda s: _flat(s, 3e-4), _improving)
    long = build_long_horizon(runs, ["bf16", "tis", "acr_no_uaq", "acr_uaq"], tmp_path / "out")
    v = _long_verdicts(long)
    assert v == {"TIS drifts after ~500 steps": "reproduced", "ACR stays stable where TIS drifts": "reproduced"}
    assert "acr_uaq" not in long["variants"]  # not run: no table, no claim
    assert long["settings"]["steps"] == 1000
    assert all((tmp_path / "out" / f).exists() for f in ("long_horizon_kl.png", "long_horizon_reward.png"))

    # the window means are plain means over the steps of each window, per seed, then across seeds
    tis = long["variants"]["tis"]
    assert [(w["start"], w["end"]) for w in tis["windows"]] == [(a, a + 100) for a in range(0, 1000, 100)]
    for k, w in enumerate(tis["windows"]):
        per_seed = [statistics.fmean(_rising(s)(i) for i in range(100 * k, 100 * k + 100)) for s in (1, 2)]
        assert math.isclose(tis["per_seed"][1]["windows"][k]["kl_k3"], per_seed[0])
        assert math.isclose(w["kl_k3"], statistics.fmean(per_seed))
        assert math.isclose(w["kl_k3_se"], statistics.stdev(per_seed) / math.sqrt(2))
        steps = range(100 * k, 100 * k + 100)
        assert math.isclose(w["clipfrac_upper"], statistics.fmean(1e-2 * (1 + i % 5) for i in steps))
        assert math.isclose(w["entropy"], statistics.fmean(_entropy(i) for i in steps))
    acr = long["variants"]["acr_no_uaq"]
    late = [statistics.fmean(_improving(s)(i) for i in range(900, 1000)) for s in (1, 2)]
    assert math.isclose(acr["windows"][-1]["reward"], statistics.fmean(late))
    # evaluations at every 100 steps, the final evaluation-only row included
    assert [e["step"] for e in tis["evals"]] == list(range(0, 1001, 100))
    assert math.isclose(tis["evals"][3]["train_acc_full"], 0.4 + 300 / 1e4)
    assert math.isclose(tis["evals"][-1]["val_acc_full"], 0.35)

    drift = long["verdicts"][0]["values"]
    base = [statistics.fmean(_rising(s)(i) for i in range(400, 500)) for s in (1, 2)]
    last = [statistics.fmean(_rising(s)(i) for i in range(900, 1000)) for s in (1, 2)]
    assert math.isclose(drift["kl_late"], statistics.fmean(last))
    assert math.isclose(drift["kl_base"], statistics.fmean(base))
    assert math.isclose(drift["ratio"], statistics.fmean(last) / statistics.fmean(base)) and drift["ratio"] >= 2

    # the entropy table: one cell per window, seeds agree (same values), so no standard error shown
    text = long_markdown(long, 5)
    entropy_table = text.split("### Entropy of the sampled policy")[1].split("###")[0]
    first = statistics.fmean(_entropy(i) for i in range(100))
    assert f"| W5A8 + TIS | 2 | {first:.3f} ± 0.000 |" in entropy_table


def test_long_horizon_flat_or_small_tis_rise_is_not_drift(tmp_path):
    runs = _write_long(tmp_path / "flat", "tis", _flat, _improving)
    _write_long(runs, "acr_no_uaq", _flat, _improving)
    v = _long_verdicts(build_long_horizon(runs, ["tis", "acr_no_uaq"], tmp_path / "out"))
    assert v == {"TIS drifts after ~500 steps": "not reproduced",
                 "ACR stays stable where TIS drifts": "not testable (TIS does not drift)"}

    # a rise of 1.5x is far beyond the seed noise but below the 2x that counts as drift
    def step_up(seed):
        return lambda i: 2e-3 * (1 + 0.01 * seed) * (1.5 if i >= 800 else 1)

    small = _write_long(tmp_path / "small", "tis", step_up, _improving)
    long = build_long_horizon(small, ["tis"], tmp_path / "out2")
    drift = long["verdicts"][0]
    assert drift["verdict"] == "not reproduced" and math.isclose(drift["values"]["ratio"], 1.5, rel_tol=1e-9)
    assert drift["values"]["kl_rise"] > 2 * drift["values"]["kl_rise_se"]
    assert _long_verdicts(long)["ACR stays stable where TIS drifts"] == "not testable (TIS does not drift)"


def test_long_horizon_acr_that_drifts_too_is_not_reproduced(tmp_path):
    runs = _write_long(tmp_path / "long", "tis", _rising, _improving)
    _write_long(runs, "acr_no_uaq", _rising, _improving)
    _write_long(runs, "acr_uaq", _flat, lambda s: (lambda i: 0.5 - 4e-4 * i + 0.01 * s))  # stable KL, reward falls
    v = _long_verdicts(build_long_horizon(runs, ["tis", "acr_no_uaq", "acr_uaq"], tmp_path / "out"))
    assert v["TIS drifts after ~500 steps"] == "reproduced"
    assert v["ACR stays stable where TIS drifts"] == "not reproduced"
    assert v["ACR + UAQ stays stable where TIS drifts"] == "not reproduced"


def test_long_horizon_short_or_missing_runs_are_not_testable(tmp_path):
    runs = _write_long(tmp_path / "short", "tis", _rising, _improving, n_steps=300)
    _write_long(runs, "acr_no_uaq", _flat, _improving, n_steps=300)
    long = build_long_horizon(runs, ["tis", "acr_no_uaq"], tmp_path / "out")
    reason = "not testable (runs have 300 steps; at least 600 are needed for a 100-step window after step 500)"
    assert _long_verdicts(long) == {"TIS drifts after ~500 steps": reason, "ACR stays stable where TIS drifts": reason}
    assert len(long["variants"]["tis"]["windows"]) == 3

    only_acr = _write_long(tmp_path / "acr_only", "acr_no_uaq", _flat, _improving)
    assert set(_long_verdicts(build_long_horizon(only_acr, ["tis", "acr_no_uaq"], tmp_path / "out2")).values()) == \
        {"not testable (no TIS runs)"}


def test_long_runs_option_adds_a_section_and_leaves_the_200_step_report_alone(tmp_path):
    settings = {"steps": 20, "weight_bits": 5, "lr": 1e-4, "prompts_per_step": 4, "group_size": 2, "mini_batches": 2,
                "is_cap": C}
    for variant in ("bf16", "tis"):
        for seed in (1, 2):
            folder = tmp_path / "runs" / variant / f"seed{seed}"
            folder.mkdir(parents=True)
            rows = _rows([0.01 * (i + seed) for i in range(20)], [1e-3 * seed] * 20, [1.0 + 0.1 * seed] * 20)
            (folder / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
            (folder / "run.json").write_text(json.dumps({"seed": seed, "variant": variant, "settings": settings,
                                                         "cpu": {"model": "x", "isa": "avx2"}}))
    long_runs = _write_long(tmp_path / "long", "tis", _rising, _improving)
    _write_long(long_runs, "acr_no_uaq", _flat, _improving)

    main(["--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "plain")])
    main(["--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "with_long"), "--long-runs", str(long_runs)])
    plain = json.loads((tmp_path / "plain" / "results.json").read_text())
    with_long = json.loads((tmp_path / "with_long" / "results.json").read_text())
    assert sorted(plain) == ["claims", "cpu", "figures", "settings", "variants"]
    assert not any(f.startswith("long_horizon") for f in plain["figures"])
    assert not (tmp_path / "plain" / "long_horizon_kl.png").exists()
    long = with_long.pop("long_horizon")
    assert with_long == plain  # the 200-step part is the same with or without the long runs
    assert _long_verdicts(long)["TIS drifts after ~500 steps"] == "reproduced"
    assert long["figures"] == ["long_horizon_kl.png", "long_horizon_reward.png"]
    plain_md = (tmp_path / "plain" / "results.md").read_text()
    long_md = (tmp_path / "with_long" / "results.md").read_text()
    assert "Long horizon" not in plain_md
    assert long_md.startswith(plain_md) and "## Long horizon" in long_md[len(plain_md):]
    assert "| 900–1000 |" in long_md and "TIS drifts after ~500 steps" in long_md


def test_long_runs_alone_extend_the_existing_report_as_building_both_at_once_does(tmp_path):
    """The long horizon can be added later, without the 200-step runs: the same files as one build."""
    settings = {"steps": 20, "weight_bits": 5, "lr": 1e-4, "prompts_per_step": 4, "group_size": 2, "mini_batches": 2,
                "is_cap": C}
    for seed in (1, 2):
        folder = tmp_path / "runs" / "tis" / f"seed{seed}"
        folder.mkdir(parents=True)
        rows = _rows([0.01 * (i + seed) for i in range(20)], [1e-3 * seed] * 20, [1.0 + 0.1 * seed] * 20)
        (folder / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
        (folder / "run.json").write_text(json.dumps({"seed": seed, "variant": "tis", "settings": settings,
                                                     "cpu": {"model": "x", "isa": "avx2"}}))
    long_runs = _write_long(tmp_path / "long", "tis", _rising, _improving)
    _write_long(long_runs, "acr_no_uaq", _flat, _improving)
    at_once, later = tmp_path / "at_once", tmp_path / "later"

    with pytest.raises(SystemExit, match="no report in"):
        main(["--long-runs", str(long_runs), "--out", str(later)])
    main(["--runs", str(tmp_path / "runs"), "--out", str(at_once), "--long-runs", str(long_runs)])
    main(["--runs", str(tmp_path / "runs"), "--out", str(later)])
    plain_md = (later / "results.md").read_text()
    main(["--long-runs", str(long_runs), "--out", str(later)])
    for name in ("results.json", "results.md"):
        assert (later / name).read_text() == (at_once / name).read_text()
    assert (later / "results.md").read_text().startswith(plain_md)

    # a second pass replaces the long-horizon part instead of appending another one
    flat_runs = _write_long(tmp_path / "flat", "tis", _flat, _improving)
    main(["--long-runs", str(flat_runs), "--out", str(later)])
    md = (later / "results.md").read_text()
    assert md.count("## Long horizon") == 1 and md.startswith(plain_md)
    assert _long_verdicts(json.loads((later / "results.json").read_text())["long_horizon"])[
        "TIS drifts after ~500 steps"] == "not reproduced"


# --- the FP8 KV cache arm ----------------------------------------------------------------------

def _fp8_rows(n, seed):
    """Per-step records of an FP8 KV arm: scale 1.0 at step 0, measured scales after it."""
    rows = _rows([0.1 + 0.01 * (i + seed) for i in range(n)], [2e-3 * seed] * n, [2.5] * n)
    for r in rows[:n]:
        i = r["step"]
        scale = 1.0 if i == 0 else 0.01 * (1 + i / n) * seed
        r.update(kl_fp8kv_k3=1e-4 * (1 + i % 2) * seed, w_frac_above_c=1e-3 * (1 + i % 3), kv_fill_max=0.3 + 0.01 * i,
                 kv_k_scale_min=scale, kv_k_scale_max=2 * scale, kv_v_scale_min=scale / 2, kv_v_scale_max=scale)
    return rows


def _write_runs(root, variant, rows_of_seed, settings):
    for seed in (1, 2):
        folder = root / variant / f"seed{seed}"
        folder.mkdir(parents=True)
        (folder / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows_of_seed(seed)) + "\n")
        (folder / "run.json").write_text(json.dumps({"seed": seed, "variant": variant, "settings": settings,
                                                     "cpu": {"model": "x", "isa": "avx2"}}))


def test_fp8_kv_statistics_by_hand():
    s = seed_statistics(_fp8_rows(10, 1), C)
    assert math.isclose(s["kl_fp8kv_mean"], statistics.fmean(1e-4 * (1 + i % 2) for i in range(10)))
    assert math.isclose(s["kv_fill_max"], 0.39)
    # step 0's initial scale 1.0 is not a measured one: the ranges start at step 1
    assert math.isclose(s["kv_k_scale_min"], 0.011) and math.isclose(s["kv_k_scale_max"], 2 * 0.019)
    assert math.isclose(s["kv_v_scale_min"], 0.0055) and math.isclose(s["kv_v_scale_max"], 0.019)
    summary = variant_summary({seed: seed_statistics(_fp8_rows(10, seed), C) for seed in (1, 2)})
    assert math.isclose(summary["kv_k_scale_min"], 0.011) and math.isclose(summary["kv_k_scale_max"], 2 * 0.038)
    plain = seed_statistics(_rows([0.1] * 4, [1e-3] * 4, [1.0] * 4), C)
    assert math.isnan(plain["kl_fp8kv_mean"]) and math.isnan(plain["kv_k_scale_min"])  # not logged, not invented


def test_fp8_kv_claims_follow_the_two_standard_error_rule():
    s = {"tis": _summary(0.60, 0.02), "tis_fp8kv": _summary(0.58, 0.02, kl_fp8kv_mean=1e-4),
         "acr_uaq": _summary(0.60, 0.02), "acr_uaq_fp8kv": _summary(0.50, 0.02, kl_fp8kv_mean=1e-4)}
    s["tis_fp8kv"]["kl_mean"] = 3e-3  # +1e-3 against 2 x 1.4e-4
    v = _verdicts(s)
    assert v["TIS holds the extra mismatch of an FP8 KV cache"] == \
        "held within seed noise (final accuracy); KL(behav‖prox) rises beyond seed noise"
    assert v["ACR + UAQ holds the extra mismatch of an FP8 KV cache"] == \
        "not held (final accuracy falls beyond seed noise)"  # -0.10 against 2 x 0.028


def test_an_added_arm_keeps_the_earlier_arms_their_figures_and_the_long_horizon(tmp_path):
    """Runs of the FP8 KV arms alone extend the report in --out: the earlier arms keep their numbers and
    claims, their figures are not redrawn without them, the long-horizon section stays as written."""
    settings = {"steps": 10, "weight_bits": 5, "lr": 1e-4, "prompts_per_step": 4, "group_size": 2,
                "mini_batches": 2, "is_cap": C}
    for variant, offset in (("tis", 0.0), ("acr_uaq", 0.02)):
        _write_runs(tmp_path / "runs", variant, lambda seed, o=offset: _rows(
            [o + 0.01 * (i + seed) for i in range(10)], [1e-3 * seed] * 10, [2.5] * 10), settings)
    long_runs = _write_long(tmp_path / "long", "tis", _rising, _improving)
    out = tmp_path / "out"
    main(["--runs", str(tmp_path / "runs"), "--out", str(out), "--long-runs", str(long_runs)])
    before = json.loads((out / "results.json").read_text())
    before_md = (out / "results.md").read_text()
    stamps = {f: (out / f).stat().st_mtime_ns for f in before["figures"]}

    for variant in ("tis_fp8kv", "acr_uaq_fp8kv"):
        _write_runs(tmp_path / "fp8", variant, lambda seed: _fp8_rows(10, seed), settings)
    main(["--runs", str(tmp_path / "fp8"), "--out", str(out), "--variants", "tis_fp8kv", "acr_uaq_fp8kv"])
    after = json.loads((out / "results.json").read_text())
    assert sorted(after["variants"]) == ["acr_uaq", "acr_uaq_fp8kv", "tis", "tis_fp8kv"]
    assert all(after["variants"][v] == before["variants"][v] for v in ("tis", "acr_uaq"))
    assert sorted(after["kept_arms"]) == ["acr_uaq", "tis"]
    assert all(c in after["claims"] for c in before["claims"])
    assert {c["claim"] for c in after["claims"]} - {c["claim"] for c in before["claims"]} == {
        "TIS holds the extra mismatch of an FP8 KV cache", "ACR + UAQ holds the extra mismatch of an FP8 KV cache"}
    assert after["long_horizon"] == before["long_horizon"]
    assert after["figures"] == before["figures"] + ["fp8_kv_cache.png"] and (out / "fp8_kv_cache.png").exists()
    assert all((out / f).stat().st_mtime_ns == t for f, t in stamps.items())
    md = (out / "results.md").read_text()
    long_part = before_md[before_md.index("## Long horizon"):]
    assert md.endswith(long_part) and md.count("## Long horizon") == 1
    fp8_table = md.split("## FP8 KV cache")[1].split("## Long horizon")[0]
    assert [line.split(" | ")[0] for line in fp8_table.splitlines() if line.startswith("| W5A8")] == [
        "| W5A8 + TIS", "| W5A8 + FP8 KV + TIS", "| W5A8 + ACR + UAQ", "| W5A8 + FP8 KV + ACR + UAQ"]
    assert "kept from the earlier report" in md.splitlines()[2]

    # a second pass finds the same report (the kept arms stay kept, with their CPU)
    main(["--runs", str(tmp_path / "fp8"), "--out", str(out), "--variants", "tis_fp8kv", "acr_uaq_fp8kv"])
    assert json.loads((out / "results.json").read_text()) == after and (out / "results.md").read_text() == md

    other = tmp_path / "other"
    _write_runs(other, "tis_fp8kv", lambda seed: _fp8_rows(12, seed), {**settings, "steps": 12})
    with pytest.raises(SystemExit, match="other settings"):
        main(["--runs", str(other), "--out", str(out), "--variants", "tis_fp8kv"])
