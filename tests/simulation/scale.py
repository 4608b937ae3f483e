"""Fleets at scale in virtual time: the real lease code, one event loop, a metered DynamoDB.

The history simulator (``history.py``) runs whole workers on a cooperative scheduler that
gives every kclpy thread a real thread; that is what finds races, and it is far too heavy for
10,000 leases. Here only the lease layer runs - each worker is a real
:class:`~kclpy.leases.coordinator.LeaseCoordinator` (its balancer, scan budget, held set,
fence, renewer and taker) whose two loops are driven by one event loop in virtual time
instead of by its threads, against the in-memory DynamoDB of ``aws.py`` (its conditional
writes are atomic). There are no shard consumers: a handed-off lease is let go at the
owner's next renewal, as by a worker without handoff listeners, and a lease's traffic is a
rate, not records.

Every request is metered as DynamoDB bills it: request count, and capacity units from the
item sizes (a write unit per started KB written, a read unit per started 4 KB read, half for
an eventually consistent read; a Scan pages at 1 MB and is billed on the bytes it read).

A run has four phases: a cold start (every worker starts within the first second), a steady
window (the cost figures), 20 % of the workers killed (SIGKILL: they stop renewing), then
20 % as many new workers joining. Each phase ends once the fleet is *settled* - every lease
held by a live worker that knows it holds it, no handoff in flight, and balanced (lease
counts differing by at most one; with load-based assignment, the busiest worker within the
bound of ``balanced_load``) - or when its time limit passes.
"""

from __future__ import annotations

import bisect
import heapq
import math
import random
from collections import Counter, defaultdict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from kclpy.leases import serializer as ser
from kclpy.leases.assignment import COUNT, LOAD
from kclpy.leases.budget import java_taker_interval
from kclpy.leases.coordinator import CoordinatorSettings, LeaseAssignment, LeaseCoordinator
from kclpy.leases.leader import LeaderLock, LeaderMode
from kclpy.leases.lease import Lease
from kclpy.leases.load import (
    LOAD_TABLE_SUFFIX,
    WORKER_ID,
    LoadBalancing,
    LoadMeter,
    LoadSettings,
    LoadTable,
)
from kclpy.leases.table import LeaseTable
from kclpy.position import Position
from tests.simulation.aws import Dynamo, Item
from tests.simulation.scheduler import Sim

if TYPE_CHECKING:
    from mypy_boto3_dynamodb import DynamoDBClient

TABLE = "scale"
LOAD_TABLE = TABLE + LOAD_TABLE_SUFFIX
#: DynamoDB's Scan page limit
PAGE_BYTES = 1024 * 1024


#: id(item) -> (item, size): items are replaced on every write, never changed in place, so
#: an item object's size never changes (the item is kept so that its id is not reused)
_SIZES: dict[int, tuple[Item, int]] = {}


def item_bytes(item: Item) -> int:
    """An item's size as DynamoDB bills it: attribute names plus values (numbers roughly
    one byte per two digits)."""
    known = _SIZES.get(id(item))
    if known is not None and known[0] is item:
        return known[1]
    if len(_SIZES) > 1_000_000:
        _SIZES.clear()
    size = 0
    for name, value in item.items():
        size += len(name)
        if "S" in value:
            size += len(value["S"].encode())
        elif "N" in value:
            size += 1 + (len(value["N"]) + 1) // 2
        elif "SS" in value:
            size += sum(len(s.encode()) for s in value["SS"])
        elif "B" in value:
            size += len(value["B"])
        else:
            size += 8
    _SIZES[id(item)] = (item, size)
    return size


@dataclass
class Meter:
    """What one worker (or the whole fleet) asked of DynamoDB."""

    requests: Counter[str] = field(default_factory=Counter)
    read_units: float = 0.0
    write_units: float = 0.0
    #: the largest Scan page (items, bytes) and the largest full scan (items)
    largest_page_items: int = 0
    largest_page_bytes: int = 0
    #: the largest owner-index Query answer (items)
    largest_query_items: int = 0

    def add(self, other: Meter) -> None:
        self.requests.update(other.requests)
        self.read_units += other.read_units
        self.write_units += other.write_units
        self.largest_page_items = max(self.largest_page_items, other.largest_page_items)
        self.largest_page_bytes = max(self.largest_page_bytes, other.largest_page_bytes)
        self.largest_query_items = max(self.largest_query_items, other.largest_query_items)

    @property
    def total_requests(self) -> int:
        return sum(self.requests.values())


