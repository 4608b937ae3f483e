"""The scheduler: the run loop over the parts ``kclpy.composition`` builds from the config.

Shard sync creates leases; the lease coordinator takes and renews them; for every held lease
the worker runs a ShardConsumer whose readers read the shard and whose processor the user
wrote. The worker loop reconciles held leases with running consumers while a thread of its
own repeats shard sync, and on shutdown lets every processor checkpoint before the leases are
released. Which parts there are, and how options become them, is the composition's job.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from typing import Any

import boto3

from kclpy.composition import WorkerParts, build_parts, consumer_settings, record_processors
from kclpy.config import OPTIONS, KCLConfig
from kclpy.consumer import FatalProcessorError, ShardConsumer
from kclpy.errors import ConfigError, KCLError, cannot_heal
from kclpy.leases.coordinator import LeaseCoordinator
from kclpy.leases.lease import Lease
from kclpy.leases.streams import StreamSet
from kclpy.leases.table import LeaseTable
from kclpy.metrics import (
    INITIALIZATION_FAILURES,
    LEASES_HELD,
    SHARDS_PARKED,
    SHARDS_UNCONSUMED,
    Metrics,
)
from kclpy.multilang.process import kill_all as kill_children
from kclpy.processor import IRecordProcessor
from kclpy.retrieval.page import ChildShard
from kclpy.retry import NO_JITTER, GaveUp, RetryPolicy, RetryStopped, retrying
from kclpy.signals import on_stop_signals
from kclpy.state.processor import StatefulProcessor
from kclpy.state.store import StateStore
from kclpy.streams import StreamConfig

log = logging.getLogger(__name__)

#: how often a shutting-down worker looks for processors that are over, to release their leases
_SHUTDOWN_POLL_S = 0.1

#: ``--stream-name`` -> ``stream_name``: what a ConfigError from start-up is named by
KEYWORD_OF_FLAG = {option.flag: option.name for option in OPTIONS}


class WorkerFatalError(KCLError):
    """The worker stopped because of an error it cannot recover from (exit code 1)."""


class Worker:
    """Consumes one stream, or several with one lease table, for one application.
    ``run()`` blocks until shutdown."""

    def __init__(
        self,
        config: KCLConfig,
        processor_factory: Callable[[], IRecordProcessor] | Callable[[], StatefulProcessor],
        *,
        metrics: Metrics | None = None,
        session: boto3.session.Session | None = None,
        state_store: StateStore | None = None,
    ) -> None:
        # A config's fields may have been set since it was made: refused here, before any
        # thread starts, rather than in every consumer thread.
        config.validate()
        self.config = config
        self.metrics = metrics or Metrics()
        # a shard has metrics while this worker holds it: opened with its consumer, closed
        # when the consumer is retired (lease lost, released, handed off, shard ended)
        self.metrics.implicit_shards = False
        #: with a store, ``processor_factory`` makes StatefulProcessors (exactly-once state)
        self.state_store: StateStore | None
        self._records_processor: Callable[[], IRecordProcessor]
        self.state_store, self._records_processor = record_processors(
            config, processor_factory, state_store, self.metrics)
        self._session = session
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._consumers: dict[str, ShardConsumer] = {}
        self._consumers_lock = threading.Lock()
        #: held lease key -> time.monotonic() since when it has had no running consumer
        self._unconsumed_since: dict[str, float] = {}
        #: held leases of finished shards kept without a consumer until the lease cleanup
        #: deletes them, as Java KCL 2.x workers sharing the table expect (leases/mixed.py)
        self._finished_held: set[str] = set()
        self._fatal: BaseException | None = None
        self._started = threading.Event()
        #: the shard-sync thread (``_sync_loop``), once the loop runs
        self._syncer: threading.Thread | None = None
        self._settings = consumer_settings(config)
        #: what ``run()`` runs, built by ``kclpy.composition`` when it starts
        self._parts: WorkerParts | None = None
        self.kinesis: Any = None
        self.dynamodb: Any = None
        self.lease_table: LeaseTable | None = None
        self.coordinator: LeaseCoordinator | None = None
        #: the streams consumed now, each with its shard sync (kclpy.leases.streams)
        self.streams: StreamSet | None = None

    # -- public --------------------------------------------------------------------------

    def run(self, *, install_signal_handlers: bool | None = None) -> None:
        """Consume until ``shutdown()`` (or SIGTERM/SIGINT when run on the main thread).

        Raises WorkerFatalError after a fatal error, once the leases are released.
        """
        main = threading.current_thread() is threading.main_thread()
        handlers = main if install_signal_handlers is None else install_signal_handlers
        with on_stop_signals(self._on_stop_signal) if handlers else nullcontext():
            try:
                self._setup()
                self._loop()
            except ConfigError as exc:
                # Named as a Python caller gave it, by its KCLConfig keyword; kclpy-worker
                # turns the keyword back into the flag, key or variable its user wrote.
                raise ConfigError(KEYWORD_OF_FLAG.get(exc.option, exc.option),
                                  exc.message) from None
            finally:
                self._shutdown_consumers()
                self._join_sync()
        if self._fatal is not None:
            raise WorkerFatalError(str(self._fatal)) from self._fatal

    def shutdown(self) -> None:
        """Ask for a graceful shutdown; safe from any thread (a signal handler must call it
        from another one: ``kclpy.signals``)."""
        self._stop.set()
        self._wake.set()

    def wait_started(self, timeout: float | None = None) -> bool:
        """True once the lease table and shard sync are ready (for embedding and tests)."""
        return self._started.wait(timeout)

    @property
    def healthy(self) -> bool:
        """Running, renewing its leases, and consuming every lease it holds (what /healthz
        reports): a shard held with no consumer for longer than the failover time is stuck
        for good unless someone notices."""
        return (self.coordinator is not None and self.coordinator.healthy
                and self.unconsumed_for() <= self.config.failover_time_ms / 1000)

    def consumers(self) -> dict[str, ShardConsumer]:
        with self._consumers_lock:
            return dict(self._consumers)

    def status(self) -> dict[str, Any]:
        """What /status and operators see: this worker's leases and each shard's progress."""
        shards = {}
        for lease_key, consumer in self.consumers().items():
            position = consumer.position
            shards[lease_key] = {
                "stream": consumer.stream_name,
                "state": consumer.state.value,
                "checkpoint": position.checkpoint,
                "checkpoint_sub_sequence_number": position.sub_sequence_number,
                "millis_behind_latest": consumer.millis_behind_latest,
                "retrieval": consumer.retrieval,
                "recovery": consumer.recovery,
                "failure": consumer.failure,
            }
        held = sorted(self.coordinator.held_leases()) if self.coordinator else []
        streams = sorted(a.label for a in self.streams.active.values()) if self.streams else []
        return {"worker_id": self.config.worker_id, "stream": self.config.stream_label,
                "streams": streams, "application": self.config.application_name,
                "held_leases": held, "shards": shards}

    def shard_location(self, lease_key: str) -> tuple[StreamConfig, str] | None:
        """The stream a lease key belongs to and the shard's Kinesis id (lag probes need
        both); None for a stream this worker does not consume."""
        stream = self.streams.for_lease_key(lease_key) if self.streams is not None else None
        if stream is None:
            return None
        prefix = f"{stream.identifier}:" if stream.identifier is not None else ""
        return stream.config, lease_key.removeprefix(prefix)

    # -- set-up --------------------------------------------------------------------------

    def _setup(self) -> None:
        cfg = self.config
        parts = build_parts(cfg, self.metrics, self._session, self.state_store)
        self._parts = parts
        self.kinesis, self.dynamodb = parts.kinesis, parts.dynamodb
        self.lease_table, self.streams = parts.lease_table, parts.streams
        self.coordinator = parts.coordinator
        self.coordinator.add_lease_lost_listener(self._on_lease_lost)
        self.coordinator.add_handoff_listener(self._on_handoff)
        if not self._initialize():
            return
        self.coordinator.start()
        self._started.set()
        log.info("worker %s consuming %s for application %s", cfg.worker_id,
                 cfg.stream_label, cfg.application_name)

    def _initialize(self) -> bool:
        """The start-up calls, retried as the Java Scheduler retries its initialization: a
        worker started into a throttle, a 5xx or a database restart must not die of what a
        second later would have worked. A ConfigError (a missing stream, say) is not
        transient and ends the worker at once. False when shutdown came first."""
        assert self._parts is not None
        cfg, load = self.config, self._parts.load
        # the Java Scheduler's fixed wait between attempts
        wait_s = cfg.initialization_backoff_ms / 1000
        retries = RetryPolicy(wait_s, wait_s, max_attempts=cfg.max_initialization_attempts,
                              jitter=NO_JITTER)

        def start_up() -> None:
            assert self.lease_table is not None and self.streams is not None
            # the streams first: a misspelled stream creates nothing (a first-hour finding)
            self.streams.refresh(starting=True)
            self.lease_table.create_if_missing()
            if load is not None:
                load.table.create_if_missing()
            if cfg.lease_assigner == "leader":
                self.lease_table.ensure_owner_index()
            if self.state_store is not None:
                self.state_store.open(self.dynamodb)
            self._sync_shards(starting=True)

        def worth_retrying(exc: BaseException) -> bool:
            if isinstance(exc, ConfigError):
                return False
            self.metrics.inc(INITIALIZATION_FAILURES, type(exc).__name__)
            # credentials or permissions: retrying cannot help (a first-hour finding)
            return not cannot_heal(exc)

        def retry_later(exc: BaseException, attempt: int, delay: float) -> None:
            log.warning("worker %s: start-up attempt %d of %d failed (%s: %s); retrying "
                        "in %.1f s", cfg.worker_id, attempt, cfg.max_initialization_attempts,
                        type(exc).__name__, exc, cfg.initialization_backoff_ms / 1000)

        try:
            retrying(start_up, retries, retry_on=worth_retrying, wait=self._stop.wait,
                     on_retry=retry_later)
        except GaveUp as gave_up:
            raise gave_up.last from None
        except RetryStopped:
            log.info("worker %s: shutdown requested during start-up", cfg.worker_id)
            return False
        return True

    def _syncs_shards(self) -> bool:
        """With a leader (``--lease-assigner leader``) only the leader syncs shards after
        start-up, as in the Java KCL 3.x: a sync reads every lease key, the very scan the
        other workers are spared. The others only refresh a stream tracker's streams, so
        that they consume what it names (``LeaseTaker.set_consumable``)."""
        assert self.coordinator is not None
        return self.coordinator.leads() is not False

    def _sync_shards(self, *, starting: bool = False) -> None:
        """Shard sync of every stream; at start-up, and at every sync while a tracker may
        name new ones, the streams are (re)opened first."""
        assert self.streams is not None and self.coordinator is not None
        if starting or self.config.stream_tracker is not None:
            self.streams.refresh(starting=starting)
        # The taker scans the table anyway; reusing its view saves a scan per sync.
        recent = self.coordinator.recent_lease_keys(2 * self.config.failover_time_ms / 1000)
        created = self.streams.sync(
            recent, None if recent is None else self.coordinator.all_leases())
        self.coordinator.set_known_lease_keys(self.streams.known_lease_keys())
        self.streams.delete_due(self.coordinator.idle_leases(), self.coordinator.all_leases())
        if created:
            # each stream's shard sync has logged the leases it created
            self.coordinator.wake_taker()

    # -- the loop ------------------------------------------------------------------------

    def _loop(self) -> None:
        syncing = threading.Event()
        syncer = threading.Thread(target=self._sync_loop, args=(syncing,),
                                  name=f"kclpy-shard-sync-{self.config.worker_id}", daemon=True)
        self._syncer = syncer
        syncer.start()
        try:
            while not self._stop.is_set():
                self._reconcile()
                if self._fatal is not None:
                    return
                if self.config.stop_when_caught_up and self._all_caught_up():
                    log.info("every shard is caught up; stopping (stop_when_caught_up)")
                    return
                self._wake.wait(0.2)
                self._wake.clear()
        finally:
            # Not joined here: a sync under way ends with its slowest answer, and the
            # processors' shutdown and the lease releases must not wait for it
            # (``_join_sync`` waits once they are done).
            syncing.set()

    def _join_sync(self) -> None:
        """Wait, once the leases are released, for a shard sync still under way: run()
        must not return while it may still delete and create leases. Its ListShards was
        seen answered after "worker stopped" (under load, in
        tests/leases/test_shard_sync.py's stream created again, which deletes it right then):
        a listing of the stream created again, judged against the stopped worker's last
        scan, retires and creates leases while the next worker does the same. Bounded by
        the shutdown grace: a sync stuck longer is left behind, with a warning."""
        syncer = self._syncer
        if syncer is None:
            return
        syncer.join(self.config.shutdown_grace_ms / 1000)
        if syncer.is_alive():
            log.warning("worker %s: a shard sync still under way after the shutdown grace "
                        "period is left behind", self.config.worker_id)

    def _sync_loop(self, done: threading.Event) -> None:
        """Shard sync on a thread of its own: a ListShards slowed by throttles or a slow
        endpoint (simulator seed 553: 4.3 s) held the loop, so the consumers of leases the
        taker (or, with a leader, the leader) gave this worker meanwhile did not start, and
        the leases stayed held by nobody's consumer past the failover time."""
        interval = self.config.shard_sync_interval_ms / 1000
        while not done.wait(interval) and not self._stop.is_set():
            try:
                if self._syncs_shards():
                    self._sync_shards()
                elif self.config.stream_tracker is not None:
                    assert self.streams is not None
                    self.streams.refresh()
            except Exception:
                log.exception("shard sync failed; retrying at the next interval")

    def _reconcile(self) -> None:
        """Start a consumer for every newly held lease; retire consumers that are over."""
        assert self.coordinator is not None
        held = self.coordinator.held_leases()
        with self._consumers_lock:
            for lease_key, consumer in list(self._consumers.items()):
                lease = held.get(lease_key)
                if lease is None or lease.concurrency_token != consumer.concurrency_token:
                    consumer.notify_lease_lost()
                    if consumer.done:
                        del self._consumers[lease_key]
                        self.metrics.close_shard(lease_key)
                    continue
                if lease.checkpoint_owner is not None or not self._consumed(lease):
                    # Another worker asked for this lease: the processor gets
                    # shutdown_requested (it may checkpoint), then the lease moves on.
                    consumer.request_shutdown()
                    if consumer.done:
                        del self._consumers[lease_key]
                        self.metrics.close_shard(lease_key)
                        self.coordinator.release_soon(lease_key)
                        del held[lease_key]
                    continue
                if not consumer.done:
                    continue
                if isinstance(consumer.error, FatalProcessorError):
                    self._fatal = consumer.error
                    continue
                del self._consumers[lease_key]
                self.metrics.close_shard(lease_key)
                if consumer.shard_ended and self.coordinator.java_peers():
                    current = self.coordinator.get_held(lease_key)
                    if current is not None and current.is_finished:
                        # kept, as a Java worker keeps it: Java's taker counts it as ours
                        # instead of taking it and running a consumer on a finished shard
                        self._finished_held.add(lease_key)
                        continue
                # A held lease must always have a running consumer: whatever ended this one,
                # the lease is let go now so that a worker (this one included) takes it
                # again and a new consumer resumes from the checkpoint.
                self.coordinator.release_soon(lease_key)
                # no longer held: not to be given a new consumer from this snapshot below
                del held[lease_key]
                if consumer.shard_ended:
                    # Nobody needs a finished shard's lease held (children read only its
                    # checkpoint), and renewing it would cost a write every renewal period.
                    continue
                if consumer.parked:
                    log.error("shard %s: parked; its lease is released and no worker takes "
                              "it until 'kclpy shard resume'", lease_key)
                elif consumer.error is not None:
                    log.error("shard %s: consumer stopped on %r; releasing its lease so it is "
                              "retried", lease_key, consumer.error)
                else:
                    # Told the lease was lost (or asked to shut down) while a late write or
                    # a stream named again kept the lease ours.
                    log.warning("shard %s: consumer ended (%s) while its lease stayed held; "
                                "releasing the lease so the shard is consumed again",
                                lease_key, consumer.ended_why)
            self._finished_held.intersection_update(
                key for key, lease in held.items() if lease.is_finished)
            for lease_key, lease in held.items():
                if lease_key in self._consumers or lease_key in self._finished_held:
                    continue
                if lease.checkpoint_owner is not None or not self._consumed(lease):
                    # asked for, or of a stream no longer consumed; nothing to finish
                    self.coordinator.release_soon(lease_key)
                else:
                    consumer = self._new_consumer(lease)
                    self._consumers[lease_key] = consumer
                    consumer.start()
            self._track_unconsumed(
                {key: lease for key, lease in held.items() if key not in self._finished_held})
        self.metrics.set(LEASES_HELD, len(held))
        self.metrics.set(SHARDS_PARKED, sum(
            lease.parked is not None for lease in self.coordinator.all_leases()))

    def _track_unconsumed(self, held: dict[str, Lease]) -> None:
        """Note since when each held lease has had no running consumer (the consumers lock
        held). ``_reconcile`` replaces such consumers in one pass, so a lasting one means a
        fault this worker cannot see: it is a metric and fails ``healthy``."""
        now = time.monotonic()
        running = {key for key, consumer in self._consumers.items() if not consumer.done}
        for key in list(self._unconsumed_since):
            if key not in held or key in running:
                del self._unconsumed_since[key]
        for key in held:
            if key not in running:
                self._unconsumed_since.setdefault(key, now)
        self.metrics.set(SHARDS_UNCONSUMED, len(self._unconsumed_since))

    def unconsumed_for(self) -> float:
        """How long the longest-waiting held lease has had no running consumer (0: none)."""
        with self._consumers_lock:
            since = min(self._unconsumed_since.values(), default=None)
        return 0.0 if since is None else time.monotonic() - since

    def _consumed(self, lease: Lease) -> bool:
        """The lease's stream is one this worker consumes now."""
        return self.streams is not None and self.streams.for_lease(lease) is not None

    def _new_consumer(self, lease: Lease) -> ShardConsumer:
        assert self.coordinator is not None and self._parts is not None
        token = lease.concurrency_token
        assert token is not None
        readers = self._parts.retrieval.readers(lease, token)
        stream_name = self._parts.retrieval.stream(lease).label
        self.metrics.open_shard(lease.lease_key, lease.shard_id, lease.stream)
        return ShardConsumer(
            lease, concurrency_token=token, processor_factory=self._records_processor,
            fence=self.coordinator.fence, readers=readers, host=self, settings=self._settings,
            metrics=self.metrics, stream_name=stream_name)

    # -- kclpy.consumer.ShardHost, from the consumers' threads -----------------------------

    def get_lease(self, lease_key: str) -> Lease | None:
        """The lease as the table has it now (a consumer's parents, its durable checkpoint)."""
        assert self.coordinator is not None
        return self.coordinator.get_lease(lease_key)

    def shard_ended(self, lease_key: str, children: Sequence[ChildShard]) -> None:
        """Called from a consumer's thread when its shard (a lease key) is fully read."""
        assert self.streams is not None and self.coordinator is not None
        stream = self.streams.for_lease_key(lease_key)
        if stream is None:
            return  # a stream no longer consumed: its children are not ours to create
        if children:
            # records them as known shards, and this shard as finished in each
            stream.syncer.create_child_leases(children, lease_key)
        else:
            # Emulators without ChildShards: a sync of the stream finds the children instead.
            stream.syncer.sync(self.coordinator.recent_lease_keys(
                2 * self.config.failover_time_ms / 1000))
        self.coordinator.set_known_lease_keys(self.streams.known_lease_keys())
        self.coordinator.wake_taker()

    def shard_left_stream(self, lease_key: str) -> frozenset[str] | None:
        """Called from a consumer's thread when Kinesis no longer finds its shard: any
        worker may confirm it, leader or not, since the holder then ends the lease through
        its own fence."""
        assert self.streams is not None
        stream = self.streams.for_lease_key(lease_key)
        return None if stream is None else stream.syncer.left_unfinished(lease_key)

    def _on_handoff(self, lease_key: str) -> None:
        """Another worker asked for a held lease; ``_reconcile`` winds its consumer down."""
        self._wake.set()

    def _on_lease_lost(self, lease_key: str) -> None:
        with self._consumers_lock:
            consumer = self._consumers.get(lease_key)
        if consumer is not None:
            consumer.notify_lease_lost()
        self._wake.set()

    def _all_caught_up(self) -> bool:
        """This worker's shards are drained and every other open lease has a worker seen
        renewing it. One worker therefore stops only once it holds every lease; in a fleet
        each stops when its own shards are drained, and the last one takes and drains what
        the others released. A lease left by a crashed run is not "run elsewhere" until it
        expires and is taken, so nothing is skipped."""
        assert self.coordinator is not None
        held = self.coordinator.held_leases()
        consumers = self.consumers()
        if not all(lease_key in consumers and consumers[lease_key].caught_up
                   for lease_key in held if lease_key not in self._finished_held):
            return False
        if self.coordinator.leads() is False:
            # with a leader only the leader scans the table: a drained worker asks for scans
            self.coordinator.survey()
        leases = self.coordinator.all_leases()
        if not leases:
            return False  # the taker has not scanned the table yet
        elsewhere = self.coordinator.run_elsewhere()
        open_leases = [lease for lease in leases if not lease.is_finished and not lease.parked]
        return all(lease.lease_key in held or lease.lease_key in elsewhere
                   for lease in open_leases)

    # -- shutdown ------------------------------------------------------------------------

    def _shutdown_consumers(self) -> None:
        """Let every processor checkpoint in shutdown_requested, then release the leases so
        that another worker can take them at once instead of waiting for them to expire.
        No lease is taken once this starts (``stop_taking``)."""
        consumers = self.consumers()
        for consumer in consumers.values():
            consumer.request_shutdown()
        deadline = time.monotonic() + self.config.shutdown_grace_ms / 1000
        coordinator = self.coordinator
        # The taker is told to stop but not waited for here: a cycle under way can take as
        # long as its slowest answer, and the lease of a processor already over must not
        # wait for it. What that cycle took last is released once it has ended.
        taking = coordinator is not None and not coordinator.stop_taking(timeout=0)
        if coordinator is not None:
            # Taken since the last reconcile: no consumer to wait for, even while the
            # taker's cycle (slow answers) goes on.
            self._release_unconsumed(coordinator, consumers)
        # Each lease goes as soon as its processor is over: held until the slowest one is,
        # it would be consumed by nobody for up to the grace period.
        waiting = dict(consumers)
        while (waiting or taking) and time.monotonic() < deadline:
            for lease_key, consumer in list(waiting.items()):
                if consumer.done:
                    del waiting[lease_key]
                    self.metrics.close_shard(lease_key)
                    if coordinator is not None:
                        coordinator.release_soon(lease_key)
            left = min(_SHUTDOWN_POLL_S, max(0.0, deadline - time.monotonic()))
            if coordinator is not None and taking and coordinator.stop_taking(
                    timeout=0 if waiting else left):
                taking = False
                self._release_unconsumed(coordinator, consumers)
            if waiting:
                next(iter(waiting.values())).join(left)
        late = [lease_key for lease_key, consumer in waiting.items() if not consumer.done]
        for lease_key in late:
            log.warning("shard %s: shutdown_requested did not finish within the grace "
                        "period; releasing the lease anyway", lease_key)
        if late:
            # A MultiLang child still busy must not keep processing once its lease moves on.
            killed = kill_children()
            if killed:
                log.warning("killed %d MultiLang child(ren) still running after the grace "
                            "period", killed)
        if self.coordinator is not None:
            self.coordinator.stop(release=True)
        for lease_key in consumers:
            self.metrics.close_shard(lease_key)
        if self._parts is not None:
            self._parts.close(self.config.worker_id)
        log.info("worker %s stopped", self.config.worker_id)

    @staticmethod
    def _release_unconsumed(coordinator: LeaseCoordinator,
                            consumers: Mapping[str, ShardConsumer]) -> None:
        """Leases the taker took last, after the consumers were asked to stop: nothing to
        finish, so they go at once."""
        for lease_key in coordinator.held_leases().keys() - consumers.keys():
            coordinator.release_soon(lease_key)

    def _on_stop_signal(self, signum: int) -> None:
        """SIGTERM or SIGINT, on a thread of its own (``kclpy.signals``)."""
        log.info("received %s; shutting down", signal.Signals(signum).name)
        self.shutdown()

