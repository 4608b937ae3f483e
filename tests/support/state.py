"""Exactly-once state's test parts: a counting processor, records, a shard held through a real
fence with the checkpointer its consumer would hand out, and a store's committed state read
around its cache."""

from __future__ import annotations

import functools
import importlib.util
import json
import sys
import uuid
from pathlib import Path
from types import ModuleType
from typing import Any

import sqlalchemy as sa

from kclpy.checkpoint import Checkpointer
from kclpy.leases import assignment
from kclpy.leases.fence import LeaseFence
from kclpy.leases.held import HeldSet
from kclpy.leases.table import LeaseTable
from kclpy.metrics import Metrics
from kclpy.processor import InitializeInput, ProcessRecordsInput
from kclpy.records import Record, Records
from kclpy.retrieval import modes
from kclpy.state.dynamodb import DynamoDBStateStore
from kclpy.state.processor import ExactlyOnceProcessor, StatefulProcessor
from kclpy.state.sql import SQLStateStore
from kclpy.state.store import StateStore
from kclpy.state.transaction import StateTransaction
from tests.support.determinism import Clock

FAILOVER = 10.0


class Counter(StatefulProcessor):
    """Counts records and sums their numeric payloads per key (``key:number``)."""

    def __init__(self, fail_once_at: int | None = None) -> None:
        self.applied = 0
        self.fail_once_at = fail_once_at

    def apply(self, record: Record, txn: StateTransaction) -> None:
        key, number = record.binary_data.decode().split(":")
        self.applied += 1
        if self.fail_once_at is not None and self.applied == self.fail_once_at:
            self.fail_once_at = None
            raise RuntimeError("crash in the middle of a batch")
        txn.update(f"count/{key}", lambda n: n + 1, 0)
        txn.update(f"sum/{key}", lambda n: n + int(number), 0)


class Ops(StatefulProcessor):
    """Each record one operation on ``k``: ``add:N``, ``set:N``, ``del`` or ``del-if:N``
    (delete when ``k`` is N)."""

    def apply(self, record: Record, txn: StateTransaction) -> None:
        op, _, number = record.binary_data.decode().partition(":")
        if op == "add":
            txn.update("k", lambda n: n + int(number), 0)
        elif op == "set":
            txn.put("k", int(number))
        elif op == "del" or txn.get("k") == int(number):
            txn.delete("k")


def rec(seq: int, data: str, sub: int = 0) -> Record:
    """Record ``seq`` (sub-sequence ``sub``) carrying ``data``."""
    return Record(str(seq), "pk", None, sub, data.encode())


class Shard:
    """One shard held through a real fence, and the checkpointer its consumer would hand out."""

    def __init__(self, table: LeaseTable, key: str, worker: str, clock: Clock,
                 failover: float = FAILOVER) -> None:
        self.held = HeldSet(worker, renewer_interval_s=failover / 2)
        self.fence = LeaseFence(table, self.held, failover_time_s=failover, clock=clock)
        current = table.get(key)
        assert current is not None
        fresh = table.take(current, worker)
        fresh.concurrency_token = uuid.uuid4().hex
        self.held.install(fresh, clock())
        self.key = key
        #: where the consumer would start: the lease's checkpoint when taken
        self.start = (fresh.checkpoint.sequence_number, fresh.checkpoint.sub_sequence_number)
        self.checkpointer = Checkpointer(key, self.fence, fresh.concurrency_token,
                                         fresh.checkpoint)

    def deliver(self, processor: ExactlyOnceProcessor, records: list[Record]) -> None:
        self.checkpointer.mark_delivered(records[-1])
        processor.process_records(
            ProcessRecordsInput(self.key, Records([records]), self.checkpointer, None))


@functools.cache
@functools.cache
def toy_extensions() -> ModuleType:
    """examples/toy_extensions.py, imported once per process, for its ``toy://`` store (one
    of every store test's stores, run through the same cases as the package's own).
    Importing it registers a retrieval mode and an assignment strategy as well; those are
    taken out again, since tests that list the known names run in the same process."""
    path = Path(__file__).resolve().parents[2] / "examples" / "toy_extensions.py"
    spec = importlib.util.spec_from_file_location("toy_extensions", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["toy_extensions"] = module
    registries: list[dict[str, Any]] = [modes._MODES, modes._NAMES, assignment._STRATEGIES]
    before = [dict(registry) for registry in registries]
    spec.loader.exec_module(module)
    for registry, kept in zip(registries, before, strict=True):
        registry.clear()
        registry.update(kept)
    return module


def stored_state(store: StateStore) -> dict[str, Any]:
    """Every committed key and value, read around the store's cache."""
    if isinstance(store, toy_extensions().DictStateStore):
        return {key: held.value for key, held in store.table.items()}
    if isinstance(store, SQLStateStore):
        with store.engine.connect() as conn:
            rows = conn.execute(sa.select(store.state.c.state_key, store.state.c.state_value))
            return {key: json.loads(value) for key, value in rows}
    assert isinstance(store, DynamoDBStateStore)
    items = store.table.client.scan(TableName=store.table_name, ConsistentRead=True)["Items"]
    return {item["stateKey"]["S"]: json.loads(item["stateValue"]["S"]) for item in items}


def runner(store: StateStore, processor: StatefulProcessor | None = None,
           **kwargs: Any) -> ExactlyOnceProcessor:
    """``processor`` (a Counter by default) on ``store``, initialised for s1 at ``start``."""
    metrics = kwargs.pop("metrics", Metrics())
    start = kwargs.pop("start", ("TRIM_HORIZON", 0))
    adapter = ExactlyOnceProcessor(processor or Counter(), store, metrics=metrics, **kwargs)
    adapter.initialize(InitializeInput("s1", *start))
    return adapter