class MeteredClient:
    """A botocore-shaped DynamoDB client of one worker over the shared in-memory tables."""

    def __init__(self, backend: Dynamo, meter: Meter) -> None:
        self.backend = backend
        self.meter = meter

    def _write(self, operation: str, key: str, kw: dict[str, Any],
               call: Callable[..., dict[str, Any]]) -> dict[str, Any]:
        self.meter.requests[operation] += 1
        old = self.backend.tables[kw["TableName"]][1].get(key)
        try:
            return call(**kw)
        finally:
            new = self.backend.tables[kw["TableName"]][1].get(key)
            largest = max(item_bytes(old) if old else 0, item_bytes(new) if new else 0)
            self.meter.write_units += max(1, math.ceil(largest / 1024))
            self.meter.write_units += self._index_writes(kw["TableName"], old, new)

    def _index_writes(self, table: str, old: Item | None, new: Item | None) -> int:
        """A keys-only index is written only when an index key changes: one unit to remove
        the old entry, one to add the new one."""
        units = 0
        for hash_key, _ in self.backend.indexes.get(table, {}).values():
            before = old.get(hash_key) if old else None
            after = new.get(hash_key) if new else None
            if before != after:
                units += (before is not None) + (after is not None)
        return units

    def _key(self, kw: dict[str, Any], where: str) -> str:
        hash_key = self.backend.tables[kw["TableName"]][0]
        return str(kw[where][hash_key]["S"])

    def update_item(self, **kw: Any) -> dict[str, Any]:
        return self._write("UpdateItem", self._key(kw, "Key"), kw, self.backend.update_item)

    def put_item(self, **kw: Any) -> dict[str, Any]:
        return self._write("PutItem", self._key(kw, "Item"), kw, self.backend.put_item)

    def delete_item(self, **kw: Any) -> dict[str, Any]:
        return self._write("DeleteItem", self._key(kw, "Key"), kw, self.backend.delete_item)

    def describe_table(self, **kw: Any) -> dict[str, Any]:
        return self.backend.describe_table(**kw)

    def create_table(self, **kw: Any) -> dict[str, Any]:
        return self.backend.create_table(**kw)

    def get_item(self, **kw: Any) -> dict[str, Any]:
        self.meter.requests["GetItem"] += 1
        answer = self.backend.get_item(**kw)
        size = item_bytes(answer["Item"]) if "Item" in answer else 0
        units = max(1, math.ceil(size / 4096))
        self.meter.read_units += units if kw.get("ConsistentRead") else units / 2
        return answer

    def update_table(self, **kw: Any) -> dict[str, Any]:
        return self.backend.update_table(**kw)

    def query(self, **kw: Any) -> dict[str, Any]:
        """A Query of the owner index, billed on the keys it returns."""
        self.meter.requests["Query"] += 1
        answer = self.backend.query(**kw)
        size = sum(item_bytes(item) for item in answer["Items"])
        self.meter.read_units += max(1, math.ceil(size / 4096)) / 2
        self.meter.largest_query_items = max(self.meter.largest_query_items,
                                             len(answer["Items"]))
        return answer

    def scan(self, **kw: Any) -> dict[str, Any]:
        """One page of at most 1 MB, from ``ExclusiveStartKey``."""
        self.meter.requests["Scan"] += 1
        hash_key, items = self.backend.tables[kw["TableName"]]
        start = kw.get("ExclusiveStartKey", {}).get(hash_key, {}).get("S")
        keys = sorted(items)
        if start is not None:
            keys = keys[bisect.bisect_right(keys, start):]
        page: list[Item] = []
        size = 0
        for key in keys:
            # not copied: the in-memory table replaces an item on every write and never
            # changes one in place, and the lease table only reads what a scan returns
            item = items[key]
            size += item_bytes(item)
            page.append(item)
            if size >= PAGE_BYTES:
                break
        units = max(1, math.ceil(size / 4096))
        self.meter.read_units += units if kw.get("ConsistentRead") else units / 2
        self.meter.largest_page_items = max(self.meter.largest_page_items, len(page))
        self.meter.largest_page_bytes = max(self.meter.largest_page_bytes, size)
        answer: dict[str, Any] = {"Items": page}
        if page and page[-1][hash_key]["S"] != keys[-1]:
            answer["LastEvaluatedKey"] = {hash_key: page[-1][hash_key]}
        return answer


