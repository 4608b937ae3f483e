"""Lease assignment by worker load (``--lease-assignment load``), the Java KCL 3.x idea
without its leader.

Counting leases balances work only when every shard carries the same traffic and every
worker runs as fast as the others. With a few hot partition keys some workers run hot while
others idle. Here each worker:

1. *measures* its load (:class:`LoadMeter`): the records and bytes per second its processors
   handled, per lease and in total (from its ``kclpy_records_processed`` and
   ``kclpy_bytes_processed`` counters), and its process's CPU; smoothed by an exponential moving
   average (``workerMetricsEMAAlpha``). The load that is balanced is the CPU (percent of one
   core) - it is what a slow host or an expensive processor shows - unless the process
   spent none, then the throughput in KB/s;
2. *publishes* it (:class:`LoadTable`) as one item per worker in a table of its own,
   ``<lease table>-kclpyWorkerLoad``, so every worker reads the whole fleet's load with one
   small Scan of as many items as there are workers, never the lease table;
3. *takes load* (:class:`LoadBalancing`), as the thief in kclpy's protocol always does: a
   worker below the fleet's average looks for workers above the average by more than
   ``reBalanceThresholdPercentage`` (or above itself by twice that) and asks (graceful
   handoff) for leases worth its share of the gap, damped by ``dampeningPercentage``
   (:func:`choose_steals` has the rules). A lease fits when the thief stays below what the
   victim keeps and within the threshold above the average, so it cannot come back in the
   next round. When no lease fits, ``allowThroughputOvershoot`` lets it take the one lease
   whose move lowers the two workers' sum of squared loads the most: that sum falls with
   every move, so again nothing flaps, and a fast worker can take a hot shard off a slow
   one.

Free leases (a dead worker's, new shards) are still taken by the count rules of
``balancing.py``: a shard without history has no known load, and nothing must wait for a
load report to be consumed. Load balancing replaces only the count rule's steals.

Freshness is judged as lease expiry is: a worker's entry is believed while its report
sequence number keeps changing, measured on the reader's own clock; clocks of different hosts
are never compared.
"""

from __future__ import annotations

import functools
import logging
import math
import random
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from kclpy.leases.dynamo import TABLE_ERRORS, DynamoTable
from kclpy.leases.lease import Lease
from kclpy.metrics import BYTES_PROCESSED, RECORDS_PROCESSED, Metrics
from kclpy.retry import spread

if TYPE_CHECKING:
    from mypy_boto3_dynamodb import DynamoDBClient

    from kclpy.config import KCLConfig

log = logging.getLogger(__name__)

#: the load table's name is the lease table's plus this
LOAD_TABLE_SUFFIX = "-kclpyWorkerLoad"
WORKER_ID = "workerId"
#: the leader lock's key in the load table (``leader.py``), not a worker's report
LEADER_ITEM = "__kclpyLeader__"
#: a report's ``WorkerLoad.written_at``
WRITTEN_AT = "writtenAt"


@dataclass(frozen=True)
class LoadSettings:
    """The Java KCL 3.x knobs, under their meaning here (docs/configuration.md)."""

    #: a worker is overloaded above ``average * (1 + threshold)``
    threshold: float = 0.10
    #: the share of an overloaded worker's excess moved per balancing round
    dampening: float = 0.60
    #: when no lease fits a thief's share, it may take the smallest one that helps
    allow_overshoot: bool = True
    #: KB/s a worker takes no more load beyond (None: no cap)
    max_kbps: float | None = None
    #: seconds between two balancing rounds of one worker
    balance_interval_s: float = 60.0
    #: seconds between two load reports of one worker
    report_interval_s: float = 30.0
    #: the weight of the newest sample in the moving averages
    ema_alpha: float = 0.5


