"""The colocate_async study's summary (qurl_recipes.study_async_verl) against numbers computed here with
``statistics``: metrics.jsonl files with known values, in the format verl's file logger writes."""
from __future__ import annotations

import json
import math
import statistics

import pytest

from qurl_recipes import study_async_verl as study

STEPS = 5
# per (preset, seed): the value of each KL at every step; the staleness of each step as colocate_async gives
# it on the tiny recipe (both batches in flight are generated together, then the second is trained a step later)
STALENESS = [0, 1, 0, 1, 0]
KL = {("bf16", 1): [1e-3, 2e-2, 3e-2, 1e-2, 2e-2], ("bf16", 2): [2e-3, 1e-2, 1e-2, 3e-2, 2e-2],
      ("int8", 1): [4e-3, 5e-2, 4e-2, 6e-2, 5e-2], ("int8", 2): [3e-3, 3e-2, 4e-2, 5e-2, 6e-2]}
REWARD = [0.1, 0.2, 0.3, 0.4, 0.5]


def row(step: int, preset: str, seed: int, staleness: int | None = None) -> dict:
    """One line of verl's file logger: {"step": n, "data": {...}}; qurl's keys only under the qurl loss."""
    i = step - 1
    s = STALENESS[i] if staleness is None else staleness
    kl = KL[(preset, seed)][i]
    data = {"timing_s/step": 10.0 if step == 1 else 0.5 + 0.1 * seed, "critic/score/mean": REWARD[i] + 0.01 * seed,
            "training/off_policy/trajectory_staleness/mean": float(s),
            "training/off_policy/trajectory_staleness/max": s, "training/off_policy/trajectory_staleness/min": s,
            "rollout_corr/kl": kl, "rollout_corr/k3_kl": 2 * kl, "training/global_step": step}
    if preset == "int8":
        data |= {"actor/qurl/kl_behav_prox_k3": 3 * kl, "actor/qurl/w_frac_above_c": 0.1 * s}
    return {"step": step, "data": data}


def write_run(root, preset: str, seed: int, steps=range(1, STEPS + 1), staleness=None, prompts=None) -> None:
    folder = root / preset / f"seed{seed}"
    folder.mkdir(parents=True)
    lines = [row(s, preset, seed, None if staleness is None else staleness[s - 1]) for s in steps]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    (folder / "wall_s").write_text(f"{60 + seed}\n")
    if prompts is not None:  # verl's rollout dump: one JSON line per response
        (folder / "rollouts").mkdir()
        for s in steps:
            text = "".join(json.dumps({"input": p, "output": "x", "score": 0.0, "step": s}) + "\n"
                           for p in prompts(s) for _ in range(2))
            (folder / "rollouts" / f"{s}.jsonl").write_text(text)


def se(values: list[float]) -> float:
    return statistics.stdev(values) / math.sqrt(len(values))


@pytest.fixture
def root(tmp_path):
    for preset in ("bf16", "int8"):
        for seed in (1, 2):
            write_run(tmp_path, preset, seed, prompts=lambda s, seed=seed: [f"q{seed}-{s}-{k}" for k in range(3)])
    return tmp_path


def test_mean_and_standard_error_of_the_staleness_split(root):
    res = study.summarize(root, ["bf16", "int8"], [1, 2], STEPS)
    for preset in ("bf16", "int8"):
        s = res["summary"][preset]
        fresh = [statistics.fmean(KL[(preset, seed)][i] for i in (0, 2, 4)) for seed in (1, 2)]
        stale = [statistics.fmean(KL[(preset, seed)][i] for i in (1, 3)) for seed in (1, 2)]
        assert s["rollout_corr_kl_stale0"] == pytest.approx(statistics.fmean(fresh))
        assert s["rollout_corr_kl_stale0_se"] == pytest.approx(se(fresh))
        assert s["rollout_corr_kl_stale1"] == pytest.approx(statistics.fmean(stale))
        assert s["rollout_corr_kl_stale1_se"] == pytest.approx(se(stale))
        assert s["rollout_corr_k3_kl_stale1"] == pytest.approx(2 * statistics.fmean(stale))
        gains = [b - a for a, b in zip(fresh, stale, strict=True)]
        assert s["rollout_corr_kl_stale_gain"] == pytest.approx(statistics.fmean(gains))
        assert s["rollout_corr_kl_stale_gain_se"] == pytest.approx(se(gains))
        assert s["staleness_mean"] == pytest.approx(statistics.fmean(STALENESS))
        assert s["staleness_max"] == 1
        # the reward window is a tenth of the run, at least one step; step 1 (warm-up) apart from the rest
        assert s["reward_first"] == pytest.approx(statistics.fmean([REWARD[0] + 0.01, REWARD[0] + 0.02]))
        assert s["reward_last"] == pytest.approx(statistics.fmean([REWARD[-1] + 0.01, REWARD[-1] + 0.02]))
        assert s["first_step_s"] == 10.0 and s["step_s"] == pytest.approx(0.65)
        assert s["step_s_se"] == pytest.approx(se([0.6, 0.7]))
        assert s["wall_s"] == pytest.approx(61.5)
    int8 = res["summary"]["int8"]
    assert int8["qurl_kl_k3_stale1"] == pytest.approx(3 * statistics.fmean(
        statistics.fmean(KL[("int8", seed)][i] for i in (1, 3)) for seed in (1, 2)))
    assert int8["qurl_w_frac_above_c_stale0"] == 0 and int8["qurl_w_frac_above_c_stale1"] == pytest.approx(0.1)
    assert math.isnan(res["summary"]["bf16"]["qurl_kl_k3_stale1"])  # bf16 has no qurl loss


