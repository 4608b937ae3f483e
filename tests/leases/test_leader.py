"""``kclpy.leases.leader``: the leader's decisions (pure), who counts as live, and the
election over the simulator's in-memory DynamoDB (atomic conditional writes)."""

from __future__ import annotations

import random
from collections import Counter
from typing import TYPE_CHECKING, Any, cast

import pytest
from botocore.exceptions import ClientError

from kclpy.leases.assignment import COUNT, LOAD
from kclpy.leases.coordinator import CoordinatorSettings, LeaseAssignment, LeaseCoordinator
from kclpy.leases.leader import LeaderLock, LeaderMode, held_leases, live_workers, plan
from kclpy.leases.leading import LeaderTaker
from kclpy.leases.lease import Lease, new_incarnation
from kclpy.leases.load import (
    LEADER_ITEM,
    LOAD_TABLE_SUFFIX,
    WORKER_ID,
    LoadBalancing,
    LoadMeter,
    LoadSettings,
    LoadTable,
    WorkerLoad,
)
from kclpy.leases.park import marker, park_held
from kclpy.leases.table import OWNER_INDEX, LeaseTable
from kclpy.position import Position
from tests.simulation.aws import Dynamo
from tests.simulation.scheduler import Sim

if TYPE_CHECKING:
    from mypy_boto3_dynamodb import DynamoDBClient


def _lease(key: str, owner: str | None = None, counter: int = 1,
           checkpoint_owner: str | None = None) -> Lease:
    return Lease(key, lease_owner=owner, lease_counter=counter, checkpoint_owner=checkpoint_owner)


def _report(worker: str, load: float = 0.0, leases: dict[str, float] | None = None) -> WorkerLoad:
    kbps = sum((leases or {}).values())
    return WorkerLoad(worker, load, kbps, 0.0, load, leases or {}, 1)


def _never_expired(lease: Lease) -> bool:
    return False


def test_free_leases_go_to_the_emptiest_workers_and_counts_end_within_one() -> None:
    """Ten free leases over three idle workers: 4/3/3; then a worker holding all six of the
    others' share gives the newcomer its excess, and nothing else moves."""
    live = {w: _report(w) for w in ("a", "b", "c")}
    decided = plan([_lease(f"s{i:02d}") for i in range(10)], live, is_expired=_never_expired,
                   known_lease_keys=None, no_move=(), strategy=COUNT, rng=random.Random(1))
    assert sorted(Counter(owner for _, owner in decided.assign).values()) == [3, 3, 4]
    assert decided.move == ()
    leases = ([_lease(f"a{i}", "a") for i in range(6)] + [_lease(f"b{i}", "b") for i in range(3)])
    decided = plan(leases, live, is_expired=_never_expired, known_lease_keys=None, no_move=(),
                   strategy=COUNT, rng=random.Random(1))
    moved = Counter(owner for _, owner in decided.move)
    assert moved == {"c": 3}
    assert {lease.lease_owner for lease, _ in decided.move} == {"a"}


def test_among_workers_with_as_few_leases_those_that_reported_last_get_the_free_ones() -> None:
    """Two free leases, four idle workers: with ``recency`` (worker -> when it last showed it
    lives, on the leader's clock then on the reporter's) the two most recent get them,
    whatever the generator draws; the reporter's clock only orders workers the leader's
    clock ties; without ``recency`` the draw decides."""
    live = {w: _report(w) for w in ("a", "b", "c", "d")}
    recency = {"a": (5.0, 100.0), "b": (9.0, 1.0), "c": (5.0, 200.0), "d": (5.0, 150.0)}
    winners = set()
    for seed in range(20):
        decided = plan([_lease("s0"), _lease("s1")], live, is_expired=_never_expired,
                       known_lease_keys=None, no_move=(), strategy=COUNT,
                       rng=random.Random(seed), recency=recency)
        winners.add(frozenset(owner for _, owner in decided.assign))
    assert winners == {frozenset({"b", "c"})}
    drawn = {frozenset(owner for _, owner in plan(
        [_lease("s0"), _lease("s1")], live, is_expired=_never_expired, known_lease_keys=None,
        no_move=(), strategy=COUNT, rng=random.Random(seed)).assign) for seed in range(20)}
    assert len(drawn) > 1