@dataclass(frozen=True)
class WorkerLoad:
    """One worker's published load."""

    worker_id: str
    #: what is balanced: CPU percent of one core, or KB/s when the process spent no CPU
    load: float
    kbps: float
    records_per_s: float
    cpu_percent: float
    #: lease key -> KB/s processed for it
    lease_kbps: Mapping[str, float] = field(default_factory=dict)
    #: bumped at each report: how readers tell a live reporter (their own clock decides)
    seq: int = 0
    #: the reporter's wall clock (epoch seconds) when it wrote the report; None from a
    #: reporter that does not write it. Only ever orders candidates (``leader.plan``'s
    #: ``recency``), never decides liveness: clocks differ between hosts
    written_at: float | None = None

    def lease_load(self, lease_key: str) -> float:
        """The share of this worker's load one of its leases accounts for."""
        if self.kbps <= 0:
            return self.load / max(1, len(self.lease_kbps))
        return self.load * self.lease_kbps.get(lease_key, 0.0) / self.kbps

    def load_of_kbps(self, kbps: float) -> float | None:
        """What ``kbps`` more would add to this worker's load, by its own ratio; None when
        it processed nothing (no ratio known)."""
        if self.kbps <= 0:
            return None
        return self.load * kbps / self.kbps


def _ema(old: float | None, sample: float, alpha: float) -> float:
    return sample if old is None else alpha * sample + (1 - alpha) * old


#: lease key -> (records, bytes) processed since some fixed moment (cumulative counters)
Totals = Mapping[str, tuple[float, float]]


def processed_by_lease(metrics: Metrics) -> dict[str, tuple[float, float]]:
    """The worker's totals of ``kclpy_records_processed`` and ``kclpy_bytes_processed``
    per lease key: what its processors handled, kept after a shard leaves (its Prometheus
    series do not stay), so a lease given up between two samples still counts its last
    interval."""
    records = metrics.totals.by_lease(RECORDS_PROCESSED)
    nbytes = metrics.totals.by_lease(BYTES_PROCESSED)
    return {key: (records.get(key, 0.0), nbytes.get(key, 0.0))
            for key in records.keys() | nbytes.keys()}


class LoadMeter:
    """Turns cumulative counters into smoothed rates; sampled by the taker's cycle only."""

    def __init__(
        self,
        worker_id: str,
        totals: Callable[[], Totals],
        *,
        clock: Callable[[], float],
        cpu_seconds: Callable[[], float] = time.process_time,
        ema_alpha: float = 0.5,
    ) -> None:
        self.worker_id = worker_id
        self._totals = totals
        self._clock = clock
        self._cpu_seconds = cpu_seconds
        self._alpha = ema_alpha
        self._since = clock()
        self._cpu_since = cpu_seconds()
        #: the counters at the last sample
        self._last: dict[str, tuple[float, float]] = {}
        self._lease_kbps: dict[str, float] = {}
        #: the leases held at the last sample (only those are measured over a whole interval)
        self._held: frozenset[str] = frozenset()
        self._kbps: float | None = None
        self._rps: float | None = None
        self._cpu: float | None = None
        self._seq = 0

    def sample(self, held: AbstractSet[str]) -> WorkerLoad:
        """Close the current interval and fold its rates into the moving averages. The
        counters grow only while this worker processes a lease, so what a lease shows since
        the last sample is this worker's work; but a lease taken during the interval shows
        only part of it, so a lease's rate is first folded in once it was held for a whole
        interval (until then it is not reported: a reader estimates it from its previous
        owner's report). Leases no longer ``held`` are forgotten at once, and the published
        load is that of the leases held now (see :meth:`current`)."""
        now, cpu, totals = self._clock(), self._cpu_seconds(), self._totals()
        elapsed = max(1e-9, now - self._since)
        cpu_used = cpu - self._cpu_since
        self._since, self._cpu_since = now, cpu
        records = nbytes = 0.0
        for key, current in totals.items():
            before = self._last.get(key, (0.0, 0.0))
            delta_records = max(0.0, current[0] - before[0])
            delta_bytes = max(0.0, current[1] - before[1])
            records += delta_records
            nbytes += delta_bytes
            if key in held and key in self._held:
                kbps = delta_bytes / 1024 / elapsed
                self._lease_kbps[key] = _ema(self._lease_kbps.get(key), kbps, self._alpha)
        for key in (held & self._held) - self._lease_kbps.keys():
            self._lease_kbps[key] = 0.0
        for key in self._lease_kbps.keys() - held:
            del self._lease_kbps[key]
        self._held = frozenset(held)
        self._last = dict(totals)
        self._kbps = _ema(self._kbps, nbytes / 1024 / elapsed, self._alpha)
        self._rps = _ema(self._rps, records / elapsed, self._alpha)
        self._cpu = _ema(self._cpu, 100.0 * cpu_used / elapsed, self._alpha)
        self._seq += 1
        return self.current()

    def current(self) -> WorkerLoad:
        """The load of the leases held now: their smoothed KB/s at the worker's smoothed
        cost per KB/s. The totals' own moving averages would go on counting a lease for
        several reports after it left (or before it arrived), so that a worker that just
        gave a lease away would still look busy and lose another."""
        kbps = sum(self._lease_kbps.values())
        cpu = self._cpu or 0.0
        load = kbps * (cpu / self._kbps if cpu > 0 else 1.0) if self._kbps else cpu
        return WorkerLoad(self.worker_id, load, kbps, self._rps or 0.0, cpu,
                          dict(self._lease_kbps), self._seq)


