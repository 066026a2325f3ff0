"""Where fp4fuse's log lines go when the user asks for a level and has not configured logging.

Python's ``logging`` shows nothing below WARNING until the application configures it, so
``FusionConfig(log_level="INFO")`` on its own would print nothing. :func:`apply_log_level` sets
the level of the ``fp4fuse`` logger and attaches one :class:`UnconfiguredStderrHandler` to it:

* once per process: a second call only changes the level;
* only when a level is asked for: without one, fp4fuse leaves logging configuration alone;
* never a line twice: the handler writes only while the root logger has no handlers. Once the
  application configures logging (``logging.basicConfig``, pytest, a serving engine), fp4fuse's
  records reach the application's handlers by propagation and this handler stays silent.

It writes to ``sys.stderr`` as it is when a record is emitted (as ``logging.lastResort`` does), so
redirections and captures made after the handler was attached see the lines.
"""
from __future__ import annotations

import logging
import sys

__all__ = ["PACKAGE_LOGGER", "UnconfiguredStderrHandler", "apply_log_level"]

PACKAGE_LOGGER = "fp4fuse"


class UnconfiguredStderrHandler(logging.Handler):
    """Writes records to the current ``sys.stderr`` while the root logger has no handlers."""

    FORMAT = "%(levelname)s %(name)s: %(message)s"

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter(self.FORMAT))

    def filter(self, record: logging.LogRecord) -> bool:
        return not logging.getLogger().handlers and super().filter(record)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(self.format(record) + "\n")
            sys.stderr.flush()
        except Exception:  # noqa: BLE001 - logging's contract: report, never raise
            self.handleError(record)


def apply_log_level(level: int) -> None:
    """Give the ``fp4fuse`` logger ``level`` and make sure its records reach the user (see the
    module docstring)."""
    logger = logging.getLogger(PACKAGE_LOGGER)
    logger.setLevel(level)
    if not any(isinstance(h, UnconfiguredStderrHandler) for h in logger.handlers):
        logger.addHandler(UnconfiguredStderrHandler())
