"""The chaos run: a fleet of ``kclpy-worker`` processes consuming a stream while they are
killed, frozen and restarted, a shard is split, and the proxies throttle and fail requests.

Everything random comes from one seed, printed at the start: each test's own, fixed, unless
``KCLPY_CHAOS_SEED`` names another (or ``random``), so a failing run can be replayed (the
MultiLang children draw from it too); what the processes do in between still depends on
timing, so a replay reproduces the faults, not every interleaving. ``python -m tests.support.chaos``
runs longer chaos against emulators it starts itself.

The fleet reads by polling (GetRecords, throttled by the proxy) or by enhanced fan-out
(``retrieval_mode="fanout"``: one registered consumer for the application, SubscribeToShard
through the same proxy, which refuses subscriptions and cuts or ends them part way).

With ``answer_hold_rate`` the DynamoDB proxy also holds back the answers of lease writes in
bursts (the write lands, its answer comes 0.5-1.1 failover times later), and with
``stall_check`` every worker's ``/status`` is watched for shards held with no running
consumer (``tests.support.liveness``); ``KCLPY_CHAOS_SECONDS`` lengthens the chaos window
of the runs that honour it (``chaos_seconds``), for a soak.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from prometheus_client.parser import text_string_to_metric_families

from kclpy.local import free_port
from kclpy.position import SHARD_END
from kclpy.retrieval.registration import list_consumers
from tests.support.audit import AuditReport, LeaseSampler, audit
from tests.support.faultproxy import FaultProxy
from tests.support.ledger import (
    CHECKPOINT_EVERY_ENV,
    KPL,
    LEDGER_ENV,
    PLAIN,
    RECORD,
    WORKER_ENV,
    Entry,
    Ledger,
    Produced,
)
from tests.support.liveness import POLL_S, HoldBursts, Stall, StallWatch, Watched, plan_bursts
from tests.support.streams import (
    create_stream,
    dynamodb_client,
    kinesis_client,
    put_aggregated,
    put_plain,
    unique_name,
    wait_for_stream_active,
)
from tests.support.waiting import wait_for

if TYPE_CHECKING:
    from mypy_boto3_kinesis import KinesisClient
    from mypy_boto3_kinesis.type_defs import ShardTypeDef

ROOT = Path(__file__).resolve().parent.parent.parent
SEED_ENV = "KCLPY_CHAOS_SEED"
#: a worker's wall-clock offset (``ChaosSettings.clock_skews_s``), applied by the
#: ``sitecustomize`` in this folder
SKEW_ENV = "KCLPY_TEST_CLOCK_SKEW_S"
SKEWED_CLOCK = Path(__file__).parent / "skewed_clock"
#: a longer chaos window for the runs that read it (a soak), in seconds
SECONDS_ENV = "KCLPY_CHAOS_SECONDS"

KILL = "kill -9"
STOP = "SIGSTOP/SIGCONT"
TERM = "SIGTERM+restart"

POLLING = "polling"
FANOUT = "fanout"
SUBSCRIBE = "SubscribeToShard"
#: what the Kinesis proxy does to subscriptions, as its fault counters name it
SUBSCRIPTION_FAULTS = ("cut_stream", "end_stream", "in_use", "throttle", "error_5xx")
#: the kclpy_subscriptions_total outcomes a fan-out run's workers must have counted: a
#: subscription renewed after one ended, and failures on a broken connection and on a
#: shard still in use
SUBSCRIPTION_OUTCOMES = ("renewed", "failed_connection", "failed_in_use")
#: the exception events a SubscribeToShard stream carries for transient trouble, which the
#: fan-out variant with ``subscription_exception_rate`` injects part way through
EXCEPTION_EVENTS = ("InternalFailureException", "KMSThrottlingException",
                    "ResourceInUseException")

_PLAIN_BATCH = 250
_AGGREGATES_PER_BATCH = 10


def seed_from_environment(default: int) -> int:
    """``$KCLPY_CHAOS_SEED`` to replay a run (``random`` for a fresh one, as a soak
    wants), else the run's own ``default``: a suite run is the same plan of faults every
    time, so what one CI run covers the next one covers too."""
    configured = os.environ.get(SEED_ENV)
    if not configured:
        return default
    return random.SystemRandom().randrange(2**32) if configured == "random" else int(configured)


def chaos_seconds(default: float) -> float:
    """``$KCLPY_CHAOS_SECONDS`` for a soak, else ``default`` (what CI can afford)."""
    configured = os.environ.get(SECONDS_ENV)
    return float(configured) if configured else default


@dataclass(frozen=True)
class ChaosSettings:
    seed: int
    shards: int = 6
    workers: int = 3
    plain_records: int = 7_000
    kpl_records: int = 7_000
    per_aggregate: int = 20
    #: disruptions happen during this window; production is spread over most of it
    chaos_s: float = 45.0
    #: seconds between two disruptions, drawn uniformly: a 30 s window sees about as many
    #: kills, freezes and restarts as 45 s did at the former 2-5 s, and a run costs
    #: its window plus the catch-up, so the disruptions are dense rather than the run long
    disruption_gap_s: tuple[float, float] = (1.25, 3.25)
    failover_ms: int = 3000
    get_records_throttle_rate: float = 0.2
    dynamodb_5xx_rate: float = 0.05
    #: after the chaos, how long the fleet may take to process what is left
    catch_up_timeout_s: float = 240.0
    checkpoint_every_batches: int = 2
    #: polling or fanout (enhanced fan-out through one consumer registered for the fleet)
    retrieval_mode: str = POLLING
    #: fan-out: shares of SubscribeToShard calls refused with ResourceInUseException, with
    #: LimitExceededException, and with 500/503
    subscription_refusal_rates: tuple[float, float, float] = (0.05, 0.05, 0.05)
    #: fan-out: shares of subscriptions cut (the connection breaks mid-frame) and ended
    #: early (cleanly, as after the service's five minutes)
    subscription_cut_rate: float = 0.4
    subscription_end_rate: float = 0.2
    #: fan-out: a cut or end comes after this many events (bounds included) or after this
    #: many seconds, whichever is first; kinesis-mock sends an event a second
    subscription_cut_events: tuple[int, int] = (1, 5)
    subscription_cut_s: tuple[float, float] = (0.5, 6.0)
    #: the disruptions that come round in the chaos window; empty: none (the split stays)
    disruption_kinds: tuple[str, ...] = (KILL, STOP, TERM)
    #: held answers: during each burst this share of the DynamoDB answers of
    #: ``answer_hold_operations`` is held back, each for a time drawn from
    #: ``answer_hold_failovers`` times the failover time, after the write landed
    answer_hold_rate: float = 0.0
    answer_hold_failovers: tuple[float, float] = (0.5, 1.1)
    answer_hold_operations: tuple[str, ...] = ("UpdateItem", "TransactWriteItems")
    #: held answers come in this many bursts of this length, spread over the chaos window
    answer_hold_bursts: int = 3
    answer_hold_burst_s: float = 6.0
    #: watch every worker's /status: a shard held with no running consumer for longer than
    #: the failover time fails the run
    stall_check: bool = False
    #: while the fleet catches up, fail when it made no progress for this long (None: wait
    #: for ``catch_up_timeout_s``)
    stuck_after_s: float | None = None
    #: lag recovery (``--max-lag-ms``) on every worker; None: off
    max_lag_ms: int | None = None
    #: per worker place (by index): its wall clock's offset from the host's, in seconds
    #: (``tests/support/skewed_clock``); places past the tuple's end are not skewed
    clock_skews_s: tuple[float, ...] = ()
    #: polling: the GetRecords limit of every worker (``--max-records``); None: kclpy's.
    #: Without one a batch is whatever a shard holds beyond the checkpoint, so the number
    #: of batches, and of whatever a processor draws per batch, shrinks as the fleet falls
    #: behind on a slow machine
    max_records: int | None = None
    #: fan-out: share of subscriptions ended at a cut point by an exception event, its type
    #: drawn from EXCEPTION_EVENTS
    subscription_exception_rate: float = 0.0
    #: fan-out: the disruptions go on past ``chaos_s``, for at most this long, until the
    #: proxy has made every subscription fault these settings inject and the workers have
    #: counted every SUBSCRIPTION_OUTCOMES (``missing_subscription_faults``). How many
    #: subscriptions a window sees depends on the machine, not only on the window: on a
    #: loaded one most SubscribeToShard calls are refused while a stopped or killed
    #: predecessor's subscription is open, and a cut is only made in one that streams
    subscription_overtime_s: float = 0.0
    #: fan-out with exception events: the overtime also goes on until the workers' logs
    #: show this many kinds of them handled (``handled_exception_events``)
    exception_kinds_handled: int = 0

    @property
    def failover_s(self) -> float:
        return self.failover_ms / 1000

    @property
    def subscription_faults_injected(self) -> tuple[str, ...]:
        """The SUBSCRIPTION_FAULTS these settings inject (fan-out only)."""
        if self.retrieval_mode != FANOUT:
            return ()
        in_use, throttle, server_error = self.subscription_refusal_rates
        rates = {"cut_stream": self.subscription_cut_rate,
                 "end_stream": self.subscription_end_rate, "in_use": in_use,
                 "throttle": throttle, "error_5xx": server_error}
        return tuple(kind for kind in SUBSCRIPTION_FAULTS if rates[kind] > 0)


@dataclass
class ChaosResult:
    settings: ChaosSettings
    report: AuditReport
    disruptions: Counter[str] = field(default_factory=Counter)
    #: exit codes of the workers stopped with SIGTERM (during the run and at its end)
    sigterm_exit_codes: list[int] = field(default_factory=list)
    split: tuple[str, list[str]] | None = None
    throttles_injected: int = 0
    server_errors_injected: int = 0
    duration_s: float = 0.0
    logs: Path = Path()
    #: fan-out: the proxy's subscription faults by kind (SUBSCRIPTION_FAULTS), and the
    #: SubscribeToShard calls it saw
    subscription_faults: Counter[str] = field(default_factory=Counter)
    subscribe_calls: int = 0
    #: fan-out: kclpy_subscriptions_total by outcome, summed over every worker process, each
    #: read right before it was killed or sent SIGTERM
    subscription_outcomes: Counter[str] = field(default_factory=Counter)
    #: fan-out: the proxy's exception events the workers handled, by (event type, the
    #: ``failed_<kind>`` outcome they were counted under), from the workers' logs
    #: (``handled_exception_events``)
    exception_events_handled: Counter[tuple[str, str]] = field(default_factory=Counter)
    #: fan-out: the stream's registered consumers at the end
    consumers: list[str] = field(default_factory=list)
    #: the duplicate window: the most records one processor instance repeated, and the
    #: span of the previous owners' processing those repeats redid
    largest_repeat: int = 0
    largest_repeat_s: float = 0.0
    #: held DynamoDB answers (by operation) and the stalls the /status watch found
    holds: Counter[str] = field(default_factory=Counter)
    longest_hold_s: float = 0.0
    stalls: list[Stall] = field(default_factory=list)
    #: why the fleet did not catch up after the chaos (None: it did)
    catch_up_failure: str | None = None

    def figure_lines(self) -> list[str]:
        s = self.settings
        split = f"{self.split[0]} -> {', '.join(self.split[1])}" if self.split else "none"
        disruptions = ", ".join(f"{kind}: {n}" for kind, n in sorted(self.disruptions.items()))
        lines = [
            f"chaos seed {s.seed}: {s.workers} workers ({s.retrieval_mode}), {s.shards} "
            f"shards, {s.chaos_s:g} s of chaos, failover {s.failover_ms} ms, run took "
            f"{self.duration_s:.0f} s",
            f"disruptions: {disruptions}; split: {split}",
            f"injected: {self.throttles_injected} GetRecords throttles "
            f"({s.get_records_throttle_rate:.0%}), {self.server_errors_injected} DynamoDB 5xx "
            f"({s.dynamodb_5xx_rate:.0%})",
        ]
        if s.retrieval_mode == FANOUT:
            faults = ", ".join(f"{kind} {self.subscription_faults[kind]}"
                               for kind in (*SUBSCRIPTION_FAULTS, *EXCEPTION_EVENTS)
                               if kind in SUBSCRIPTION_FAULTS or self.subscription_faults[kind])
            outcomes = ", ".join(f"{outcome} {n}" for outcome, n in
                                 sorted(self.subscription_outcomes.items()))
            lines += [
                f"subscriptions: {self.subscribe_calls} SubscribeToShard calls; injected: "
                f"{faults}",
                f"kclpy_subscriptions_total of all workers: {outcomes or 'none'}; "
                f"consumers: {', '.join(self.consumers) or 'none'}",
            ]
            if self.exception_events_handled:
                handled = ", ".join(f"{event} {n} ({outcome})" for (event, outcome), n in
                                    sorted(self.exception_events_handled.items()))
                lines.append(f"exception events the workers handled (their logs): {handled}")
        lines.append(f"largest repeat after a failover: {self.largest_repeat} records, "
                     f"redoing {self.largest_repeat_s:.1f} s of the previous owners' processing")
        lines += liveness_lines(s, self.holds, self.longest_hold_s, self.stalls)
        return [*lines, *self.report.figure_lines()]


def liveness_lines(settings: ChaosSettings, holds: Counter[str], longest_hold_s: float,
                   stalls: list[Stall]) -> list[str]:
    """The held answers and the stalls of a run, when it held answers or watched for stalls."""
    lines = []
    if settings.answer_hold_rate:
        low, high = settings.answer_hold_failovers
        by_operation = ", ".join(f"{op} {n}" for op, n in sorted(holds.items()))
        lines.append(
            f"held answers: {sum(holds.values())} ({by_operation or 'none'}), "
            f"{settings.answer_hold_rate:.0%} in {settings.answer_hold_bursts} bursts of "
            f"{settings.answer_hold_burst_s:g} s, {low:g}-{high:g} x failover, longest "
            f"{longest_hold_s:.1f} s")
    if settings.stall_check:
        lines.append(f"stalled shards: {len(stalls)}")
        lines += [f"  {stall.describe()}" for stall in stalls]
    return lines


def wait_caught_up(missing: Callable[[], int], settings: ChaosSettings,
                   watch: StallWatch | None, what: str) -> str | None:
    """Wait until ``missing()`` is 0; else say why not. Give up at once when the watch found
    a stalled shard, or when nothing was caught up for ``settings.stuck_after_s``: either
    would only end at the timeout, minutes later, and then without naming what stopped. The
    caller goes on to stop the fleet and check what it did, so a failed run still shows its
    figures."""
    deadline = time.monotonic() + settings.catch_up_timeout_s
    best = missing()
    progressed = time.monotonic()
    while best:
        now = time.monotonic()
        stalls = watch.stalls() if watch is not None else []
        if stalls:
            return (f"{what}: {best} left, and shards stalled: "
                    + "; ".join(stall.describe() for stall in stalls))
        stuck = settings.stuck_after_s
        if stuck is not None and now - progressed > stuck:
            return f"{what}: stuck at {best} left for {now - progressed:.0f} s"
        if now > deadline:
            return f"{what}: {best} left after {settings.catch_up_timeout_s:g} s"
        time.sleep(0.5)
        left = missing()
        if left < best:
            best, progressed = left, time.monotonic()
    return None


def repeats(journal: Iterable[Entry]) -> tuple[int, float]:
    """The duplicate window, measured: the most records one session (processor instance)
    processed after an earlier session had, and the time between the first and the last of
    those earlier deliveries (how much of the previous owners' work it redid)."""
    first: dict[str, tuple[str, float]] = {}
    redone: defaultdict[str, list[float]] = defaultdict(list)
    for entry in journal:
        if entry.event != RECORD or entry.id is None:
            continue
        seen = first.setdefault(entry.id, (entry.session, entry.at))
        if seen[0] != entry.session:
            redone[entry.session].append(seen[1])
    if not redone:
        return 0, 0.0
    largest = max(redone.values(), key=len)
    return len(largest), max(largest) - min(largest)


class Liveness(Protocol):
    """Where a run notes the answers held back and the stalls found."""

    holds: Counter[str]
    longest_hold_s: float
    stalls: list[Stall]


class Tally(Protocol):
    """Where a chaos window counts its disruptions and graceful exits."""

    disruptions: Counter[str]
    sigterm_exit_codes: list[int]
    split: tuple[str, list[str]] | None


@dataclass
class _Slot:
    """One of the fleet's places; each restart is a new process with a new worker id."""

    index: int
    generation: int = 0
    process: subprocess.Popen[bytes] | None = None
    worker_id: str = ""
    #: monotonic time at which a frozen worker is resumed or a killed one restarted
    due: float | None = None
    state: str = "running"  # running, stopped, dead
    #: the loopback port of this process's /metrics, when the fleet serves them
    metrics_port: int | None = None


class _Fleet:
    def __init__(
        self, settings: ChaosSettings, args: Callable[[str], list[str]], ledger: Path, logs: Path,
        env: dict[str, str] | None = None, counter: tuple[str, str] | None = None,
        ops: bool = False,
    ) -> None:  # fmt: skip
        self._settings = settings
        self._args = args
        self._ledger = ledger
        self._logs = logs
        self._env = env or {}
        #: (name, label): a counter every process serves on /metrics, read into
        #: ``harvested`` every second (``harvest_every``) and before the process is killed
        #: or sent SIGTERM
        self._counter = counter
        #: every process serves /metrics, /status and /healthz, even without a counter
        self._ops = ops
        #: (worker id, a series' labels) -> (what earlier tenures of the series counted, its
        #: last value read). A shard's series leaves a worker with the shard and starts
        #: again from 0 if the shard comes back, so a series is read while it lives and a
        #: value lower than the last one read is a new tenure's.
        self._read: dict[tuple[str, frozenset[tuple[str, str]]], tuple[float, float]] = {}
        #: one harvest at a time, so two reads of a series are stored in the order taken
        self._harvesting = threading.Lock()
        self.slots = [_Slot(i) for i in range(settings.workers)]

    def spawn(self, slot: _Slot) -> None:
        slot.worker_id = f"chaos-w{slot.index}-g{slot.generation}"
        slot.generation += 1
        env = {
            **os.environ,
            LEDGER_ENV: str(self._ledger),
            WORKER_ENV: slot.worker_id,
            CHECKPOINT_EVERY_ENV: str(self._settings.checkpoint_every_batches),
            **self._env,
        }
        skews = self._settings.clock_skews_s
        if slot.index < len(skews) and skews[slot.index]:
            env[SKEW_ENV] = str(skews[slot.index])
            env["PYTHONPATH"] = os.pathsep.join(
                filter(None, [str(SKEWED_CLOCK), env.get("PYTHONPATH", "")]))
        args = self._args(slot.worker_id)
        slot.metrics_port = None
        if self._counter is not None or self._ops:
            slot.metrics_port = free_port()
            args += ["--metrics-port", str(slot.metrics_port), "--metrics-host", "127.0.0.1"]
        with (self._logs / f"{slot.worker_id}.log").open("wb") as log:
            slot.process = subprocess.Popen(
                [sys.executable, "-m", "kclpy", *args],
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        slot.state = "running"
        slot.due = None

    def running(self) -> list[_Slot]:
        return [slot for slot in self.slots if slot.state == "running"]

    def up(self, slot: _Slot) -> bool:
        """The worker logged that it is consuming, so its SIGTERM handler is installed: a
        SIGTERM before that (while Python still imports) kills it like any program, which
        says nothing about kclpy's graceful shutdown."""
        log = (self._logs / f"{slot.worker_id}.log").read_text(errors="replace")
        return f"worker {slot.worker_id} consuming" in log

    def wait_up(self, timeout: float) -> None:
        """Wait until every slot's worker is up; a timeout names those that are not, with
        their exit codes and the end of their logs, which is all a CI run leaves behind."""
        try:
            wait_for(lambda: all(self.up(slot) for slot in self.slots), timeout,
                     "every worker to be up")
        except AssertionError as exc:
            down = []
            for slot in self.slots:
                if self.up(slot):
                    continue
                code = slot.process.poll() if slot.process is not None else None
                tail = (self._logs / f"{slot.worker_id}.log").read_text(
                    errors="replace").splitlines()[-15:]
                down.append(f"{slot.worker_id} ({slot.state}, exit code {code}):\n  "
                            + "\n  ".join(tail))
            raise AssertionError(f"{exc}; not up:\n" + "\n".join(down)) from None

    def terminate(self, *slots: _Slot) -> list[int]:
        """SIGTERM, then the exit codes of the graceful exits; a worker still running after
        a minute is killed and its code is -9, which reads as a failed graceful shutdown."""
        for slot in slots:
            self.harvest(slot)
        processes = [slot.process for slot in slots if slot.process is not None]
        for process in processes:
            process.send_signal(signal.SIGTERM)
        codes = []
        for process in processes:
            try:
                codes.append(process.wait(60))
            except subprocess.TimeoutExpired:
                process.kill()
                codes.append(process.wait())
        return codes

    def revive(self, slot: _Slot) -> None:
        """Resume a frozen worker, restart a killed one."""
        if slot.state == "stopped":
            assert slot.process is not None
            slot.process.send_signal(signal.SIGCONT)
            slot.state = "running"
            slot.due = None
        elif slot.state == "dead":
            self.spawn(slot)

    @property
    def harvested(self) -> Counter[str]:
        """The counter summed by its label over every process and every series it served."""
        if self._counter is None:
            return Counter()
        label = self._counter[1]
        totals: Counter[str] = Counter()
        with self._harvesting:
            for (_, labels), (earlier, last) in self._read.items():
                totals[dict(labels)[label]] += int(earlier + last)
        return totals

    def harvest(self, slot: _Slot) -> None:
        """Read the running worker's counter, before its counts die with it (or with a
        shard it lets go); a worker that does not answer (still starting) adds nothing."""
        if self._counter is None:
            return
        name, label = self._counter
        with self._harvesting:
            if slot.metrics_port is None or slot.state != "running":
                return
            url = f"http://127.0.0.1:{slot.metrics_port}/metrics"
            try:
                with urllib.request.urlopen(url, timeout=5) as response:
                    text = response.read().decode()
            except OSError:
                return
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    if sample.name == name and label in sample.labels:
                        key = (slot.worker_id, frozenset(sample.labels.items()))
                        earlier, last = self._read.get(key, (0.0, 0.0))
                        if sample.value < last:
                            earlier += last
                        self._read[key] = (earlier, sample.value)

    def harvest_every(self, interval_s: float, stop: threading.Event) -> None:
        """Read every running worker's counter each ``interval_s`` until ``stop``."""
        while not stop.wait(interval_s):
            for slot in self.running():
                self.harvest(slot)

    def watched(self) -> list[Watched]:
        """The running workers' /status ports, for a StallWatch."""
        return [Watched(slot.worker_id, slot.metrics_port) for slot in self.running()
                if slot.metrics_port is not None]

    def kill_all(self) -> None:
        """Last-resort cleanup: no worker outlives the run, frozen or not."""
        for slot in self.slots:
            process = slot.process
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGCONT)
                process.kill()
                process.wait()


class _Producer:
    """Puts the planned records at an even pace over ``duration_s`` on its own thread and
    records each user record in the ledger once Kinesis has accepted it."""

    def __init__(
        self, kinesis: KinesisClient, stream: str, ledger: Ledger, settings: ChaosSettings,
        duration_s: float,
    ) -> None:  # fmt: skip
        self._kinesis = kinesis
        self._stream = stream
        self._ledger = ledger
        self._rng = random.Random(f"{settings.seed}-producer")
        self._per_aggregate = settings.per_aggregate
        self._batches = self._plan(settings)
        self._duration_s = duration_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-producer", daemon=True)
        self.error: BaseException | None = None

    def _plan(self, settings: ChaosSettings) -> list[tuple[str, list[str]]]:
        batches: list[tuple[str, list[str]]] = []
        ids = [f"p-{n:06d}" for n in range(settings.plain_records)]
        for start in range(0, len(ids), _PLAIN_BATCH):
            batches.append((PLAIN, ids[start : start + _PLAIN_BATCH]))
        ids = [f"k-{n:06d}" for n in range(settings.kpl_records)]
        size = settings.per_aggregate * _AGGREGATES_PER_BATCH
        for start in range(0, len(ids), size):
            batches.append((KPL, ids[start : start + size]))
        self._rng.shuffle(batches)
        return batches

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)
        if self._thread.is_alive():
            self._stop.set()
            self._thread.join(30)
            raise AssertionError(f"the producer did not finish within {timeout:g} s")
        if self.error is not None:
            raise AssertionError(f"the producer failed: {self.error!r}") from self.error

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        started = time.monotonic()
        interval = self._duration_s / max(1, len(self._batches))
        try:
            for index, (kind, ids) in enumerate(self._batches):
                if self._stop.wait(max(0.0, started + index * interval - time.monotonic())):
                    return
                self._ledger.record_produced(self._put(kind, ids))
        except BaseException as exc:  # surfaced by join()
            self.error = exc

    def _put(self, kind: str, ids: list[str]) -> list[Produced]:
        payloads = [record_id.encode() for record_id in ids]
        if kind == PLAIN:
            keys = [str(self._rng.getrandbits(64)) for _ in ids]
            placed = put_plain(self._kinesis, self._stream, payloads, keys)
            now = time.time()
            return [
                Produced(record_id, PLAIN, shard, seq, 0, now)
                for record_id, (shard, seq) in zip(ids, placed, strict=True)
            ]
        key = str(self._rng.getrandbits(64))
        aggregates = put_aggregated(self._kinesis, self._stream, payloads, self._per_aggregate, key)
        now = time.time()
        rows: list[Produced] = []
        position = 0
        for shard, seq, count in aggregates:
            for sub in range(count):
                rows.append(Produced(ids[position], KPL, shard, seq, sub, now))
                position += 1
        return rows


