"""One history: a fleet of real ``kclpy.Worker``s, a producer, resharding and faults, all
chosen by the seed; then the invariants.

A history runs in three phases of virtual time:

- *faulty* ``[0, quiet)``: the producer writes, workers start (staggered, so balancing hands
  leases over), and the seed schedules kills (with a replacement started later), pauses
  (SIGSTOP) of one to two failover times, graceful shutdowns, shard splits and merges; the
  fault layer delays answers around the failover time, loses answers after the write landed,
  throttles and answers 5xx;
- *quiet* ``[quiet, quiet + failover + LIVENESS_BOUND_S)``: no more faults, kills or pauses;
- the end: the checks below, from what the in-memory endpoints and the processors saw.

Invariants (each named in a failure):

- ``nothing-lost``: a checkpoint written at P (or SHARD_END) finds every record of the shard
  up to P (all of them) already delivered to a processor - checked when the write lands (not
  with lag recovery, whose live checkpoint passes a queued gap on purpose: there
  ``liveness`` checks every record);
- ``checkpoint-monotonic``: no write moves a lease's checkpoint backwards;
- ``one-committer``: per lease, processor commits come from non-decreasing tenures (lease
  counters), and one tenure's commits from one worker only;
- ``exactly-once``: every committed transaction read the versions that were current when it
  landed (commit order is a serial order), and the state holds each record applied exactly
  once and the per-key counts of the stream;
- ``no-collateral-loss``: a live, unpaused worker drops a lease for want of renewal only if a
  request about that lease itself was faulty (delayed, lost, throttled, 5xx) or another worker
  took it;
- ``liveness``: at the end of the quiet phase every record produced was delivered (applied,
  with exactly-once state) and every shard's checkpoint covers it;
- ``consumed-while-held``: no running, unpaused worker holds an unfinished lease with no
  running consumer for longer than the failover time, graceful shutdown included (what the
  chaos runs' /status watch, ``tests.support.liveness``, checks over real HTTP). It is read
  by a callback of the scheduler that never blocks, so a history is the same with it;
- ``committed-once``, ``committed-in-order``: the micro-batch histories' sink
  (``tests/simulation/microbatch.py``), where a commit is what counts as a delivery.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import logging
import math
import random
import sqlite3
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection
from sqlalchemy.pool import StaticPool

from kclpy.config import KCLConfig
from kclpy.errors import CheckpointError, ProcessorRestartRequired
from kclpy.leases.held import HeldLease, HeldSet
from kclpy.leases.lease import Lease
from kclpy.ops import control
from kclpy.ops.commands import Clients, build_parser, execute
from kclpy.position import SHARD_END
from kclpy.position import Position as CheckpointPosition
from kclpy.processor import (
    InitializeInput,
    IRecordProcessor,
    LeaseLostInput,
    ProcessRecordsInput,
    ShardEndedInput,
    ShutdownRequestedInput,
)
from kclpy.records import Record
from kclpy.state.dynamodb import DynamoDBStateStore
from kclpy.state.processor import StatefulProcessor
from kclpy.state.sql import SQLStateStore
from kclpy.state.transaction import DELETED, StateTransaction, Versioned
from kclpy.streams import StreamConfig
from kclpy.worker import Worker
from tests.simulation import scheduler
from tests.simulation.aws import (
    Dynamo,
    FaultPlan,
    FaultyClient,
    Kinesis,
    KRecord,
    Session,
    Touch,
)
from tests.simulation.microbatch import MICROBATCH, MicroBatchWorld, hosts_microbatch
from tests.simulation.scheduler import EPOCH, Node, Sim, Task

#: after the faults stop, every shard is consumed again within failover time + this
LIVENESS_BOUND_S = 20.0
#: how often ``consumed-while-held`` compares every worker's held leases with its consumers
WATCH_S = 0.25
STREAM = "sim-stream"
#: the second stream of a multi-stream history, which the tracker drops and names again
OTHER_STREAM = "sim-other"
APP = "sim-app"
STATE_TABLE = "sim-state"
FLAG_KEYS = 3
#: the seeds that found holes before the edge review of 2026-12-06 keep the world they were found in
#: (and the invariants of then), so FOUND.md's replay commands still show what they showed; every
#: other seed runs the grown world
CLASSIC_SEEDS = frozenset({1, 5, 6, 10, 40, 139, 159, 186, 338, 400, 471, 553, 625, 844, 947})
#: the seeds whose stories FOUND.md tells (the classic ones and the grown world's,
#: ``tests/system/test_simulation.py``'s FOUND_36) keep the choice of assigner they were found with
STORIED_SEEDS = CLASSIC_SEEDS | frozenset({7, 19, 21, 72, 169, 173, 189, 223, 292, 341, 458, 464,
                                           546, 559, 706, 794, 971})
#: the operator's node name (its writes are not a worker's)
OPERATOR = "operator"

Position = tuple[int, int]


class Violation(AssertionError):
    """An invariant broke; ``invariant`` names it."""

    def __init__(self, invariant: str, detail: str) -> None:
        super().__init__(f"{invariant}: {detail}")
        self.invariant = invariant


@dataclass
class Plan:
    """Everything the seed decides about a history."""

    seed: int
    workers: int
    shards: int
    #: plain | exactly-once (DynamoDB store) | exactly-once-sql (SQLite store) | microbatch
    #: (Spark's micro-batch path into ParquetSink, tests/simulation/microbatch.py)
    mode: str
    recovery: bool
    failover_s: float
    quiet: float
    records: int
    faults: FaultPlan
    #: two streams: a multi-stream application whose tracker drops and adds one back
    multi_stream: bool = False
    events: list[tuple[float, str, int]] = field(default_factory=list)
    #: ``--lease-assigner leader``: one elected worker scans and assigns (kclpy.leases.leader)
    leader: bool = False
    #: with a leader: how long the owner index the first worker adds takes to build (virtual
    #: seconds; ``Dynamo.index_build_s``), during which every Query of it is refused
    index_build_s: float = 0.0
    #: the grown world of the edge review of 2026-12-06 (False: the classic world,
    #: ``CLASSIC_SEEDS``): per-worker state stores (each with its own cache), workers' clocks offset
    #: from Kinesis' arrival clock by up to ``skew_s`` both ways, a list-append workload checked on
    #: values, retention, processor restarts, operator commands and the invariants that go with them
    grown: bool = False
    skew_s: float = 0.5
    max_lag_ms: int = 3000
    #: the stream's retention in virtual seconds (``Kinesis.retention_s``)
    retention_s: float | None = None
    #: per batch (per record with exactly-once state): the processor raises
    #: ``ProcessorRestartRequired`` (a MultiLang child died), so the consumer restarts it
    restart_p: float = 0.0

    def describe(self) -> str:
        events = ", ".join(f"{what}@{when:.1f}" for when, what, _ in self.events)
        index = (f", owner index built in {self.index_build_s:.0f}s" if self.index_build_s
                 else "")
        f = self.faults
        grown = (f", grown world (clock skew {self.skew_s:.1f}s, max lag {self.max_lag_ms} ms, "
                 f"retention {'none' if self.retention_s is None else f'{self.retention_s:.0f}s'}"
                 f", restarts {self.restart_p:.2f})" if self.grown else "")
        return (f"seed {self.seed}: {self.workers} workers, {self.shards} shards"
                f"{' per stream, 2 streams' if self.multi_stream else ''}, {self.mode}"
                f"{' + lag recovery' if self.recovery else ''}"
                f"{', leader-assigned' if self.leader else ''}"
                f"{index}"
                f"{grown}, {self.records} records, "
                f"faults until {self.quiet:.0f}s (throttle {f.throttle:.2f}, 5xx "
                f"{f.server_error:.2f}, lost {f.lost:.2f}, delayed {f.delay:.2f}); {events}")


def plan_for(seed: int) -> Plan:
    sim_rng = __import__("random").Random(seed * 7919 + 1)
    failover = 5.0
    quiet = sim_rng.uniform(20.0, 40.0)
    heavy = sim_rng.random() < 0.5
    faults = FaultPlan(
        until=quiet,
        throttle=sim_rng.choice([0.0, 0.01, 0.05]),
        server_error=sim_rng.choice([0.0, 0.01, 0.03]),
        lost=sim_rng.choice([0.0, 0.005, 0.02]) if heavy else 0.0,
        delay=sim_rng.choice([0.0, 0.01, 0.03, 0.06]) if heavy else sim_rng.choice([0.0, 0.01]),
        failover_s=failover)
    mode = sim_rng.choice(["plain", "plain", "exactly-once", "exactly-once-sql"])
    plan = Plan(seed, workers=sim_rng.choice([3, 3, 4]), shards=sim_rng.choice([2, 3, 4]),
                mode=mode, recovery=sim_rng.random() < 0.25, failover_s=failover, quiet=quiet,
                records=sim_rng.choice([60, 120, 240]), faults=faults)
    for _ in range(sim_rng.choice([0, 1, 2, 3])):
        what = sim_rng.choice(["kill", "pause", "shutdown", "split", "merge", "pause"])
        plan.events.append((sim_rng.uniform(3.0, quiet - 3.0), what, sim_rng.randrange(1 << 30)))
    if sim_rng.random() < 0.2:
        plan.multi_stream = True
        plan.events.append((sim_rng.uniform(5.0, quiet - 12.0), "drop-stream", 0))
    if mode == "exactly-once-sql" and sim_rng.random() < 0.5:
        # an operator resets the lease table: the leases come back with new counters
        plan.events.append((sim_rng.uniform(5.0, quiet - 5.0), "reset", 0))
    plan.events.sort()
    # Nearly two seeds in three run with a leader: those of residue 0 or 4 modulo 7 (the
    # two in seven that always did), and every other even seed but the storied ones.
    # Decided by the seed alone, not by a draw of the plan's generator, so the histories
    # of the odd and the storied seeds stay what they were.
    storied = seed in STORIED_SEEDS
    plan.leader = seed % 7 in (0, 4) or (not storied and seed % 2 == 0)
    if plan.leader and not storied:
        # Half of those add the owner index to a table where it takes a while to build
        # (on AWS minutes): until then every Query of it is refused, as DynamoDB refuses
        # reads of a backfilling index. A generator of its own, for the same reason.
        index_rng = random.Random(seed * 15485863 + 7)
        if index_rng.random() < 0.5:
            plan.index_build_s = index_rng.uniform(3.0, quiet)
    if seed not in CLASSIC_SEEDS:
        if hosts_microbatch(seed):
            plan.mode = MICROBATCH
        _grow(plan, random.Random(seed * 104729 + 36))
    return plan


def _grow(plan: Plan, rng: random.Random) -> None:
    """The grown world's draws, from a generator of their own (the classic draws above are
    the same for every seed, so a classic seed's plan is what it was)."""
    plan.grown = True
    plan.skew_s = rng.choice([0.5, 2.0, 4.0, 6.0])
    plan.max_lag_ms = rng.choice([1000, 3000, 5000])
    if not plan.recovery and rng.random() < 0.15:
        plan.recovery = True
    if rng.random() < 0.35:
        plan.retention_s = rng.uniform(15.0, 30.0)
    plan.restart_p = rng.choice([0.0, 0.0, 0.02, 0.05])
    if rng.random() < 0.5:  # resharding, so that operators and retention meet it
        plan.events.append((rng.uniform(2.0, plan.quiet - 3.0), rng.choice(["split", "merge"]),
                            rng.randrange(1 << 30)))
    if not plan.multi_stream and rng.random() < 0.6:
        kinds = ["op-park", "op-park"]
        if plan.mode == "plain":  # a rewind or a backfill applies records again
            kinds += ["op-rewind", "op-rewind", "op-backfill"]
        for _ in range(rng.choice([1, 1, 2])):
            plan.events.append((rng.uniform(3.0, plan.quiet - 8.0), rng.choice(kinds),
                                rng.randrange(1 << 30)))
    plan.events.sort()