def test_what_the_leader_leaves_alone() -> None:
    """A lease being handed off counts for its new owner and never moves again; a lease
    whose owner does not report but renews it (a Java KCL 2.x worker) is neither moved nor
    counted; an expired one of such an owner is free; a recently moved one stays put;
    finished, parked and unknown leases are nobody's business."""
    live = {w: _report(w) for w in ("a", "b")}
    leases = [
        _lease("h1", "b", checkpoint_owner="a"), _lease("h2", "b", checkpoint_owner="a"),
        _lease("h3", "b", checkpoint_owner="a"), _lease("j1", "java"), _lease("j2", "java"),
        _lease("x1", "java", counter=7), _lease("r1", "b"), _lease("r2", "b"),
    ]
    done = _lease("f1")
    done.checkpoint = Position.shard_end()
    parked = _lease("p1")
    parked.parked = "operator"
    decided = plan([*leases, done, parked, _lease("u1")], live,
                   is_expired=lambda lease: lease.lease_key == "x1",
                   known_lease_keys={lease.lease_key for lease in [*leases, done, parked]},
                   no_move={"r1", "r2"}, strategy=COUNT, rng=random.Random(2))
    assert [(lease.lease_key, owner) for lease, owner in decided.assign] == [("x1", "a")]
    assert decided.move == ()


def test_by_load_moves_damped_shares_from_the_busiest_and_leaves_a_balanced_fleet_alone() -> None:
    """One worker at 90 % with three leases of 30 %, two at 10 % with one lease each: the
    hot worker's leases go one to each idle worker (each takes what keeps it below what the
    victim keeps); a fleet within the threshold of its average moves nothing."""
    hot = _report("a", 90.0, {"a1": 300.0, "a2": 300.0, "a3": 300.0})
    live = {"a": hot, "b": _report("b", 10.0, {"b1": 100.0}),
            "c": _report("c", 10.0, {"c1": 100.0})}
    leases = [_lease("a1", "a"), _lease("a2", "a"), _lease("a3", "a"), _lease("b1", "b"),
              _lease("c1", "c")]
    settings = LoadSettings(threshold=0.10, dampening=1.0)
    decided = plan(leases, live, is_expired=_never_expired, known_lease_keys=None, no_move=(),
                   strategy=LOAD, settings=settings, rng=random.Random(3))
    assert sorted(owner for _, owner in decided.move) == ["b", "c"]
    assert {lease.lease_owner for lease, _ in decided.move} == {"a"}
    even = {w: _report(w, 50.0 + i, {f"{w}1": 500.0}) for i, w in enumerate("abc")}
    decided = plan([_lease(f"{w}1", w) for w in "abc"], even, is_expired=_never_expired,
                   known_lease_keys=None, no_move=(), strategy=LOAD, settings=settings,
                   rng=random.Random(3))
    assert decided.move == ()


def test_by_load_judges_each_report_as_of_the_lease_table_not_as_of_when_it_was_sent() -> None:
    """The hot worker's report still counts a1, which the leader already handed to b (the
    lease table says ``leaseOwner`` b, ``checkpointOwner`` a): projected onto the table, b
    is at the average (its 10 plus a1's 30) and a at 60, so only c takes a lease. Judged
    on the reports as sent, b looks idle and takes a second lease off a, which leaves a
    below the others and sends a lease back at the next round."""
    live = {"a": _report("a", 90.0, {"a1": 300.0, "a2": 300.0, "a3": 300.0}),
            "b": _report("b", 10.0, {"b1": 100.0}), "c": _report("c", 10.0, {"c1": 100.0})}
    leases = [_lease("a1", "b", checkpoint_owner="a"), _lease("a2", "a"), _lease("a3", "a"),
              _lease("b1", "b"), _lease("c1", "c")]
    decided = plan(leases, live, is_expired=_never_expired, known_lease_keys=None, no_move=(),
                   strategy=LOAD, settings=LoadSettings(threshold=0.10, dampening=1.0),
                   rng=random.Random(3))
    assert [(lease.lease_owner, owner) for lease, owner in decided.move] == [("a", "c")]


def test_a_worker_whose_lease_expired_after_its_last_report_is_dead_until_it_reports() -> None:
    reports = {w: _report(w) for w in ("a", "b")}
    reported = {"a": 100.0, "b": 100.0}
    dead: dict[str, float] = {}
    leases = [_lease("s1", "a"), _lease("s2", "b")]

    def expired_at(lease: Lease) -> float | None:
        return 105.0 if lease.lease_owner == "a" else None

    def live(leases: list[Lease]) -> set[str]:
        return set(live_workers(reports, reported.__getitem__, leases, expired_at, dead,
                                unchanged_for=lambda lease: 0.0, claim_within_s=5.0))

    assert live(leases) == {"b"}
    # its leases assigned away, it is still dead: no new report since
    assert live([]) == {"b"}
    reported["a"] = 130.0
    assert live([]) == {"a", "b"}
    assert dead == {}