# -- traffic -------------------------------------------------------------------------------------


@dataclass
class Traffic:
    """What each shard carries (KB/s) and how fast each worker processes (KB per CPU
    second); accrued at every probe into the counters a worker's load meter reads."""

    kbps: dict[str, float]
    #: worker id -> KB one CPU second processes (absent: ``default_speed``)
    speed: dict[str, float]
    default_speed: float = 1000.0
    #: worker id -> lease key -> (records, bytes) processed, cumulative
    processed: dict[str, dict[str, tuple[float, float]]] = field(
        default_factory=lambda: defaultdict(dict))
    cpu_seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    def flow(self, fleet: Fleet, seconds: float) -> None:
        for worker in fleet.live():
            done = self.processed[worker.worker_id]
            kb_total = 0.0
            for key in worker.coordinator.held.entries():
                kb = self.kbps.get(key, 0.0) * seconds
                records, nbytes = done.get(key, (0.0, 0.0))
                done[key] = (records + kb, nbytes + kb * 1024)
                kb_total += kb
            self.cpu_seconds[worker.worker_id] += kb_total / self.speed_of(worker.worker_id)

    def speed_of(self, worker_id: str) -> float:
        return float(self.speed.get(worker_id, self.default_speed))

    def load(self, worker_id: str, keys: list[str]) -> float:
        """The true load (CPU percent) of a worker holding ``keys``."""
        return 100.0 * sum(self.kbps.get(k, 0.0) for k in keys) / self.speed_of(worker_id)


def zipf_kbps(shards: int, total_kbps: float, *, top: float = 0.05,
              top_share: float = 0.5) -> list[float]:
    """Per-shard traffic from a Zipf law whose exponent makes the top ``top`` of the shards
    carry ``top_share`` of the bytes, hottest first."""
    head = max(1, round(top * shards))

    def share(exponent: float) -> float:
        weights = [1.0 / math.pow(rank, exponent) for rank in range(1, shards + 1)]
        return sum(weights[:head]) / sum(weights)

    low, high = 0.0, 10.0
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if share(middle) < top_share else (low, middle)
    weights = [1.0 / math.pow(rank, high) for rank in range(1, shards + 1)]
    scale = total_kbps / sum(weights)
    return [w * scale for w in weights]


# -- the fleet ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ScaleSpec:
    """One fleet to measure."""

    shards: int
    workers: int
    failover_s: float = 10.0
    seed: int = 0
    #: how often a taker loop wakes to ask its budget whether a scan is affordable (the
    #: coordinator's minimum scan interval)
    taker_wake_s: float = 0.5
    #: how often the event loop checks whether the fleet has settled
    probe_s: float = 1.0
    #: the share of workers killed, then joined
    churn: float = 0.2
    #: a phase gives up after this many failover times
    phase_limit_failovers: float = 60.0
    #: the steady window the cost is measured over
    steady_s: float = 120.0
    #: with a leader: True puts the leader among the workers killed (one of the sample
    #: swapped for it); None leaves it to the draw
    kill_leader: bool | None = None


@dataclass
class Phase:
    """How one phase went."""

    name: str
    #: virtual seconds from the phase's event to settled (None: not within the limit)
    settled_after_s: float | None
    #: ownership changes between two workers (steals and handoffs), and takes of free leases
    moved: int
    taken_free: int


