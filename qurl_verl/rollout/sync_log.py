"""One console line per weight sync, shown by default.

The summary goes to ``qurl_verl.sync``, a logger with a console handler of its own (``console_log``: verl sets the
root logger to WARNING, which would hide INFO records). Silence it with
``logging.getLogger("qurl_verl.sync").setLevel(logging.WARNING)``; the full report stays at DEBUG on
``qurl_verl``.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping

from qurl_verl.rollout.console_log import console_logger

SYNC_LOGGER_NAME = "qurl_verl.sync"


def sync_logger() -> logging.Logger:
    """``qurl_verl.sync`` with its console handler, set up on the first call only (a level the user set is kept)."""
    return console_logger(SYNC_LOGGER_NAME, logging.INFO)


def _size(num_bytes: float) -> str:
    return f"{num_bytes / 1e9:.2f} GB" if num_bytes >= 1e9 else f"{num_bytes / 1e6:.1f} MB"


def _percent(fraction: float) -> str:
    return f"{100 * fraction:.3g}%"


def sync_summary(stats: Mapping, global_steps=None) -> str:
    """One line from a sync's report (``sync_stats.combine_ranks`` row): time, bytes received, tensors
    quantized and their share of the elements, and the share of 8-bit codes that changed when tracked."""
    parts = [f"sync step {global_steps if global_steps is not None else '?'}:"]
    total_s = stats.get("total_s")
    parts.append(f"{total_s:.2f} s," if total_s is not None else "? s,")
    parts.append(f"{_size(stats.get('bytes_in') or 0)} received,")
    tensors = f"{stats.get('quantized') or 0}/{stats.get('tensors_in') or 0} tensors quantized"
    if stats.get("quantized_frac") is not None:
        tensors += f" ({_percent(stats['quantized_frac'])} of elements)"
    parts.append(tensors)
    if stats.get("changed_code_frac") is not None:
        parts[-1] += ","
        parts.append(f"{_percent(stats['changed_code_frac'])} of codes changed")
    return " ".join(parts)


def log_sync_summary(stats: Mapping, global_steps=None) -> None:
    """Emit ``sync_summary`` at INFO on ``qurl_verl.sync`` (shown whatever the root logger's level)."""
    sync_logger().info("%s", sync_summary(stats, global_steps))