@dataclass
class Delivery:
    node: str
    shard: str
    position: Position
    when: float


class Observer:
    """What the checks need, recorded as the history runs; raises at the first violation."""

    def __init__(self, sim: Sim, kinesis: Kinesis, plan: Plan) -> None:
        self.sim = sim
        self.kinesis = kinesis
        self.plan = plan
        self.delivered: dict[str, set[Position]] = defaultdict(set)
        self.commits: dict[str, tuple[tuple[int, int], str]] = {}
        #: how many times each lease item was created (a reset table creates them again)
        self.incarnation: dict[str, int] = defaultdict(int)
        self.tenure_incarnation: dict[tuple[str, str, int], int] = {}
        self.violations: list[Violation] = []
        #: lease keys whose loss to retention a worker reported (logged at ERROR, counted)
        self.reported_lost: set[str] = set()
        self.touched: dict[tuple[str, str], Touch] = {}
        self.pauses: dict[str, list[tuple[float, float]]] = defaultdict(list)
        #: the workers by node name (the history fills it)
        self.workers: dict[str, Worker] = {}
        self.pending_txn: dict[int, tuple[dict[str, int], dict[str, Any]]] = {}
        #: every committed transaction in the order it landed: the versions it read and what
        #: it wrote (``rec/<seq>`` names each record it applied)
        self.transactions: list[tuple[dict[str, int], dict[str, Any]]] = []
        #: (grown world) the last virtual time each record was delivered
        self.delivered_at: dict[tuple[str, Position], float] = {}
        #: (grown world) the node whose write moving each lease item's counter landed last
        self.last_writer: dict[str, str | None] = {}
        #: (grown world) the lease writes each operator command (its task) landed
        self.operator_writes: dict[Task, int] = defaultdict(int)
        #: (grown world) when each lease's records were delivered, batch by batch
        self.delivery_times: dict[str, list[float]] = defaultdict(list)
        #: (grown world) the lease table's items, for the drop hook
        self.lease_items: Callable[[], dict[str, Any]] = dict

    def fail(self, invariant: str, detail: str) -> None:
        violation = Violation(invariant, f"at {self.sim.now:.3f}s: {detail}")
        self.violations.append(violation)
        self.sim.log(f"VIOLATION {violation}")

    # -- the lease table -------------------------------------------------------------------

    def on_write(self, table: str, key: str, old: dict[str, Any] | None,
                 new: dict[str, Any] | None, request: dict[str, Any]) -> None:
        if table == APP:
            task = self.sim.current
            writer = task.node.name if task is not None else None
            if old is None or new is None or old.get("leaseCounter") != new.get("leaseCounter"):
                # a write that leaves the counter alone (a parent's ``childShardIds``) fences
                # nothing: it cannot be what a worker's refused write ran into (seed 918)
                self.last_writer[key] = writer
            if writer == OPERATOR and task is not None:
                self.operator_writes[task] += 1
            # an operator's rewind moves a checkpoint back on purpose; a lease it creates
            # (a cleaned-up parent it replays) is a new incarnation all the same
            self._lease_write(key, old, new, monotonic=writer != OPERATOR)
        txn = self.pending_txn.pop(id(self.sim.current), None)
        if txn is not None:
            self._transaction_landed(*txn)

    def _lease_write(self, key: str, old: dict[str, Any] | None,
                     new: dict[str, Any] | None, *, monotonic: bool = True) -> None:
        if old is None and new is not None:
            self.incarnation[key] += 1
        if new is None or old is None or not monotonic:
            return
        before, after = _checkpoint_of(old), _checkpoint_of(new)
        if after < before:
            self.fail("checkpoint-monotonic",
                      f"lease {key} checkpoint {_show(before)} -> {_show(after)}")
        if after == before:
            return
        if self.plan.mode != "exactly-once-sql":  # there the store's commit is the commit
            self.commit_landed(key)
        if self.plan.recovery:
            return
        shard = self.kinesis.shard_of_lease(key)
        if shard is None:
            return
        delivered = self.delivered[key]
        missing = [r.sequence_number for r in shard.records
                   if (r.sequence_number, 0) <= after and (r.sequence_number, 0) not in delivered
                   and not self.kinesis.trimmed(r)]
        if missing:
            self.fail("nothing-lost", f"lease {key} checkpointed at {_show(after)} but "
                      f"{len(missing)} record(s) up to it were never delivered "
                      f"(first {missing[0]})")

    # -- processors ------------------------------------------------------------------------

    def delivered_batch(self, node: str, shard: str, records: list[Record]) -> None:
        now = self.sim.now
        for record in records:
            position = (int(record.sequence_number), record.sub_sequence_number)
            self.delivered[shard].add(position)
            if self.plan.grown:
                self.delivered_at[(shard, position)] = now
        if self.plan.grown and records:
            self.delivery_times[shard].append(now)

    def tenure_started(self, node: str, key: str, counter: int) -> None:
        """A worker starts a tenure of a lease (``HeldSet.install`` with a new token)."""
        self.tenure_incarnation[(node, key, counter)] = self.incarnation[key]

    def commit_landed(self, key: str) -> None:
        """A commit (a checkpoint, alone or with state) landed. It is written under the
        lease's lock by the fence, so the writer's held entry names the tenure it was
        written for; the tenure is the lease counter of one incarnation of the lease item."""
        task = self.sim.current
        worker = self.workers.get(task.node.name) if task is not None else None
        if task is None or worker is None or worker.coordinator is None:
            return
        entry = worker.coordinator.held.entry(key)
        if entry is None:
            return
        node = task.node.name
        incarnation = self.tenure_incarnation.get((node, key, entry.tenure),
                                                  self.incarnation[key])
        self.committed(node, key, (incarnation, entry.tenure))

    def committed(self, node: str, shard: str, tenure: tuple[int, int]) -> None:
        last = self.commits.get(shard)
        if last is not None:
            last_tenure, last_node = last
            if tenure < last_tenure:
                self.fail("one-committer", f"lease {shard}: {node} committed for tenure "
                          f"{tenure} after {last_node} committed for tenure {last_tenure} "
                          "(incarnation, counter)")
            elif tenure == last_tenure and node != last_node:
                self.fail("one-committer", f"lease {shard}: {node} and {last_node} both "
                          f"committed for tenure {tenure} (incarnation, counter)")
        if last is None or tenure >= last[0]:
            self.commits[shard] = (tenure, node)

    def _transaction_landed(self, versions: dict[str, int], writes: dict[str, Any]) -> None:
        self.transactions.append((versions, writes))

    # -- lease drops -----------------------------------------------------------------------

    def dropped(self, node: Node, key: str, why: str) -> None:
        if node.name == "controller":
            # the end's checks read ``held_leases()``, which gives up what the stopped
            # fleet has not renewed: not a drop of the history
            return
        if self.plan.grown and "failover time" not in why and not node.killed:
            self._own_write(node, key, why)
        if "failover time" not in why or node.killed:
            return
        now = self.sim.now
        window = self.plan.failover_s * 1.5
        if any(start - window <= now and end >= now - window
               for start, end in self.pauses[node.name]):
            return
        touch = self.touched.get((node.name, key))
        if touch is not None and touch.when >= now - window * 2:
            return
        self.fail("no-collateral-loss",
                  f"{node.name} dropped lease {key} ({why}) though no request about it was "
                  "faulty and the worker was not paused")

    def _own_write(self, node: Node, key: str, why: str) -> None:
        """``own-write-lost``: a worker drops a lease as lost (not as expired) while the
        table names it the owner and the last write that landed on the item was its own - a
        write whose answer was lost and whose retry then failed its condition against the
        first attempt's result is the usual way."""
        item = self.lease_items().get(key)
        if item is None or item.get("leaseOwner", {}).get("S") != node.name:
            return
        if item.get("checkpointOwner", {}).get("S", node.name) != node.name:
            return  # its own handoff request names it: it asked, it does not hold
        if self.last_writer.get(key) != node.name:
            return
        self.fail("own-write-lost", f"{node.name} dropped lease {key} ({why}) though the "
                  f"table names it the owner (counter {item.get('leaseCounter', {}).get('N')}) "
                  "and the last write that landed on the item was its own")