@dataclass
class ScaleResult:
    spec: ScaleSpec
    phases: list[Phase]
    #: over the steady window, the whole fleet
    steady: Meter
    steady_s: float
    #: the largest full scan (items), and the lease item's average size
    largest_scan_items: int
    item_bytes: float
    violations: list[str]
    #: with a leader: whether the leader was among the workers killed (None: no leader)
    leader_killed: bool | None = None

    def per_shard_hour(self, what: float) -> float:
        return what / self.spec.shards / (self.steady_s / 3600)

    def per_worker_hour(self, what: float) -> float:
        return what / self.spec.workers / (self.steady_s / 3600)

    @property
    def write_equivalents(self) -> float:
        """Capacity in write-unit equivalents (a read unit costs a fifth of a write unit)."""
        return self.steady.write_units + 0.2 * self.steady.read_units

    def phase(self, name: str) -> Phase:
        return next(p for p in self.phases if p.name == name)


def java2_per_shard_hour(spec: ScaleSpec, item_size: float) -> tuple[float, float]:
    """A Java KCL 2.x fleet's lease requests and capacity (write-unit equivalents) per
    shard-hour in steady state: every worker renews each lease it holds every failover / 3
    and scans the whole table every 2 x failover + 50 ms (eventually consistent)."""
    renewals = 3 / spec.failover_s * 3600
    pages = max(1, math.ceil(spec.shards * item_size / PAGE_BYTES))
    scans_per_hour = spec.workers * 3600 / java_taker_interval(spec.failover_s)
    scan_units = math.ceil(spec.shards * item_size / 4096) / 2
    requests = renewals + scans_per_hour * pages / spec.shards
    capacity = (renewals * math.ceil(item_size / 1024)
                + 0.2 * scans_per_hour * scan_units / spec.shards)
    return requests, capacity


class InlineExecutor:
    """The renewer's pool, running each renewal at once on the caller's thread."""

    def submit(self, fn: Callable[..., None], *args: Any) -> Future[None]:
        future: Future[None] = Future()
        try:
            fn(*args)
        except Exception as exc:
            future.set_exception(exc)
        else:
            future.set_result(None)
        return future

    def shutdown(self, wait: bool = True) -> None:
        """Nothing runs in the background."""


class SimWorker:
    """One worker's lease coordinator, its loops driven by the fleet's event loop."""

    def __init__(self, fleet: Fleet, worker_id: str) -> None:
        self.worker_id = worker_id
        self.meter = Meter()
        self.alive = True
        client = cast("DynamoDBClient", MeteredClient(fleet.backend, self.meter))
        table = LeaseTable(client, TABLE,
                           clock=fleet.clock, sleep=fleet.no_sleep,
                           rng=random.Random(fleet.rng.getrandbits(64)))
        self.load: LoadBalancing | None = None
        if fleet.load_settings is not None:
            load_table = LoadTable(client, LOAD_TABLE, clock=fleet.clock, sleep=fleet.no_sleep)
            meter = LoadMeter(worker_id, lambda: fleet.traffic.processed[worker_id],
                              clock=fleet.clock,
                              cpu_seconds=lambda: fleet.traffic.cpu_seconds[worker_id],
                              ema_alpha=fleet.load_settings.ema_alpha)
            self.load = LoadBalancing(meter, load_table, fleet.load_settings, clock=fleet.clock,
                                      wall_clock=fleet.clock,
                                      rng=fleet.worker_rng(worker_id, "reports"))
        self.leader: LeaderMode | None = None
        if fleet.leader:
            settings = fleet.load_settings or LoadSettings()
            reports = self.load or LoadBalancing(
                LoadMeter(worker_id, dict, clock=fleet.clock, cpu_seconds=lambda: 0.0),
                LoadTable(client, LOAD_TABLE, clock=fleet.clock, sleep=fleet.no_sleep),
                settings, clock=fleet.clock, wall_clock=fleet.clock,
                rng=fleet.worker_rng(worker_id, "reports"))
            lock = LeaderLock(reports.table, worker_id, failover_time_s=fleet.spec.failover_s,
                              clock=fleet.clock, rng=fleet.worker_rng(worker_id, "lock"))
            self.leader = LeaderMode(lock, reports)
        strategy = COUNT if fleet.load_settings is None else LOAD
        self.coordinator = LeaseCoordinator(
            table, worker_id, fleet.coordinator_settings, clock=fleet.clock,
            rng=random.Random(fleet.rng.getrandbits(64)),
            assignment=LeaseAssignment(strategy, self.load, self.leader))
        # Renewals run inline: a pool thread per worker would cost two thread switches per
        # renewal, which on a busy machine is most of a run's wall time, and the order of
        # one worker's renewals among themselves decides nothing here.
        self.coordinator.renewer._pool = InlineExecutor()  # type: ignore[assignment]
        self._first_scan = True
        self._next_poll: float | None = None

    def renew(self, now: float) -> float:
        """The renewer loop's body; when it runs next."""
        self.coordinator.held_leases()  # gives up leases past the failover time
        self.coordinator.run_renewer_once(due_only=True)
        return now + self.coordinator.renewer.next_wait()

    def take(self, now: float) -> float:
        """The taker loop's body (``LeaseCoordinator._taker_loop``); when it runs next."""
        taker = self.coordinator.taker
        next_scan = taker.next_scan()
        if self._first_scan or now >= next_scan:
            self._first_scan = False
            taker.run_once()
            next_scan = taker.next_scan()
            self._next_poll = None
        elif self._next_poll is not None and now >= self._next_poll:
            taker.poll_handoffs()
            self._next_poll = None
        if taker.pending_handoffs() and self._next_poll is None:
            self._next_poll = now + self.coordinator.handoff_poll_s
        wake = min(next_scan, now + self.fleet_wake)
        if self._next_poll is not None:
            wake = min(wake, self._next_poll)
        return max(wake, now + 1e-3)

    fleet_wake = 0.5


