"""Worker load for lease assignment by load (``--lease-assignment load``, the strategy
``assignment.LOAD``), the Java KCL 3.x idea, with or without its leader.

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
3. *takes load* (:class:`LoadBalancing`'s rounds, decided by ``assignment.LOAD``), as the
   thief in kclpy's protocol always does: a worker below the fleet's average looks for
   workers above the average by more than ``reBalanceThresholdPercentage`` (or above itself
   by twice that) and asks (graceful handoff) for leases worth its share of the gap, damped
   by ``dampeningPercentage`` (``assignment.choose_steals`` has the rules). A lease fits
   when the thief stays below what the victim keeps and within the threshold above the
   average, so it cannot come back in the next round. When no lease fits,
   ``allowThroughputOvershoot`` lets it take the one lease whose move lowers the two
   workers' sum of squared loads the most: that sum falls with every move, so again nothing
   flaps, and a fast worker can take a hot shard off a slow one.

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
import random
import time
from collections.abc import Callable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from kclpy.leases.assignment import assignment_strategy
from kclpy.leases.dynamo import TABLE_ERRORS, DynamoTable
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
        #: that moved since its new owner's report weighs (``assignment.project``)
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

    def balancing_round(self, held: AbstractSet[str], *,
                        busy: bool) -> tuple[bool, dict[str, WorkerLoad] | None]:
        """The worker-decides taker's round (``assignment.LOAD``): this worker's report
        published when due, then whether the fleet reports any traffic (while it reports
        none there is no load to balance, and the strategy counts instead) and the fleet's
        fresh reports, read now, when a balancing round is due and the worker is not
        ``busy`` (taking free leases, or waiting for a handoff to it); None otherwise, or
        when the read failed."""
        self.report_if_due(held)
        now = self._clock()
        if self._fleet_kbps <= 0:
            if self._next_round is None or now >= self._next_round:
                self._refresh(now)
            if self._fleet_kbps <= 0:
                return False, None
        if busy or (self._next_round is not None and now < self._next_round):
            return True, None
        return True, self._refresh(now)

    @property
    def known_kbps(self) -> Mapping[str, float]:
        """Lease key -> its KB/s in the latest fresh report that measured it (for a
        strategy's ``assignment.project``)."""
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


def load_balancing(config: KCLConfig, client: DynamoDBClient,
                   metrics: Metrics) -> LoadBalancing | None:
    """The worker's load balancing for ``--lease-assignment load`` (None for ``count``,
    unless ``--lease-assigner leader``, whose liveness is the load reports): the Java KCL 3.x
    knobs read as docs/configuration.md says."""
    if (not assignment_strategy(config.lease_assignment).uses_load
            and config.lease_assigner != "leader"):
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