def _checkpoint_of(item: dict[str, Any]) -> tuple[int, int, int]:
    value = item.get("checkpoint", {}).get("S", "TRIM_HORIZON")
    sub = int(item.get("checkpointSubSequenceNumber", {}).get("N", "0"))
    if value == SHARD_END:
        return (2, 0, 0)
    if value.isdigit():
        return (1, int(value), sub)
    return (0, 0, 0)


def _checkpoint_value(item: dict[str, Any]) -> str | None:
    value = item.get("checkpoint", {}).get("S")
    return None if value is None else str(value)


def _show(position: tuple[int, int, int]) -> str:
    return {0: "start", 2: "SHARD_END"}.get(position[0], f"{position[1]}/{position[2]}")


# -- processors ------------------------------------------------------------------------------


class Context:
    """What a processor of one worker reports to."""

    def __init__(self, observer: Observer, node: Node) -> None:
        self.observer = observer
        self.node = node
        self.worker: Worker | None = None


class PlainProcessor(IRecordProcessor):
    """Delivers to the observer and checkpoints after every batch, as a processor should."""

    def __init__(self, context: Context) -> None:
        self.context = context
        self.shard = ""

    def initialize(self, initialize_input: InitializeInput) -> None:
        self.shard = initialize_input.shard_id

    def process_records(self, process_records_input: ProcessRecordsInput) -> None:
        records = list(process_records_input.records)
        self.context.observer.delivered_batch(self.context.node.name, self.shard, records)
        if records:
            maybe_restart(self.context, 1.0)
            self._checkpoint(process_records_input.checkpointer.checkpoint)

    def _checkpoint(self, checkpoint: Callable[[], None]) -> None:
        """A failed checkpoint is covered by the next one (or by the next holder's)."""
        with contextlib.suppress(CheckpointError):
            checkpoint()

    def lease_lost(self, lease_lost_input: LeaseLostInput) -> None:
        """Nothing to do: the next holder resumes from the last checkpoint."""

    def shard_ended(self, shard_ended_input: ShardEndedInput) -> None:
        self._checkpoint(shard_ended_input.checkpointer.checkpoint)

    def shutdown_requested(self, shutdown_requested_input: ShutdownRequestedInput) -> None:
        self._checkpoint(shutdown_requested_input.checkpointer.checkpoint)


def maybe_restart(context: Context, share: float) -> None:
    """(grown world) The processor dies after seeing a batch and before checkpointing it -
    a MultiLang child that exited - with ``share`` of the plan's probability, so that the
    consumer's restart path (``ShardConsumer._restart``) runs in histories. A dying child is
    a fault like the others, so it stops with them at ``quiet``: a processor that died on
    every large batch of the quiet phase kept a resumed shard from catching up before its
    backlog aged out (simulator seed 561)."""
    observer = context.observer
    plan = observer.plan
    if (plan.restart_p and observer.sim.now < plan.quiet
            and observer.sim.rng.random() < plan.restart_p * share):
        observer.sim.log(f"{context.node.name}: processor restart required")
        raise ProcessorRestartRequired("simulated: the processor's child exited")


class _ShardState(StatefulProcessor):
    """A stateful processor of one shard of a simulated worker: what each workload shares."""

    def __init__(self, context: Context) -> None:
        self.context = context
        self.shard = ""

    def initialize(self, initialize_input: InitializeInput) -> None:
        self.shard = initialize_input.shard_id