class Fleet:
    """Workers, the shared table, and the event loop."""

    def __init__(self, spec: ScaleSpec, *, traffic: Traffic | None = None,
                 load_settings: LoadSettings | None = None, leader: bool = False,
                 **coordinator_options: Any) -> None:
        self.spec = spec
        #: ``--lease-assigner leader``: one elected worker scans and assigns (``leader.py``)
        self.leader = leader
        self.traffic = traffic if traffic is not None else Traffic({}, {})
        #: with settings: ``--lease-assignment load``
        self.load_settings = load_settings
        #: every worker's: the spec's failover time and the options a run varies
        self.coordinator_settings = CoordinatorSettings(
            failover_time_s=spec.failover_s, renewal_threads=1, **coordinator_options)
        self.rng = random.Random(spec.seed)
        self.now = 0.0
        self.backend = Dynamo(Sim(spec.seed))
        self.backend.create_table(TableName=TABLE, KeySchema=[
            {"AttributeName": ser.LEASE_KEY, "KeyType": "HASH"}])
        if leader:
            LeaseTable(cast("DynamoDBClient", self.backend), TABLE).ensure_owner_index()
        for index in range(spec.shards):
            # a checkpoint as long as a real sequence number, so items have a real size
            lease = Lease(f"shardId-{index:012d}", checkpoint=Position(str(49_000_000 + index) * 7))
            self.backend.put_item(TableName=TABLE, Item=ser.lease_to_new_item(lease))
        self.backend.create_table(TableName=LOAD_TABLE, KeySchema=[
            {"AttributeName": WORKER_ID, "KeyType": "HASH"}])
        self.workers: dict[str, SimWorker] = {}
        self._events: list[tuple[float, int, str, str]] = []
        self._seq = 0
        self.moved = 0
        self.taken_free = 0
        self.backend.on_write = self._observe_write
        #: called with the fleet after every probe (load-based runs feed traffic here)
        self.on_probe: Callable[[Fleet, float], None] | None = None
        self.settled: Callable[[Fleet], bool] = balanced_by_count
        #: when traffic last flowed into the workers' counters
        self._flowed_at = 0.0
        #: broken invariants, as found by the probes
        self.violations: list[str] = []

    def clock(self) -> float:
        return self.now

    def worker_rng(self, worker_id: str, purpose: str) -> random.Random:
        """A generator of one worker's own for one ``purpose``, seeded by the fleet's seed
        and the worker's id without drawing from ``rng`` (whose draws decide the rest of
        the history): an unseeded one would make two runs of one seed differ."""
        return random.Random(f"{self.spec.seed}/{worker_id}/{purpose}")

    @staticmethod
    def no_sleep(seconds: float) -> None:
        """Nothing throttles here, so nothing backs off; time only moves between events."""

    def _observe_write(self, table: str, key: str, old: Item | None, new: Item | None,
                       request: dict[str, Any]) -> None:
        if table != TABLE:
            return
        before = old.get(ser.LEASE_OWNER, {}).get("S") if old else None
        after = new.get(ser.LEASE_OWNER, {}).get("S") if new else None
        if after is not None and after != before:
            if before is None:
                self.taken_free += 1
            else:
                self.moved += 1

    def _check_one_holder(self) -> None:
        """No lease is held by two live workers at once (each believes it holds it)."""
        holders: dict[str, str] = {}
        for worker in self.live():
            for key in worker.coordinator.held.entries():
                other = holders.setdefault(key, worker.worker_id)
                if other != worker.worker_id:
                    self.violations.append(
                        f"{self.now:.1f}s: {key} held by {other} and {worker.worker_id}")

    def _schedule(self, when: float, worker_id: str, kind: str) -> None:
        self._seq += 1
        heapq.heappush(self._events, (when, self._seq, worker_id, kind))

    def start_worker(self, worker_id: str, at: float) -> SimWorker:
        worker = SimWorker(self, worker_id)
        worker.fleet_wake = self.spec.taker_wake_s
        self.workers[worker_id] = worker
        self._schedule(at, worker_id, "take")
        self._schedule(at, worker_id, "renew")
        return worker

    def kill(self, worker_id: str) -> None:
        self.workers[worker_id].alive = False

    def live(self) -> list[SimWorker]:
        return [w for w in self.workers.values() if w.alive]

    def items(self) -> list[Item]:
        return list(self.backend.tables[TABLE][1].values())

    def run_until(self, deadline: float, settle: bool) -> float | None:
        """Run events up to ``deadline``; with ``settle``, stop at the first probe that finds
        the fleet settled and return when that was."""
        next_probe = self.now
        while True:
            when = self._events[0][0] if self._events else math.inf
            if next_probe <= when:
                if next_probe > deadline:
                    self.now = deadline
                    return None
                self.now = next_probe
                self._check_one_holder()
                # what flowed since the last probe: a run resumed at the instant the last
                # one stopped probes that instant again, and must not count it twice
                self.traffic.flow(self, self.now - self._flowed_at)
                self._flowed_at = self.now
                if self.on_probe is not None:
                    self.on_probe(self, self.spec.probe_s)
                if settle and self.settled(self):
                    return self.now
                next_probe += self.spec.probe_s
                continue
            if when > deadline:
                self.now = deadline
                return None
            _, _, worker_id, kind = heapq.heappop(self._events)
            self.now = when
            worker = self.workers[worker_id]
            if not worker.alive:
                continue
            nxt = worker.renew(when) if kind == "renew" else worker.take(when)
            self._schedule(nxt, worker_id, kind)


