"""Forwarding of ggml/llama log lines to the `retro.native` logger.

The native log callback only queues lines (it may run on a worker thread that must never wait for
the GIL); every binding call drains the queue afterwards, on the caller's thread."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from . import _native

logger = logging.getLogger("retro.native")

# ggml_log_level: NONE 0, DEBUG 1, INFO 2, WARN 3, ERROR 4, CONT 5
_LEVELS = {0: logging.INFO, 1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR}

P = ParamSpec("P")
R = TypeVar("R")


def drain() -> None:
    for level, line in _native.drain_logs():
        logger.log(_LEVELS.get(level, logging.INFO), "%s", line)


def recent_errors() -> list[str]:
    """The last warning and error lines the native library logged (kept for diagnostics)."""
    return list(_native.recent_errors())


def forwarding(fn: Callable[P, R]) -> Callable[P, R]:
    """Drain the native log queue after `fn`, whether it returned or raised."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        finally:
            drain()

    return wrapper
