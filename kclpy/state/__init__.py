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

from collections.abc import Callable

from kclpy.errors import ConfigError
from kclpy.state.store import StateStore

#: makes the store a ``state_store`` spec names, given the spec
StoreFactory = Callable[[str], StateStore]

#: the stores chosen by a spec's URL scheme (its base, before any ``+driver``); a spec
#: without a scheme names a DynamoDB table, and any other scheme is SQLAlchemy's to open
_STORES: dict[str, StoreFactory] = {}


def register_store(scheme: str, factory: StoreFactory) -> None:
    """Open ``state_store`` specs of ``scheme://...`` with ``factory(spec)``: a store of
    one's own (a ``StateStore``) joins the worker, ``kclpy checkpoint set --state-store``
    and every other user of :func:`open_store` this way (a scheme SQLAlchemy also knows is
    then the registered store's)."""
    base = scheme.lower()
    if not base.isidentifier():
        raise ValueError(f"{scheme!r} is not a URL scheme")
    _STORES[base] = factory


def open_store(spec: str) -> StateStore:
    """The store ``spec`` names (the ``state_store`` option): one registered for its URL
    scheme (:func:`register_store`), else a SQLAlchemy URL when it has a scheme, a DynamoDB
    table name when it has none."""
    scheme, _, _ = spec.partition("://")
    if spec != scheme:
        factory = _STORES.get(scheme.split("+", 1)[0].lower())
        if factory is not None:
            return factory(spec)
        return _sql_store(spec)
    from kclpy.state.dynamodb import DynamoDBStateStore

    return DynamoDBStateStore(spec)


def _sql_store(spec: str) -> StateStore:
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
