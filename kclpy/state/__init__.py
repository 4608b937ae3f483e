"""Exactly-once state: a processor's state changes committed with its checkpoint, fenced by
the lease.

A ``StatefulProcessor`` applies one record at a time to a ``StateTransaction``; kclpy ends
transactions (after each batch, or at most N records or T seconds) and commits the staged
state together with the checkpoint of the last record covered, in one write fenced by the
lease (``processor.py`` runs it; a store - ``dynamodb.py`` or ``sql.py`` - persists it).
Records after the last commit are read again after a failover, but their effects were never
committed, so each record's effect on the state is applied exactly once.
"""

from __future__ import annotations

from kclpy.errors import ConfigError
from kclpy.state.store import StateStore


def open_store(spec: str) -> StateStore:
    """The store ``spec`` names (the ``state_store`` option): a SQLAlchemy URL when it has a
    scheme, a DynamoDB table name otherwise."""
    if "://" in spec:
        try:
            from kclpy.state.sql import SQLStateStore
        except ImportError as exc:
            raise ConfigError("--state-store", "a SQL state store needs SQLAlchemy: "
                              "pip install 'kinesis-kclpy[sql]'") from exc
        try:
            return SQLStateStore(spec)
        except Exception as exc:
            raise ConfigError("--state-store", f"not a usable database URL ({type(exc).__name__})"
                              ) from None
    from kclpy.state.dynamodb import DynamoDBStateStore

    return DynamoDBStateStore(spec)