class LoadTable(DynamoTable):
    """The workers' load reports: one item per worker, hash key ``workerId``."""

    kind = "worker load"

    def __init__(self, client: DynamoDBClient, table_name: str, **options: Any) -> None:
        super().__init__(client, table_name, hash_key=WORKER_ID, **options)

    def publish(self, load: WorkerLoad) -> None:
        self.call("PutItem", self.client.put_item, TableName=self.table_name, Item={
            WORKER_ID: {"S": load.worker_id},
            "load": {"N": f"{load.load:.3f}"},
            "kbps": {"N": f"{load.kbps:.3f}"},
            "recordsPerSecond": {"N": f"{load.records_per_s:.3f}"},
            "cpuPercent": {"N": f"{load.cpu_percent:.3f}"},
            "seq": {"N": str(load.seq)},
            "leases": {"M": {k: {"N": f"{v:.3f}"} for k, v in load.lease_kbps.items()}},
            **({} if load.written_at is None
               else {WRITTEN_AT: {"N": f"{load.written_at:.3f}"}}),
        })

    def read_all(self) -> list[WorkerLoad]:
        loads: list[WorkerLoad] = []
        request: dict[str, Any] = {"TableName": self.table_name, "ConsistentRead": False}
        while True:
            page = self.call("Scan", self.client.scan, **request)
            for item in page.get("Items", []):
                if item.get(WORKER_ID, {}).get("S") == LEADER_ITEM:
                    continue
                try:
                    loads.append(WorkerLoad(
                        item[WORKER_ID]["S"], float(item["load"]["N"]),
                        float(item["kbps"]["N"]), float(item["recordsPerSecond"]["N"]),
                        float(item["cpuPercent"]["N"]),
                        {k: float(v["N"]) for k, v in item.get("leases", {}).get("M", {}).items()},
                        int(item["seq"]["N"]),
                        float(item[WRITTEN_AT]["N"]) if WRITTEN_AT in item else None))
                except (KeyError, ValueError):
                    log.warning("skipping malformed item in %s: %s", self.table_name, sorted(item))
            last = page.get("LastEvaluatedKey")
            if not last:
                return loads
            request["ExclusiveStartKey"] = last

    def withdraw(self, worker_id: str) -> None:
        """A stopping worker's report goes, so nobody counts it in the average."""
        try:
            self.call("DeleteItem", self.client.delete_item, TableName=self.table_name,
                      Key={WORKER_ID: {"S": worker_id}})
        except TABLE_ERRORS as exc:
            log.info("withdrawing the load report of %s failed: %r", worker_id, exc)