def holders(fleet: Fleet) -> dict[str, list[str]] | None:
    """Live worker -> the leases it holds, when every lease is held by a live worker that
    knows it and no handoff is in flight; None otherwise."""
    live = {w.worker_id: w for w in fleet.live()}
    held: dict[str, list[str]] = {worker_id: [] for worker_id in live}
    entries = {worker_id: w.coordinator.held.entries() for worker_id, w in live.items()}
    for item in fleet.items():
        key = item[ser.LEASE_KEY]["S"]
        owner = item.get(ser.LEASE_OWNER, {}).get("S")
        if owner not in live or ser.CHECKPOINT_OWNER in item or key not in entries[owner]:
            return None
        held[owner].append(key)
    return held


def balanced_by_count(fleet: Fleet) -> bool:
    held = holders(fleet)
    if held is None:
        return False
    counts = [len(keys) for keys in held.values()]
    return max(counts) - min(counts) <= 1


def run_scale(spec: ScaleSpec, *, fleet: Fleet | None = None) -> ScaleResult:
    """The four phases of one fleet."""
    fleet = fleet if fleet is not None else Fleet(spec)
    limit = spec.phase_limit_failovers * spec.failover_s
    phases: list[Phase] = []

    def phase(name: str, started: float) -> None:
        moved, free = fleet.moved, fleet.taken_free
        done = fleet.run_until(started + limit, settle=True)
        phases.append(Phase(name, None if done is None else done - started,
                            fleet.moved - moved, fleet.taken_free - free))

    for index in range(spec.workers):
        fleet.start_worker(f"w{index:03d}", fleet.rng.random())
    phase("cold start", 0.0)
    # the steady window: settled, then measured
    fleet.run_until(fleet.now + 2 * spec.failover_s, settle=False)
    before = _fleet_meter(fleet)
    started = fleet.now
    fleet.run_until(started + spec.steady_s, settle=False)
    steady = _fleet_meter(fleet)
    steady_s = fleet.now - started
    window = Meter(requests=steady.requests - before.requests,
                   read_units=steady.read_units - before.read_units,
                   write_units=steady.write_units - before.write_units,
                   largest_page_items=steady.largest_page_items,
                   largest_page_bytes=steady.largest_page_bytes,
                   largest_query_items=steady.largest_query_items)
    churn = max(1, round(spec.churn * spec.workers))
    leader_killed: bool | None = None
    doomed = fleet.rng.sample(fleet.live(), churn)
    leaders = [w for w in fleet.live() if w.coordinator.leads()]
    if spec.kill_leader and leaders and leaders[0] not in doomed:
        doomed[-1] = leaders[0]
    for worker in doomed:
        if worker.coordinator.leads():
            leader_killed = True
        elif leader_killed is None and worker.coordinator.leads() is False:
            leader_killed = False
        fleet.kill(worker.worker_id)
    phase(f"{churn} die", fleet.now)
    joined = fleet.now
    for index in range(churn):
        fleet.start_worker(f"j{index:03d}", joined + fleet.rng.random())
    phase(f"{churn} join", joined)
    sizes = [item_bytes(item) for item in fleet.items()]
    largest_scan = max((_largest_scan(w) for w in fleet.workers.values()), default=0)
    return ScaleResult(spec, phases, window, steady_s, largest_scan or spec.shards,
                       sum(sizes) / len(sizes), fleet.violations, leader_killed)


