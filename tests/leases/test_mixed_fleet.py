"""kclpy next to Java KCL 2.x workers on one lease table (``kclpy/leases/mixed.py``).

Coordinators against moto in-process with an injected clock; the "Java worker" writes the
lease item as the Java KCL 2.5.8 does (take: owner and counter, conditional on the counter
alone; renewal: the counter alone; no ``checkpointOwner``, no ``kclpyHolder``). The real Java
KCL against kclpy over real HTTP is ``tests/system/test_java_kcl.py``.
"""

from __future__ import annotations

from collections.abc import Iterator

import boto3
import pytest
from moto import mock_aws

from kclpy.leases import cleanup, mixed
from kclpy.leases.balancing import Balancer
from kclpy.leases.coordinator import CoordinatorSettings, LeaseCoordinator
from kclpy.leases.lease import Lease
from kclpy.leases.table import LeaseTable
from kclpy.position import Position
from tests.support.determinism import Clock, FirstChoiceRandom

FAILOVER = 10.0
TIMEOUT = 30.0


@pytest.fixture
def table() -> Iterator[LeaseTable]:
    with mock_aws():
        client = boto3.client("dynamodb", region_name="us-east-1")
        lease_table = LeaseTable(client, "app", sleep=lambda _: None)
        lease_table.create_if_missing()
        yield lease_table


def coordinator(table: LeaseTable, name: str, clock: Clock) -> LeaseCoordinator:
    settings = CoordinatorSettings(failover_time_s=FAILOVER, graceful_handoff_timeout_s=TIMEOUT,
                                   renewal_threads=1)
    return LeaseCoordinator(table, name, settings, clock=clock, rng=FirstChoiceRandom())


def java_take(table: LeaseTable, key: str, owner: str) -> None:
    """A Java KCL 2.x take: owner and counter, conditional on the counter."""
    lease = fetch(table, key)
    values = {":o": {"S": owner}, ":n": {"N": str(lease.lease_counter + 1)},
              ":c": {"N": str(lease.lease_counter)}}
    expression = "SET leaseOwner = :o, leaseCounter = :n"
    if lease.lease_owner not in (None, owner):
        expression += " ADD ownerSwitchesSinceCheckpoint :one"
        values[":one"] = {"N": "1"}
    table.client.update_item(TableName="app", Key={"leaseKey": {"S": key}},
                             UpdateExpression=expression, ConditionExpression="leaseCounter = :c",
                             ExpressionAttributeValues=values)


def java_renew(table: LeaseTable, key: str) -> None:
    """A Java KCL 2.x renewal: the counter alone, whoever ``leaseOwner`` names."""
    table.client.update_item(TableName="app", Key={"leaseKey": {"S": key}},
                             UpdateExpression="ADD leaseCounter :one",
                             ExpressionAttributeValues={":one": {"N": "1"}})


def fetch(table: LeaseTable, key: str) -> Lease:
    lease = table.get(key)
    assert lease is not None
    return lease


def owned(prefix: str, owner: str, count: int, *, kclpy: bool = False) -> list[Lease]:
    """``count`` leases ``<prefix>0``... held by ``owner`` at counter 1 (a kclpy holder's
    with its ``kclpyHolder`` mark)."""
    return [Lease(f"{prefix}{n}", lease_owner=owner, lease_counter=1,
                  kclpy_holder=owner if kclpy else None) for n in range(count)]


def renewed_but_stopped(leases: list[Lease], counter: int) -> list[Lease]:
    """Every lease renewed to ``counter`` but the stopped node's."""
    return [lease.copy(lease_counter=counter) if lease.lease_owner != "stopped" else lease
            for lease in leases]


def test_a_java_owner_is_stolen_from_outright_and_a_kclpy_owner_is_asked(
    table: LeaseTable,
) -> None:
    clock = Clock()
    for key in ("s1", "s2", "s3", "s4"):
        assert table.create(Lease(key))
    for key in ("s1", "s2"):
        java_take(table, key, "java")
    a = coordinator(table, "A", clock)
    assert {lease.lease_key for lease in a.run_taker_once()} == {"s3", "s4"}
    assert fetch(table, "s3").kclpy_holder == "A"
    assert mixed.speaks_handoff(fetch(table, "s3"))
    assert not mixed.speaks_handoff(fetch(table, "s1"))

    b = coordinator(table, "B", clock)
    # target 2 of 4, nothing free: the first of the most loaded ("A", "java") is A, asked
    assert b.run_taker_once() == []
    assert b.pending_handoffs() == {"s3"}
    stored = fetch(table, "s3")
    assert (stored.lease_owner, stored.checkpoint_owner) == ("B", "A")