def _start_split(
    kinesis: KinesisClient, stream: str, rng: random.Random
) -> tuple[str, Future[list[str]]]:
    """Split one open shard, chosen now, on a thread of its own; the shard and its future
    children. kinesis-mock keeps the stream UPDATING for seconds (tens of seconds on a busy
    machine), and the disruptions must not wait for it."""
    shards = [
        s for s in _all_shards(kinesis, stream)
        if "EndingSequenceNumber" not in s["SequenceNumberRange"]
    ]  # fmt: skip
    parent = rng.choice(sorted(shards, key=lambda s: s["ShardId"]))
    executor = ThreadPoolExecutor(1, thread_name_prefix="chaos-split")
    children = executor.submit(_split, kinesis, stream, parent)
    executor.shutdown(wait=False)
    return parent["ShardId"], children


def _split(kinesis: KinesisClient, stream: str, parent: ShardTypeDef) -> list[str]:
    low = int(parent["HashKeyRange"]["StartingHashKey"])
    high = int(parent["HashKeyRange"]["EndingHashKey"])
    kinesis.split_shard(
        StreamName=stream, ShardToSplit=parent["ShardId"], NewStartingHashKey=str((low + high) // 2)
    )
    wait_for_stream_active(kinesis, stream)
    return sorted(
        s["ShardId"]
        for s in _all_shards(kinesis, stream)
        if s.get("ParentShardId") == parent["ShardId"]
    )


def _all_shards(kinesis: KinesisClient, stream: str) -> list[ShardTypeDef]:
    shards: list[ShardTypeDef] = []
    response = kinesis.list_shards(StreamName=stream)
    while True:
        shards.extend(response["Shards"])
        token = response.get("NextToken")
        if not token:
            return shards
        response = kinesis.list_shards(NextToken=token)


def _parents(kinesis: KinesisClient, stream: str) -> dict[str, list[str]]:
    lineage: dict[str, list[str]] = {}
    for shard in _all_shards(kinesis, stream):
        parents = (shard.get("ParentShardId"), shard.get("AdjacentParentShardId"))
        lineage[shard["ShardId"]] = [p for p in parents if p]
    return lineage


def worker_args(
    settings: ChaosSettings, stream: str, application: str, kinesis_url: str, dynamodb_url: str,
    worker_id: str, processor_args: list[str],
) -> list[str]:  # fmt: skip
    """One chaos worker's ``kclpy-worker`` command line after ``-m kclpy``."""
    # Always said: a properties file without retrievalMode reads with fan-out, as the Java
    # MultiLangDaemon does, and the MultiLang fleet read with fan-out unseen (no
    # subscription faults, no GetRecords to throttle) while its settings said polling.
    retrieval = ["--retrieval-mode", settings.retrieval_mode]
    if settings.max_lag_ms is not None:
        retrieval += ["--max-lag-ms", str(settings.max_lag_ms)]
    if settings.max_records is not None:
        retrieval += ["--max-records", str(settings.max_records)]
    return [*retrieval,
        "--stream-name", stream,
        "--application-name", application,
        *processor_args,
        "--worker-id", worker_id,
        "--region", "us-east-1",
        "--kinesis-endpoint", kinesis_url,
        "--dynamodb-endpoint", dynamodb_url,
        "--initial-position", "TRIM_HORIZON",
        "--failover-time-ms", str(settings.failover_ms),
        "--idle-time-between-reads-ms", "100",
        "--shard-sync-interval-ms", "2000",
        "--parent-shard-poll-interval-ms", "200",
        "--task-backoff-time-ms", "50",
        "--shutdown-grace-ms", "5000",
    ]  # fmt: skip


class ChaosRig:
    """What every chaos run stands on: a seeded random source, a fresh stream and
    application, the ledger, fault proxies in front of Kinesis (GetRecords throttled) and
    DynamoDB (5xx), and a sampler of the lease table. Use it as a context manager; it stops
    and kills everything it started on the way out."""

    def __init__(self, kinesis_url: str, dynamodb_url: str, workdir: Path,
                 settings: ChaosSettings, name: str, say: Callable[[str], None]) -> None:
        say(f"{name} seed {settings.seed} (replay with {SEED_ENV}={settings.seed})")
        self.settings = settings
        self.workdir = workdir
        self.say = say
        self.rng = random.Random(settings.seed)
        self.stream = unique_name(name.replace(" ", "-"))
        self.application = unique_name(f"{name.replace(' ', '-')}-app")
        self.kinesis = kinesis_client(kinesis_url)
        create_stream(self.kinesis, self.stream, settings.shards)
        self.logs = workdir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self._urls = (kinesis_url, dynamodb_url)
        self.stack = ExitStack()

    def __enter__(self) -> ChaosRig:
        kinesis_url, dynamodb_url = self._urls
        stack, settings = self.stack, self.settings
        self.ledger = stack.enter_context(Ledger(self.workdir / "ledger.db"))
        self.kinesis_proxy = stack.enter_context(FaultProxy(kinesis_url, seed=settings.seed))
        self.dynamodb_proxy = stack.enter_context(
            FaultProxy(dynamodb_url, seed=settings.seed + 1))
        self.kinesis_proxy.set_rule("GetRecords",
                                    throttle_rate=settings.get_records_throttle_rate)
        if settings.retrieval_mode == FANOUT:
            in_use, throttle, server_error = settings.subscription_refusal_rates
            self.kinesis_proxy.set_rule(
                SUBSCRIBE, in_use_rate=in_use, throttle_rate=throttle,
                error_5xx_rate=server_error, cut_stream_rate=settings.subscription_cut_rate,
                end_stream_rate=settings.subscription_end_rate,
                stream_cut_frames=settings.subscription_cut_events,
                stream_cut_s=settings.subscription_cut_s,
                stream_exception_rate=settings.subscription_exception_rate,
                stream_exceptions=EXCEPTION_EVENTS)
        self.dynamodb_proxy.set_rule("*", error_5xx_rate=settings.dynamodb_5xx_rate)
        self.sampler = LeaseSampler(dynamodb_client(dynamodb_url), self.application).start()
        stack.callback(self.sampler.stop)
        self.watch: StallWatch | None = None
        self.bursts: HoldBursts | None = None
        return self

    def __exit__(self, *exc: object) -> None:
        self.stack.close()

    def window(self, result: Tally, processor_args: list[str],
               env: dict[str, str] | None = None,
               counter: tuple[str, str] | None = None) -> _Fleet:
        """Start the fleet, and once it is up the producer; disrupt for the chaos window,
        then resume every worker and let the producer finish. The fleet keeps running (the
        rig kills it on the way out). With ``counter`` (name, label), each worker serves /metrics on
        a loopback port of its own, and the counter is summed in the fleet's
        ``harvested`` over every process and every shard it held, read every second and
        before the process goes."""
        settings = self.settings

        def args(worker_id: str) -> list[str]:
            return worker_args(settings, self.stream, self.application,
                               self.kinesis_proxy.url, self.dynamodb_proxy.url, worker_id,
                               processor_args)

        fleet = _Fleet(settings, args, self.workdir / "ledger.db", self.logs, env, counter,
                       ops=settings.stall_check)
        self.stack.callback(fleet.kill_all)
        if counter is not None:
            stop = threading.Event()
            harvester = threading.Thread(target=fleet.harvest_every, args=(1.0, stop),
                                         name="chaos-harvest", daemon=True)
            harvester.start()
            self.stack.callback(harvester.join)
            self.stack.callback(stop.set)
        for slot in fleet.slots:
            fleet.spawn(slot)
        # The window starts once the fleet is up. Started at the spawn, it was spent on
        # Python's imports on a loaded machine (workers up 27-36 s after their spawn, load
        # average 25 on 2 cores): a SIGTERM, first in its round, waits for a worker that is
        # up and the kills and freezes wait behind it, so the 30 s window of
        # tests/state/test_state_chaos.py's skewed-clocks run ended with no disruption at all.
        fleet.wait_up(60)
        if settings.stall_check:
            sampler = self.sampler
            self.watch = StallWatch(
                fleet.watched, settings.failover_s,
                lambda: {s.shard for s in sampler.samples() if s.checkpoint == SHARD_END},
            ).start()
            self.stack.callback(self.watch.stop)
        if settings.answer_hold_rate:
            low, high = settings.answer_hold_failovers
            plan = plan_bursts(random.Random(f"{settings.seed}-holds"), settings.chaos_s,
                               settings.answer_hold_bursts, settings.answer_hold_burst_s)
            self.bursts = HoldBursts(
                self.dynamodb_proxy, settings.answer_hold_operations, settings.answer_hold_rate,
                (low * settings.failover_s, high * settings.failover_s), plan, self.say).start()
            self.stack.callback(self.bursts.stop)
        producer = _Producer(self.kinesis, self.stream, self.ledger, settings,
                             settings.chaos_s * 0.8)
        self.stack.callback(producer.stop)
        producer.start()
        proxy = self.kinesis_proxy
        result.split = _disrupt(
            fleet, self.ledger, self.kinesis, self.stream, settings, self.rng, result, self.say,
            lambda: missing_subscription_faults(settings, proxy, fleet.harvested, self.logs))
        for slot in fleet.slots:
            fleet.revive(slot)
        producer.join(settings.catch_up_timeout_s)
        if self.bursts is not None:
            self.bursts.stop()
        return fleet

    def settle(self, result: Liveness) -> None:
        """After the catch-up: watch one more failover time and a bit, so a shard that
        stalled at the very end is found too, then note the holds and the stalls."""
        settings = self.settings
        if self.watch is not None:
            watch = self.watch
            due = watch.polls + math.ceil((settings.failover_s + 1.0) / POLL_S) + 1
            wait_for(lambda: watch.polls >= due, settings.catch_up_timeout_s,
                     "the stall watch to look for one more failover time")
            result.stalls = watch.stop()
        held = self.dynamodb_proxy.holds()
        result.holds = Counter({op: len(self.dynamodb_proxy.holds(op))
                                for op in settings.answer_hold_operations})
        result.longest_hold_s = max(held, default=0.0)


def run_chaos(
    kinesis_url: str,
    dynamodb_url: str,
    workdir: Path,
    settings: ChaosSettings,
    say: Callable[[str], None] = print,
) -> ChaosResult:
    """Run the fleet under chaos, let it catch up, stop it gracefully, and audit the ledger."""
    started = time.monotonic()
    with ChaosRig(kinesis_url, dynamodb_url, workdir, settings, "chaos", say) as rig:
        ledger = rig.ledger
        result = ChaosResult(settings, AuditReport(), logs=rig.logs)
        fanout = settings.retrieval_mode == FANOUT
        fleet = rig.window(result, ["--processor", "tests.support.ledger:LedgerProcessor"],
                           counter=("kclpy_subscriptions_total", "outcome") if fanout else None)
        say(f"chaos over after {time.monotonic() - started:.0f} s; the fleet catches up")
        over = time.monotonic()
        result.catch_up_failure = wait_caught_up(
            ledger.missing_count, settings, rig.watch,
            f"every produced record to be processed (logs in {rig.logs})")
        say(f"catch-up took {time.monotonic() - over:.0f} s")
        fleet.wait_up(60)
        rig.settle(result)
        if fanout:
            proxy = rig.kinesis_proxy
            result.subscription_faults = Counter(
                {kind: proxy.faults(kind, SUBSCRIBE) for kind in SUBSCRIPTION_FAULTS})
            result.subscription_faults.update(
                {name: proxy.faults(f"exception_event:{name}", SUBSCRIBE)
                 for name in EXCEPTION_EVENTS})
            result.subscribe_calls = proxy.requests(SUBSCRIBE)
            arn = rig.kinesis.describe_stream_summary(StreamName=rig.stream)[
                "StreamDescriptionSummary"]["StreamARN"]
            result.consumers = sorted(c["ConsumerName"] for c in list_consumers(rig.kinesis, arn))
        result.sigterm_exit_codes.extend(fleet.terminate(*fleet.slots))
        result.subscription_outcomes = fleet.harvested
        if fanout:
            result.exception_events_handled = handled_exception_events(rig.logs)
        samples = rig.sampler.stop()
        ledger.record_lease_samples(samples)
        result.throttles_injected = rig.kinesis_proxy.faults("throttle", "GetRecords")
        result.server_errors_injected = rig.dynamodb_proxy.faults("error_5xx")
        journal = ledger.journal()
        result.report = audit(
            ledger.produced(), journal, samples, _parents(rig.kinesis, rig.stream)
        )
        result.largest_repeat, result.largest_repeat_s = repeats(journal)
    result.duration_s = time.monotonic() - started
    return result


#: the retry warning ``kclpy.retrieval.source.Retrying`` logs right after it counted a failed
#: subscription as ``failed_<kind>``, here for an exception event the fault proxy sent (its
#: payload names the event's type)
_HANDLED_EVENT = re.compile(
    r"SubscribeToShard on \S+ failed \((?P<kind>\w+), attempt \d+\); retrying in .*"
    r"FaultProxy: (?P<event>\w+)")


def handled_exception_events(logs: Path) -> Counter[tuple[str, str]]:
    """The exception events the workers handled, by (event type, outcome counted), read
    from every worker process's log.

    The proxy counts an event when it writes it, not when a worker reads it: one written
    into the subscription of a frozen or killed worker may never be read. And a worker's
    count lives in a per-shard series that leaves /metrics with the shard, a SIGSTOPped
    worker's shards leave as soon as it resumes, and a killed one's /metrics may not answer
    its last read: ``harvested`` can miss every event of a kind. A worker's log is written
    as it goes and outlives a SIGKILL, so it is the lossless record of what was handled.
    """
    handled: Counter[tuple[str, str]] = Counter()
    for log in sorted(logs.glob("*.log")):
        for line in log.read_text(errors="replace").splitlines():
            if (match := _HANDLED_EVENT.search(line)) is not None:
                handled[(match["event"], f"failed_{match['kind']}")] += 1
    return handled


def missing_subscription_faults(settings: ChaosSettings, proxy: FaultProxy,
                                outcomes: Counter[str], logs: Path) -> list[str]:
    """What a fan-out run has yet to see: the subscription faults the settings inject that
    the proxy has not made yet; with exception events, fewer kinds of them handled than
    ``exception_kinds_handled`` (the workers' logs), else the SUBSCRIPTION_OUTCOMES absent
    from ``outcomes`` (the workers' kclpy_subscriptions_total; refusals and cuts alone make
    them all); nothing for a run without overtime."""
    if settings.retrieval_mode != FANOUT or not settings.subscription_overtime_s:
        return []
    missing = [kind for kind in settings.subscription_faults_injected
               if not proxy.faults(kind, SUBSCRIBE)]
    if settings.subscription_exception_rate > 0:
        kinds = {event for event, _ in handled_exception_events(logs)}
        if len(kinds) < settings.exception_kinds_handled:
            missing.append(f"{settings.exception_kinds_handled} kinds of exception events "
                           f"handled ({len(kinds)} so far)")
        return missing
    return missing + [outcome for outcome in SUBSCRIPTION_OUTCOMES if not outcomes[outcome]]


#: how often an overtime looks again at what is missing
_OVERTIME_POLL_S = 0.5


def _disrupt(
    fleet: _Fleet,
    ledger: Ledger,
    kinesis: KinesisClient,
    stream: str,
    settings: ChaosSettings,
    rng: random.Random,
    result: Tally,
    say: Callable[[str], None],
    missing: Callable[[], list[str]],
) -> tuple[str, list[str]]:
    """The chaos window: every few seconds one running worker is killed, frozen past the
    failover time, or stopped gracefully and restarted; one shard is split on the way.

    At least two workers keep running through every disruption, so the fleet always has
    somewhere to move leases to. The kinds come round in shuffled rounds, so even a short
    window sees each of them; a SIGTERM waits for a worker that is up. While ``missing()``
    names a fault the run has yet to see, the window goes on, for at most
    ``settings.subscription_overtime_s``: each disruption moves leases, and each moved
    lease is subscribed to again.
    """
    begin = time.monotonic()
    end = begin + settings.chaos_s
    overtime_end = end + settings.subscription_overtime_s
    announced = False

    def going_on(now: float) -> bool:
        nonlocal announced
        if now < end:
            return True
        left = missing() if now < overtime_end else []
        if left and not announced:
            say(f"{now - begin:5.1f} s  the window goes on (at most "
                f"{settings.subscription_overtime_s:g} s more): no {', '.join(left)} yet")
            announced = True
        elif announced and not left:
            still = missing()
            say(f"{now - begin:5.1f} s  the window ends"
                + (f" without {', '.join(still)}" if still else ""))
        return bool(left)

    split_at = begin + settings.chaos_s * rng.uniform(0.25, 0.5)
    split: tuple[str, Future[list[str]]] | None = None
    next_at = begin + rng.uniform(*settings.disruption_gap_s)
    kinds: list[str] = []
    pause = threading.Event()
    while going_on(now := time.monotonic()):
        for slot in fleet.slots:
            if slot.due is not None and slot.due <= now:
                fleet.revive(slot)
        if split is None and now >= split_at:
            split = _start_split(kinesis, stream, rng)
            say(f"{now - begin:5.1f} s  split {split[0]}")
        if now >= next_at:
            running = fleet.running()
            if not kinds and settings.disruption_kinds:
                kinds = rng.sample(list(settings.disruption_kinds),
                                   len(settings.disruption_kinds))
            candidates = [s for s in running if kinds and (kinds[-1] != TERM or fleet.up(s))]
            if len(running) >= 2 and candidates:
                kind = kinds.pop()
                slot = rng.choice(candidates)
                say(f"{time.monotonic() - begin:5.1f} s  {kind} {slot.worker_id}")
                ledger.record_disruption(kind, slot.worker_id)
                _apply(fleet, slot, kind, settings, rng, result)
                result.disruptions[kind] += 1
            next_at = time.monotonic() + rng.uniform(*settings.disruption_gap_s)
        dues = [slot.due for slot in fleet.slots if slot.due is not None]
        horizon = end if now < end else now + _OVERTIME_POLL_S
        pause.wait(max(0.0, min([next_at, horizon, *dues]) - time.monotonic()))
    if split is None:
        # a disruption that blocked (a SIGTERMed worker slow to exit on a loaded machine)
        # can carry the loop past the window before the split's time: split now, so that
        # every run reshards while its fleet recovers
        split = _start_split(kinesis, stream, rng)
        say(f"{time.monotonic() - begin:5.1f} s  split {split[0]} (after the window)")
    parent, children = split
    return parent, children.result(timeout=settings.catch_up_timeout_s)


def _apply(
    fleet: _Fleet,
    slot: _Slot,
    kind: str,
    settings: ChaosSettings,
    rng: random.Random,
    result: Tally,
) -> None:
    assert slot.process is not None
    now = time.monotonic()
    if kind == KILL:
        fleet.harvest(slot)
        slot.process.kill()
        slot.process.wait()
        slot.state = "dead"
        slot.due = now + rng.uniform(0.5, 2.0)
    elif kind == STOP:
        slot.process.send_signal(signal.SIGSTOP)
        slot.state = "stopped"
        slot.due = now + settings.failover_s * rng.uniform(1.3, 2.0)
    else:
        result.sigterm_exit_codes.extend(fleet.terminate(slot))
        fleet.spawn(slot)


@contextmanager
def _local_endpoints() -> Iterator[tuple[str, str]]:
    from kclpy.local import start_kinesis_mock, start_moto_server

    with start_kinesis_mock() as kinesis, start_moto_server() as moto:
        yield kinesis.url, moto.url


def main(argv: list[str] | None = None) -> int:
    """Longer chaos than CI can afford, against emulators started here."""
    parser = argparse.ArgumentParser(prog="python -m tests.support.chaos")
    parser.add_argument("--seed", type=int, default=seed_from_environment(
        random.SystemRandom().randrange(2**32)))
    parser.add_argument("--chaos-seconds", type=float, default=300.0)
    parser.add_argument("--plain-records", type=int, default=10_000)
    parser.add_argument("--kpl-records", type=int, default=12_000)
    parser.add_argument("--retrieval-mode", choices=(POLLING, FANOUT), default=POLLING)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--shards", type=int, default=6)
    parser.add_argument("--hold-answers", type=float, default=0.0, metavar="RATE",
                        help="hold back this share of lease-write answers, in bursts, and "
                             "watch every worker's /status for stalled shards")
    parser.add_argument("--hold-bursts", type=int, default=3)
    parser.add_argument("--hold-burst-seconds", type=float, default=25.0)
    parser.add_argument("--no-disruptions", action="store_true",
                        help="no kills, freezes or restarts (the split stays)")
    args = parser.parse_args(argv)
    for name, value in (
        ("AWS_ACCESS_KEY_ID", "testing"),
        ("AWS_SECRET_ACCESS_KEY", "testing"),
        ("AWS_DEFAULT_REGION", "us-east-1"),
    ):
        os.environ.setdefault(name, value)
    settings = ChaosSettings(
        seed=args.seed,
        chaos_s=args.chaos_seconds,
        plain_records=args.plain_records,
        kpl_records=args.kpl_records,
        retrieval_mode=args.retrieval_mode,
        workers=args.workers,
        shards=args.shards,
        answer_hold_rate=args.hold_answers,
        answer_hold_bursts=args.hold_bursts,
        answer_hold_burst_s=args.hold_burst_seconds,
        stall_check=args.hold_answers > 0,
        stuck_after_s=60.0 if args.hold_answers > 0 else None,
        disruption_kinds=() if args.no_disruptions else (KILL, STOP, TERM),
    )
    with _local_endpoints() as (kinesis_url, dynamodb_url):
        workdir = Path(tempfile.mkdtemp(prefix="kclpy-chaos-"))
        result = run_chaos(kinesis_url, dynamodb_url, workdir, settings)
    print("\n".join(result.figure_lines()))
    if result.catch_up_failure is not None:
        print(result.catch_up_failure)
    if not result.report.ok:
        print(result.report.describe_violations())
    return 0 if result.report.ok and not result.stalls and not result.catch_up_failure else 1


if __name__ == "__main__":
    sys.exit(main())