class ListState(_ShardState):
    """(grown world) A list-append workload in the manner of Jepsen's Elle: record ``A<n>``
    appends its sequence number to ``list/<n>``, record ``D<n>`` reads and deletes it (so a
    key is deleted and created again, at version 1 again), and every record counts itself
    under ``rec/<seq>``. The lists are shared by every shard. ``History._check_values``
    replays the committed transactions in the order they landed and checks every value
    written, not only versions."""

    def apply(self, record: Record, txn: StateTransaction) -> None:
        self.context.observer.delivered_batch(self.context.node.name, self.shard, [record])
        maybe_restart(self.context, 0.2)
        seq = int(record.sequence_number)
        txn.update(f"rec/{seq}", lambda n: n + 1, 0)
        data = record.binary_data.decode()
        key = f"list/{data[1:]}"
        if data.startswith("D"):
            txn.get(key)
            txn.delete(key)
        else:
            txn.update(key, lambda items: [*items, seq], [])


class CountingState(_ShardState):
    """Counts each record once under its own key, per partition key, and toggles shared
    flags: a record ``D<n>`` deletes ``flag/<n>`` after reading it (maybe absent), any other
    record of flag ``n`` increments it - so shards contend on keys, read absent keys and
    delete them."""

    def apply(self, record: Record, txn: StateTransaction) -> None:
        self.context.observer.delivered_batch(self.context.node.name, self.shard, [record])
        txn.update(f"rec/{record.sequence_number}", lambda n: n + 1, 0)
        txn.update(f"count/{record.partition_key}", lambda n: n + 1, 0)
        data = record.binary_data.decode()
        flag = f"flag/{data[1:]}"
        if data.startswith("D"):
            txn.get(flag)
            txn.delete(flag)
        else:
            txn.update(flag, lambda n: n + 1, 0)


class ObservedSQLStore(SQLStateStore):
    """The real SQL store on an in-memory SQLite database; the observer learns each
    transaction as it is written (the database commit follows at once, in the same step)."""

    observer: Observer | None = None

    def __init__(self, engine: sa.Engine, write_lock: scheduler.Lock) -> None:
        super().__init__(engine)
        #: the database's write lock, shared by every store object over ``engine``
        self.write_lock = write_lock
        #: the shard each simulated thread is committing (``_write`` is not told)
        self._shard: dict[int, str] = {}

    def commit(self, writer: Any, lease_key: str, token: str, position: CheckpointPosition,
               txn: StateTransaction, gap: CheckpointPosition | None = None) -> None:
        self._round_trip()
        self._shard[id(scheduler.ACTIVE and scheduler.ACTIVE.current)] = lease_key
        super().commit(writer, lease_key, token, position, txn, gap)

    def _fetch(self, key: str) -> Versioned:
        self._round_trip()
        return super()._fetch(key)

    @contextlib.contextmanager
    def _locked(self, guard: Any) -> Iterator[Connection]:
        """SQLite's database lock (``BEGIN IMMEDIATE``) in virtual time. Every thread shares
        the one in-memory connection, so SQLite cannot keep a second writer out itself; and a
        transaction does yield: a claim reads the lease table while it holds the lock
        (``_take_over``). Without this, another worker's commit ran inside that claim's
        transaction (simulator seeds 50 and 156 in the classic world: a zombie's commit
        landed between the claim's read of the position and its resumption, and the
        records it applied were applied again). A wait past the store's budget fails
        as SQLite's busy timeout does."""
        budget_s = min(self.lock_timeout_s, guard.wait_s)
        if not self.write_lock.acquire(timeout=budget_s):
            busy: Any = sqlite3.OperationalError("database is locked")
            busy.sqlite_errorcode = 5  # SQLITE_BUSY
            raise sa.exc.OperationalError("BEGIN IMMEDIATE", None, busy)
        try:
            with super()._locked(guard) as conn:
                yield conn
        finally:
            self.write_lock.release()

    @staticmethod
    def _round_trip() -> None:
        """A database is across the network: other threads run while a request travels.
        Only before a transaction or a lone read: a SQL statement itself never yields, as
        every thread shares the one in-memory connection."""
        sim = scheduler.ACTIVE
        assert sim is not None
        sim.sleep(0.001 + sim.rng.random() * 0.004)

    def _write(self, conn: Connection, txn: StateTransaction) -> None:
        super()._write(conn, txn)
        observer = self.observer
        assert observer is not None
        observer.transactions.append((dict(txn.versions), dict(txn.writes)))
        shard = self._shard.get(id(observer.sim.current))
        if shard is not None:
            observer.commit_landed(shard)


def sqlite_store() -> ObservedSQLStore:
    """One connection shared by every thread: only one thread runs at a time, and a SQL
    transaction never gives the baton up before it ends."""
    engine = sa.create_engine("sqlite://", poolclass=StaticPool,
                              connect_args={"check_same_thread": False})
    return ObservedSQLStore(engine, scheduler.Lock())


class ObservedStore(DynamoDBStateStore):
    """The real DynamoDB store; the observer learns which transaction each commit carries."""

    observer: Observer | None = None

    def commit(self, writer: Any, lease_key: str, token: str, position: CheckpointPosition,
               txn: StateTransaction, gap: CheckpointPosition | None = None) -> None:
        observer = self.observer
        assert observer is not None
        observer.pending_txn[id(observer.sim.current)] = (dict(txn.versions), dict(txn.writes))
        try:
            super().commit(writer, lease_key, token, position, txn, gap)
        finally:
            observer.pending_txn.pop(id(observer.sim.current), None)


class Tracker:
    """The multi-stream tracker every worker of a history asks (kclpy.StreamTracker)."""

    def __init__(self) -> None:
        self.streams = [StreamConfig(name=STREAM), StreamConfig(name=OTHER_STREAM)]

    def stream_configs(self) -> list[StreamConfig]:
        return list(self.streams)

    def restore(self) -> None:
        self.streams = [StreamConfig(name=STREAM), StreamConfig(name=OTHER_STREAM)]


@functools.cache
def _operator_parser() -> argparse.ArgumentParser:
    """The ``kclpy`` command's parser, built once per process: building it (every command
    and its help) took about 5 ms, 1 % of the soak's CPU, and parsing leaves it as it
    was."""
    return build_parser()


# -- the history -----------------------------------------------------------------------------


@dataclass
class Outcome:
    plan: Plan
    violations: list[Violation]
    switches: int
    virtual_s: float
    trace: list[str] | None = None
    digest: str = ""