def test_steal_from_java_takes_at_once_and_counts_the_owner_switch(table: LeaseTable) -> None:
    clock = Clock()
    for key in ("s1", "s2"):
        assert table.create(Lease(key))
        java_take(table, key, "java")
    b = coordinator(table, "B", clock)
    (taken,) = b.run_taker_once()
    stored = fetch(table, taken.lease_key)
    assert (stored.lease_owner, stored.checkpoint_owner, stored.kclpy_holder) == ("B", None, "B")
    assert stored.owner_switches_since_checkpoint == 1
    assert b.pending_handoffs() == set()


def test_a_take_after_asking_counts_an_owner_switch(table: LeaseTable) -> None:
    assert table.create(Lease("s1"))
    held = table.take(fetch(table, "s1"), "A")
    asked = table.set_checkpoint_owner(held, "B")
    assert (asked.lease_owner, asked.checkpoint_owner) == ("B", "A")
    taken = table.take(asked, "B")
    assert taken.owner_switches_since_checkpoint == 1
    assert taken.checkpoint_owner is None


def test_a_request_to_a_java_holder_whose_requester_died_is_undone(table: LeaseTable) -> None:
    """The stuck lease a mixed-fleet review found: ``leaseOwner=<dead requester>,
    checkpointOwner=<java>``, renewed by Java for ever. Another kclpy worker gives it back
    to Java, which keeps renewing it undisturbed."""
    clock = Clock()
    for key in ("s1", "s2"):
        assert table.create(Lease(key))
        java_take(table, key, "java")
    # an earlier kclpy version asked, then died
    table.client.update_item(
        TableName="app", Key={"leaseKey": {"S": "s1"}},
        UpdateExpression="SET leaseOwner = :dead, checkpointOwner = :java",
        ExpressionAttributeValues={":dead": {"S": "dead"}, ":java": {"S": "java"}})
    c = coordinator(table, "C", clock)
    c.run_taker_once()
    for _ in range(int((TIMEOUT + 2 * FAILOVER) / (FAILOVER / 3)) + 2):
        clock.advance(FAILOVER / 3)
        java_renew(table, "s1")
        java_renew(table, "s2")
        c.run_taker_once()
        if fetch(table, "s1").checkpoint_owner is None:
            break
    stored = fetch(table, "s1")
    assert (stored.lease_owner, stored.checkpoint_owner) == ("java", None)
    java_renew(table, "s1")  # Java's counter-only renewal still lands
    assert c.pending_handoffs() == set()


def test_a_java_take_during_a_kclpy_handoff_leaves_the_lease_with_java(
    table: LeaseTable,
) -> None:
    clock = Clock()
    assert table.create(Lease("s1"))
    held = table.take(fetch(table, "s1"), "A")
    table.set_checkpoint_owner(held, "B")
    java_take(table, "s1", "java")  # Java ignores checkpointOwner and leaves it behind
    c = coordinator(table, "C", clock)
    c.run_taker_once()
    clock.advance(TIMEOUT + 2 * FAILOVER + 1)
    java_renew(table, "s1")
    c.run_taker_once()
    stored = fetch(table, "s1")
    assert (stored.lease_owner, stored.checkpoint_owner) == ("java", None)


def test_finished_leases_count_as_java_counts_them_only_with_java_in_the_table() -> None:
    leases = [Lease(f"s{n}", lease_owner="java", lease_counter=1) for n in range(4)]
    leases += [Lease(f"f{n}", lease_owner="java", lease_counter=1, checkpoint=Position.shard_end())
               for n in range(2)]
    balancer = Balancer("K", FAILOVER, rng=FirstChoiceRandom())
    balancer.observe(leases, 0.0)
    plain = balancer.plan(held=set(), known_lease_keys=None, no_steal=(), now=1.0)
    java = balancer.plan(held=set(), known_lease_keys=None, no_steal=(), now=1.0,
                         java_peers=True)
    assert (plain.total, plain.needed) == (4, 2)
    assert (java.total, java.needed) == (6, 3)
    assert not any(lease.is_finished for lease in java.take + java.steal)