def test_int8_minus_bf16_at_staleness_one(root):
    res = study.summarize(root, ["bf16", "int8"], [1, 2], STEPS)
    stale = {p: [statistics.fmean(KL[(p, seed)][i] for i in (1, 3)) for seed in (1, 2)] for p in ("bf16", "int8")}
    d = res["int8_minus_bf16"]["rollout_corr_kl_stale1"]
    assert d["diff"] == pytest.approx(statistics.fmean(stale["int8"]) - statistics.fmean(stale["bf16"]))
    assert d["se"] == pytest.approx(math.hypot(se(stale["int8"]), se(stale["bf16"])))
    assert d["beyond_noise"] == (abs(d["diff"]) > 2 * d["se"])


def test_steps_are_split_by_verls_staleness_not_by_position(tmp_path):
    write_run(tmp_path, "bf16", 1, staleness=[1, 0, 1, 0, 2])
    stats = study.run_statistics(study.read_run(tmp_path / "bf16" / "seed1", STEPS))
    kl = KL[("bf16", 1)]
    assert stats["steps_stale0"] == 2 and stats["steps_stale1"] == 3
    assert stats["rollout_corr_kl_stale0"] == pytest.approx(statistics.fmean([kl[1], kl[3]]))
    assert stats["rollout_corr_kl_stale1"] == pytest.approx(statistics.fmean([kl[0], kl[2], kl[4]]))
    assert stats["staleness_max"] == 2
    assert stats["by_step"]["staleness"] == [1, 0, 1, 0, 2] and stats["by_step"]["rollout_corr_kl"] == kl
    assert "qurl_kl_k3" not in stats["by_step"]  # bf16 logs no qurl loss


def test_a_run_with_missing_steps_is_refused(tmp_path, capsys):
    write_run(tmp_path, "bf16", 1, steps=range(1, 4))
    with pytest.raises(ValueError, match=r"3 of 5 steps logged, missing steps \[4, 5\]"):
        study.read_run(tmp_path / "bf16" / "seed1", STEPS)
    assert study.main(["--complete", str(tmp_path / "bf16" / "seed1"), "--steps", str(STEPS)]) == 1
    assert "missing steps [4, 5]" in capsys.readouterr().err
    assert study.main(["--complete", str(tmp_path / "bf16" / "seed1"), "--steps", "3"]) == 0
    # the summary names the run that is short instead of averaging it with the others
    write_run(tmp_path, "bf16", 2)
    assert study.main(["--root", str(tmp_path), "--presets", "bf16", "--seeds", "1", "2", "--steps", str(STEPS),
                       "--out-dir", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "seed1/metrics.jsonl" in err and "missing steps" in err
    assert not (tmp_path / "out").exists()


def test_data_order_from_the_rollout_dumps(root):
    order = study.summarize(root, ["bf16", "int8"], [1, 2], STEPS)["data_order"]
    assert order["seed 1: bf16 vs int8"] == {"same_steps": STEPS, "shared_prompts": 1.0}
    assert order["bf16: seed 1 vs 2"] == {"same_steps": 0, "shared_prompts": 0.0}


def test_the_same_prompt_stream_cut_into_steps_differently(tmp_path):
    """colocate_async trains a step on the groups that finish first: the same stream, other step boundaries."""
    write_run(tmp_path, "bf16", 1, prompts=lambda s: [f"q{s}-{k}" for k in range(2)])
    swapped = {1: ["q1-0", "q2-1"], 2: ["q2-0", "q1-1"], 5: ["q5-0", "q6-1"]}
    write_run(tmp_path, "int8", 1, prompts=lambda s: swapped.get(s, [f"q{s}-{k}" for k in range(2)]))
    write_run(tmp_path, "bf16", 2, prompts=lambda s: [f"q{s}-0", f"r{s}"])
    order = study.data_order({p: {s: study.prompts_by_step(tmp_path / p / f"seed{s}", STEPS)
                                  for s in (1, 2) if (tmp_path / p / f"seed{s}").exists()} for p in ("bf16", "int8")})
    # int8: q1-1 and q2-1 trade steps (the stream is the same), and the last step has q6-1 for q5-1
    assert order["seed 1: bf16 vs int8"] == {"same_steps": 2, "shared_prompts": pytest.approx(9 / 10)}
    assert order["bf16: seed 1 vs 2"] == {"same_steps": 0, "shared_prompts": pytest.approx(5 / 10)}
    assert "seed 2: bf16 vs int8" not in order  # no int8 run of seed 2 to compare with


def test_files_written(root):
    out = root / "summary"
    assert study.main(["--root", str(root), "--steps", str(STEPS), "--out-dir", str(out)]) == 0
    res = json.loads((out / "verl_colocate_async.json").read_text())  # strict JSON: NaN written as null
    assert res["summary"]["bf16"]["qurl_kl_k3_stale1"] is None
    assert res["cpu"]["model"] and res["versions"]["verl"]
    md = (out / "verl_colocate_async.md").read_text()
    assert "| steps at staleness 0 / ≥ 1 | 3 / 2 | 3 / 2 |" in md
    assert res["cpu"]["class"] in md and f"- seed 1: bf16 vs int8: {STEPS} of {STEPS} steps, 100% of the prompts" in md