class LoadBalancing:
    """One worker's load reports and balancing rounds (the taker's hook). Not thread-safe:
    the taker calls it from its cycle only."""

    def __init__(self, meter: LoadMeter, table: LoadTable, settings: LoadSettings, *,
                 clock: Callable[[], float],
                 wall_clock: Callable[[], float] = time.time,
                 rng: random.Random | None = None) -> None:
        self.meter = meter
        self._rng = rng
        #: stamps each report (``WorkerLoad.written_at``)
        self._wall_clock = wall_clock
        self.table = table
        self.settings = settings
        self._clock = clock
        self.worker_id = meter.worker_id
        self._next_report: float | None = None
        self._next_round: float | None = None
        #: worker id -> (report seq, this worker's clock when it first saw that seq)
        self._seen: dict[str, tuple[int, float]] = {}
        self.mine = meter.current()
        #: the fleet's throughput in the last reports read (0: nothing to balance by load)
        self._fleet_kbps = 0.0
        #: lease key -> its KB/s in the latest fresh report that measured it: what a lease
        #: that moved since its new owner's report weighs (:func:`project`)
        self._known_kbps: dict[str, float] = {}

    def report_if_due(self, held: AbstractSet[str]) -> None:
        now = self._clock()
        if self._next_report is not None and now < self._next_report:
            return
        interval = self.settings.report_interval_s
        # The second report comes after a random share of one to three halves of the
        # interval: a fleet started at once would otherwise report in bursts, and a leader
        # looking for who still lives between two bursts (``leader.plan``'s ``recency``)
        # would find no report newer than a death.
        first = self._next_report is None
        self._next_report = now + (spread(interval, 0.5, 1.5, self._rng) if first else interval)
        self.mine = replace(self.meter.sample(held), written_at=self._wall_clock())
        try:
            self.table.publish(self.mine)
        except TABLE_ERRORS as exc:
            log.warning("worker %s: publishing its load failed: %r", self.worker_id, exc)

    def steals(
        self,
        leases: Iterable[Lease],
        *,
        held: AbstractSet[str],
        live: Callable[[Lease], bool],
        no_steal: Collection[str],
        busy: bool,
        count_steals: Iterable[Lease] = (),
    ) -> list[Lease]:
        """The leases to ask for in this cycle: by load when a balancing round is due and the
        worker is not ``busy`` (taking free leases, or waiting for a handoff to it). While
        the fleet reports no traffic at all (an idle stream, or before the first reports)
        there is no load to balance, and the count rule's ``count_steals`` are made
        instead, so that a fleet still spreads its leases before data flows."""
        self.report_if_due(held)
        now = self._clock()
        if self._fleet_kbps <= 0:
            if self._next_round is None or now >= self._next_round:
                self._refresh(now)
            if self._fleet_kbps <= 0:
                return list(count_steals)
        if busy or (self._next_round is not None and now < self._next_round):
            return []
        reports = self._refresh(now)
        if reports is None:
            return []
        owned: dict[str, list[Lease]] = {}
        owners: dict[str, str] = {}
        stopped: set[str] = set()
        for lease in leases:
            owner = lease.lease_owner
            if owner is None or lease.is_finished or lease.parked is not None:
                continue
            if not live(lease):
                stopped.add(owner)
                continue
            owners[lease.lease_key] = owner
            if owner != self.worker_id and lease.checkpoint_owner is None:
                owned.setdefault(owner, []).append(lease)
        stopped.discard(self.worker_id)
        fleet = project({w: r for w, r in reports.items() if w not in stopped}, owners,
                        self._known_kbps)
        return choose_steals(fleet[self.worker_id], fleet, owned, self.settings, no_steal)

    @property
    def known_kbps(self) -> Mapping[str, float]:
        """Lease key -> its KB/s in the latest fresh report that measured it (for a
        leader's :func:`project`)."""
        return self._known_kbps

    def fleet(self) -> dict[str, WorkerLoad] | None:
        """The fleet's fresh reports (this worker's own latest sample included), read now;
        None when the read failed. For a leader, which balances every worker's load."""
        return self._refresh(self._clock())

    def reported_at(self, worker_id: str) -> float:
        """When (this worker's clock) ``worker_id``'s current report was first seen."""
        if worker_id == self.worker_id:
            return self._clock()
        seen = self._seen.get(worker_id)
        return seen[1] if seen is not None else float("-inf")

    def _refresh(self, now: float) -> dict[str, WorkerLoad] | None:
        """Read the fleet's reports; the fresh ones, this worker's own latest sample in
        place of its published one. Starts the next balancing interval."""
        self._next_round = now + self.settings.balance_interval_s
        try:
            reports = self.table.read_all()
        except TABLE_ERRORS as exc:
            log.warning("worker %s: reading the fleet's load failed: %r", self.worker_id, exc)
            return None
        fleet = {self.worker_id: self.mine}
        stale_after = 3 * self.settings.report_interval_s
        reporting = {report.worker_id for report in reports}
        self._seen = {w: seen for w, seen in self._seen.items() if w in reporting}
        for report in reports:
            seen = self._seen.get(report.worker_id)
            if seen is None or seen[0] != report.seq:
                self._seen[report.worker_id] = (report.seq, now)
                seen = self._seen[report.worker_id]
            if report.worker_id != self.worker_id and now - seen[1] <= stale_after:
                fleet[report.worker_id] = report
        self._fleet_kbps = sum(report.kbps for report in fleet.values())
        for report in fleet.values():
            self._known_kbps.update(report.lease_kbps)
        return fleet