class History:
    def __init__(self, plan: Plan, *, trace: bool = False) -> None:
        self.plan = plan
        self.sim = Sim(plan.seed, trace=trace)
        self.kinesis = Kinesis(self.sim)
        self.dynamo = Dynamo(self.sim)
        self.dynamo.index_build_s = plan.index_build_s
        self.observer = Observer(self.sim, self.kinesis, plan)
        self.dynamo.on_write = self.observer.on_write
        self.observer.lease_items = lambda: self.dynamo.tables.get(APP, ("", {}))[1]
        self.kinesis.retention_s = plan.retention_s
        #: (grown world) what the operator did, for the end's checks: rewinds and backfills
        #: (lease key or None for all shards, the arrival time or sequence range, since when;
        #: a rewind also when it was done), parks (lease key, parked from, resumed at)
        self.rewinds: list[tuple[float, float, float]] = []
        self.backfills: list[tuple[str, int, int, float]] = []
        self.parks: list[list[Any]] = []
        #: lease key -> when the operator's last ``shard resume`` of it succeeded
        self.resumed: dict[str, float] = {}
        #: lease keys whose ``shard resume`` was sent and has not succeeded yet
        self.resuming: set[str] = set()
        #: shards whose ``shard park`` is running (a failed one keeps its shard here)
        self.parking: set[str] = set()
        self.workers: dict[str, tuple[Node, Worker | None]] = {}
        self.produced: dict[str, list[tuple[int, str, bytes]]] = defaultdict(list)
        self._generation = 0
        self.store: ObservedStore | ObservedSQLStore | None = None
        self.tracker = Tracker()
        self.kinesis.multi_stream = plan.multi_stream
        #: (worker, lease key) -> since when it is held with no running consumer
        self._unconsumed: dict[tuple[str, str], float] = {}
        self._watched_at = 0.0
        #: (worker, lease key, since) of every stall reported, so each is reported once
        self._stalls: set[tuple[str, str, float]] = set()
        self.microbatch = (MicroBatchWorld(plan, self.observer) if plan.mode == MICROBATCH
                           else None)

    # -- fleet -----------------------------------------------------------------------------

    def start_worker(self) -> None:
        self._generation += 1
        rng = self.sim.rng
        name = f"w{self._generation}"
        plan = self.plan
        # A worker's clock against Kinesis' arrival clock (true virtual time), both ways
        node = Node(name, offset=rng.uniform(-plan.skew_s, plan.skew_s),
                    rate=1 + rng.uniform(-0.002, 0.002))
        clients = {
            "kinesis": FaultyClient(self.sim, node, self.kinesis, "kinesis", plan.faults,
                                    self.observer.touched, max_attempts=1),
            "dynamodb": FaultyClient(self.sim, node, self.dynamo, "dynamodb", plan.faults,
                                     self.observer.touched, max_attempts=3),
        }
        context = Context(self.observer, node)
        config = KCLConfig(
            application_name=APP, worker_id=name, region="us-east-1",
            stream_name=None if plan.multi_stream else STREAM,
            stream_tracker=self.tracker if plan.multi_stream else None,
            initial_position="TRIM_HORIZON", failover_time_ms=int(plan.failover_s * 1000),
            idle_time_between_reads_ms=500, shard_sync_interval_ms=5000,
            parent_shard_poll_interval_ms=1000,
            max_lag_ms=plan.max_lag_ms if plan.recovery else None,
            recovery_max_rate=1000, graceful_lease_handoff_timeout_ms=10_000,
            shutdown_grace_ms=5000, initialization_backoff_ms=500,
            task_backoff_time_ms=200, max_task_backoff_time_ms=2000,
            transaction_max_time_ms=2000,
            lease_assigner="leader" if plan.leader else "worker")
        self.workers[name] = (node, None)

        def run() -> None:
            worker: Worker
            if self.microbatch is not None:
                worker = self.microbatch.worker(config, node, Session(clients))
            elif plan.mode != "plain":
                assert self.store is not None
                store = self.store if not plan.grown else self._own_store()
                state: Callable[[Context], StatefulProcessor] = (
                    ListState if plan.grown else CountingState)
                worker = Worker(config, lambda: state(context),
                                session=Session(clients), state_store=store)  # type: ignore[arg-type]
            else:
                worker = Worker(config, lambda: PlainProcessor(context),
                                session=Session(clients))  # type: ignore[arg-type]
            context.worker = worker
            self.workers[name] = (node, worker)
            self.observer.workers[name] = worker
            worker.run(install_signal_handlers=False)

        self.sim.spawn(f"{name}-main", run, node)

    def _own_store(self) -> ObservedStore | ObservedSQLStore:
        """(grown world) Each worker its own store object, as each process has: its own
        cache of committed values, over the one state table or database."""
        store: ObservedStore | ObservedSQLStore
        if isinstance(self.store, ObservedSQLStore):
            store = ObservedSQLStore(self.store.engine, self.store.write_lock)
        else:
            store = ObservedStore(STATE_TABLE)
        store.observer = self.observer
        return store

    def live(self) -> list[str]:
        return [name for name, (node, worker) in self.workers.items()
                if not node.killed and worker is not None and not worker._stop.is_set()]

    # -- the controller --------------------------------------------------------------------

    def controller(self) -> None:
        plan, sim = self.plan, self.sim
        rng = sim.rng
        if plan.mode == "exactly-once":
            self.store = ObservedStore(STATE_TABLE)
            self.store.observer = self.observer
        elif plan.mode == "exactly-once-sql":
            self.store = sqlite_store()
            self.store.observer = self.observer
        self.kinesis.create_stream(STREAM, plan.shards)
        if plan.multi_stream:
            self.kinesis.create_stream(OTHER_STREAM, plan.shards)
        for index in range(plan.workers):
            sim.at(rng.uniform(0, 6) if index else 0.0, self.start_worker)
        produce_until = plan.quiet + 5.0
        times = sorted(rng.uniform(0, produce_until) for _ in range(plan.records))
        for when in times:
            sim.at(when, self._produce)
        for when, what, arg in plan.events:
            sim.at(when, functools.partial(self._event, what, arg))
        end = plan.quiet + plan.failover_s + LIVENESS_BOUND_S
        sim.at(WATCH_S, self._watch)
        sim.sleep(end)
        self.check_end()

    def _produce(self) -> None:
        rng = self.sim.rng
        key = f"k{rng.randrange(12)}"
        flag = rng.randrange(FLAG_KEYS)
        data = f"{'D' if rng.random() < 0.2 else 'A' if self.plan.grown else 'I'}{flag}".encode()
        stream = OTHER_STREAM if self.plan.multi_stream and rng.random() < 0.5 else STREAM
        shard, seq = self.kinesis.put(stream, key, data)
        self.produced[self.kinesis.lease_key(stream, shard)].append((seq, key, data))

    def _event(self, what: str, arg: int) -> None:
        sim, plan = self.sim, self.plan
        live = self.live()
        sim.log(f"controller: {what} (live: {live})")
        if what in ("kill", "pause", "shutdown") and len(live) > 1:
            name = live[arg % len(live)]
            node, worker = self.workers[name]
            if what == "kill":
                sim.kill(node)
                sim.at(sim.now + plan.failover_s * (arg % 3), self.start_worker)
            elif what == "pause":
                seconds = plan.failover_s * (1.0 + (arg % 100) / 100)
                seconds = min(seconds, max(0.0, plan.quiet - sim.now))
                sim.pause(node, seconds)
                self.observer.pauses[name].append((sim.now, sim.now + seconds))
            elif worker is not None:
                worker.shutdown()
                sim.at(sim.now + plan.failover_s * (arg % 2), self.start_worker)
        elif what == "split":
            shards = self.kinesis.open_shards(STREAM)
            if len(shards) < 6:
                self.kinesis.split(STREAM, shards[arg % len(shards)].shard_id)
        elif what == "drop-stream":
            # gone for one shard sync or several, then named again
            self.tracker.streams = [StreamConfig(name=STREAM)]
            sim.at(sim.now + plan.failover_s * (0.5 + arg % 3), self.tracker.restore)
        elif what == "reset":
            _, items = self.dynamo.tables.get(APP, ("", {}))
            items.clear()
            for park in self.parks:  # the park marks went with the table
                if park[2] is None:
                    park[2] = sim.now
        elif what == "merge":
            pair = self.kinesis.adjacent_open_pair(STREAM)
            if pair is not None:
                self.kinesis.merge(STREAM, *pair)
        elif what.startswith("op-"):
            self._operator(what, arg)

    # -- the operator (grown world) ------------------------------------------------------

    def _operator(self, what: str, arg: int) -> None:
        """An operator runs one of the ``kclpy`` control commands against the live fleet:
        ``checkpoint set --all-shards --to TIME --force`` (a rewind), ``shard park`` (then
        ``shard resume`` one or two failover times later) or ``recovery add`` (a backfill),
        whatever the resharding and the holders are at that moment."""
        sim, plan = self.sim, self.plan
        _, items = self.dynamo.tables.get(APP, ("", {}))
        common = ["--application-name", APP, "--region", "us-east-1"]
        if what == "op-rewind":
            at = round(sim.now - 1.0 - (arg % 700) / 100, 3)  # 1-8 s ago, Kinesis' clock
            iso = datetime.fromtimestamp(EPOCH + at, timezone.utc).replace(
                tzinfo=None).isoformat(timespec="milliseconds")
            argv = ["checkpoint", "set", *common, "--stream-name", STREAM, "--all-shards",
                    "--to", iso, "--force"]
            self._run_operator(what, argv,
                               lambda started: self.rewinds.append((at, started, sim.now)))
        elif what == "op-park":
            # Not a shard still being resumed: the operator runs a refused resume again
            # until it works, and one that works after a new park would end that park too
            # (seed 36), a mistake of the simulated operator, not kclpy's
            # nor one whose park is still running: two parks in flight end with the same
            # resume, and the later one's own resume then fails for ever (seed 375)
            keys = sorted(k for k, item in items.items()
                          if _checkpoint_value(item) != SHARD_END and k not in self.resuming
                          and k not in self.parking
                          and not any(p[0] == k and p[2] is None for p in self.parks))
            if not keys:
                return
            key = keys[arg % len(keys)]
            self.parking.add(key)

            def parked(started: float) -> None:
                self.parking.discard(key)
                park: list[Any] = [key, sim.now, None]
                self.parks.append(park)

                def resume() -> None:
                    # the park ends when the first resume is sent: its write may land
                    # long before its answer, or before a retry of it fails
                    if park[2] is not None:
                        return  # ended by a reset of the lease table: nothing to resume
                    park[2] = sim.now
                    self.resuming.add(key)

                    def resumed(_: float) -> None:
                        self.resumed[key] = sim.now
                        self.resuming.discard(key)

                    self._run_operator("op-resume", ["shard", "resume", *common,
                                                     "--shard-id", key], resumed, True)

                resume_at = min(sim.now + plan.failover_s * (1 + arg % 2), plan.quiet)
                sim.at(max(resume_at, sim.now), resume)

            self._run_operator(what, ["shard", "park", *common, "--shard-id", key], parked)
        elif what == "op-backfill":
            shards = [s for s in self.kinesis.open_shards(STREAM)
                      if sum(not self.kinesis.trimmed(r) for r in s.records) >= 2]
            if not shards:
                return
            shard = shards[arg % len(shards)]
            kept = [r.sequence_number for r in shard.records if not self.kinesis.trimmed(r)]
            first = kept[arg % (len(kept) - 1)]
            last = kept[min(len(kept) - 1, kept.index(first) + 1 + arg % 5)]
            argv = ["recovery", "add", *common, "--stream-name", STREAM, "--shard-id",
                    shard.shard_id, "--from", str(first), "--to", str(last)]
            self._run_operator(what, argv, lambda started: self.backfills.append(
                (shard.shard_id, first, last, started)))

    def _run_operator(self, what: str, argv: list[str], done: Callable[[float], None],
                      again: bool = False) -> None:
        """Run the command's own code (``kclpy.ops.commands.execute``) on a node of its own,
        through the faulty clients; ``done(started)`` when it succeeded. A command that
        fails after some of its writes landed breaks ``operator-partial``: the operator is
        left with a plan half carried out."""
        sim, observer = self.sim, self.observer
        node = Node(OPERATOR)
        clients = {service: FaultyClient(sim, node, backend, service, self.plan.faults,
                                         observer.touched, max_attempts=3)
                   for service, backend in (("kinesis", self.kinesis),
                                            ("dynamodb", self.dynamo))}

        def run() -> None:
            args = _operator_parser().parse_args(argv)
            started = sim.now
            me = sim.current
            assert me is not None
            try:
                aws = Clients(args, (clients["kinesis"], clients["dynamodb"]))
                execute(args, aws, io.StringIO())
            except Exception as exc:  # any failure is judged the same way
                sim.log(f"operator: {' '.join(argv[:2])} failed: {exc!r}")
                written = observer.operator_writes[me]
                # A partial move the command reports shard by shard, saying to run it again,
                # is its documented outcome (operations.md): the operator runs it again, and
                # ``operator-replay`` judges the result. A failure that does not say what it
                # left behind is the hole.
                reported = isinstance(exc, control.Refused) and "run the command again" in str(
                    exc)
                if written and not reported:
                    observer.fail("operator-partial", f"`kclpy {' '.join(argv)}` failed "
                                  f"({type(exc).__name__}: {exc}) after {written} of its "
                                  "writes landed")
                if again or reported:  # tried until it works, as an operator would
                    sim.at(sim.now + 1.0, functools.partial(
                        self._run_operator, what, argv, done, again))
                return
            sim.log(f"operator: {' '.join(argv)} done")
            done(started)

        sim.log(f"controller: {what} {' '.join(argv)}")
        sim.spawn(f"operator-{what}", run, node)

    # -- held and consumed ---------------------------------------------------------------

    def _watch(self) -> None:
        """``consumed-while-held``, judged as the chaos runs' /status watch judges it: a
        lease not written within the failover time is not held (``held_leases()`` gives it
        up), one checkpointed at SHARD_END needs no consumer, and a worker paused since the
        last look is watched afresh. Reads kclpy's state without its locks: no other thread
        runs while a scheduler callback does."""
        sim, failover = self.sim, self.plan.failover_s
        now = sim.now
        _, items = self.dynamo.tables.get(APP, ("", {}))
        idle: set[tuple[str, str]] = set()
        for name, (node, worker) in self.workers.items():
            if (worker is None or worker.coordinator is None or node.killed
                    or node.paused_until > self._watched_at):
                continue
            clock = node.clock(now)
            for key, entry in list(worker.coordinator.held._held.items()):
                item = items.get(key)  # None: the table was reset, its next write finds out
                if (item is None or clock - entry.renewed_at > failover
                        or entry.lease.is_shard_end or _checkpoint_value(item) == SHARD_END):
                    continue
                consumer = worker._consumers.get(key)
                if consumer is not None and not consumer.done:
                    continue
                idle.add((name, key))
                since = self._unconsumed.setdefault((name, key), now)
                if now - since > failover and (name, key, since) not in self._stalls:
                    self._stalls.add((name, key, since))
                    what = "no consumer" if consumer is None else "its consumer DONE"
                    self.observer.fail("consumed-while-held", f"{name} held {key} with {what} "
                                       f"since {since:.2f}s, longer than the failover time")
        self._unconsumed = {k: v for k, v in self._unconsumed.items() if k in idle}
        self._watched_at = now
        sim.at(now + WATCH_S, self._watch)

    # -- the end ---------------------------------------------------------------------------

    def check_end(self) -> None:
        observer = self.observer
        _, leases = self.dynamo.tables.get(APP, ("", {}))
        for stream_name, shard_id, shard in self.kinesis.all_shards():
            records = shard.records
            shard_id = self.kinesis.lease_key(stream_name, shard_id)
            undelivered = [r.sequence_number for r in records
                           if (r.sequence_number, 0) not in observer.delivered[shard_id]
                           and not self.excused(r, shard_id)]
            if undelivered:
                observer.fail("liveness", f"shard {shard_id}: {len(undelivered)} of "
                              f"{len(records)} record(s) never delivered "
                              f"(first {undelivered[0]}); {self._holder(shard_id, leases)}")
                continue
            item = leases.get(shard_id)
            if item is None or self.kinesis.expired(shard):
                continue  # finished and cleaned up after its children, or gone from the stream
            checkpoint = _checkpoint_of(item)
            stored = (self._sql_checkpoint(shard_id) if isinstance(self.store, SQLStateStore)
                      else None)
            if stored is not None:  # the SQL store holds the truth; SHARD_END is the lease's
                checkpoint = max(checkpoint, _checkpoint_of(stored))
            want = ((2, 0, 0) if shard.ending_sequence is not None
                    else (1, records[-1].sequence_number, 0) if records else (0, 0, 0))
            if checkpoint < want:
                observer.fail("liveness", f"shard {shard_id}: checkpoint {_show(checkpoint)} "
                              f"short of {_show(want)} at the end")
        if self.plan.grown:
            self._check_operator()
        if self.microbatch is not None:
            self.microbatch.check_end()
        elif self.plan.mode != "plain":
            self._check_state()

    def excused(self, record: KRecord, lease_key: str) -> bool:
        """A record retention trimmed before the quiet phase was a failover time old: the
        fleet may have lagged past it during the faults (a pause, a kill); kclpy cannot
        always tell (a lease at ``TRIM_HORIZON`` does not know what was trimmed before it).
        Later, a record is excused only if a worker reported the shard's loss, and only
        if it was trimmed before a quiet fleet had to have read it: a failover time after
        the faults' last effect (a request delayed just before the quiet phase answers up
        to ``delay_range`` failover times later) or, for a shard an operator parked, after
        its resume (the command's success; its write may land any time before) - while
        parked, nobody may read it, so its backlog is as old as the park. (Simulator seeds
        341, 559, 561 and 617: a shard resumed near the end of the faults, or held up by a
        read delayed into the quiet phase, lost its oldest records while reading them, and
        said so.) One trimmed later was readable by a quiet fleet, so it must have been
        read."""
        plan = self.plan
        if plan.retention_s is None:
            return False
        trimmed_at = record.arrival + plan.retention_s
        if trimmed_at <= plan.quiet + plan.failover_s:
            return True
        faults_end = plan.quiet + plan.failover_s * plan.faults.delay_range[1]
        caught_up_by = max(faults_end, self.resumed.get(lease_key, 0.0))
        return (lease_key in self.observer.reported_lost
                and trimmed_at <= caught_up_by + plan.failover_s)

    def _check_operator(self) -> None:
        """``operator-replay``: after ``checkpoint set --all-shards --to T`` every record
        that arrived at or after T (and before the command) is delivered again, in every
        shard of the stream, closed ones included; after ``recovery add`` every record of
        the range is. ``parked-consumed``: from one failover time after ``shard park`` (the
        holder learns at its next renewal) until ``shard resume``, nobody delivers the
        shard's records. Records trimmed by retention are excused, and so are the records
        before a later rewind's time when that rewind started while this one was still
        being retried and was done after it: its writes may land right after this one's,
        before any worker read the shard, and move the checkpoint past them as the operator
        asked (seeds 244 and 971: the first command's answer lost, its write landing 0.8 s
        before the second's)."""
        observer, kinesis = self.observer, self.kinesis
        stream = kinesis.streams[STREAM]
        for at, started, done in self.rewinds:
            superseded = max((later_at for later_at, later_started, later_done in self.rewinds
                              if started < later_started < done and later_done > done),
                             default=-math.inf)
            for shard in stream.shards.values():
                missed = [r.sequence_number for r in shard.records
                          if max(at, superseded) <= r.arrival < started and not kinesis.trimmed(r)
                          and observer.delivered_at.get((shard.shard_id, (r.sequence_number, 0)),
                                                        -1.0) < started]
                if missed:
                    observer.fail("operator-replay", f"`checkpoint set --all-shards` to "
                                  f"{at:.3f}s at {started:.3f}s: {len(missed)} record(s) of "
                                  f"{shard.shard_id} that arrived since were not delivered "
                                  f"again (first {missed[0]})")
                    return
        for shard_id, first, last, started in self.backfills:
            shard = stream.shards[shard_id]
            missed = [r.sequence_number for r in shard.records
                      if first <= r.sequence_number <= last and not kinesis.trimmed(r)
                      and observer.delivered_at.get((shard_id, (r.sequence_number, 0)),
                                                    -1.0) < started]
            if missed:
                observer.fail("operator-replay", f"`recovery add` of {shard_id} {first}..{last}"
                              f" at {started:.3f}s: {len(missed)} record(s) not delivered "
                              f"again (first {missed[0]})")
                return
        for key, parked, resumed in self.parks:
            until = resumed if resumed is not None else self.sim.now
            during = [t for t in observer.delivery_times[key]
                      if parked + self.plan.failover_s < t < until]
            if during:
                observer.fail("parked-consumed", f"{key} parked at {parked:.3f}s (resumed "
                              f"{'never' if resumed is None else f'at {resumed:.3f}s'}) but "
                              f"records of it were delivered at {during[0]:.3f}s")
                return

    def _sql_checkpoint(self, lease_key: str) -> dict[str, Any] | None:
        """The SQL store's checkpoint row, shaped as a lease item's checkpoint."""
        store = self.store
        assert isinstance(store, SQLStateStore)
        c = store.checkpoints.c
        with store.engine.connect() as conn:
            row = conn.execute(sa.select(c.checkpoint, c.sub_sequence_number)
                               .where(c.lease_key == lease_key)).first()
        if row is None or row[0] is None:
            return None
        return {"checkpoint": {"S": row[0]}, "checkpointSubSequenceNumber": {"N": str(row[1])}}

    def _stored_versions(self) -> dict[str, int]:
        store = self.store
        if isinstance(store, SQLStateStore):
            with store.engine.connect() as conn:
                rows = conn.execute(sa.select(store.state.c.state_key, store.state.c.version))
                return {str(key): int(version) for key, version in rows}
        _, state = self.dynamo.tables.get(STATE_TABLE, ("", {}))
        return {key: int(item["stateVersion"]["N"]) for key, item in state.items()}

    def _stored_values(self) -> dict[str, Any]:
        store = self.store
        if isinstance(store, SQLStateStore):
            with store.engine.connect() as conn:
                rows = conn.execute(sa.select(store.state.c.state_key, store.state.c.state_value))
                return {str(key): json.loads(value) for key, value in rows}
        _, state = self.dynamo.tables.get(STATE_TABLE, ("", {}))
        return {key: json.loads(item["stateValue"]["S"]) for key, item in state.items()}

    def _check_values(self) -> None:
        """``exactly-once`` on values (grown world), as Elle checks a list-append history:
        the transactions, replayed in the order they landed, must each have written exactly
        what its records compute from the values current then - each record's append lands
        on the list the serial order before it left, a delete clears it - and, without lag
        recovery (whose gaps are older than live records on purpose), each shard's records
        land in the shard's order. Then the store must hold the replay's values, and every
        record not trimmed before it was read must count once. Linear in the history: a
        version check passes a key deleted and created again (its version starts at 1
        again), a value check does not."""
        observer, kinesis = self.observer, self.kinesis
        data_of = {seq: (lease, data.decode()) for lease, produced in self.produced.items()
                   for seq, _, data in produced}
        values: dict[str, Any] = {}
        last_of: dict[str, int] = {}
        missing = object()
        for index, (_, writes) in enumerate(observer.transactions):
            seqs = sorted(int(key[4:]) for key in writes if key.startswith("rec/"))
            view: dict[str, Any] = {}

            def current(key: str, view: dict[str, Any] = view) -> Any:
                value = view[key] if key in view else values.get(key)
                return None if value is DELETED else value

            for seq in seqs:
                lease, text = data_of[seq]
                if not self.plan.recovery:
                    if seq <= last_of.get(lease, -1):
                        observer.fail("exactly-once", f"transaction {index} applied record "
                                      f"{seq} of {lease} after record {last_of[lease]} "
                                      "(shard order broken, or applied again)")
                        return
                    last_of[lease] = seq
                view[f"rec/{seq}"] = (current(f"rec/{seq}") or 0) + 1
                key = f"list/{text[1:]}"
                view[key] = DELETED if text.startswith("D") else [*(current(key) or []), seq]
            for key in sorted(set(view) | set(writes)):
                wrote, serial = writes.get(key, missing), view.get(key, missing)
                if wrote is not serial and wrote != serial:
                    show = {id(DELETED): "deleted", id(missing): "nothing"}
                    observer.fail("exactly-once", f"transaction {index} (records {seqs}) wrote "
                                  f"{key} = {show.get(id(wrote), wrote)}, but the transactions "
                                  f"in the order they landed give {show.get(id(serial), serial)}"
                                  " (lost update)")
                    return
            for key, value in writes.items():
                if value is DELETED:
                    values.pop(key, None)
                else:
                    values[key] = value
        stored = self._stored_values()
        if stored != values:
            wrong = sorted(k for k in set(stored) | set(values) if stored.get(k) != values.get(k))
            observer.fail("exactly-once", f"the state holds {wrong[0]} = {stored.get(wrong[0])}"
                          f", the serial replay {values.get(wrong[0])}")
            return
        for stream_name, shard_id, shard in kinesis.all_shards():
            for record in shard.records:
                applied = values.get(f"rec/{record.sequence_number}")
                lease_key = kinesis.lease_key(stream_name, shard_id)
                if applied != 1 and not (applied is None and self.excused(record, lease_key)):
                    observer.fail("exactly-once", f"record {record.sequence_number} applied "
                                  f"{applied or 0} times")
                    return

    def _holder(self, shard_id: str, leases: dict[str, Any]) -> str:
        """Who holds the lease and what its consumer is doing: a lease held and renewed
        with no running consumer is hole 1's signature."""
        item = leases.get(shard_id)
        owner = item.get("leaseOwner", {}).get("S") if item is not None else None
        if owner is None:
            return "the lease is not owned" if item is not None else "no lease"
        node, worker = self.workers.get(owner, (None, None))
        if node is None or worker is None or node.killed:
            return f"owner {owner} is gone"
        held = worker.coordinator is not None and shard_id in worker.coordinator.held_leases()
        consumer = worker.consumers().get(shard_id)
        state = consumer.state.value if consumer is not None else "no consumer"
        return f"held by {owner} ({'renewed' if held else 'not held there'}, consumer: {state})"

    def _check_state(self) -> None:
        observer = self.observer
        versions: dict[str, int] = {}
        values: dict[str, Any] = {}
        for index, (read, writes) in enumerate(observer.transactions):
            for key, version in read.items():
                if versions.get(key, 0) != version:
                    observer.fail("exactly-once", f"transaction {index} read {key} at version "
                                  f"{version} but {versions.get(key, 0)} was current when it "
                                  "landed (write skew)")
                    return
            for key, value in writes.items():
                if value is DELETED:
                    versions.pop(key, None)
                    values.pop(key, None)
                else:
                    versions[key] = versions.get(key, 0) + 1
                    values[key] = value
        stored = self._stored_versions()
        if stored != versions:
            observer.fail("exactly-once", "the state table differs from the serial replay "
                          "of the committed transactions")
            return
        if self.plan.grown:
            self._check_values()
            return
        counts: dict[str, int] = defaultdict(int)
        for records in self.produced.values():
            for seq, key, _ in records:
                counts[key] += 1
                applied = values.get(f"rec/{seq}")
                if applied != 1:
                    observer.fail("exactly-once", f"record {seq} applied {applied or 0} times")
                    return
        for key, count in counts.items():
            if values.get(f"count/{key}") != count:
                observer.fail("exactly-once", f"count/{key} is {values.get(f'count/{key}')}, "
                              f"the stream has {count}")
                return


