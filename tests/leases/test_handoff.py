"""Graceful lease handoff (the Java KCL 3.x ``checkpointOwner`` protocol).

Coordinators against moto in-process with an injected clock for every state and fallback of
the protocol, then worker processes over real HTTP: a rebalance where the processor
checkpoints in ``shutdown_requested`` repeats no record.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from moto import mock_aws

from kclpy.errors import ShutdownException
from kclpy.leases import handoff, park
from kclpy.leases.coordinator import CoordinatorSettings, LeaseAssignment, LeaseCoordinator
from kclpy.leases.dynamo import LeaseTableThrottled
from kclpy.leases.leader import LeaderLock, LeaderMode
from kclpy.leases.leading import LeaderTaker
from kclpy.leases.lease import Lease
from kclpy.leases.load import LoadBalancing, LoadMeter, LoadSettings, LoadTable
from kclpy.leases.table import LeaseChanged, LeaseTable
from kclpy.local import LocalEndpoint
from kclpy.metrics import Metrics
from kclpy.position import Position
from tests.support.determinism import Clock, FirstChoiceRandom
from tests.support.fleet import Producer, fleet
from tests.support.streams import create_stream, kinesis_client, unique_name
from tests.support.waiting import wait_for

FAILOVER = 10.0
TIMEOUT = 30.0


class Calls:
    def __init__(self) -> None:
        self.shards: list[str] = []

    def __call__(self, shard_id: str) -> None:
        self.shards.append(shard_id)


@pytest.fixture
def table() -> Iterator[LeaseTable]:
    with mock_aws():
        client = boto3.client("dynamodb", region_name="us-east-1")
        lease_table = LeaseTable(client, "app", sleep=lambda _: None)
        lease_table.create_if_missing()
        yield lease_table


@pytest.fixture
def clock() -> Clock:
    return Clock()


def worker(
    table: LeaseTable, name: str, clock: Clock, *, listen: bool = True,
    metrics: Metrics | None = None, assignment: LeaseAssignment | None = None,
) -> tuple[LeaseCoordinator, Calls, Calls]:
    """A coordinator with recorded lease-lost and (unless ``listen`` is False) handoff
    listeners."""
    c = LeaseCoordinator(
        table,
        name,
        CoordinatorSettings(
            failover_time_s=FAILOVER, graceful_handoff_timeout_s=TIMEOUT, renewal_threads=1),
        clock=clock,
        rng=FirstChoiceRandom(),
        metrics=metrics,
        assignment=assignment,
    )
    lost, asked = Calls(), Calls()
    c.add_lease_lost_listener(lost)
    if listen:
        c.add_handoff_listener(asked)
    return c, lost, asked


def fetch(table: LeaseTable, key: str) -> Lease:
    lease = table.get(key)
    assert lease is not None
    return lease


def b_asks_a_for_s1(
    table: LeaseTable, clock: Clock, **a_kwargs: Any
) -> tuple[LeaseCoordinator, Calls, Calls, LeaseCoordinator]:
    """A holds s1 and s2; B starts and (target 1, nothing free) asks for s1."""
    for key in ("s1", "s2"):
        assert table.create(Lease(key))
    a, a_lost, a_asked = worker(table, "A", clock, **a_kwargs)
    a.run_taker_once()
    b, _, _ = worker(table, "B", clock)
    assert b.run_taker_once() == []
    return a, a_lost, a_asked, b


def test_a_steal_asks_the_owner_and_waits(table: LeaseTable, clock: Clock) -> None:
    a, _, _, b = b_asks_a_for_s1(table, clock)
    before = a.get_held("s1")
    assert before is not None
    stored = fetch(table, "s1")
    assert (stored.lease_owner, stored.checkpoint_owner) == ("B", "A")
    assert stored.lease_counter == before.lease_counter, "asking does not bump the counter"
    assert b.pending_handoffs() == {"s1"}
    assert b.held_leases() == {}
    assert b.run_taker_once() == [], "B waits while A holds it"


def test_a_request_whose_answer_was_lost_is_still_followed_to_the_end(
    table: LeaseTable, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The request is written but its answer lost, and the SDK's retry is refused by the
    condition the first attempt changed: B still waits for s1 and adopts it when A lets go,
    instead of leaving ``checkpointOwner`` dangling until the lease expires."""
    for key in ("s1", "s2"):
        assert table.create(Lease(key))
    a, _, a_asked = worker(table, "A", clock)
    a.run_taker_once()
    b, _, _ = worker(table, "B", clock)
    ask = table.set_checkpoint_owner

    def ask_then_lose_the_answer(lease: Lease, new_owner: str) -> Lease:
        ask(lease, new_owner)
        raise LeaseChanged(f"lease {lease.lease_key} changed", None)

    monkeypatch.setattr(table, "set_checkpoint_owner", ask_then_lose_the_answer)
    assert b.run_taker_once() == []
    stored = fetch(table, "s1")
    assert (stored.lease_owner, stored.checkpoint_owner) == ("B", "A")
    assert b.pending_handoffs() == {"s1"}
    a.run_renewer_once()
    assert a_asked.shards == ["s1"]
    a.release("s1")
    (adopted,) = b.poll_handoffs()
    assert adopted.lease_key == "s1" and set(b.held_leases()) == {"s1"}


