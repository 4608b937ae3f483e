"""A retrieval mode, a state store and a lease assignment strategy of one's own, joined
from outside the package.

All three go through kclpy's public registries only: ``kclpy.register_retrieval_mode``
makes ``counting`` a value of ``retrieval_mode`` (``--retrieval-mode``),
``kclpy.register_store`` makes ``toy://NAME`` a value of ``state_store`` (``--state-store``),
and ``kclpy.register_assignment_strategy`` makes ``sticky`` a value of ``lease_assignment``
(``--lease-assignment``). The mode polls like the built-in one and notes every record it
hands over; the store keeps the state in a dict, committed only once the lease's fenced
checkpoint write succeeded, so a worker that lost the lease changes nothing; the strategy
never moves a lease a live worker holds (free leases are still spread by count). Run it to
see a worker read a small stream on the embedded local endpoint (the ``local`` extra)
through all three:

    python examples/toy_extensions.py

It exits 0 once every record was handed over by the toy mode and applied once in the toy
store, and the worker's taker asked the toy strategy, and 1 (saying what is missing)
otherwise. With the module imported first (its registrations run on import), the same works
from the command line: ``kclpy-worker --local --retrieval-mode counting --state-store
toy://counts --lease-assignment sticky ...`` needs a processor module that imports this one.
"""

from __future__ import annotations

import sys
import threading
import uuid
from collections.abc import Sequence
from typing import Any

import boto3

import kclpy

# -- (a) a retrieval mode --------------------------------------------------------------------


class CountingSource:
    """Polling's pages, each record's sequence number noted before the pipeline gets it."""

    def __init__(self, inner: kclpy.PageSource, handed: dict[str, list[str]],
                 lock: threading.Lock) -> None:
        self._inner = inner
        self.address = inner.address
        self._handed = handed
        self._lock = lock
        self.pages = 0

    @property
    def idle_s(self) -> float:
        return self._inner.idle_s

    def read(self, reading: Any) -> Any:
        page = self._inner.read(reading)
        with self._lock:
            self.pages += 1
            self._handed.setdefault(self.address.shard_id, []).extend(
                record.sequence_number for record in page.records)
        return page

    def close(self) -> None:
        self._inner.close()

    def status(self) -> dict[str, Any]:
        """Shown in ``/status``: this mode's name, and how many pages it handed over."""
        return {**self._inner.status(), "mode": CountingMode.name, "pages": self.pages}


class CountingMode:
    """``retrieval_mode="counting"``: polling, with every record handed over noted in
    ``handed`` (shard id -> sequence numbers, in order: a sequence number is unique only
    within its shard)."""

    name = "counting"
    aliases: tuple[str, ...] = ()
    needs_consumer = False

    def __init__(self) -> None:
        self.handed: dict[str, list[str]] = {}
        self._lock = threading.Lock()

    def source(self, context: kclpy.RetrievalContext) -> kclpy.PageSource:
        polling = kclpy.retrieval_mode("polling").source(context)
        return CountingSource(polling, self.handed, self._lock)


COUNTING = CountingMode()
kclpy.register_retrieval_mode(COUNTING)

# -- (b) a state store -----------------------------------------------------------------------


class DictStateStore:
    """State in a dict shared by every store opened on the same ``toy://NAME``, as the
    workers of one application share a table. A commit checks every key is still at the
    version (and incarnation) it was read at (else ``TransactionRejected``: another shard
    changed it), then writes the checkpoint through the lease's fence (which raises
    ``ShutdownException`` for a worker that lost the lease), and only then applies the
    writes, all under one lock: nobody sees or changes the dict between the check and the
    apply. Each store keeps what it read and committed, as a worker's store caches (a
    stale entry is what the version check catches); ``forget`` drops entries. The lease
    item's checkpoint is the store's position (``keeps_position`` False), so it keeps none
    of its own."""

    limits = kclpy.StateLimits(items=1000, bytes=4_000_000)
    keeps_position = False

    def __init__(self, table: dict[str, kclpy.Versioned], lock: threading.Lock) -> None:
        self.table = table
        self._lock = lock
        self._cache: dict[str, kclpy.Versioned] = {}

    def open(self, dynamodb: Any) -> None:
        """Nothing to create."""

    def begin_tenure(self, writer: Any, lease_key: str, token: str) -> None:
        """Nothing to claim: the fence on the lease item guards every commit."""
        return None

    def read(self, key: str) -> kclpy.Versioned:
        cached = self._cache.get(key)
        if cached is None:
            with self._lock:
                held = self.table.get(key)
            cached = self._cache[key] = kclpy.Versioned(None, 0) if held is None else held
        return kclpy.Versioned(cached.value, cached.version, cached.incarnation)

    def commit(self, writer: Any, lease_key: str, token: str, position: Any,
               txn: kclpy.StateTransaction, gap: Any = None) -> None:
        """``writer`` is the gap's when ``gap`` is set: its checkpoint moves instead."""
        if txn.outgoing:
            raise ValueError("the dict store takes no outgoing writes")
        with self._lock:
            for key, version in txn.versions.items():
                held = self.table.get(key)
                if (held.version if held else 0) != version or (
                        held is not None and held.incarnation != txn.incarnations[key]):
                    raise kclpy.TransactionRejected(f"{key} changed since it was read", [])
            writer.update_checkpoint(lease_key, token, position)
            for key, value in txn.writes.items():
                if value is kclpy.STATE_DELETED:
                    self.table.pop(key, None)
                    self._cache[key] = kclpy.Versioned(None, 0)
                else:
                    self.table[key] = self._cache[key] = kclpy.Versioned(
                        value, txn.versions[key] + 1, txn.incarnations[key])

    def durable_position(self, writer: Any, lease_key: str, token: str,
                         gap: Any) -> Any:
        """The lease item's checkpoint (or its gap's), which every commit writes."""
        return writer.durable_checkpoint(lease_key, token)

    def gap_position(self, lease_key: str, gap: Any) -> None:
        return None

    def forget(self, keys: Sequence[str]) -> None:
        for key in keys:
            self._cache.pop(key, None)