_dropped_hook_installed = False


class _LossHandler(logging.Handler):
    """Which shards' losses to retention the workers reported: only those can be excused
    (``History.excused``)."""

    REPORTS = ("past the stream's retention", "left the stream unfinished")

    def __init__(self) -> None:
        super().__init__(logging.ERROR)

    def emit(self, record: logging.LogRecord) -> None:
        observer = getattr(scheduler.ACTIVE, "observer", None)
        if observer is not None and record.args and any(
                report in record.msg for report in self.REPORTS):
            observer.reported_lost.add(str(record.args[0]))  # type: ignore[index]


class _TraceHandler(logging.Handler):
    """kclpy's log lines in the history's trace, stamped with virtual time and node."""

    def emit(self, record: logging.LogRecord) -> None:
        sim = scheduler.ACTIVE
        if sim is not None:
            sim.log(f"{record.levelname} {record.name}: {record.getMessage()}")


def _install_drop_hook() -> None:
    """Observe every lease a worker drops or gives up (``HeldSet.drop``, ``HeldSet.expire``),
    for ``no-collateral-loss``."""
    global _dropped_hook_installed
    if _dropped_hook_installed:
        return
    original = HeldSet.drop

    def drop(self: HeldSet, lease_key: str, why: str, entry: HeldLease | None = None) -> bool:
        dropped = original(self, lease_key, why, entry)
        sim = scheduler.ACTIVE
        if dropped and sim is not None and sim.current is not None:
            observer = getattr(sim, "observer", None)
            if observer is not None:
                observer.dropped(sim.current.node, lease_key, why)
        return dropped

    original_install = HeldSet.install

    def install(self: HeldSet, lease: Lease, sent_at: float,
                handoff_since: float | None = None) -> None:
        previous = self.entry(lease.lease_key)
        original_install(self, lease, sent_at, handoff_since)
        sim = scheduler.ACTIVE
        observer = getattr(sim, "observer", None)
        if (observer is not None and sim is not None and sim.current is not None and (
                previous is None
                or previous.lease.concurrency_token != lease.concurrency_token)):
            observer.tenure_started(sim.current.node.name, lease.lease_key, lease.lease_counter)

    original_expire = HeldSet.expire

    def expire(self: HeldSet, now: float, failover_time_s: float) -> list[str]:
        expired = original_expire(self, now, failover_time_s)
        sim = scheduler.ACTIVE
        observer = getattr(sim, "observer", None)
        if observer is not None and sim is not None and sim.current is not None:
            for key in expired:
                observer.dropped(sim.current.node, key, self.gone_why(key))
        return expired

    HeldSet.drop = drop  # type: ignore[method-assign]
    HeldSet.install = install  # type: ignore[method-assign]
    HeldSet.expire = expire  # type: ignore[method-assign]
    _dropped_hook_installed = True