def test_a_refused_request_that_did_not_land_is_forgotten(
    table: LeaseTable, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key in ("s1", "s2"):
        assert table.create(Lease(key))
    a, _, _ = worker(table, "A", clock)
    a.run_taker_once()
    b, _, _ = worker(table, "B", clock)

    def refused(lease: Lease, new_owner: str) -> Lease:
        raise LeaseChanged(f"lease {lease.lease_key} changed", None)

    monkeypatch.setattr(table, "set_checkpoint_owner", refused)
    assert b.run_taker_once() == []
    assert b.pending_handoffs() == set()
    assert fetch(table, "s1").lease_owner == "A"


def test_the_owner_learns_at_its_next_renewal_and_keeps_renewing(
    table: LeaseTable, clock: Clock
) -> None:
    a, a_lost, a_asked, b = b_asks_a_for_s1(table, clock)
    a.run_renewer_once()
    assert a_asked.shards == ["s1"]
    assert a_lost.shards == []
    assert a.handing_off("s1") and not a.handing_off("s2")
    for _ in range(4):
        clock.advance(FAILOVER / 2)
        a.run_renewer_once()
        assert b.run_taker_once() == [], "the owner renews: the lease never expires"
    assert a.get_held("s1") is not None
    assert fetch(table, "s1").checkpoint_owner == "A"


def test_a_request_found_by_a_renewal_that_then_fails_is_still_announced(
    table: LeaseTable, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, a_lost, a_asked, _ = b_asks_a_for_s1(table, clock)
    renew = table.renew
    calls: list[Lease] = []

    def renew_then_throttle(lease: Lease) -> Lease:
        calls.append(lease)
        if lease.checkpoint_owner == "A" and len(calls) == 2:  # repeated as handing off
            raise LeaseTableThrottled("throttled")
        return renew(lease)

    monkeypatch.setattr(table, "renew", renew_then_throttle)
    a.run_renewer_once()
    assert a_asked.shards == ["s1"]
    assert a_lost.shards == []
    assert a.handing_off("s1")
    a.run_renewer_once()
    last = [lease for lease in calls if lease.lease_key == "s1"][-1]
    assert last.checkpoint_owner == "A", "renewed as the handing-off holder"
    assert a_asked.shards == ["s1"], "announced once"


def test_the_owner_may_checkpoint_during_the_handoff(table: LeaseTable, clock: Clock) -> None:
    a, _, a_asked, _ = b_asks_a_for_s1(table, clock)
    held = a.get_held("s1")
    assert held is not None and held.concurrency_token is not None
    # The checkpoint is what discovers the request here: it is retried as the handing-off
    # holder and succeeds.
    a.fence.update_checkpoint("s1", held.concurrency_token, Position("1000"))
    assert a_asked.shards == ["s1"]
    a.fence.update_checkpoint("s1", held.concurrency_token, Position("2000", 1))
    stored = fetch(table, "s1")
    assert stored.checkpoint == Position("2000", 1)
    assert (stored.lease_owner, stored.checkpoint_owner) == ("B", "A")


def test_release_completes_the_handoff_and_the_new_owner_resumes_from_the_last_checkpoint(
    table: LeaseTable, clock: Clock
) -> None:
    metrics = Metrics()
    for key in ("s1", "s2"):
        assert table.create(Lease(key))
    a, _, _ = worker(table, "A", clock)
    a.run_taker_once()
    b, b_lost, _ = worker(table, "B", clock, metrics=metrics)
    b.run_taker_once()
    a.run_renewer_once()
    held = a.get_held("s1")
    assert held is not None and held.concurrency_token is not None
    a.fence.update_checkpoint("s1", held.concurrency_token, Position("777", 2))
    a.release("s1")
    assert a.get_held("s1") is None
    with pytest.raises(ShutdownException):
        a.fence.update_checkpoint("s1", held.concurrency_token, Position("778"))
    stored = fetch(table, "s1")
    assert (stored.lease_owner, stored.checkpoint_owner) == ("B", None)
    (adopted,) = b.poll_handoffs()
    assert adopted.lease_key == "s1"
    assert adopted.checkpoint == Position("777", 2)
    assert adopted.concurrency_token not in (None, held.concurrency_token)
    assert b.pending_handoffs() == set()
    assert set(b.held_leases()) == {"s1"}
    assert metrics.registry.get_sample_value("kclpy_leases_stolen_total") == 1
    assert b_lost.shards == []
    # A does not steal it back in its next cycle.
    assert a.run_taker_once() == []
    assert fetch(table, "s1").lease_owner == "B"


def test_a_lease_asked_for_while_being_released_goes_to_the_worker_that_asked(
    table: LeaseTable, clock: Clock
) -> None:
    a, a_lost, _, b = b_asks_a_for_s1(table, clock)
    a.release("s1")  # e.g. shutting down, before any renewal saw the request
    stored = fetch(table, "s1")
    assert (stored.lease_owner, stored.checkpoint_owner) == ("B", None)
    assert [lease.lease_key for lease in b.poll_handoffs()] == ["s1"]
    assert a_lost.shards == []


def test_a_stopping_worker_releases_what_was_already_handed_to_it(
    table: LeaseTable, clock: Clock
) -> None:
    a, _, _, b = b_asks_a_for_s1(table, clock)
    a.run_renewer_once()
    a.release("s1")
    b.stop(release=True)
    stored = fetch(table, "s1")
    assert (stored.lease_owner, stored.checkpoint_owner) == (None, None)
    assert b.pending_handoffs() == set()


def test_an_owner_without_handoff_listeners_lets_go_at_once(
    table: LeaseTable, clock: Clock
) -> None:
    a, a_lost, _, b = b_asks_a_for_s1(table, clock, listen=False)
    a.run_renewer_once()
    assert a.get_held("s1") is None
    assert a_lost.shards == []
    assert [lease.lease_key for lease in b.run_taker_once()] == ["s1"]


def test_an_owner_that_does_not_finish_lets_go_after_the_timeout(
    table: LeaseTable, clock: Clock
) -> None:
    a, a_lost, a_asked, b = b_asks_a_for_s1(table, clock)
    a.run_renewer_once()
    held = a.get_held("s1")
    assert held is not None and held.concurrency_token is not None
    elapsed = 0.0
    while elapsed <= TIMEOUT:
        clock.advance(FAILOVER / 2)
        elapsed += FAILOVER / 2
        a.run_renewer_once(due_only=True)
    assert a_asked.shards == ["s1"]
    assert a_lost.shards == ["s1"], "the processor that did not finish is fenced out"
    with pytest.raises(ShutdownException):
        a.fence.update_checkpoint("s1", held.concurrency_token, Position("5"))
    assert fetch(table, "s1").checkpoint_owner is None
    assert [lease.lease_key for lease in b.poll_handoffs()] == ["s1"]


def test_a_dead_owner_is_taken_over_once_its_lease_expires(table: LeaseTable, clock: Clock) -> None:
    _, _, _, b = b_asks_a_for_s1(table, clock)
    clock.advance(FAILOVER)
    assert b.run_taker_once() == []
    clock.advance(0.01)
    taken = b.run_taker_once()
    assert "s1" in {lease.lease_key for lease in taken}
    stored = fetch(table, "s1")
    assert (stored.lease_owner, stored.checkpoint_owner) == ("B", None)
    assert b.pending_handoffs() == set()


def test_an_owner_that_ignores_the_protocol_is_taken_over_after_timeout_and_failover(
    table: LeaseTable, clock: Clock
) -> None:
    _, _, _, b = b_asks_a_for_s1(table, clock)
    client: Any = table.client

    def java_2_renewal() -> None:
        """A Java 2.x owner renews on the counter alone and never reads checkpointOwner."""
        counter = fetch(table, "s1").lease_counter
        client.update_item(
            TableName="app",
            Key={"leaseKey": {"S": "s1"}},
            UpdateExpression="SET leaseCounter = :next",
            ConditionExpression="leaseCounter = :c",
            ExpressionAttributeValues={":next": {"N": str(counter + 1)}, ":c": {"N": str(counter)}},
        )

    waited = 0.0
    while waited <= TIMEOUT + FAILOVER:
        assert "s1" not in b.held_leases()
        java_2_renewal()
        clock.advance(FAILOVER / 3)
        waited += FAILOVER / 3
        b.run_taker_once()
    assert "s1" in b.held_leases()
    stored = fetch(table, "s1")
    assert (stored.lease_owner, stored.checkpoint_owner) == ("B", None)


def test_a_handed_off_lease_no_longer_consumed_is_not_adopted(
    table: LeaseTable, clock: Clock
) -> None:
    """The worker stopped consuming s1's stream while its handoff was under way: it does not
    adopt the lease (then release it at once, with no processor) and forgets the handoff."""
    a, _, a_asked, b = b_asks_a_for_s1(table, clock)
    a.run_renewer_once()
    assert a_asked.shards == ["s1"]
    a.release("s1")
    b.set_consumable(lambda key: key != "s1")
    assert b.poll_handoffs() == []
    assert b.held_leases() == {} and b.pending_handoffs() == set()
    assert fetch(table, "s1").lease_owner == "B", "not adopted: nothing written"


def test_a_lease_no_longer_consumed_is_not_taken_when_its_handoff_timed_out(
    table: LeaseTable, clock: Clock
) -> None:
    """The same for the take that follows an owner that never let go."""
    a, _, _, b = b_asks_a_for_s1(table, clock)
    b.set_consumable(lambda key: key != "s1")
    clock.advance(TIMEOUT + FAILOVER + 1)
    before = fetch(table, "s1")
    b.run_taker_once()
    assert "s1" not in b.held_leases() and "s1" not in b.pending_handoffs()
    assert fetch(table, "s1").lease_counter == before.lease_counter, "nothing written"


def park_s1_as_a(a: LeaseCoordinator) -> None:
    """A's ``park`` processor-error policy marks s1 through A's fence, as the consumer does."""
    held = a.get_held("s1")
    assert held is not None and held.concurrency_token is not None
    park.park_held(a.fence, "s1", held.concurrency_token,
                   park.marker("processor failed 3 times", "A", error="boom", attempts=3))


def test_a_lease_parked_during_a_handoff_is_not_adopted_and_the_handoff_is_cancelled(
    table: LeaseTable, clock: Clock
) -> None:
    """A is handing s1 off to B when its processor's errors park the shard (the park write
    goes through as the handing-off holder). Its release then cancels the handoff - the
    lease ends unowned and parked, as an operator's park leaves it - and B stops waiting
    instead of adopting the lease and starting a consumer on a parked shard."""
    a, a_lost, a_asked, b = b_asks_a_for_s1(table, clock)
    a.run_renewer_once()
    assert a_asked.shards == ["s1"] and a.handing_off("s1")
    park_s1_as_a(a)
    a.release("s1")
    stored = fetch(table, "s1")
    assert stored.parked is not None
    assert (stored.lease_owner, stored.checkpoint_owner) == (None, None), "handoff cancelled"
    assert b.poll_handoffs() == []
    assert b.pending_handoffs() == set(), "B stops waiting for it"
    assert "s1" not in {lease.lease_key for lease in b.run_taker_once()}
    assert "s1" not in b.held_leases()
    assert a_lost.shards == []


def test_a_lease_parked_by_a_holder_that_died_during_the_handoff_is_never_taken(
    table: LeaseTable, clock: Clock
) -> None:
    """A parks s1 while handing it off and dies before releasing it (the item still says
    ``leaseOwner=B, checkpointOwner=A``): when it expires, B forgets the handoff instead of
    taking the lease."""
    a, _, _, b = b_asks_a_for_s1(table, clock)
    a.run_renewer_once()
    park_s1_as_a(a)
    stored = fetch(table, "s1")
    assert (stored.lease_owner, stored.checkpoint_owner) == ("B", "A")
    clock.advance(TIMEOUT + 2 * FAILOVER)
    b.run_taker_once()
    clock.advance(0.01)
    b.run_taker_once()
    b.poll_handoffs()
    assert "s1" not in b.held_leases()
    assert b.pending_handoffs() == set()
    stored = fetch(table, "s1")
    assert stored.parked is not None and stored.kclpy_holder == "A"


def test_a_worker_assigned_leases_by_a_leader_never_takes_a_parked_one(
    table: LeaseTable, clock: Clock
) -> None:
    """With ``--lease-assigner leader`` a worker takes what the owner index names it for.
    A parked lease left naming it (released by a holder that handed it off before this
    release cancelled such a handoff) is not taken."""
    table.ensure_owner_index()
    assert table.create(Lease("s1", lease_owner="B", lease_counter=4))
    client: Any = table.client
    client.update_item(TableName="app", Key={"leaseKey": {"S": "s1"}},
                       UpdateExpression="SET kclpyParked = :p",
                       ExpressionAttributeValues={":p": {"S": "{}"}})
    reports = LoadBalancing(LoadMeter("B", dict, clock=clock, cpu_seconds=lambda: 0.0),
                            LoadTable(table.client, "app-load", clock=clock), LoadSettings(),
                            clock=clock)
    mode = LeaderMode(LeaderLock(reports.table, "B", failover_time_s=FAILOVER, clock=clock),
                      reports)
    b, _, _ = worker(table, "B", clock, assignment=LeaseAssignment(leader=mode))
    assert isinstance(b.taker, LeaderTaker)
    assert b.taker._discover() == []
    assert b.pending_handoffs() == set() and "s1" not in b.held_leases()
    assert fetch(table, "s1").lease_counter == 4


def test_a_parked_lease_is_forgotten_whatever_else_its_handoff_says() -> None:
    asked = Lease("s1", lease_owner="B", lease_counter=5, checkpoint_owner="A", parked="{}")
    for expired, overdue in [(False, False), (True, False), (False, True)]:
        assert handoff.next_step(asked, "B", asked_at_counter=5, expired=expired,
                                 overdue=overdue) is handoff.Step.FORGET
    let_go = asked.copy(checkpoint_owner=None, lease_counter=7)
    assert handoff.next_step(let_go, "B", asked_at_counter=5, expired=False,
                             overdue=False) is handoff.Step.FORGET


def test_a_read_older_than_the_request_does_not_cancel_it() -> None:
    before = Lease("s1", lease_owner="A", lease_counter=5)
    assert handoff.next_step(before, "B", asked_at_counter=5, expired=False, overdue=False) is (
        handoff.Step.WAIT
    )
    moved = before.copy(lease_owner="C", lease_counter=6)
    assert handoff.next_step(moved, "B", asked_at_counter=5, expired=False, overdue=False) is (
        handoff.Step.FORGET
    )
    assert handoff.next_step(None, "B", asked_at_counter=5, expired=False, overdue=False) is (
        handoff.Step.FORGET
    )
    asked = Lease("s1", lease_owner="B", lease_counter=5, checkpoint_owner="A")
    for expired, overdue, step in [
        (False, False, handoff.Step.WAIT),
        (True, False, handoff.Step.TAKE),
        (False, True, handoff.Step.TAKE),
    ]:
        assert (
            handoff.next_step(asked, "B", asked_at_counter=5, expired=expired, overdue=overdue)
            is step
        )
    let_go = asked.copy(checkpoint_owner=None, lease_counter=7)
    assert handoff.next_step(let_go, "B", asked_at_counter=5, expired=False, overdue=False) is (
        handoff.Step.ADOPT
    )


def test_only_an_unchanged_lease_naming_this_worker_is_a_request() -> None:
    held = Lease("s1", lease_owner="A", lease_counter=5)
    asked = held.copy(lease_owner="B", checkpoint_owner="A")
    assert handoff.is_request_to_hand_off(held, asked, "A")
    assert not handoff.is_request_to_hand_off(held, None, "A")
    assert not handoff.is_request_to_hand_off(held, asked.copy(lease_counter=6), "A")
    assert not handoff.is_request_to_hand_off(held, asked.copy(checkpoint_owner="C"), "A")
    assert not handoff.is_request_to_hand_off(held, held.copy(lease_owner="B"), "A")
    assert not handoff.is_request_to_hand_off(asked, asked, "A"), "already handing off"
    assert handoff.as_handing_off(held, asked, "A") == asked


def test_a_fleet_balancing_by_handoff_converges_without_ping_pong(
    table: LeaseTable, clock: Clock
) -> None:
    keys = [f"s{i}" for i in range(7)]
    for key in keys:
        assert table.create(Lease(key))
    workers = [
        LeaseCoordinator(
            table, name, CoordinatorSettings(failover_time_s=FAILOVER, renewal_threads=1),
            clock=clock, rng=random.Random(seed),
        )
        for seed, name in enumerate("ABC")
    ]  # fmt: skip
    workers[0].run_taker_once()
    history = []
    for _ in range(12):
        for c in workers:
            c.run_taker_once()
        for _ in range(2):
            clock.advance(FAILOVER / 2)
            for c in workers:
                c.run_renewer_once()
        history.append({lease.lease_key: lease.lease_owner for lease in table.list_leases()})
    counts = sorted(list(history[-1].values()).count(name) for name in "ABC")
    assert counts == [2, 2, 3]
    assert history[-5] == history[-1]
    held = [set(c.held_leases()) for c in workers]
    assert set().union(*held) == set(keys)
    assert sum(len(h) for h in held) == len(keys)


# -- worker processes over real HTTP ---------------------------------------------------------


@pytest.mark.integration
def test_a_rebalance_with_checkpoints_in_shutdown_requested_repeats_nothing(
    kinesis_mock: LocalEndpoint, moto_server: LocalEndpoint, tmp_path: Path
) -> None:
    kinesis = kinesis_client(kinesis_mock.url)
    stream = unique_name("handoff")
    create_stream(kinesis, stream, 2)
    with (
        fleet(kinesis_mock.url, moto_server.url, stream, unique_name("app"), tmp_path) as group,
        Producer(kinesis, stream, "h") as producer,
    ):
        first = group.start("first")

        def first_processing_both() -> bool:
            owners = group.owners()
            processed = {r["shard"] for r in group.ledger.records() if r["pid"] == first.pid}
            return (
                len(owners) == 2 and set(owners.values()) == {"first"} and processed == set(owners)
            )

        wait_for(first_processing_both, 30, "the first worker processing both shards")
        second = group.start("second")
        wait_for(lambda: group.balanced_among({"first", "second"}), 30, "one shard each")
        moved = {key for key, owner in group.owners().items() if owner == "second"}
        wait_for(
            lambda: moved <= {r["shard"] for r in group.ledger.records() if r["pid"] == second.pid},
            30,
            "the second worker processing the moved shard",
        )
        sent = producer.stop()
        wait_for(lambda: group.ledger.processed_all(set(sent)), 45, "every record processed")
    ledger = group.ledger
    (shard,) = moved
    handed = [
        e
        for e in ledger.events("shutdown_requested")
        if e["pid"] == first.pid and e["shard"] == shard
    ]
    assert handed, "the first worker's processor was asked to shut down"
    last_checkpoint = [
        c
        for c in ledger.events("checkpoint")
        if c["pid"] == first.pid and c["shard"] == shard and c["ok"]
    ][-1]
    assert last_checkpoint["during"] == "shutdown_requested"
    starts = [e for e in ledger.events("initialize") if e["pid"] == second.pid]
    assert next(e["checkpoint"] for e in starts if e["shard"] == shard) == last_checkpoint["seq"]
    payloads = ledger.payloads()
    assert set(payloads) == set(sent)
    assert max(payloads.values()) == 1
