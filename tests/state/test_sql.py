"""The SQL state store (kclpy/state/sql.py): its position is the truth when the lease item
lags behind, workers open it together, a lease or a stream created again resumes from its
position or from the start, and a checkpoints table of an earlier version is upgraded
(SQLite, and PostgreSQL on loopback)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from kclpy.errors import KCLError, ShutdownException, ThrottlingException
from kclpy.leases.lease import Lease, new_incarnation
from kclpy.leases.table import LeaseTable
from kclpy.metrics import Metrics
from kclpy.position import Position
from kclpy.processor import InitializeInput
from kclpy.records import Record
from kclpy.recovery import queue as gaps
from kclpy.state.processor import ExactlyOnceProcessor, StatefulProcessor
from kclpy.state.sql import SQLStateStore, StateStoreUnavailable
from kclpy.state.transaction import StateTransaction, Versioned
from tests.support.determinism import Clock
from tests.support.recovery import Holder, gap, recovery_for
from tests.support.state import FAILOVER, Counter, Ops, Shard, rec, runner, stored_state
from tests.support.streams import unique_name
from tests.support.waiting import wait_for


@pytest.fixture
def table(table: LeaseTable) -> LeaseTable:
    """The lease table with the leases of s1 and s2, as in test_state.py."""
    for key in ("s1", "s2"):
        assert table.create(Lease(key))
    return table


def test_a_new_owner_starts_from_the_sql_stores_position_when_the_lease_lags_behind(
        table: LeaseTable, tmp_path: Path) -> None:
    """The SQL store is the truth: its commit landed, the lease item's update after it did
    not, and the next owner - starting from the lease's older checkpoint - applies nothing
    twice."""
    url = f"sqlite:///{tmp_path / 'state.db'}"
    clock = Clock()
    first = Shard(table, "s1", "A", clock)
    lease_update = first.fence.update_checkpoint

    def throttled(*args: Any) -> None:
        raise ThrottlingException("the lease table is throttled")

    first.fence.update_checkpoint = throttled  # type: ignore[method-assign, assignment]
    store_a = SQLStateStore(url)
    store_a.open(None)
    first.deliver(runner(store_a), [rec(10, "k:1"), rec(11, "k:2")])
    first.fence.update_checkpoint = lease_update  # type: ignore[method-assign]
    assert (lease := table.get("s1")) is not None and lease.checkpoint == Position.trim_horizon()
    second = Shard(table, "s1", "B", clock)
    store_b = SQLStateStore(url)
    store_b.open(None)
    second.deliver(runner(store_b, start=second.start),
                   [rec(10, "k:1"), rec(11, "k:2"), rec(12, "k:3")])
    assert stored_state(store_b) == {"count/k": 3, "sum/k": 6}
    assert (lease := table.get("s1")) is not None and lease.checkpoint == Position("12")


def test_a_holder_whose_lease_expired_under_a_commits_lease_write_applies_nothing_more(
        table: LeaseTable, tmp_path: Path) -> None:
    """Simulator seed 836: a commit landed in the store, and its lease write, held up past
    the failover time, found the lease given up on this worker. Swallowed like a throttled
    lease write ("will be on the next commit"), it let the processor apply the batch's next
    records (the shard parked meanwhile) though no commit of this tenure can land again."""
    clock = Clock()
    first = Shard(table, "s1", "A", clock)
    lease_update = first.fence.update_checkpoint

    def held_up(lease_key: str, concurrency_token: str, position: Position) -> None:
        clock.advance(FAILOVER + 1)
        first.held.expire(clock(), FAILOVER)
        lease_update(lease_key, concurrency_token, position)

    first.fence.update_checkpoint = held_up  # type: ignore[method-assign]
    store = SQLStateStore(f"sqlite:///{tmp_path / 'state.db'}")
    store.open(None)
    counter = Counter()
    with pytest.raises(ShutdownException, match="expired on this worker"):
        first.deliver(runner(store, counter, max_records=2),
                      [rec(10, "k:1"), rec(11, "k:2"), rec(12, "k:3"), rec(13, "k:4")])
    assert counter.applied == 2
    assert stored_state(store) == {"count/k": 2, "sum/k": 3}


def test_workers_starting_together_all_open_the_postgresql_store(postgres_url: str) -> None:
    """Found by the chaos run: two CREATE TABLEs at once, the loser exited at start-up."""
    prefix = unique_name("race").replace("-", "_")
    stores = [SQLStateStore(postgres_url, prefix=prefix) for _ in range(6)]
    failures: list[BaseException] = []

    def open_store(store: SQLStateStore) -> None:
        try:
            store.open(None)
        except Exception as exc:  # collected: a thread's exception is otherwise only logged
            failures.append(exc)

    threads = [threading.Thread(target=open_store, args=(store,)) for store in stores]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    with stores[0].engine.connect() as conn:
        assert sa.inspect(conn).has_table(f"{prefix}_checkpoints")


def create_again(table: LeaseTable, key: str, incarnation: str | None) -> None:
    """The lease deleted (a former stream's, a table reset) and created anew: counter 0."""
    lease = table.get(key)
    assert lease is not None and table.delete(lease)
    assert table.create(Lease(key, incarnation=incarnation))


def first_life(table: LeaseTable, store: SQLStateStore, clock: Clock) -> Shard:
    """The lease of ``s9`` (stream created at epoch 100) taken three times, the third
    tenure committing records 10-12."""
    assert table.create(Lease("s9", incarnation=new_incarnation(100, now=1000.0)))
    for _ in range(2):
        Shard(table, "s9", "A", clock)
    shard = Shard(table, "s9", "A", clock)
    adapter = ExactlyOnceProcessor(Counter(), store)
    adapter.initialize(InitializeInput("s9", *shard.start))
    shard.deliver(adapter, [rec(10, "k:1"), rec(11, "k:1"), rec(12, "k:1")])
    return shard


def second_life(table: LeaseTable, store: SQLStateStore, clock: Clock) -> Shard:
    """The new lease taken once (counter 1, below the first life's tenure 3) and the
    shard read again from its start, one record further."""
    shard = Shard(table, "s9", "B", clock)
    adapter = ExactlyOnceProcessor(Counter(), store)
    adapter.initialize(InitializeInput("s9", *shard.start))
    shard.deliver(adapter, [rec(10, "k:1"), rec(11, "k:1"), rec(12, "k:1"), rec(13, "k:1")])
    return shard


def test_a_lease_created_again_resumes_from_the_sql_stores_position(
        table: LeaseTable, new_sql_store: Callable[[], SQLStateStore],
        caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    zombie = first_life(table, new_sql_store(), clock)
    create_again(table, "s9", new_incarnation(100, now=2000.0))
    store = new_sql_store()
    second_life(table, store, clock)
    assert stored_state(store) == {"count/k": 4, "sum/k": 4}, "records 10-12 not applied again"
    assert "lease was created again" in caplog.text
    late = ExactlyOnceProcessor(Counter(), new_sql_store())
    late.initialize(InitializeInput("s9", *zombie.start))
    with pytest.raises(ShutdownException):  # the former lease's holder cannot take it back
        zombie.deliver(late, [rec(14, "k:1")])
    assert stored_state(store) == {"count/k": 4, "sum/k": 4}
    assert (lease := table.get("s9")) is not None and lease.checkpoint.sequence_number == "13"


def test_a_stream_created_again_is_read_from_its_start_on_the_sql_store(
        table: LeaseTable, new_sql_store: Callable[[], SQLStateStore],
        caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    first_life(table, new_sql_store(), clock)
    create_again(table, "s9", new_incarnation(200, now=2000.0))  # same name, new stream
    store = new_sql_store()
    second_life(table, store, clock)
    assert stored_state(store) == {"count/k": 7, "sum/k": 7}, "the new stream's 4 records"
    assert "stream was created again" in caplog.text


def test_a_lease_created_again_without_an_incarnation_is_refused_loudly(
        table: LeaseTable, new_sql_store: Callable[[], SQLStateStore],
        caplog: pytest.LogCaptureFixture) -> None:
    """A lease item written without ``kclpyIncarnation`` (by Java, or an older kclpy): the
    store cannot tell a new lease from a zombie, and says so instead of skipping."""
    clock = Clock()
    first_life(table, new_sql_store(), clock)
    create_again(table, "s9", None)
    with pytest.raises(ShutdownException):
        second_life(table, new_sql_store(), clock)
    assert "delete the shard's row" in caplog.text


def older_database(tmp_path: Path, *statements: str) -> str:
    """A SQLite file as an earlier kclpy left it (its tables made by ``statements``)."""
    url = f"sqlite:///{tmp_path / 'old.db'}"
    with sa.create_engine(url).begin() as conn:
        for statement in statements:
            conn.exec_driver_sql(statement)
    return url


def test_a_checkpoints_table_of_an_earlier_version_gets_the_incarnation_column(
        tmp_path: Path) -> None:
    url = older_database(
        tmp_path,
        "CREATE TABLE kclpy_state_checkpoints (lease_key VARCHAR(1024) PRIMARY KEY, "
        "tenure BIGINT NOT NULL, checkpoint VARCHAR(256), sub_sequence_number BIGINT NOT NULL)",
        "INSERT INTO kclpy_state_checkpoints VALUES ('s1', 4, '12', 0)")
    store = SQLStateStore(url)
    store.open(None)
    with store.engine.connect() as conn:
        assert conn.execute(sa.select(store.checkpoints)).all() == [("s1", 4, "12", 0, None)]


def test_a_state_table_of_an_earlier_version_gets_the_incarnation_column_and_stays_usable(
        table: LeaseTable, tmp_path: Path) -> None:
    """Upgraded in place: the rows an earlier kclpy wrote are read and updated as they
    were, and a key created now gets an incarnation."""
    url = older_database(
        tmp_path,
        "CREATE TABLE kclpy_state (state_key VARCHAR(1024) PRIMARY KEY, "
        "state_value TEXT NOT NULL, version BIGINT NOT NULL)",
        "INSERT INTO kclpy_state VALUES ('k', '7', 3)")
    store = SQLStateStore(url)
    store.open(None)
    shard = Shard(table, "s1", "A", Clock())
    adapter = runner(store, Ops())
    shard.deliver(adapter, [rec(10, "add:1")])
    fresh = SQLStateStore(url)
    assert fresh.read("k") == Versioned(8, 4)
    fresh.forget(["k"])
    shard.deliver(adapter, [rec(11, "del")])  # a commit each: the key gone, then created
    shard.deliver(adapter, [rec(12, "set:1")])
    created = fresh.read("k")
    assert (created.value, created.version) == (1, 1) and created.incarnation is not None


class Probe(StatefulProcessor):
    """Counts records into ``k``, and has each commit's own database transaction write down
    how long its lock waits may last (PostgreSQL ``lock_timeout``, SQLite busy timeout)."""

    def __init__(self, store: SQLStateStore, probe: sa.Table) -> None:
        self.setting = (
            sa.select(sa.func.current_setting("lock_timeout"))
            if store.engine.dialect.name == "postgresql" else
            sa.select(sa.literal_column("CAST(timeout AS TEXT)"))
            .select_from(sa.text("pragma_busy_timeout")))
        self.probe = probe

    def apply(self, record: Record, txn: StateTransaction) -> None:
        txn.update("k", lambda n: n + 1, 0)
        txn.emit(sa.insert(self.probe).from_select(["wait"], self.setting))


def test_a_commit_waits_on_a_hot_row_a_quarter_failover_time_then_applies_again(
        table: LeaseTable, new_sql_store: Callable[[], SQLStateStore]) -> None:
    """A commit holds the lease's lock (renewals of the lease wait for it), so its lock
    waits end within a quarter of the failover time - here 0.4 s, so 100 ms - instead of the
    store's 10 s, which would cost a renewal and the lease. The wait that runs out is
    refused like a conflict and the record applied again, the lease's lock let go in
    between (here the other transaction ends then)."""
    store = new_sql_store()
    probe = sa.Table(f"{store.state.name}_probe", sa.MetaData(), sa.Column("wait", sa.Text))
    probe.create(store.engine)
    shard = Shard(table, "s1", "A", Clock(), failover=0.4)
    metrics = Metrics()
    hot = store.engine.connect()
    hot_txn: list[sa.RootTransaction] = []

    def backoff(_: float) -> None:
        hot_txn.pop().rollback()  # the other writer ends while the commit backs off

    adapter = runner(store, Probe(store, probe), metrics=metrics, sleep=backoff)
    shard.deliver(adapter, [rec(10, "k:1")])
    hot_txn.append(hot.begin())  # SQLite: BEGIN IMMEDIATE, the file's write lock
    hot.execute(sa.select(store.state).where(store.state.c.state_key == "k").with_for_update())
    shard.deliver(adapter, [rec(11, "k:1")])
    hot.close()
    assert stored_state(store) == {"k": 2}
    assert metrics.registry.get_sample_value(
        "kclpy_state_conflicts_total", {"shard_id": "s1"}) == 1
    with store.engine.connect() as conn:
        waits = conn.execute(sa.select(probe.c.wait)).scalars().all()
    # PostgreSQL: half for each wait, the sum bounded by the other half (the test below)
    assert set(waits) == {"50ms" if store.engine.dialect.name == "postgresql" else "100"}
    assert len(waits) == 2, "the refused attempt's probe rolled back with it"


def test_a_commit_found_landed_already_leaves_no_stale_cache(
        table: LeaseTable, new_sql_store: Callable[[], SQLStateStore]) -> None:
    """A commit landed and its answer was lost: the batch is applied again in a new
    transaction, whose commit finds its position stored and writes nothing. The cache must
    not take the new transaction for what is stored - a key it created carries another
    incarnation than the one that landed - or the next commit of the key is refused."""
    store = new_sql_store()
    shard = Shard(table, "s1", "A", Clock())
    token = shard.checkpointer._token
    assert store.begin_tenure(shard.fence, "s1", token) is None
    for attempt in range(2):
        txn = StateTransaction(store.read, store.limits)
        txn.put("k", 1)
        store.commit(shard.fence, "s1", token, Position("10"), txn)
        if attempt == 0:  # its answer lost: the cache holds what was read before it
            store._cache.remember({"k": Versioned(None, 0)})
    assert store.read("k") == new_sql_store().read("k")


def test_a_postgresql_commit_whose_lock_waits_add_up_past_its_budget_stops_and_applies_again(
        table: LeaseTable, postgres_url: str) -> None:
    """PostgreSQL bounds each lock wait, not their sum: a commit that meets one hot row
    after another would hold the lease's lock for many waits. Past half its budget (the
    other half is each wait's) it stops before its next statement, nothing written, and is
    applied again like a conflict. The store's clock jumps past the budget once, as if the
    first key's row had kept the commit waiting."""
    readings = iter([0.0, 0.0, 0.0, 60.0])  # claim, commit start, before key 1, before key 2

    def clock() -> float:
        return next(readings, 60.0)

    store = SQLStateStore(postgres_url, prefix=unique_name("sum").replace("-", "_"),
                          clock=clock)
    store.open(None)
    shard = Shard(table, "s1", "A", Clock(), failover=0.4)
    metrics = Metrics()
    shard.deliver(runner(store, metrics=metrics, sleep=lambda _: None), [rec(10, "k:5")])
    assert stored_state(store) == {"count/k": 1, "sum/k": 5}
    assert metrics.registry.get_sample_value(
        "kclpy_state_conflicts_total", {"shard_id": "s1"}) == 1


# -- no wait on the database is unbounded ----------------------------------------------------


def test_opening_a_store_on_a_host_that_never_answers_fails_naming_the_connect_timeout(
) -> None:
    """A listener that accepts (the kernel completes the handshake) and never says a word:
    without a connect timeout, start-up hung there for as long as the host stayed silent."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        store = SQLStateStore(f"postgresql+psycopg://kclpy:pg-canary-pw@127.0.0.1:{port}/db",
                              connect_timeout_s=2)
        with pytest.raises(StateStoreUnavailable) as info:
            store.open(None)
    message = str(info.value)
    assert "connect timeout 2s" in message and "timeout expired" in message
    assert "pg-canary-pw" not in message


def test_postgresql_sessions_carry_the_statement_and_connect_timeouts(
        postgres_url: str) -> None:
    store = SQLStateStore(postgres_url, prefix=unique_name("timeouts").replace("-", "_"),
                          statement_timeout_s=7, lock_timeout_s=3)
    with store.engine.connect() as conn:
        shown = {name: conn.exec_driver_sql(f"SHOW {name}").scalar()
                 for name in ("statement_timeout", "lock_timeout",
                              "idle_in_transaction_session_timeout")}
        dsn = conn.connection.driver_connection.info.get_parameters()  # type: ignore[union-attr]
    assert shown == {"statement_timeout": "7s", "lock_timeout": "3s",
                     "idle_in_transaction_session_timeout": "3s"}
    assert dsn.get("connect_timeout") == "10"


def test_a_holder_frozen_inside_a_transaction_is_ended_by_the_server_and_frees_the_shard(
        table: LeaseTable, postgres_url: str) -> None:
    """A worker stopped (SIGSTOP, a host cut off) between its commit's statements keeps its
    checkpoint row locked; without a server-side end to idle transactions the shard's next
    owner failed every claim on lock_timeout for as long as the holder stayed frozen."""
    prefix = unique_name("frozen").replace("-", "_")
    held = SQLStateStore(postgres_url, prefix=prefix, lock_timeout_s=1)
    held.open(None)
    table.create(Lease("s1"))
    clock = Clock()
    Shard(table, "s1", "A", clock).deliver(runner(held), [rec(1, "a:1")])
    frozen = held.engine.connect()
    frozen.begin()
    frozen.execute(sa.select(held.checkpoints).with_for_update())
    clock.advance(60)  # A's lease expired; B takes it
    successor = SQLStateStore(postgres_url, prefix=prefix, lock_timeout_s=1)
    b = Shard(table, "s1", "B", clock)
    adapter = runner(successor)
    failures: list[str] = []

    def delivered() -> bool:
        try:
            b.deliver(adapter, [rec(2, "a:1"), rec(3, "a:1")])
        except KCLError as exc:
            failures.append(type(exc).__name__)
            return False
        return True

    wait_for(delivered, 60, "the shard's new owner commits while its old one is frozen")
    assert stored_state(successor)["count/a"] == 3
    with pytest.raises(sa.exc.DBAPIError):
        frozen.execute(sa.select(sa.literal(1)))
    frozen.close()


def test_a_gaps_table_of_an_earlier_version_gets_the_end_column_filled_by_the_next_tenure(
        table: LeaseTable, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Upgraded in place: an earlier kclpy wrote a gap's row at its first commit, without
    the gap's end. The next tenure records the end of the gap its lease still queues (its
    progress kept), and drops the row of a gap no longer queued, whose end nobody knows."""
    url = older_database(
        tmp_path,
        "CREATE TABLE kclpy_state_gaps (lease_key VARCHAR(1024) NOT NULL, "
        "gap VARCHAR(300) NOT NULL, checkpoint VARCHAR(256) NOT NULL, "
        "sub_sequence_number BIGINT NOT NULL, PRIMARY KEY (lease_key, gap))",
        "INSERT INTO kclpy_state_gaps VALUES ('s1', '10/0', '15', 0), ('s1', '40/0', '44', 0)")
    store = SQLStateStore(url)
    store.open(None)
    assert store.stored_gaps("s1") == {Position("10"): None, Position("40"): None}
    holder = Holder(table, "A", Clock())
    token = holder.take("s1")
    queued = gap("10", 5000, 4000, done="12")
    recovery = recovery_for(holder, token, gaps.dumps((queued,)), store=store,
                            max_lag_ms=None)
    with caplog.at_level("INFO"):
        assert recovery.begin(Position("30")) is None
    assert store.stored_gaps("s1") == {Position("10"): queued.checkpointed(Position("15"),
                                                                           None)}
    assert "written by an older kclpy without their end: dropped" in caplog.text