#: toy://NAME -> that store's dict and lock
TABLES: dict[str, tuple[dict[str, kclpy.Versioned], threading.Lock]] = {}


def open_dict_store(spec: str) -> DictStateStore:
    table, lock = TABLES.setdefault(spec, ({}, threading.Lock()))
    return DictStateStore(table, lock)


kclpy.register_store("toy", open_dict_store)

# -- (c) a lease assignment strategy --------------------------------------------------------


class StickyAssignment:
    """``lease_assignment="sticky"``: a lease stays with the live worker that holds it - no
    steals, no leader moves - for processors that keep a shard's state warm in memory and
    would rather run unevenly than rebuild it. Free and expired leases are still taken (or
    assigned by a leader) by count, as under every strategy. ``asked`` counts how often each
    decider asked it."""

    name = "sticky"
    uses_load = False

    def __init__(self) -> None:
        self.asked = {"taker": 0, "leader": 0}

    def steals(self, view: kclpy.TakerView) -> list[Any]:
        self.asked["taker"] += 1
        return []

    def moves(self, view: kclpy.FleetView) -> list[tuple[Any, str]]:
        self.asked["leader"] += 1
        return []

    def balance_interval_s(self, settings: Any) -> float | None:
        return None


STICKY = StickyAssignment()
kclpy.register_assignment_strategy(STICKY)

# -- all three, in a worker ------------------------------------------------------------------


class Seen(kclpy.StatefulProcessor):
    """Counts each record by its partition key (one per record here): a value of 1 is a
    record applied once."""

    def apply(self, record: kclpy.Record, txn: kclpy.StateTransaction) -> None:
        txn.update(f"seen/{record.partition_key}", lambda n: n + 1, 0)


def run(records: int = 40, shards: int = 2) -> list[str]:
    """Write ``records`` to a new stream on the embedded endpoint, consume it with a worker
    through the toy mode into the toy store, its leases spread by the toy strategy, and
    return what went wrong (nothing: [])."""
    from kclpy.local import start_embedded

    name = f"toy-{uuid.uuid4().hex[:8]}"
    session = boto3.session.Session(aws_access_key_id="toy", aws_secret_access_key="toy",
                                    region_name="us-east-1")
    with start_embedded() as endpoint:
        kinesis = session.client("kinesis", endpoint_url=endpoint.url)
        kinesis.create_stream(StreamName=name, ShardCount=shards)
        kinesis.get_waiter("stream_exists").wait(
            StreamName=name, WaiterConfig={"Delay": 1, "MaxAttempts": 30})
        written = {}
        for n in range(records):
            put = kinesis.put_record(StreamName=name, Data=f"{n}".encode(), PartitionKey=f"k{n}")
            written[f"k{n}"] = (put["ShardId"], put["SequenceNumber"])
        config = kclpy.KCLConfig(
            stream_name=name, application_name=name, region="us-east-1",
            kinesis_endpoint=endpoint.url, dynamodb_endpoint=endpoint.url,
            initial_position="TRIM_HORIZON", retrieval_mode=COUNTING.name,
            state_store=f"toy://{name}", lease_assignment=STICKY.name,
            idle_time_between_reads_ms=100,
            stop_when_caught_up=True)
        kclpy.Worker(config, Seen, session=session).run(install_signal_handlers=False)
    handed = {(shard, seq) for shard, sequences in COUNTING.handed.items()
              for seq in sequences}
    state = {key: held.value for key, held in TABLES[f"toy://{name}"][0].items()}
    problems = [f"{key} ({where}) was not handed over by the counting mode"
                for key, where in written.items() if where not in handed]
    problems += [f"{key} is {state.get(f'seen/{key}')} in the dict store, not 1"
                 for key in written if state.get(f"seen/{key}") != 1]
    if STICKY.asked["taker"] == 0:
        problems.append("the worker's taker never asked the sticky strategy")
    return problems


if __name__ == "__main__":
    problems = run()
    for problem in problems:
        print(problem, file=sys.stderr)
    if not problems:
        print(f"every record came through the {COUNTING.name} mode into the dict store once, "
              f"leases spread by the {STICKY.name} strategy")
    sys.exit(1 if problems else 0)
