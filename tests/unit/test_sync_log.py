"""The per-sync console line: its text from a sync's report, and that it shows at INFO while verl holds
the root logger at WARNING, once per step, from replica 0's leader only."""
from __future__ import annotations

import logging

import pytest

from qurl_verl.rollout.sync_log import SYNC_LOGGER_NAME, sync_logger, sync_summary

STATS = {
    "sync": 3, "format": "int8", "total_s": 1.234, "bytes_in": 4_100_000_000, "tensors_in": 291, "quantized": 196,
    "quantized_frac": 0.987, "changed_code_frac": 0.0081, "rss_mb": 5120.0, "ranks": 2,
}


def test_the_summary_names_time_bytes_quantized_share_and_changed_codes():
    assert sync_summary(STATS, 7) == (
        "sync step 7: 1.23 s, 4.10 GB received, 196/291 tensors quantized (98.7% of elements), 0.81% of codes changed"
    )


def test_the_summary_leaves_out_what_the_sync_did_not_report():
    small = {"total_s": 0.05, "bytes_in": 2_500_000, "tensors_in": 12, "quantized": 0, "quantized_frac": None,
             "changed_code_frac": None}
    assert sync_summary(small, None) == "sync step ?: 0.05 s, 2.5 MB received, 0/12 tensors quantized"


class Collected(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


@pytest.fixture
def root_at_warning():
    """verl's logging: the root logger at WARNING (``verl/__init__.py``)."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.WARNING)
    yield root
    root.setLevel(level)


def adapter(replica_rank: int, rollout_rank: int):
    pytest.importorskip("verl")
    from qurl_verl.rollout.adapter import QurlServerAdapter

    made = QurlServerAdapter.__new__(QurlServerAdapter)  # no engine: only the ranks log_sync reads
    made.replica_rank, made.rollout_rank = replica_rank, rollout_rank
    return made


def test_one_info_line_per_step_from_replica_0s_leader_while_root_is_at_warning(root_at_warning, caplog):
    logger = sync_logger()
    assert sync_logger() is logger and sum(h.get_name() == "qurl_verl.sync.console" for h in logger.handlers) == 1
    collected = Collected()
    logger.addHandler(collected)
    try:
        with caplog.at_level(logging.WARNING):  # caplog's handler sits on the root logger
            adapter(0, 0).log_sync(STATS, 5, report=False)  # the first of a step's two syncs (LoRA): nothing yet
            adapter(0, 0).log_sync(STATS, 5, report=True)
            adapter(1, 0).log_sync(STATS, 5, report=True)  # another replica
            adapter(0, 1).log_sync(STATS, 5, report=True)  # another rank of replica 0
    finally:
        logger.removeHandler(collected)
    assert [(r.levelno, r.getMessage()) for r in collected.records] == [(logging.INFO, sync_summary(STATS, 5))]
    assert logging.getLogger().level == logging.WARNING and not logger.propagate
    assert not [r for r in caplog.records if r.name == SYNC_LOGGER_NAME]  # the root logger's handlers never see it


def test_the_whole_report_is_at_debug_on_the_package_logger(caplog):
    with caplog.at_level(logging.DEBUG, logger="qurl_verl"):
        adapter(1, 0).log_sync(STATS, 5, report=True)
    assert [r.levelno for r in caplog.records if r.name == "qurl_verl"] == [logging.DEBUG]
    assert "'rss_mb': 5120.0" in caplog.records[0].getMessage()