def test_a_worker_that_never_takes_what_it_was_assigned_is_dead_and_the_lease_free() -> None:
    """A worker with no lease proves it is alive by its reports alone, which stay fresh for
    a while after it died: a lease assigned to it and left unclaimed (no ``kclpyHolder`` of
    its own) for longer than ``claim_within_s`` marks it dead, and frees the lease."""
    reports = {w: _report(w) for w in ("a", "b")}
    assigned = _lease("s1", "a", counter=2)
    taken = _lease("s2", "b", counter=3)
    taken.kclpy_holder = "b"
    dead: dict[str, float] = {}
    live = live_workers(reports, lambda w: 100.0, [assigned, taken], lambda lease: None, dead,
                        unchanged_for=lambda lease: 9.0, claim_within_s=5.0)
    assert set(live) == {"b"}
    decided = plan([assigned, taken], live, is_expired=_never_expired, known_lease_keys=None,
                   no_move=(), strategy=COUNT, rng=random.Random(4), dead=set(dead))
    assert [(lease.lease_key, owner) for lease, owner in decided.assign] == [("s1", "b")]


def test_an_assignment_a_holder_was_not_notified_of_is_judged_by_its_expiry() -> None:
    """A worker that holds leases queries for new ones only on a notice (or every three
    failover times): left untaken past the claim window, a lease assigned to it without a
    notice says nothing of its life, since it renews what it holds; one it was notified of
    does."""
    reports = {w: _report(w) for w in ("a", "b")}
    assigned = _lease("s1", "a", counter=2)
    held = _lease("s2", "a", counter=7)
    held.kclpy_holder = "a"

    def live(noticed: set[str]) -> set[str]:
        return set(live_workers(reports, lambda w: 100.0, [assigned, held], lambda lease: None,
                                {}, unchanged_for=lambda lease: 9.0, claim_within_s=5.0,
                                holders={"a"}, noticed=noticed))

    assert live(set()) == {"a", "b"}
    assert live({"s1"}) == {"b"}


def test_a_notice_goes_on_a_lease_its_worker_holds_and_takes_and_renews() -> None:
    leases = [_lease("held", "a"), _lease("assigned", "a"), _lease("handing", "a", 3, "b"),
              _lease("expired", "a"), _lease("b's", "b")]
    for lease in leases:
        lease.kclpy_holder = lease.checkpoint_owner or lease.lease_owner
    leases[1].kclpy_holder = None
    held = held_leases(leases, is_expired=lambda lease: lease.lease_key == "expired")
    assert {w: [lease.lease_key for lease in ls] for w, ls in held.items()} == {
        "a": ["held"], "b": ["b's"]}


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_lock_one_leader_at_a_time_taken_over_within_the_failover_time() -> None:
    """Two workers on one lock: the first to read it wins; the other reads the term every
    half failover time and takes over only once the term stood still for longer than half
    the failover time on its own clock; the old leader, back, finds it lost on its next
    renewal.
    A resigning leader deletes the lock, so the next reader leads at once."""
    backend = Dynamo(Sim(0))
    backend.create_table(TableName="load", KeySchema=[{"AttributeName": WORKER_ID,
                                                       "KeyType": "HASH"}])
    client = cast("DynamoDBClient", backend)
    clock = _Clock()

    def lock(worker: str) -> LeaderLock:
        table = LoadTable(client, "load", clock=clock, sleep=lambda s: None)
        return LeaderLock(table, worker, failover_time_s=10.0, clock=clock)

    first, second = lock("w1"), lock("w2")
    assert first.tick() is True
    assert second.tick() is False
    for _ in range(18):  # 30 s of renewals every sixth of the failover time
        clock.now += first.heartbeat_s
        assert first.tick() is True
        assert second.tick() is False
    stopped_at = clock.now  # w1 stops renewing (paused)
    while not second.tick():
        clock.now += 0.5
    # seen at a check after the last renewal, expired half a failover time later, found so
    # at the next check: 1.5 failover times at worst
    assert 5.0 < clock.now - stopped_at <= 5.0 + 2 * second.check_s + 0.5
    assert first.is_leader() is False  # its belief ended one failover time after renewing
    clock.now += first.heartbeat_s
    assert first.tick() is False  # its renewal is refused: w2's term
    item = backend.get_item(TableName="load", Key={WORKER_ID: {"S": LEADER_ITEM}})["Item"]
    assert item["leader"]["S"] == "w2"
    second.resign()
    assert backend.get_item(TableName="load", Key={WORKER_ID: {"S": LEADER_ITEM}}) == {}
    clock.now += 2 * first.check_s  # its next read, at a random phase within that
    assert first.tick() is True