def test_with_java_peers_a_lease_free_for_a_failover_time_is_taken_above_target() -> None:
    """A lease a kclpy worker released: Java takes it only two scans after its last change
    (up to four failover times), so kclpy does not leave it free that long."""
    leases = [Lease(f"k{n}", lease_owner="K", lease_counter=1) for n in range(3)]
    leases += [Lease(f"j{n}", lease_owner="java", lease_counter=1) for n in range(3)]
    leases += [Lease("o0", lease_owner="other", lease_counter=1), Lease("free", lease_counter=2)]
    # 8 leases, 3 workers: K's target is 3, which it holds
    balancer = Balancer("K", FAILOVER, rng=FirstChoiceRandom())
    balancer.observe(leases, 0.0)
    # every owner renews; the free lease stays as it was
    balancer.observe([lease.copy(lease_counter=2) if lease.lease_owner else lease
                      for lease in leases], FAILOVER)
    held = {f"k{n}" for n in range(3)}
    for java_peers, expected in ((False, ()), (True, ("free",))):
        plan = balancer.plan(held=held, known_lease_keys=None, no_steal=(), now=FAILOVER + 1,
                             java_peers=java_peers)
        assert tuple(lease.lease_key for lease in plan.take) == expected


def test_a_finished_lease_a_java_worker_holds_is_left_to_its_cleanup() -> None:
    parent = Lease("p", lease_owner="java", checkpoint=Position.shard_end(),
                   child_shard_ids=frozenset({"c"}))
    child = Lease("c", lease_owner="K", checkpoint=Position("123"),
                  parent_shard_ids=frozenset({"p"}))
    assert cleanup.deletable([parent, child], "K") == [parent]
    assert cleanup.deletable([parent, child], "K", keep={"p"}) == []


def test_with_java_peers_a_silent_java_workers_lease_is_taken_above_target_at_expiry() -> None:
    """A Java node stopped (Java 2.x never releases): its leases expire a failover time after
    its last renewal, and a Java worker would wait up to two more of its taker scans."""
    leases = owned("k", "K", 3) + owned("j", "java", 3) + owned("d", "stopped", 2)
    balancer = Balancer("K", FAILOVER, rng=FirstChoiceRandom())
    balancer.observe(leases, 0.0)
    # every owner renews but the stopped one
    balancer.observe(renewed_but_stopped(leases, 2), FAILOVER)
    held = {f"k{n}" for n in range(3)}
    # 8 leases, 2 live workers: K's target is 4, it holds 3 and needs one
    plain = balancer.plan(held=held, known_lease_keys=None, no_steal=(), now=FAILOVER + 1)
    assert len(plain.take) == 1
    java = balancer.plan(held=held, known_lease_keys=None, no_steal=(), now=FAILOVER + 1,
                         java_peers=True)
    assert {lease.lease_key for lease in java.take} == {"d0", "d1"}


def test_a_held_finished_lease_is_deleted_by_its_holder_alone() -> None:
    parent = Lease("p", lease_owner="K", checkpoint=Position.shard_end(),
                   child_shard_ids=frozenset({"c"}))
    child = Lease("c", lease_owner="java", checkpoint=Position("123"),
                  parent_shard_ids=frozenset({"p"}))
    # the child's holder would delete an unowned parent; a held one is its holder's to delete
    assert cleanup.deletable([parent, child], "java", keep={"p"}) == []
    assert cleanup.deletable([parent, child], "K", held={"p"}) == [parent]
    assert cleanup.deletable([parent, child], "K") == []