def _largest_scan(worker: SimWorker) -> int:
    return len(worker.coordinator.taker.all_leases())


def _fleet_meter(fleet: Fleet) -> Meter:
    total = Meter()
    for worker in fleet.workers.values():
        total.add(worker.meter)
    return total


def summary(result: ScaleResult) -> dict[str, Any]:
    """The figures of one run, as the bench prints them."""
    spec = result.spec
    java_requests, java_capacity = java2_per_shard_hour(spec, result.item_bytes)
    requests = result.per_shard_hour(result.steady.total_requests)
    capacity = result.per_shard_hour(result.write_equivalents)
    by_op: dict[str, float] = defaultdict(float)
    for op, count in result.steady.requests.items():
        by_op[op] = round(result.per_shard_hour(count), 1)
    return {
        "shards": spec.shards, "workers": spec.workers, "failover_s": spec.failover_s,
        **{f"{p.name.split()[-1]}_s": p.settled_after_s for p in result.phases},
        **{f"{p.name.split()[-1]}_moved": p.moved for p in result.phases},
        "requests_per_shard_hour": round(requests, 1),
        "requests_by_operation_per_shard_hour": dict(by_op),
        "wcu_equiv_per_shard_hour": round(capacity, 1),
        "read_units_per_worker_hour": round(result.per_worker_hour(result.steady.read_units)),
        "write_units_per_worker_hour": round(result.per_worker_hour(result.steady.write_units)),
        "requests_per_worker_hour": round(result.per_worker_hour(result.steady.total_requests)),
        "java2_requests_per_shard_hour": round(java_requests, 1),
        "java2_wcu_equiv_per_shard_hour": round(java_capacity, 1),
        "requests_vs_java2": round(requests / java_requests, 2),
        "capacity_vs_java2": round(capacity / java_capacity, 2),
        "largest_scan_items": result.largest_scan_items,
        "largest_page_items": result.steady.largest_page_items,
        "largest_page_kb": round(result.steady.largest_page_bytes / 1024, 1),
        "largest_query_items": result.steady.largest_query_items,
        "item_bytes": round(result.item_bytes),
        "violations": len(result.violations),
        "leader_killed": result.leader_killed,
    }