def test_a_fleet_started_at_once_reads_the_lock_within_the_first_interval() -> None:
    """200 workers join a fleet whose lock says 200 workers: each reads it every 25 check
    intervals, and the first of those reads falls anywhere in that period, so some worker
    looks within the first interval after joining (about eight do) and a leader lost in the
    fleet's first minute is noticed as soon as later. Drawn within 0.5-1.5 periods, as every
    later read is, no worker would look for 12.5 intervals (62 s at 10 s failover)."""
    backend = Dynamo(Sim(0))
    backend.create_table(TableName="load", KeySchema=[{"AttributeName": WORKER_ID,
                                                       "KeyType": "HASH"}])
    backend.put_item(TableName="load", Item={WORKER_ID: {"S": LEADER_ITEM},
                                             "leader": {"S": "boss"}, "term": {"N": "1"},
                                             "workers": {"N": "200"}})
    client = cast("DynamoDBClient", backend)
    clock = _Clock()
    locks = [LeaderLock(LoadTable(client, "load", clock=clock, sleep=lambda s: None),
                        f"w{index}", failover_time_s=10.0, clock=clock,
                        rng=random.Random(index))
             for index in range(200)]
    for lock in locks:
        assert lock.tick() is False  # a term seen for the first time
    confirmed_at = max(lock.next_tick() for lock in locks)
    clock.now = confirmed_at
    backend.update_item(TableName="load", Key={WORKER_ID: {"S": LEADER_ITEM}},
                        UpdateExpression="SET #t = :t", ExpressionAttributeNames={"#t": "term"},
                        ExpressionAttributeValues={":t": {"N": "2"}})  # the leader renews
    for lock in locks:
        assert lock.tick() is False
    first_reads = sorted(lock.next_tick() - confirmed_at for lock in locks)
    check_s = locks[0].check_s
    assert sum(1 for wait in first_reads if wait <= check_s) >= 1, first_reads[:5]
    assert first_reads[-1] <= 25 * check_s


# -- workers with a leader over the simulator's DynamoDB (atomic; an index can be building) --

_FAILOVER = 10.0


class _Counted:
    """The simulator's DynamoDB, counting the calls made of it by operation."""

    def __init__(self, backend: Dynamo) -> None:
        self.backend = backend
        self.calls: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Any:
        self.calls[name] += 1
        return getattr(self.backend, name)


def _tables(backend: Dynamo) -> tuple[LeaseTable, _Counted]:
    client = _Counted(backend)
    table = LeaseTable(cast("DynamoDBClient", client), "app", sleep=lambda s: None)
    table.create_if_missing()
    LoadTable(cast("DynamoDBClient", client), "app" + LOAD_TABLE_SUFFIX,
              sleep=lambda s: None).create_if_missing()
    return table, client


def _led_worker(table: LeaseTable, name: str, clock: _Clock) -> LeaseCoordinator:
    """A worker's lease coordinator with ``--lease-assigner leader``, as ``Worker`` builds it."""
    load = LoadBalancing(LoadMeter(name, dict, clock=clock),
                         LoadTable(table.client, "app" + LOAD_TABLE_SUFFIX, sleep=lambda s: None),
                         LoadSettings(report_interval_s=2.0), clock=clock)
    mode = LeaderMode(LeaderLock(load.table, name, failover_time_s=_FAILOVER, clock=clock),
                      load)
    return LeaseCoordinator(table, name,
                            CoordinatorSettings(failover_time_s=_FAILOVER, renewal_threads=1),
                            clock=clock, rng=random.Random(1),
                            assignment=LeaseAssignment(COUNT, load, mode))


def _taker(worker: LeaseCoordinator) -> LeaderTaker:
    assert isinstance(worker.taker, LeaderTaker)
    return worker.taker


def _leader_and_holder() -> tuple[LeaseTable, _Counted, _Clock, list[str], LeaseCoordinator,
                                  LeaseCoordinator]:
    """Twelve leases, a leader L that has won the lock and a worker H, on one fake clock."""
    table, client = _tables(Dynamo(Sim(0)))
    table.ensure_owner_index()
    keys = [f"s{i:02}" for i in range(12)]
    for key in keys:
        assert table.create(Lease(key))
    clock = _Clock()
    leader, holder = _led_worker(table, "L", clock), _led_worker(table, "H", clock)
    assert leader.run_taker_once() == []  # wins the lock first
    return table, client, clock, keys, leader, holder