def run_history(seed: int, *, trace: bool = False) -> Outcome:
    """Run the history of ``seed`` in this process (see ``scheduler.install``)."""
    scheduler.install()
    _install_drop_hook()
    kclpy_log = logging.getLogger("kclpy")
    handler, losses = _TraceHandler(), _LossHandler()
    kclpy_log.addHandler(losses)
    kclpy_log.propagate = False
    if trace:
        logging.disable(logging.NOTSET)
        kclpy_log.setLevel(logging.INFO)
        kclpy_log.addHandler(handler)
    else:  # errors only: the reports of data lost to retention
        logging.disable(logging.WARNING)
    plan = plan_for(seed)
    history = History(plan, trace=trace)
    sim = history.sim
    sim.observer = history.observer  # type: ignore[attr-defined]
    scheduler.ACTIVE = sim
    try:
        sim.run(history.controller, until=plan.quiet + plan.failover_s + LIVENESS_BOUND_S + 1)
    finally:
        scheduler.ACTIVE = None
        kclpy_log.removeHandler(handler)
        kclpy_log.removeHandler(losses)
    violations = list(history.observer.violations)
    if sim.error is not None:
        violations.append(Violation("crash", repr(sim.error)))
    import hashlib
    digest = hashlib.sha256(repr((sorted(history.observer.commits.items()),
                                  [str(v) for v in violations], sim.switches,
                                  sorted((k, sorted(v)) for k, v in
                                         history.observer.delivered.items()))).encode())
    return Outcome(plan, violations, sim.switches, sim.now, sim.trace, digest.hexdigest()[:16])
