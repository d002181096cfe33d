"""NIXL's `nixl.logging`: loggers under the `nixl` name, the level from
`NIXL_LOG_LEVEL`."""

import logging
import os

_LEVELS = {"TRACE": logging.DEBUG, "DEBUG": logging.DEBUG, "INFO": logging.INFO,
           "WARN": logging.WARNING, "WARNING": logging.WARNING, "ERROR": logging.ERROR,
           "FATAL": logging.CRITICAL}


def set_log_level_by_env(logger=None):
    """Sets the `nixl` logger's level from `NIXL_LOG_LEVEL` (default WARN)."""
    level = _LEVELS.get(os.environ.get("NIXL_LOG_LEVEL", "WARN").upper(), logging.WARNING)
    (logger or logging.getLogger("nixl")).setLevel(level)


def setup_logging():
    """Gives the `nixl` logger its level (the application owns handlers)."""
    set_log_level_by_env()


def get_logger(name):
    """A logger under `nixl`."""
    return logging.getLogger(name if name.startswith("nixl") else f"nixl.{name}")