def _step(clock: _Clock, workers: tuple[LeaseCoordinator, ...]) -> None:
    """What each worker's renewer and taker loops do in 50 ms."""
    clock.now += 0.05
    for worker in workers:
        worker.run_renewer_once(due_only=True)
        if clock.now >= worker.taker.next_scan():
            worker.run_taker_once()


def _assign(table: LeaseTable, key: str, owner: str) -> None:
    """What a leader's pass writes for a free lease."""
    lease = table.get(key)
    assert lease is not None
    table.assign(lease, owner)


def test_while_the_owner_index_backfills_a_worker_finds_its_leases_by_a_scan() -> None:
    """On AWS an index added to a table backfills for minutes: DescribeTable says CREATING
    and a Query of it is refused with a ValidationException. A worker assigned a lease
    then must not wait for the index (the leader would take every lease itself, one
    claim timeout at a time): it reads its keys from a scan, and Queries again once the
    index answers."""
    backend = Dynamo(Sim(0))
    backend.index_build_s = 60.0
    table, client = _tables(backend)
    assert table.ensure_owner_index()
    described = backend.describe_table(TableName="app")["Table"]
    assert described["TableStatus"] == "UPDATING"
    assert described["GlobalSecondaryIndexes"] == [
        {"IndexName": OWNER_INDEX, "IndexStatus": "CREATING", "Backfilling": True}]
    with pytest.raises(ClientError, match="Cannot read from backfilling global secondary index"):
        table.keys_owned_by("B")
    for key in ("s1", "s2"):
        assert table.create(Lease(key))
    _assign(table, "s1", "B")
    b = _led_worker(table, "B", _Clock())
    client.calls.clear()
    assert [lease.lease_key for lease in _taker(b)._discover()] == ["s1"]
    assert set(b.held_leases()) == {"s1"}
    assert client.calls["scan"] == 1
    backend.sim.now = 60.0  # built
    _assign(table, "s2", "B")
    client.calls.clear()
    assert [lease.lease_key for lease in _taker(b)._discover()] == ["s2"]
    assert (client.calls["scan"], client.calls["query"]) == (0, 1)


def test_a_stopping_worker_hands_its_released_lease_to_a_live_worker_without_the_leader() -> None:
    """A worker that shuts down with a leader leaves the fleet first (its report and, if it
    leads, the lock go) and hands each lease it releases straight to the live worker with
    the fewest leases, with a notice on one that worker holds: the lease is taken after the
    taker's next renewal, before any leader pass (there is no leader left here). A lease
    a leader assigned it and it never took goes the same way. Counted as live while it
    released, the stopping worker used to be given its own leases back by the leader, and
    they came back only once it was judged dead."""
    backend = Dynamo(Sim(0))
    table, _ = _tables(backend)
    table.ensure_owner_index()
    for key in ("s1", "s2", "s3", "s4"):
        assert table.create(Lease(key))
    clock = _Clock()
    a, b, c = (_led_worker(table, name, clock) for name in ("A", "B", "C"))
    for worker, keys in ((a, ("s1",)), (b, ("s2", "s3")), (c, ())):
        worker.run_taker_once()  # the first cycle reports the worker's load (A leads)
        for key in keys:
            _assign(table, key, worker.worker_id)
    for worker in (a, b):
        _taker(worker)._discover()
    clock.now += 3.0  # the next reports (every 2 s here), with the leases now held
    for worker in (a, b, c):
        _taker(worker)._leader.reports.report_if_due(set(worker.held_leases()))
    assert a.leads() is True
    _assign(table, "s4", "A")  # a leader's last pass: A stops before it takes it
    assert a.stop_taking()
    untaken = table.get("s4")
    assert untaken is not None and untaken.lease_owner == "C"
    assert LEADER_ITEM not in _load_items(backend)
    assert "A" not in _load_items(backend)
    a.release("s1")
    stored = table.get("s1")
    assert stored is not None and stored.lease_owner == "C", "to the worker with the fewest"
    assert not any(worker.leads() for worker in (b, c))
    clock.now += 2.0  # C held nothing: it Queries every half failover time
    assert sorted(lease.lease_key for lease in c.run_taker_once()) == ["s1", "s4"]
    assert b.stop_taking()
    b.release("s2")
    stored = table.get("s2")
    assert stored is not None and stored.lease_owner == "C"
    noticed = table.get("s1")
    assert noticed is not None and noticed.assignment_notice is not None
    c.run_renewer_once()  # renewing s1 returns the notice: C looks for its leases now
    assert [lease.lease_key for lease in c.run_taker_once()] == ["s2"]
    assert set(c.held_leases()) == {"s1", "s2", "s4"}


