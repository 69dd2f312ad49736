"""End-of-run summary: training rows only, first and last values as logged."""
from __future__ import annotations

import json

import pytest

from qurl_recipes.run_summary import read_metrics, summarize


def test_validation_only_row_is_not_a_step(tmp_path):
    rows = [{"step": 0, "data": {"val-core/x/acc/mean@1": 0.4}}]
    rows += [{"step": s, "data": {"timing_s/step": 1.0 + s, "critic/score/mean": 0.1 * s}} for s in (1, 2, 3)]
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    s = summarize(read_metrics(path))
    assert s["steps"] == 3
    assert s["reward_first"] == pytest.approx(0.1) and s["reward_last"] == pytest.approx(0.3)
    assert s["step_s_first"] == 2.0 and s["step_s_last"] == 4.0
    assert s["grad_norm_first"] is None


def test_no_training_row_is_an_error():
    with pytest.raises(ValueError, match="no training steps"):
        summarize([{"step": 0, "val-core/x/acc/mean@1": 0.4}])