def project(
    reports: Mapping[str, WorkerLoad],
    owners: Mapping[str, str],
    known_kbps: Mapping[str, float],
) -> dict[str, WorkerLoad]:
    """Each report as of the lease table: the leases ``owners`` (lease key -> worker, a
    lease being handed off counted for the worker it goes to) gives each reporter now,
    those in its report at the KB/s it reported, those it gained since (or holds but has
    not measured for a whole interval yet) at ``known_kbps`` - what their previous owner
    reported - and those it lost since not at all; the load at the reporter's own cost per
    KB/s. A report predates the moves made since: judged as it is, a worker that just took
    a lease looks idle enough to take again, and its victim busy enough to lose another,
    so the same lease can go back and forth. A lease nobody measured yet weighs the
    average of the known ones."""
    average_kbps = sum(known_kbps.values()) / len(known_kbps) if known_kbps else 0.0
    measured = [r for r in reports.values() if r.kbps > 0]
    fleet_cost = (sum(r.load for r in measured) / sum(r.kbps for r in measured)
                  if measured else None)
    keys: dict[str, list[str]] = {worker: [] for worker in reports}
    for key, owner in owners.items():
        if owner in keys:
            keys[owner].append(key)
    projected: dict[str, WorkerLoad] = {}
    for worker, report in reports.items():
        lease_kbps = {key: report.lease_kbps[key] if key in report.lease_kbps
                      else known_kbps.get(key, average_kbps) for key in keys[worker]}
        kbps = sum(lease_kbps.values())
        cost = report.load / report.kbps if report.kbps > 0 else fleet_cost
        load = report.load if cost is None else cost * kbps
        projected[worker] = replace(report, load=load, kbps=kbps, lease_kbps=lease_kbps)
    return projected


def choose_steals(
    mine: WorkerLoad,
    fleet: Mapping[str, WorkerLoad],
    owned: Mapping[str, list[Lease]],
    settings: LoadSettings,
    no_steal: Collection[str] = (),
) -> list[Lease]:
    """The leases ``mine`` should ask for, given every fresh report (``fleet``, this
    worker's included) and the leases each other worker holds. Pure, so every rule is
    tested without a table.

    A *victim* is a worker above the average by more than the threshold, or above this
    worker by more than twice the threshold (of the average): the second rule is what still
    balances the rest of the fleet when one worker is far above the average with a lease
    that cannot move (a single hot shard), which lifts the average above everyone else.
    From each victim, most loaded first, this worker takes leases worth at most the damped
    half of the gap between them divided by the number of workers that see the same victim
    (so that they do not all take the same excess at once), and stops once it took the
    damped part of its own deficit under the average; a lease is taken only if
    this worker stays below what the victim keeps and within the threshold above the
    average, so no lease can come back in the next round. When none fits,
    ``allow_overshoot`` allows one move that lowers the pair's sum of squared loads
    (:meth:`_Thief.overshoot`).
    """
    if len(fleet) < 2:
        return []
    average = sum(r.load for r in fleet.values()) / len(fleet)
    if average <= 0 or mine.load >= average:
        return []
    gap = 2 * settings.threshold * average
    ceiling = average * (1 + settings.threshold)

    def is_victim(victim: WorkerLoad, thief: WorkerLoad) -> bool:
        return victim.load > ceiling or victim.load - thief.load > gap

    thief = _Thief(mine, room=ceiling - mine.load,
                   kbps_room=math.inf if settings.max_kbps is None
                   else settings.max_kbps - mine.kbps)
    victims = sorted((r for w, r in fleet.items() if w in owned and is_victim(r, mine)),
                     key=lambda r: (-r.load, r.worker_id))
    for victim in victims:
        thieves = sum(1 for r in fleet.values() if r.load < average and is_victim(victim, r))
        quota = settings.dampening * (victim.load - thief.load) / 2 / max(1, thieves)
        left = victim.load
        candidates = sorted(
            (lease for lease in owned[victim.worker_id] if lease.lease_key not in no_steal),
            key=lambda lease: (-victim.lease_load(lease.lease_key), lease.lease_key))
        before = len(thief.chosen)
        for lease in candidates:
            taken = thief.take(victim, lease, left, quota)
            if taken is not None:
                quota -= taken[1]
                left -= taken[0]
        if len(thief.chosen) == before and settings.allow_overshoot:
            thief.overshoot(victim, candidates, left)
        if (thief.room <= 0 or thief.load >= average
                or thief.load - mine.load >= settings.dampening * (average - mine.load)):
            break
    return thief.chosen