def _load_items(backend: Dynamo) -> dict[str, Any]:
    return backend.tables["app" + LOAD_TABLE_SUFFIX][1]


def test_a_leader_moves_a_lease_whose_holder_renewed_since_the_scan() -> None:
    """A move is a handoff request fenced on the counter the leader's scan saw; a holder
    that checkpoints every batch bumps it several times a second, so the request was
    refused pass after pass. Refused, the leader reads the lease again and, still held by
    the same worker with no handoff under way, asks once more on the current counter; a
    lease that moved to someone else meanwhile is left alone."""
    backend = Dynamo(Sim(0))
    table, _ = _tables(backend)
    for key in ("s1", "s2"):
        assert table.create(Lease(key))
    clock = _Clock()
    leader, holder = _led_worker(table, "L", clock), _led_worker(table, "H", clock)
    for key in ("s1", "s2"):
        _assign(table, key, "H")
    table.ensure_owner_index()
    _taker(holder)._discover()
    scanned = {lease.lease_key: lease for lease in table.list_leases()}
    holder.run_renewer_once()  # both renewed since the scan
    assert _taker(leader)._hand(scanned["s1"], "L") is True
    s1 = table.get("s1")
    assert s1 is not None and (s1.lease_owner, s1.checkpoint_owner) == ("L", "H")
    _assign(table, "s2", "X")  # moved on: taken from H meanwhile
    assert _taker(leader)._hand(scanned["s2"], "L") is False
    s2 = table.get("s2")
    assert s2 is not None and (s2.lease_owner, s2.checkpoint_owner) == ("X", None)


def test_a_new_leader_assigns_the_leases_below_its_last_listing_before_it_syncs() -> None:
    """Only the leader syncs shards, so a worker that has just taken over knows the shards
    of its last own sync (start-up, here: s0 and s1) and not the merge child s2, nor s2's
    child s3, that the previous leader created since. Those were left unassigned until the
    new leader's first sync, a shard sync interval later (simulator seed 403: the merge
    child, unread for 5 s, aged out). A lease below a known shard is assigned at the first
    pass; one of a shard nobody listed (x9, no known parent) still is not."""
    backend = Dynamo(Sim(0))
    table, _ = _tables(backend)
    table.ensure_owner_index()
    for lease in (Lease("s2", parent_shard_ids=frozenset({"s0", "s1"})),
                  Lease("s3", parent_shard_ids=frozenset({"s2"})),
                  Lease("x9", parent_shard_ids=frozenset({"x8"}))):
        assert table.create(lease)
    clock = _Clock()
    leader = _led_worker(table, "L", clock)
    leader.set_known_lease_keys({"s0", "s1"})
    assert leader.run_taker_once() == []  # wins the lock; a cold start's first pass waits
    assert leader.leads() is True
    clock.now += _FAILOVER / 3  # the first pass

    taken = leader.run_taker_once()

    assert sorted(lease.lease_key for lease in taken) == ["s2", "s3"]
    untouched = table.get("x9")
    assert untouched is not None and untouched.lease_owner is None


def test_a_lease_of_a_former_stream_below_a_listed_shard_id_is_not_assigned() -> None:
    """The stream was deleted and created again under the same name (one stream's leases,
    no stream in the key): its new shard s0 is listed, and shard sync replaced the former
    s0's lease, but the former stream's child c1 still names s0 as its parent. That parent
    is another shard: c1's consumer would wait for the new s0 to end, holding the lease all
    the while (then read a shard id the new stream may not have). The former stream's
    leases are told by their incarnation; a child of the same stream's s0 is assigned."""
    backend = Dynamo(Sim(0))
    table, _ = _tables(backend)
    table.ensure_owner_index()
    new_stream, former_stream = 2_000_000.125, 1_000_000.5
    for lease in (Lease("s0", incarnation=new_incarnation(new_stream)),
                  Lease("c1", parent_shard_ids=frozenset({"s0"}),
                        incarnation=new_incarnation(former_stream)),
                  Lease("c2", parent_shard_ids=frozenset({"s0"}),
                        incarnation=new_incarnation(new_stream))):
        assert table.create(lease)
    clock = _Clock()
    leader = _led_worker(table, "L", clock)
    leader.set_known_lease_keys({"s0"})
    assert leader.run_taker_once() == []  # wins the lock; a cold start's first pass waits
    assert leader.leads() is True
    clock.now += _FAILOVER / 3  # the first pass

    taken = leader.run_taker_once()

    assert sorted(lease.lease_key for lease in taken) == ["c2", "s0"]
    former = table.get("c1")
    assert former is not None and former.lease_owner is None