# -- load-based assignment ---------------------------------------------------------------------


def load_ratio(fleet: Fleet) -> float | None:
    """The busiest live worker's true load over the fleet's average; None while a lease is
    not held by a live worker."""
    held = holders(fleet)
    if held is None:
        return None
    loads = [fleet.traffic.load(worker_id, keys) for worker_id, keys in held.items()]
    average = sum(loads) / len(loads)
    return max(loads) / average if average > 0 else 1.0


@dataclass
class LoadRun:
    """One fleet with skewed traffic, settled and then watched."""

    #: from the cold start to the busiest worker within ``bound`` x the average (None: not
    #: within the limit)
    settled_after_s: float | None
    #: busiest / average at every probe of the watch after settling (no handoff in flight)
    ratios: list[float]
    #: lease moves between workers per hour during the watch, after its calm period
    moves_per_hour: float
    violations: list[str]
    #: the ``ratios`` sampled after the calm period
    calm_ratios: list[float] = field(default_factory=list)


def run_load(spec: ScaleSpec, traffic: Traffic, settings: LoadSettings | None, *,
             bound: float = 1.15, watch_s: float = 1800.0, calm_s: float = 0.0,
             settle_limit_s: float = 3600.0, leader: bool = False) -> LoadRun:
    """Start ``spec.workers`` workers on skewed ``traffic`` (``settings`` None: count-based
    assignment), wait until the busiest is within ``bound`` x the average (count-based: until
    the counts are balanced), then watch for ``watch_s``: the ratios from settling on, the
    moves after the first ``calm_s`` of the watch (the last rounds of converging). With
    ``leader``, one elected worker assigns (``--lease-assigner leader``)."""
    fleet = Fleet(spec, traffic=traffic, load_settings=settings, leader=leader)

    def settled(fleet: Fleet) -> bool:
        if settings is None:
            return balanced_by_count(fleet)
        ratio = load_ratio(fleet)
        return ratio is not None and ratio <= bound

    fleet.settled = settled
    for index in range(spec.workers):
        fleet.start_worker(f"w{index:03d}", fleet.rng.random())
    done = fleet.run_until(settle_limit_s, settle=True)
    ratios: list[float] = []

    def watch(fleet: Fleet, seconds: float) -> None:
        ratio = load_ratio(fleet)
        if ratio is not None:  # None while a handoff is in flight
            ratios.append(ratio)

    fleet.on_probe = watch
    fleet.run_until(fleet.now + calm_s, settle=False)
    moved, calm = fleet.moved, len(ratios)
    fleet.run_until(fleet.now + watch_s - calm_s, settle=False)
    moves_per_hour = (fleet.moved - moved) * 3600 / max(1.0, watch_s - calm_s)
    return LoadRun(done, ratios, moves_per_hour, fleet.violations, ratios[calm:])


def skewed(shards: int, workers: int, seed: int) -> Traffic:
    """Zipf traffic on shards in a random order (the top 5 % carry half the bytes), on workers
    of three speeds, drawn from ``seed``: the histories load assignment is measured on."""
    rng = random.Random(seed)
    keys = [f"shardId-{index:012d}" for index in range(shards)]
    rng.shuffle(keys)
    speeds = {f"w{index:03d}": rng.choice([500.0, 1000.0, 1500.0]) for index in range(workers)}
    return Traffic(dict(zip(keys, zipf_kbps(shards, shards * 100.0), strict=True)), speeds)
