"""Loggers whose lines reach the console whatever the root logger says.

verl sets the root logger to WARNING (``verl/__init__.py``), and vLLM's serving entry points import
``model_hosting_container_standards``, which sets the root logger and its handlers to ERROR at import
(``logging_config.configure_root_logger``, unless ``SAGEMAKER_CONTAINER_LOG_LEVEL``/``LOG_LEVEL`` say otherwise): in a
rollout server process a warning of a logger that propagates to the root is dropped. What qurl must show there
goes to a child logger of ``qurl_verl`` with a stderr handler of its own and ``propagate=False``; the root logger,
verl's logging and the rest of ``qurl_verl`` are left as they are.

* ``qurl_verl.sync``: one line per weight sync (INFO; ``sync_log``);
* ``qurl_verl.engine``: what a rollout server decided about its engine before it started (WARNING: the model
  runner, the kernel environment).

Silence one with ``logging.getLogger(name).setLevel(...)``: a level the user set is kept.
"""
from __future__ import annotations

import logging
import sys

ENGINE_LOGGER_NAME = "qurl_verl.engine"


def console_logger(name: str, level: int) -> logging.Logger:
    """``name`` with its console handler, set up on the first call only."""
    logger = logging.getLogger(name)
    handler_name = f"{name}.console"
    if not any(h.get_name() == handler_name for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.set_name(handler_name)
        handler.setFormatter(logging.Formatter("[qurl] %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
        if logger.level == logging.NOTSET:
            logger.setLevel(level)
    return logger


def engine_logger() -> logging.Logger:
    return console_logger(ENGINE_LOGGER_NAME, logging.WARNING)