def test_a_leader_scans_every_tenth_of_the_failover_time_so_a_dead_holders_lease_goes_soon(
) -> None:
    """The leader judges a lease's expiry from its first sight of the lease's last counter
    (a live holder's lease is never taken before the failover time), so a holder that dies
    right after a write loses its lease the failover time plus the time to the leader's
    scan after that write. Scans every third of the failover time made that 13.3 s at 10 s
    here (``kill -9`` at 5 s failover: 7.4 s to the first record elsewhere, past the
    failover time + 2 s). The leader now scans every tenth of the failover time, and still
    never takes a lease before its expiry."""
    table, client, clock, keys, leader, holder = _leader_and_holder()
    for worker, mine in ((leader, keys[:6]), (holder, keys[6:])):
        for key in mine:
            _assign(table, key, worker.worker_id)
        _taker(worker)._discover()

    for _ in range(400):  # 20 s: the fleet settles
        _step(clock, (leader, holder))
    assert leader.leads() is True
    assert set(holder.held_leases()) == set(keys[6:])
    scans = client.calls["scan"]
    while client.calls["scan"] == scans:  # right after a pass, the holder writes and dies
        _step(clock, (leader, holder))
    clock.now += 0.05
    holder.run_renewer_once()
    died_at = clock.now

    while any(lease.lease_owner == "H" for lease in table.list_leases()):
        assert clock.now - died_at < 3 * _FAILOVER, "never taken over"
        _step(clock, (leader,))

    taken_after = clock.now - died_at
    assert _FAILOVER < taken_after <= _FAILOVER + _FAILOVER / 10 + 0.1


def test_a_leader_does_not_move_a_lease_its_holder_parked_since_the_scan() -> None:
    """The holder's park policy marked the lease after the leader's scan, which refuses
    the move's first request (the counter moved): read again, the lease is parked, and a
    parked lease is nobody's to move - asking its holder to hand it over would have a
    successor adopt a shard that the policy set aside."""
    backend = Dynamo(Sim(0))
    table, _ = _tables(backend)
    assert table.create(Lease("s1"))
    clock = _Clock()
    leader, holder = _led_worker(table, "L", clock), _led_worker(table, "H", clock)
    _assign(table, "s1", "H")
    table.ensure_owner_index()
    _taker(holder)._discover()
    scanned = table.get("s1")
    assert scanned is not None
    token = holder.held_leases()["s1"].concurrency_token
    assert token is not None
    park_held(holder.fence, "s1", token, marker("processor_error_policy=park", "worker"))
    assert _taker(leader)._hand(scanned, "L") is False
    s1 = table.get("s1")
    assert s1 is not None and (s1.lease_owner, s1.checkpoint_owner) == ("H", None)
    assert s1.parked is not None


def test_a_stopping_worker_does_not_hand_over_a_lease_it_parked() -> None:
    """The park policy marks the lease and the worker releases it; a worker that is
    stopping hands what it releases to a live worker - but not a parked lease, which stays
    nobody's until ``kclpy shard resume``."""
    backend = Dynamo(Sim(0))
    table, _ = _tables(backend)
    table.ensure_owner_index()
    assert table.create(Lease("s1"))
    clock = _Clock()
    a, c = (_led_worker(table, name, clock) for name in ("A", "C"))
    for worker in (a, c):
        worker.run_taker_once()  # the first cycle reports the worker's load (A leads)
    _assign(table, "s1", "A")
    _taker(a)._discover()
    clock.now += 3.0  # the next reports, with the lease now held
    for worker in (a, c):
        _taker(worker)._leader.reports.report_if_due(set(worker.held_leases()))
    token = a.held_leases()["s1"].concurrency_token
    assert token is not None
    park_held(a.fence, "s1", token, marker("processor_error_policy=park", "worker"))
    assert a.stop_taking()
    a.release("s1")
    stored = table.get("s1")
    assert stored is not None and stored.parked is not None
    assert stored.lease_owner is None, "a parked lease is handed to nobody"