def test_a_kclpy_worker_deletes_the_finished_lease_it_holds_through_its_held_set(
    table: LeaseTable,
) -> None:
    """A kclpy worker next to Java keeps a finished lease (the worker does not release it);
    its cleanup, not a Java worker's, deletes it once the child progressed, and its renewer
    no longer writes it."""
    clock = Clock()
    assert table.create(Lease("p", child_shard_ids=frozenset({"c"})))
    assert table.create(Lease("c", parent_shard_ids=frozenset({"p"})))
    assert table.create(Lease("j"))
    java_take(table, "j", "java")
    k = coordinator(table, "K", clock)
    taken = {lease.lease_key for lease in k.run_taker_once()}
    assert "p" in taken
    assert k.java_peers()
    held = k.get_held("p")
    assert held is not None and held.concurrency_token is not None
    k.fence.update_checkpoint("p", held.concurrency_token, Position.shard_end())
    java_take(table, "c", "java")
    table.client.update_item(  # the Java worker checkpoints the child
        TableName="app", Key={"leaseKey": {"S": "c"}}, UpdateExpression="SET checkpoint = :s",
        ExpressionAttributeValues={":s": {"S": "4959033827149025660855969253836157109"}})
    clock.advance(1.0)
    java_renew(table, "j")
    k.run_taker_once()
    assert table.get("p") is None
    assert k.get_held("p") is None
    k.run_renewer_once()
    assert table.get("p") is None


def test_expired_leases_a_kclpy_peer_under_target_takes_are_left_to_it() -> None:
    """Both kclpy workers scan at the expiry: one taking every expired lease above its target
    would only make the other steal one back (a second move, by a handoff)."""
    leases = (owned("k", "K", 2, kclpy=True) + owned("p", "P", 2, kclpy=True)
              + owned("j", "java", 2) + owned("d", "stopped", 2))
    balancer = Balancer("K", FAILOVER, rng=FirstChoiceRandom())
    balancer.observe(leases, 0.0)
    renewed = renewed_but_stopped(leases, 2)
    balancer.observe(renewed, FAILOVER)
    # 8 leases, 3 live workers: target 3; K and P hold 2 each and take one each
    plan = balancer.plan(held={"k0", "k1"}, known_lease_keys=None, no_steal=(), now=FAILOVER + 1,
                         java_peers=True)
    assert len(plan.take) == 1
    # with P at its target, K takes both: only Java's slower taker would be left for one
    full = [lease.copy(lease_owner="P", kclpy_holder="P") if lease.lease_key == "j0" else lease
            for lease in renewed]
    balancer.observe(full, FAILOVER + 1)
    plan = balancer.plan(held={"k0", "k1"}, known_lease_keys=None, no_steal=(), now=FAILOVER + 2,
                         java_peers=True)
    assert {lease.lease_key for lease in plan.take} == {"d0", "d1"}


def test_expired_leases_are_not_left_to_a_kclpy_peer_that_may_not_have_watched_them() -> None:
    """P took its first lease less than a failover time ago (a node started as the stopped
    node's leases fell free): it may judge them expired only a failover time after its own
    start, so K takes them above its target rather than leave them without a consumer."""
    leases = owned("k", "K", 2, kclpy=True) + owned("j", "java", 4) + owned("d", "stopped", 2)
    balancer = Balancer("K", FAILOVER, rng=FirstChoiceRandom())
    balancer.observe(leases, 0.0)
    renewed = renewed_but_stopped(leases, 2)
    # P steals j0 from Java just before the stopped node's leases expire
    renewed = [lease.copy(lease_owner="P", kclpy_holder="P") if lease.lease_key == "j0"
               else lease for lease in renewed]
    balancer.observe(renewed, FAILOVER)
    # 8 leases, 3 live workers: target 3; K holds 2, P holds 1 and has room for 2
    plan = balancer.plan(held={"k0", "k1"}, known_lease_keys=None, no_steal=(), now=FAILOVER + 1,
                         java_peers=True)
    assert {lease.lease_key for lease in plan.take} == {"d0", "d1"}
    # once P has owned leases for a failover time, its room counts again
    balancer.observe(renewed_but_stopped(renewed, 3), 2 * FAILOVER)
    plan = balancer.plan(held={"k0", "k1"}, known_lease_keys=None, no_steal=(),
                         now=2 * FAILOVER + 0.5, java_peers=True)
    assert len(plan.take) == 1
