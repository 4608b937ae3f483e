"""Exactly-once state under chaos: the chaos run's fleet, faults and producer, with
processors that keep per-key counts and sums, and a check that the stored state is exactly
what was written to the stream.

Two processors run the same arithmetic. ``ChaosCounter`` is a ``StatefulProcessor``
(``--state-store``: a DynamoDB table or a SQL database); ``PlainChaosCounter`` is the
at-least-once way - one upsert per record into a SQL table, a checkpoint every few batches -
whose counts show the records a failover delivers again.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Callable, Iterable
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

import kclpy
from kclpy.errors import KinesisClientLibDependencyException, ShutdownException, ThrottlingException
from tests.support.chaos import (
    ChaosRig,
    ChaosSettings,
    liveness_lines,
    wait_caught_up,
)
from tests.support.ledger import LeaseSample, Produced, record_id
from tests.support.liveness import Stall

#: the plain processor's database (a SQLAlchemy URL)
PLAIN_URL_ENV = "KCLPY_TEST_PLAIN_COUNTS_URL"
#: records are spread over this many keys per kind (plain, KPL)
KEYS = 16

EXACTLY_ONCE = "exactly-once"
PLAIN = "plain"


def key_and_value(rid: str) -> tuple[str, int]:
    """``p-000123`` -> (``p3``, 123): the key a record counts under, the number it adds."""
    kind, digits = rid.split("-", 1)
    number = int(digits)
    return f"{kind}{number % KEYS}", number


def expected_state(produced: Iterable[Produced]) -> dict[str, int]:
    """``count/<key>`` and ``sum/<key>`` for every record written, once each."""
    state: Counter[str] = Counter()
    for row in produced:
        key, number = key_and_value(row.id)
        state[f"count/{key}"] += 1
        state[f"sum/{key}"] += number
    return dict(state)


class ChaosCounter(kclpy.StatefulProcessor):
    def apply(self, record: kclpy.Record, txn: kclpy.StateTransaction) -> None:
        key, number = key_and_value(record_id(record))
        txn.update(f"count/{key}", lambda n: n + 1, 0)
        txn.update(f"sum/{key}", lambda n: n + number, 0)


#: the plain processor's row per record id, counting its deliveries: duplicates make the
#: counts reach what was written while a record is still unread, so only these rows tell
#: that every record was read
SEEN = "seen/"


def plain_table(meta: sa.MetaData) -> sa.Table:
    return sa.Table("plain_counts", meta,
                    sa.Column("state_key", sa.String(64), primary_key=True),
                    sa.Column("value", sa.BigInteger, nullable=False))


class PlainChaosCounter(kclpy.IRecordProcessor):
    """At-least-once, the way amazon_kclpy's sample processor does it: every batch's effects
    are written at once, the checkpoint follows at most every ``CHECKPOINT_EVERY_S`` (the
    sample: 60 s) and at shutdown."""

    CHECKPOINT_EVERY_S = 10.0

    def __init__(self) -> None:
        self._engine = sa.create_engine(os.environ[PLAIN_URL_ENV])
        self._table = plain_table(sa.MetaData())
        self._last_checkpoint = time.monotonic()

    def initialize(self, initialize_input: kclpy.InitializeInput) -> None:
        self._last_checkpoint = time.monotonic()

    def process_records(self, process_records_input: kclpy.ProcessRecordsInput) -> None:
        # One upsert per key, in key order: batches of different shards write the same keys
        # at once, and upserts in record order deadlocked each other (and were retried) for
        # most of a run.
        adds: Counter[str] = Counter()
        for record in process_records_input.records:
            rid = record_id(record)
            key, number = key_and_value(rid)
            adds[f"count/{key}"] += 1
            adds[f"sum/{key}"] += number
            adds[f"{SEEN}{rid}"] += 1
        with self._engine.begin() as conn:
            for name in sorted(adds):
                upsert = postgresql.insert(self._table).values(state_key=name, value=adds[name])
                conn.execute(upsert.on_conflict_do_update(
                    index_elements=["state_key"],
                    set_={"value": self._table.c.value + upsert.excluded.value}))
        if time.monotonic() - self._last_checkpoint >= self.CHECKPOINT_EVERY_S:
            _checkpoint(process_records_input.checkpointer)
            self._last_checkpoint = time.monotonic()

    def lease_lost(self, lease_lost_input: kclpy.LeaseLostInput) -> None:
        pass

    def shard_ended(self, shard_ended_input: kclpy.ShardEndedInput) -> None:
        shard_ended_input.checkpointer.checkpoint()

    def shutdown_requested(self, shutdown_requested_input: kclpy.ShutdownRequestedInput) -> None:
        _checkpoint(shutdown_requested_input.checkpointer)


def _checkpoint(checkpointer: kclpy.Checkpointer) -> None:
    """A failed checkpoint is retried by the next one; a lost lease ends the shard anyway."""
    with suppress(ShutdownException, ThrottlingException, KinesisClientLibDependencyException):
        checkpointer.checkpoint()


@dataclass
class StateChaosResult:
    mode: str
    settings: ChaosSettings
    produced: int = 0
    expected: dict[str, int] = field(default_factory=dict)
    stored: dict[str, int] = field(default_factory=dict)
    disruptions: Counter[str] = field(default_factory=Counter)
    sigterm_exit_codes: list[int] = field(default_factory=list)
    split: tuple[str, list[str]] | None = None
    commit_faults: int = 0
    throttles_injected: int = 0
    checkpoint_regressions: list[str] = field(default_factory=list)
    duration_s: float = 0.0
    logs: Path = Path()
    holds: Counter[str] = field(default_factory=Counter)
    longest_hold_s: float = 0.0
    stalls: list[Stall] = field(default_factory=list)
    catch_up_failure: str | None = None
    #: lag recovery: records of gaps handed to the processors (kclpy_recovery_records_total,
    #: summed over every worker process), by shard
    recovery_records: Counter[str] = field(default_factory=Counter)

    @property
    def counted(self) -> int:
        return sum(v for k, v in self.stored.items() if k.startswith("count/"))

    @property
    def wrong_keys(self) -> dict[str, tuple[int | None, int | None]]:
        keys = set(self.expected) | set(self.stored)
        return {k: (self.expected.get(k), self.stored.get(k)) for k in sorted(keys)
                if self.expected.get(k) != self.stored.get(k)}

    def figure_lines(self) -> list[str]:
        s = self.settings
        disruptions = ", ".join(f"{kind}: {n}" for kind, n in sorted(self.disruptions.items()))
        split = f"{self.split[0]} -> {', '.join(self.split[1])}" if self.split else "none"
        return [
            f"{self.mode} chaos seed {s.seed}: {s.workers} workers, {s.shards} shards, "
            f"{s.chaos_s:g} s, run took {self.duration_s:.0f} s",
            f"disruptions: {disruptions}; split: {split}; injected on commits: "
            f"{self.commit_faults} DynamoDB faults; {self.throttles_injected} GetRecords "
            "throttles",
            f"records written {self.produced}, counted {self.counted} "
            f"({self.counted - self.produced:+d}); keys wrong: {len(self.wrong_keys)}",
            *([] if s.max_lag_ms is None else [
                f"lag recovery (max_lag_ms {s.max_lag_ms}): "
                f"{sum(self.recovery_records.values())} recovery records handed out "
                f"({', '.join(f'{k} {n}' for k, n in sorted(self.recovery_records.items()))})"]),
            *liveness_lines(s, self.holds, self.longest_hold_s, self.stalls),
            *([] if self.catch_up_failure is None else [self.catch_up_failure]),
        ]


def checkpoint_regressions(samples: Iterable[LeaseSample]) -> list[str]:
    """Every lease checkpoint the samples saw move backwards."""
    last: dict[str, LeaseSample] = {}
    found = []
    for sample in samples:
        previous = last.get(sample.shard)
        if previous is not None and sample.position < previous.position:
            found.append(f"{sample.shard}: {previous.checkpoint} -> {sample.checkpoint}")
        last[sample.shard] = sample
    return found


def run_state_chaos(
    kinesis_url: str,
    dynamodb_url: str,
    workdir: Path,
    settings: ChaosSettings,
    *,
    mode: str,
    store: str,
    read_state: Callable[[], dict[str, int]],
    say: Callable[[str], None] = print,
) -> StateChaosResult:
    """Run the chaos fleet with ``mode``'s processor. ``store`` is the ``--state-store``
    (exactly-once) or the plain processor's database URL; ``read_state()`` reads what is
    stored. ``settings.max_lag_ms`` turns lag recovery on too: a shard taken over further
    behind reads live at once and its gap is recovered beside it."""
    started = time.monotonic()
    if mode == EXACTLY_ONCE:
        processor = ["--processor", "tests.support.state_chaos:ChaosCounter",
                     "--state-store", store, "--transaction-max-records", "200"]
        env = {}
    else:
        processor = ["--processor", "tests.support.state_chaos:PlainChaosCounter"]
        env = {PLAIN_URL_ENV: store}
        plain_table(meta := sa.MetaData())
        meta.create_all(sa.create_engine(store))

    with ChaosRig(kinesis_url, dynamodb_url, workdir, settings, f"{mode} chaos", say) as rig:
        result = StateChaosResult(mode, settings, logs=rig.logs)
        # commits: a DynamoDB store's TransactWriteItems, a SQL store's lease-table update
        rig.dynamodb_proxy.set_rule("TransactWriteItems", throttle_rate=0.1,
                                    error_5xx_rate=0.05, lose_response_rate=0.02)
        rig.dynamodb_proxy.set_rule("UpdateItem", throttle_rate=0.05,
                                    error_5xx_rate=settings.dynamodb_5xx_rate)
        recovery = ("kclpy_recovery_records_total", "shard_id")
        fleet = rig.window(result, processor, env,
                           counter=None if settings.max_lag_ms is None else recovery)
        result.expected = expected_state(rig.ledger.produced())
        result.produced = len(rig.ledger.produced())
        say(f"chaos over after {time.monotonic() - started:.0f} s; the fleet catches up")

        ids = {row.id for row in rig.ledger.produced()}

        def uncounted() -> int:
            state = read_state()
            if mode == PLAIN:
                return sum(1 for rid in ids if f"{SEEN}{rid}" not in state)
            return sum(max(0, want - state.get(k, 0)) for k, want in result.expected.items()
                       if k.startswith("count/"))

        over = time.monotonic()
        result.catch_up_failure = wait_caught_up(
            uncounted, settings, rig.watch, f"every record counted (logs in {rig.logs})")
        say(f"catch-up took {time.monotonic() - over:.0f} s")
        fleet.wait_up(60)
        rig.settle(result)
        result.sigterm_exit_codes.extend(fleet.terminate(*fleet.slots))
        result.recovery_records = fleet.harvested
        result.stored = {k: v for k, v in read_state().items() if not k.startswith(SEEN)}
        result.checkpoint_regressions = checkpoint_regressions(rig.sampler.stop())
        result.commit_faults = sum(rig.dynamodb_proxy.faults(kind, op)
                                   for kind in ("throttle", "error_5xx", "lose_response")
                                   for op in ("TransactWriteItems", "UpdateItem"))
        result.throttles_injected = rig.kinesis_proxy.faults("throttle", "GetRecords")
    result.duration_s = time.monotonic() - started
    return result