def test_a_leader_moves_a_lease_named_after_it_that_it_gave_up_by_assigning_it() -> None:
    """Simulator seed 246: the leader gave up leases it held (its renewal held up past the
    failover time on its own clock) while the table still named it, and its next pass
    moved some to a worker that had just joined - by a handoff request, which only a holder
    answers. Nobody held them, so they waited for the stale-handoff timeout while the
    child shard's first records aged out. A lease named after the leader that the leader
    does not hold is assigned straight to its new owner."""
    backend = Dynamo(Sim(0))
    table, _ = _tables(backend)
    table.ensure_owner_index()
    keys = [f"s{i}" for i in range(4)]
    for key in keys:
        assert table.create(Lease(key))
    clock = _Clock()
    leader, joiner = _led_worker(table, "L", clock), _led_worker(table, "J", clock)
    assert leader.run_taker_once() == []  # wins the lock
    for key in keys:
        _assign(table, key, "L")
    _taker(leader)._discover()
    assert set(leader.held_leases()) == set(keys)
    for key in keys:
        leader.held.drop(key, "expired on this worker")
    joiner.run_taker_once()  # reports: alive, holding nothing

    while not any(lease.lease_owner != "L" or lease.checkpoint_owner is not None
                  for lease in table.list_leases()):
        clock.now += 0.05
        leader.run_taker_once()

    moved = [lease for lease in table.list_leases() if lease.lease_owner != "L"
             or lease.checkpoint_owner is not None]
    assert [(lease.lease_owner, lease.checkpoint_owner) for lease in moved] == \
        [("J", None)] * len(moved)
    assert {lease.lease_key for lease in _taker(joiner)._discover()} == \
        {lease.lease_key for lease in moved}


def test_a_leader_adopts_a_lease_handed_to_it_at_its_next_pass() -> None:
    """Simulator seed 604: a lease handed to a worker that then took the lead was let go
    by its holder, and the new leader never adopted it: its cycles ran every scan (a tenth
    of the failover time), each putting off the poll of pending handoffs (a quarter of a
    renewal interval away), and its passes did not look at them. The lease sat named after
    it, unread, until it was assigned elsewhere after its oldest records aged out. A pass
    moves the leader's pending handoffs on from its scan, as the default assigner's does."""
    backend = Dynamo(Sim(0))
    table, _ = _tables(backend)
    table.ensure_owner_index()
    assert table.create(Lease("s1"))
    clock = _Clock()
    leader, holder = _led_worker(table, "L", clock), _led_worker(table, "H", clock)
    assert leader.run_taker_once() == []  # wins the lock
    _assign(table, "s1", "H")
    _taker(holder)._discover()
    held = table.get("s1")
    assert held is not None
    table.set_checkpoint_owner(held, "L")  # a handoff to L, asked by an earlier leader
    _taker(leader)._discover()
    assert leader.taker.pending_handoffs() == {"s1"}
    asked = table.get("s1")
    assert asked is not None
    table.evict(asked)  # the holder lets go

    taken: list[Lease] = []
    while clock.now < _FAILOVER / 2 and not taken:
        clock.now += 0.05
        if clock.now >= leader.taker.next_scan():
            taken += leader.run_taker_once()

    assert [lease.lease_key for lease in taken] == ["s1"]
    assert set(leader.held_leases()) == {"s1"}


def test_a_leaders_own_scan_adopts_a_lease_handed_to_it() -> None:
    """A lease the leader moves to itself arrives by a handoff: it asks, the holder lets go
    by naming the leader as owner, and the leader adopts it. The coordinator polls pending
    handoffs only between taker cycles, and every cycle starts that poll's wait again (a
    worker-decides scan progresses them itself); the poll waits a quarter of the renewal
    interval, an eighth of the failover time, longer than the leader's tenth between
    scans, so it never came. Nobody adopted the let-go lease, it expired, and the next
    pass gave it by count to whichever worker had the fewest: balancing by load moved a
    third of the leases every round and never settled (busiest 1.6-2.4 x the average).
    Stepped by its taker cycles alone, as its loop runs it, the leader now adopts each
    lease let go to it by its next scan."""
    table, _, clock, keys, leader, holder = _leader_and_holder()
    for key in keys:
        _assign(table, key, "H")
    _taker(holder)._discover()
    assert set(holder.held_leases()) == set(keys)

    let_go: dict[str, float] = {}
    adopted: dict[str, float] = {}
    while len(adopted) < len(keys) // 2:
        assert clock.now < 6 * _FAILOVER, f"adopted {sorted(adopted)} only"
        _step(clock, (leader, holder))
        for lease in table.list_leases():
            if (lease.lease_owner == "L" and lease.checkpoint_owner is None
                    and lease.kclpy_holder == "H"):
                let_go.setdefault(lease.lease_key, clock.now)
        adopted.update((key, clock.now) for key in leader.held_leases() if key not in adopted)

    assert set(adopted) <= set(let_go)
    assert not set(holder.held_leases()) & set(adopted)
    assert max(adopted[key] - let_go[key] for key in adopted) <= _FAILOVER / 10 + 0.1
