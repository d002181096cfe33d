"""Mooncake's `mooncake.engine`, over kvxfer (`kvxfer.mooncake`)."""

from kvxfer.mooncake import TransferEngine, TransferOpcode  # noqa: F401

__all__ = ["TransferEngine", "TransferOpcode"]