class _Thief:
    """What one balancing round has chosen so far, and the room left."""

    def __init__(self, mine: WorkerLoad, *, room: float, kbps_room: float) -> None:
        self.mine = mine
        self.load = mine.load
        self.room = room
        self.kbps_room = kbps_room
        self.chosen: list[Lease] = []

    def take(self, victim: WorkerLoad, lease: Lease, left: float,
             budget: float) -> tuple[float, float] | None:
        """Choose ``lease`` if it fits ``budget`` and the rules; (its load on the victim,
        its load here) when chosen. ``left`` is what the victim keeps so far."""
        kbps = victim.lease_kbps.get(lease.lease_key, 0.0)
        there = victim.lease_load(lease.lease_key)
        here = self.mine.load_of_kbps(kbps)
        cost = there if here is None else here
        if not (0 < cost <= min(budget, self.room) and kbps <= self.kbps_room
                and self.load + cost <= left - there):
            return None
        self._choose(lease, cost, kbps)
        return there, cost

    def overshoot(self, victim: WorkerLoad, candidates: list[Lease], left: float) -> None:
        """No lease fits the share: take the one whose move lowers the two workers' sum of
        squared loads the most, if any does. That sum falls with every such move and would
        rise with the move back, so no lease can flap; and unlike "stay below the victim"
        it lets a fast worker take a hot lease off a slow one although it is then the
        busier of the two (others take load from it next)."""
        best: tuple[float, Lease, float, float] | None = None
        for lease in candidates:
            kbps = victim.lease_kbps.get(lease.lease_key, 0.0)
            there = victim.lease_load(lease.lease_key)
            here = self.mine.load_of_kbps(kbps)
            cost = there if here is None else here
            if cost <= 0 or kbps > self.kbps_room:
                continue
            change = ((self.load + cost) ** 2 + (left - there) ** 2
                      - self.load ** 2 - left ** 2)
            if change < 0 and (best is None or change < best[0]):
                best = (change, lease, cost, kbps)
        if best is not None:
            self._choose(best[1], best[2], best[3])

    def _choose(self, lease: Lease, cost: float, kbps: float) -> None:
        self.chosen.append(lease)
        self.load += cost
        self.room -= cost
        self.kbps_room -= kbps


def load_balancing(config: KCLConfig, client: DynamoDBClient,
                   metrics: Metrics) -> LoadBalancing | None:
    """The worker's load balancing for ``--lease-assignment load`` (None for ``count``,
    unless ``--lease-assigner leader``, whose liveness is the load reports): the Java KCL 3.x
    knobs read as docs/configuration.md says."""
    if config.lease_assignment != "load" and config.lease_assigner != "leader":
        return None
    failover_s = config.failover_time_ms / 1000
    settings = LoadSettings(
        threshold=config.rebalance_threshold_percentage / 100,
        dampening=config.dampening_percentage / 100,
        allow_overshoot=config.allow_throughput_overshoot,
        max_kbps=(None if config.max_throughput_per_host_kbps is None
                  else float(config.max_throughput_per_host_kbps)),
        balance_interval_s=config.variance_balancing_frequency * 2 * failover_s,
        report_interval_s=config.worker_metrics_reporter_freq_ms / 1000,
        ema_alpha=config.worker_metrics_ema_alpha)
    meter = LoadMeter(config.worker_id, functools.partial(processed_by_lease, metrics),
                      clock=time.monotonic, ema_alpha=settings.ema_alpha)
    table = LoadTable(client, config.lease_table_name + LOAD_TABLE_SUFFIX, metrics=metrics)
    return LoadBalancing(meter, table, settings, clock=time.monotonic)
