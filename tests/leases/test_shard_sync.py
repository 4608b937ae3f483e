"""Shard sync: which shards get leases and where they start; ListShards pagination."""

from __future__ import annotations

import dataclasses
import random
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import boto3
import pytest
from botocore.exceptions import ClientError
from botocore.stub import Stubber
from moto import mock_aws

from kclpy.errors import ConfigError
from kclpy.leases.lease import Lease
from kclpy.leases.shard_sync import (
    LIST_SHARDS_RETRIES,
    Shard,
    ShardSyncer,
    SyncedStream,
    aged_out,
    former_incarnation,
    plan_new_leases,
)
from kclpy.leases.table import LeaseTable, checkpoint_changes
from kclpy.local import LocalEndpoint
from kclpy.metrics import Metrics
from kclpy.position import AT_TIMESTAMP, LATEST, TRIM_HORIZON, Position
from kclpy.retrieval.page import ChildShard
from tests.support.streams import wait_for_stream_active
from tests.support.waiting import wait_for

REGION = "us-east-1"
MAX_HASH = str(2**128 - 1)
#: stand-ins for collaborators a test never reaches
NO_TABLE: Any = None
NO_KINESIS: Any = None


@pytest.fixture(autouse=True)
def _aws_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (
        "AWS_ENDPOINT_URL",
        "AWS_ENDPOINT_URL_DYNAMODB",
        "AWS_ENDPOINT_URL_KINESIS",
        "AWS_PROFILE",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)


# -- which leases, at which position (no AWS) --------------------------------------------------


def shard(
    shard_id: str,
    *parents: str,
    start: int = 0,
    closed: bool = False,
    hash_range: tuple[str, str] = ("0", MAX_HASH),
) -> Shard:
    return Shard(
        shard_id=shard_id,
        parent_shard_id=parents[0] if parents else None,
        adjacent_parent_shard_id=parents[1] if len(parents) > 1 else None,
        starting_hash_key=hash_range[0],
        ending_hash_key=hash_range[1],
        starting_sequence_number=str(start),
        ending_sequence_number=str(start + 99) if closed else None,
    )


def java_example() -> list[Shard]:
    """The tree from the Java KCL's HierarchicalShardSyncer documentation:

        0 1 2 3 4   5     shards until epoch 102
        \\ / \\ / |   |
         6   7  4   5     shards from epoch 103 to 205
          \\ /   |  / \\
           8    4 9  10   shards from epoch 206 (open)
    """
    return [
        shard("8", "6", "7", start=206),
        shard("9", "5", start=206),
        shard("10", "5", start=206),
        shard("6", "0", "1", start=103, closed=True),
        shard("7", "2", "3", start=103, closed=True),
        *(shard(str(i), start=0, closed=True) for i in (0, 1, 2, 3, 5)),
        shard("4", start=0),
    ]


def planned(shards: list[Shard], existing: set[str], position: str) -> list[tuple[str, str]]:
    return [
        (lease.lease_key, lease.checkpoint.sequence_number)
        for lease in plan_new_leases(shards, existing, position)
    ]


def test_latest_with_leases_continues_below_them_from_trim_horizon() -> None:
    # Java would also create 6 at LATEST (it reads nothing from a closed shard at LATEST);
    # without a lease for 6, the consumer of 8 treats it as finished: the same outcome.
    assert sorted(planned(java_example(), {"4", "5", "7"}, LATEST)) == [
        ("10", TRIM_HORIZON),
        ("8", TRIM_HORIZON),
        ("9", TRIM_HORIZON),
    ]


def test_trim_horizon_with_leases_adds_roots_not_the_ancestors_of_leased_shards() -> None:
    assert sorted(planned(java_example(), {"4", "5", "7"}, TRIM_HORIZON)) == [
        ("0", TRIM_HORIZON),
        ("1", TRIM_HORIZON),
        ("10", TRIM_HORIZON),
        ("6", TRIM_HORIZON),
        ("8", TRIM_HORIZON),
        ("9", TRIM_HORIZON),
    ]


def test_at_timestamp_starts_every_new_lease_at_the_timestamp() -> None:
    result = dict(planned(java_example(), {"4", "5", "7"}, AT_TIMESTAMP))
    assert set(result) == {"0", "1", "6", "8", "9", "10"}
    assert set(result.values()) == {AT_TIMESTAMP}


def test_empty_table_latest_leases_open_shards_only() -> None:
    assert sorted(planned(java_example(), set(), LATEST)) == [
        ("10", LATEST),
        ("4", LATEST),
        ("8", LATEST),
        ("9", LATEST),
    ]


def test_empty_table_trim_horizon_leases_every_shard() -> None:
    result = planned(java_example(), set(), TRIM_HORIZON)
    assert sorted(key for key, _ in result) == sorted(s.shard_id for s in java_example())
    assert {checkpoint for _, checkpoint in result} == {TRIM_HORIZON}


@pytest.mark.parametrize("position", [LATEST, TRIM_HORIZON, AT_TIMESTAMP])
def test_parents_are_always_created_before_their_children(position: str) -> None:
    order = [key for key, _ in planned(java_example(), {"7"}, position)]
    by_id = {s.shard_id: s for s in java_example()}
    for index, key in enumerate(order):
        for parent in by_id[key].parent_ids:
            if parent in order:
                assert order.index(parent) < index


def test_new_leases_record_both_parents_and_the_hash_range() -> None:
    shards = [
        shard("p1", closed=True, hash_range=("0", "99")),
        shard("p2", closed=True, hash_range=("100", "199")),
        shard("merged", "p1", "p2", start=500, hash_range=("0", "199")),
    ]
    (p1, p2, merged) = plan_new_leases(shards, set(), TRIM_HORIZON)
    assert (p1.lease_key, p2.lease_key) == ("p1", "p2")
    assert merged == Lease(
        "merged",
        checkpoint=Position.trim_horizon(),
        parent_shard_ids=frozenset({"p1", "p2"}),
        starting_hash_key="0",
        ending_hash_key="199",
    )


def test_nothing_to_do_when_every_shard_is_leased() -> None:
    shards = java_example()
    assert plan_new_leases(shards, {s.shard_id for s in shards}, TRIM_HORIZON) == []


def test_a_lease_for_a_parent_no_longer_listed_still_makes_children_descendants() -> None:
    # the parent expired from the stream but its lease is still in the table
    assert planned([shard("child", "expired-parent", start=10)], {"expired-parent"}, LATEST) == [
        ("child", TRIM_HORIZON)
    ]


def test_deep_shard_trees_are_handled_without_recursion() -> None:
    chain = [shard("g0", closed=True)]
    chain += [shard(f"g{i}", f"g{i - 1}", start=i, closed=True) for i in range(1, 3000)]
    chain.append(shard("tip", "g2999", start=3000))
    result = planned(list(reversed(chain)), {"g0"}, LATEST)
    assert [key for key, _ in result] == [f"g{i}" for i in range(1, 3000)] + ["tip"]


# -- ListShards pagination and throttling (botocore Stubber) ---------------------------------


def wire_shard(shard_id: str) -> dict[str, Any]:
    return {
        "ShardId": shard_id,
        "HashKeyRange": {"StartingHashKey": "0", "EndingHashKey": MAX_HASH},
        "SequenceNumberRange": {"StartingSequenceNumber": "1"},
    }


@pytest.fixture
def stubbed() -> Iterator[tuple[Any, Stubber]]:
    kinesis = boto3.client("kinesis", region_name=REGION)
    with Stubber(kinesis) as stubber:
        yield kinesis, stubber
        stubber.assert_no_pending_responses()


def test_next_token_pages_name_only_the_token(stubbed: tuple[Any, Stubber]) -> None:
    kinesis, stubber = stubbed
    stubber.add_response(
        "list_shards",
        {"Shards": [wire_shard("a"), wire_shard("b")], "NextToken": "t1"},
        {"StreamName": "s", "MaxResults": 2},
    )
    stubber.add_response(
        "list_shards",
        {"Shards": [wire_shard("c"), wire_shard("d")], "NextToken": "t2"},
        {"NextToken": "t1", "MaxResults": 2},
    )
    stubber.add_response(
        "list_shards", {"Shards": [wire_shard("e")]}, {"NextToken": "t2", "MaxResults": 2}
    )
    syncer = ShardSyncer(kinesis, NO_TABLE, SyncedStream("s"), page_size=2)
    assert [s.shard_id for s in syncer.list_shards()] == ["a", "b", "c", "d", "e"]


def test_stream_arn_is_used_when_given(stubbed: tuple[Any, Stubber]) -> None:
    kinesis, stubber = stubbed
    arn = "arn:aws:kinesis:us-east-1:123456789012:stream/s"
    stubber.add_response("list_shards", {"Shards": [wire_shard("a")]}, {"StreamARN": arn})
    syncer = ShardSyncer(kinesis, NO_TABLE, SyncedStream(arn=arn))
    assert [s.shard_id for s in syncer.list_shards()] == ["a"]


def test_limit_exceeded_is_retried_with_backoff(stubbed: tuple[Any, Stubber]) -> None:
    kinesis, stubber = stubbed
    for _ in range(2):
        stubber.add_client_error("list_shards", "LimitExceededException")
    stubber.add_response("list_shards", {"Shards": [wire_shard("a")]}, {"StreamName": "s"})
    sleeps: list[float] = []
    metrics = Metrics()
    syncer = ShardSyncer(
        kinesis,
        NO_TABLE,
        SyncedStream("s"),
        metrics=metrics,
        retries=dataclasses.replace(LIST_SHARDS_RETRIES, base_s=1.0),
        sleep=sleeps.append,
        rng=random.Random(3),
    )
    assert [s.shard_id for s in syncer.list_shards()] == ["a"]
    assert len(sleeps) == 2 and 0 <= sleeps[0] <= 1.0 and 0 <= sleeps[1] <= 2.0
    throttles = metrics.registry.get_sample_value(
        "kclpy_throttles_total", {"operation": "ListShards"}
    )
    assert throttles == 2


def test_persistent_limit_exceeded_is_raised(stubbed: tuple[Any, Stubber]) -> None:
    kinesis, stubber = stubbed
    for _ in range(3):
        stubber.add_client_error("list_shards", "LimitExceededException")
    syncer = ShardSyncer(
        kinesis,
        NO_TABLE,
        SyncedStream("s"),
        retries=dataclasses.replace(LIST_SHARDS_RETRIES, max_attempts=3),
        sleep=lambda _: None,
    )
    with pytest.raises(ClientError, match="LimitExceededException"):
        syncer.list_shards()


def test_other_errors_on_a_token_page_are_not_papered_over(stubbed: tuple[Any, Stubber]) -> None:
    kinesis, stubber = stubbed
    stubber.add_response(
        "list_shards", {"Shards": [wire_shard("a")], "NextToken": "t1"}, {"StreamName": "s"}
    )
    stubber.add_client_error("list_shards", "ExpiredNextTokenException")
    syncer = ShardSyncer(kinesis, NO_TABLE, SyncedStream("s"))
    with pytest.raises(ClientError, match="ExpiredNextTokenException"):
        syncer.list_shards()


def test_constructor_validates_stream_and_position() -> None:
    with pytest.raises(ConfigError, match="stream_name"):
        SyncedStream()
    with pytest.raises(ConfigError, match="initial_position"):
        ShardSyncer(NO_KINESIS, NO_TABLE, SyncedStream("s"), initial_position="EARLIEST")


# -- against moto ------------------------------------------------------------------------------


@pytest.fixture
def aws() -> Iterator[tuple[Any, LeaseTable]]:
    with mock_aws():
        kinesis = boto3.client("kinesis", region_name=REGION)
        table = LeaseTable(boto3.client("dynamodb", region_name=REGION), "app")
        table.create_if_missing()
        yield kinesis, table


def make_stream(kinesis: Any, name: str, shards: int) -> None:
    kinesis.create_stream(StreamName=name, ShardCount=shards)
    wait_for_stream_active(kinesis, name)


def split_first_shard(kinesis: Any, name: str) -> tuple[str, list[str]]:
    shards = kinesis.list_shards(StreamName=name)["Shards"]
    parent = shards[0]
    low = int(parent["HashKeyRange"]["StartingHashKey"])
    high = int(parent["HashKeyRange"]["EndingHashKey"])
    kinesis.split_shard(
        StreamName=name, ShardToSplit=parent["ShardId"], NewStartingHashKey=str((low + high) // 2)
    )

    def children() -> list[str] | None:
        after = kinesis.list_shards(StreamName=name)["Shards"]
        found = [s["ShardId"] for s in after if s.get("ParentShardId") == parent["ShardId"]]
        return found if len(found) == 2 else None

    return parent["ShardId"], wait_for(children, 30, f"the two children of {parent['ShardId']}")


def test_moto_paginates_by_the_aws_contract(aws: tuple[Any, LeaseTable]) -> None:
    """In-process moto with ``kclpy.local``'s corrections (tests/conftest.py) takes a token
    alone, as AWS does, whether the first page named the stream or its ARN."""
    kinesis, table = aws
    make_stream(kinesis, "s", 5)
    arn = kinesis.describe_stream_summary(StreamName="s")["StreamDescriptionSummary"]["StreamARN"]
    expected = [s["ShardId"] for s in kinesis.list_shards(StreamName="s")["Shards"]]
    for stream in (SyncedStream("s"), SyncedStream(arn=arn)):
        syncer = ShardSyncer(kinesis, table, stream, page_size=2)
        assert [s.shard_id for s in syncer.list_shards()] == expected
        assert [s.shard_id for s in syncer.list_shards()] == expected


def test_sync_creates_latest_leases_once(aws: tuple[Any, LeaseTable]) -> None:
    kinesis, table = aws
    make_stream(kinesis, "s", 3)
    syncer = ShardSyncer(kinesis, table, SyncedStream("s"), page_size=2)
    assert syncer.known_shard_ids == frozenset()
    created = syncer.sync()
    wire = kinesis.list_shards(StreamName="s")["Shards"]
    assert sorted(lease.lease_key for lease in created) == sorted(s["ShardId"] for s in wire)
    assert syncer.known_shard_ids == {s["ShardId"] for s in wire}
    for s in wire:
        lease = table.get(s["ShardId"])
        assert lease is not None
        assert lease.checkpoint == Position.latest()
        assert lease.lease_owner is None
        assert lease.parent_shard_ids == frozenset()
        assert lease.starting_hash_key == s["HashKeyRange"]["StartingHashKey"]
        assert lease.ending_hash_key == s["HashKeyRange"]["EndingHashKey"]
    assert syncer.sync() == []


def test_children_of_a_leased_parent_start_at_trim_horizon(aws: tuple[Any, LeaseTable]) -> None:
    kinesis, table = aws
    make_stream(kinesis, "s", 2)
    syncer = ShardSyncer(kinesis, table, SyncedStream("s"))
    syncer.sync()
    parent, children = split_first_shard(kinesis, "s")
    created = {lease.lease_key: lease for lease in syncer.sync()}
    assert sorted(created) == sorted(children)
    for child in children:
        assert created[child].checkpoint == Position.trim_horizon()
        assert created[child].parent_shard_ids == {parent}
    stored = table.get(children[0])
    assert stored is not None and stored.parent_shard_ids == {parent}


def test_fresh_latest_application_ignores_a_closed_parent(aws: tuple[Any, LeaseTable]) -> None:
    kinesis, table = aws
    make_stream(kinesis, "s", 1)
    parent, children = split_first_shard(kinesis, "s")
    created = ShardSyncer(kinesis, table, SyncedStream("s")).sync()
    assert sorted((lease.lease_key, lease.checkpoint) for lease in created) == sorted(
        (child, Position.latest()) for child in children
    )
    assert table.get(parent) is None


def test_fresh_trim_horizon_application_reads_the_parent_first(
    aws: tuple[Any, LeaseTable],
) -> None:
    kinesis, table = aws
    make_stream(kinesis, "s", 1)
    parent, children = split_first_shard(kinesis, "s")
    created = ShardSyncer(kinesis, table, SyncedStream("s"), initial_position=TRIM_HORIZON).sync()
    assert created[0].lease_key == parent
    assert {lease.checkpoint.sequence_number for lease in created} == {TRIM_HORIZON}
    assert {lease.lease_key for lease in created} == {parent, *children}


def test_child_leases_from_get_records_are_created_once(aws: tuple[Any, LeaseTable]) -> None:
    kinesis, table = aws
    syncer = ShardSyncer(kinesis, table, SyncedStream("s"))
    child = ChildShard("shardId-000000000002", ("shardId-000000000000",), "0", "99")
    merged = ChildShard("shardId-000000000003", ("shardId-a", "shardId-b"), "0", "199")
    syncer.create_child_leases([child, merged])
    lease = table.get("shardId-000000000002")
    assert lease == Lease(
        "shardId-000000000002",
        checkpoint=Position.trim_horizon(),
        parent_shard_ids=frozenset({"shardId-000000000000"}),
        starting_hash_key="0",
        ending_hash_key="99",
    )
    merged_lease = table.get("shardId-000000000003")
    assert merged_lease is not None
    assert merged_lease.parent_shard_ids == {"shardId-a", "shardId-b"}
    assert syncer.known_shard_ids == {"shardId-000000000002", "shardId-000000000003"}
    # someone already took and advanced it: a second report changes nothing
    taken = table.take(lease, "w1")
    table.update_checkpoint(taken, Position("123"))
    syncer.create_child_leases([child])
    again = table.get("shardId-000000000002")
    assert again is not None and (again.checkpoint, again.lease_owner) == (Position("123"), "w1")


def test_a_child_without_parents_is_rejected(aws: tuple[Any, LeaseTable]) -> None:
    kinesis, table = aws
    syncer = ShardSyncer(kinesis, table, SyncedStream("s"))
    with pytest.raises(ValueError, match="no parent"):
        syncer.create_child_leases([ChildShard("orphan", (), "0", "1")])


# -- shards the retention removed before their leases finished ------------------------------


def test_only_unfinished_leases_of_unlisted_parents_of_listed_shards_are_aged_out() -> None:
    """P left the listing while its child C is listed (C still names it): aged out, and so
    is its own parent G, which only P's lease names, and G's finished parent H, whose
    deletion lease cleanup would wait for until G's lease progressed - ancestors first. X
    is unlisted too, but no listed shard names it (a child made from ChildShards that a
    listing does not show yet): kept. A finished parent only listed shards name (F: lease
    cleanup's), a parked one (K), a listed one (L) and another stream's leases are never
    aged out."""
    listed = [shard("C", "P", "F"), shard("D", "K"), shard("E", "L"), shard("L")]
    leases = [
        Lease("H", checkpoint=Position.shard_end()),
        Lease("G", checkpoint=Position("5"), parent_shard_ids=frozenset({"H"})),
        Lease("P", checkpoint=Position.trim_horizon(), parent_shard_ids=frozenset({"G"})),
        Lease("X", checkpoint=Position.trim_horizon(), parent_shard_ids=frozenset({"C"})),
        Lease("F", checkpoint=Position.shard_end()),
        Lease("K", checkpoint=Position("7"), parked="{}"),
        Lease("L", checkpoint=Position("8")),
        Lease("C", checkpoint=Position.trim_horizon(), parent_shard_ids=frozenset({"P", "F"})),
    ]
    assert list(aged_out(listed, leases, lambda shard_id: shard_id)) == ["H", "G", "P"]
    other = "acct:other:1"
    assert list(aged_out(listed, [lease.copy(lease_key=f"{other}:{lease.lease_key}",
                                             stream=other) for lease in leases],
                         lambda shard_id: f"acct:mine:1:{shard_id}")) == []


def test_a_stream_created_again_gives_no_evidence_of_aged_out_shards() -> None:
    """The former stream's leases of shards 3 and 4 (children of its shard 0, unfinished)
    are unlisted, but the new stream's listed shards name no parent: nothing is aged out."""
    listed = [shard("shardId-0", start=1000), shard("shardId-1", start=1000)]
    former = [Lease(f"shardId-{i}", checkpoint=Position("5"),
                    parent_shard_ids=frozenset({"shardId-0"})) for i in (3, 4)]
    assert aged_out(listed, former, lambda shard_id: shard_id) == {}


def test_a_lease_waits_for_its_aged_out_parent_to_go_first(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two generations aged out (0 split into 1 and 2, 1 split into 3 and 4; 0 and 1 left
    the listing): a failed delete of 0 keeps 1 too, so nothing is ever deleted below a lease
    that remains; the next sync deletes both, each counted once."""
    with mock_aws():
        kinesis = boto3.client("kinesis", region_name=REGION)
        make_stream(kinesis, "s", 1)
        first, (second, _) = split_first_shard(kinesis, "s")
        (listed_second,) = [s for s in kinesis.list_shards(StreamName="s")["Shards"]
                            if s["ShardId"] == second]
        low = int(listed_second["HashKeyRange"]["StartingHashKey"])
        high = int(listed_second["HashKeyRange"]["EndingHashKey"])
        kinesis.split_shard(StreamName="s", ShardToSplit=second,
                            NewStartingHashKey=str((low + high) // 2))
        table = LeaseTable(boto3.client("dynamodb", region_name=REGION), "app")
        table.create_if_missing()
        metrics = Metrics()
        syncer = ShardSyncer(kinesis, table, SyncedStream("s"), initial_position=TRIM_HORIZON,
                             metrics=metrics)
        assert len(syncer.sync()) == 5
        retained = [s for s in syncer.list_shards() if s.shard_id not in (first, second)]
        assert len(retained) == 3
        monkeypatch.setattr(syncer, "list_shards", lambda: list(retained))
        delete = table.delete
        refused: list[str] = []

        def refuse_first_once(lease: Lease) -> bool:
            if lease.lease_key == first and not refused:
                refused.append(first)
                return False
            return delete(lease)

        monkeypatch.setattr(table, "delete", refuse_first_once)
        syncer.sync()
        assert refused == [first]
        assert table.get(first) is not None and table.get(second) is not None
        syncer.sync()
        assert table.get(first) is None and table.get(second) is None
        assert [metrics.registry.get_sample_value("kclpy_data_lost_to_retention_total",
                                                  {"shard_id": key})
                for key in (first, second)] == [1, 1]


def test_the_holder_of_a_shard_not_found_learns_from_two_listings_whether_it_left(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``left_unfinished``, asked by a holder Kinesis no longer finds the shard for: the
    children when both listings leave the shard out and a listed child names it; None when
    either listing still shows it (a listing cut short or stale), when the lease is already
    finished, or when nothing listed names the shard (a stream created again). Nothing is
    deleted or reported: the holder ends the lease itself."""
    with mock_aws():
        kinesis = boto3.client("kinesis", region_name=REGION)
        make_stream(kinesis, "s", 1)
        parent, children = split_first_shard(kinesis, "s")
        table = LeaseTable(boto3.client("dynamodb", region_name=REGION), "app")
        table.create_if_missing()
        metrics = Metrics()
        syncer = ShardSyncer(kinesis, table, SyncedStream("s"), initial_position=TRIM_HORIZON,
                             metrics=metrics)
        assert len(syncer.sync()) == 3
        full = syncer.list_shards()
        retained = [s for s in full if s.shard_id != parent]
        orphans = [dataclasses.replace(s, parent_shard_id=None) for s in retained]

        def listings(*answers: list[Shard]) -> None:
            queued = iter(answers)
            monkeypatch.setattr(syncer, "list_shards", lambda: list(next(queued)))

        listings(retained, retained)
        assert syncer.left_unfinished(parent) == frozenset(children)
        for first, second in [(full, retained), (retained, full), (orphans, orphans)]:
            listings(first, second)
            assert syncer.left_unfinished(parent) is None
        lease = table.get(parent)
        assert lease is not None
        table.guarded_update(lease, checkpoint_changes(Position.shard_end()))
        listings(retained, retained)
        assert syncer.left_unfinished(parent) is None
        assert {lease.lease_key for lease in table.list_leases()} == {parent, *children}
        assert metrics.registry.get_sample_value(
            "kclpy_data_lost_to_retention_total", {"shard_id": parent}) is None


class TableReader:
    """The parent-waiting code's view of the lease table: the table itself, its reads
    counted as they complete."""

    def __init__(self, table: LeaseTable) -> None:
        self.table = table
        self.reads = 0
        self.read = threading.Condition()

    def get_lease(self, lease_key: str) -> Lease | None:
        lease = self.table.get(lease_key)
        with self.read:
            self.reads += 1
            self.read.notify_all()
        return lease

    def judged_again(self) -> bool:
        """True once the consumer acted on a read it completed after this call: read n+1
        completed after it, and the consumer went on to read n+2 (it decided to wait)."""
        with self.read:
            target = self.reads + 2
            return self.read.wait_for(lambda: self.reads >= target, timeout=10)


def test_children_of_a_parent_the_retention_removed_unfinished_start(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The stuck child: a split parent whose lease never reached SHARD_END (the application
    was stopped for longer than the retention period) has left ListShards. No worker takes
    it (it is not listed), so its child waited WAITING_ON_PARENTS for ever. Shard sync
    deletes it - on a second listing and the lease read between them, never on one - and
    counts the loss; the child then starts. The retention is simulated by the listing (in
    process, moto): an emulator cannot age a shard out."""
    from kclpy.consumer import ConsumerState, ShardConsumer
    from kclpy.processor import (
        InitializeInput,
        IRecordProcessor,
        LeaseLostInput,
        ProcessRecordsInput,
        ShardEndedInput,
        ShutdownRequestedInput,
    )
    from tests.support.scripted import (
        SETTINGS,
        Host,
        Readers,
        Result,
        ScriptedFetcher,
        Writer,
        rec,
    )

    with mock_aws():
        kinesis = boto3.client("kinesis", region_name=REGION)
        make_stream(kinesis, "s", 1)
        parent, children = split_first_shard(kinesis, "s")
        table = LeaseTable(boto3.client("dynamodb", region_name=REGION), "app")
        table.create_if_missing()
        metrics = Metrics()
        syncer = ShardSyncer(kinesis, table, SyncedStream("s"), initial_position=TRIM_HORIZON,
                             metrics=metrics)
        assert sorted(lease.lease_key for lease in syncer.sync()) == sorted([parent, *children])
        real = syncer.list_shards
        retained = [s for s in real() if s.shard_id != parent]
        child = table.get(children[0])
        assert child is not None and child.parent_shard_ids == {parent}

        initialized = threading.Event()

        class Processor(IRecordProcessor):
            def initialize(self, initialize_input: InitializeInput) -> None:
                initialized.set()

            def process_records(self, process_records_input: ProcessRecordsInput) -> None:
                pass

            def lease_lost(self, lease_lost_input: LeaseLostInput) -> None:
                pass

            def shard_ended(self, shard_ended_input: ShardEndedInput) -> None:
                pass

            def shutdown_requested(self, shutdown_input: ShutdownRequestedInput) -> None:
                pass

        reader = TableReader(table)
        consumer = ShardConsumer(
            child, concurrency_token="t", processor_factory=lambda: Processor(),
            fence=Writer(), readers=Readers(lambda start: ScriptedFetcher(
                [Result([rec(1)])], (start.checkpoint, start.sub_sequence_number))),
            host=Host(reader), settings=SETTINGS, metrics=Metrics())
        consumer.start()
        try:
            assert consumer.state is ConsumerState.WAITING_ON_PARENTS
            # One listing without the parent, then one with it (a listing that missed it):
            # nothing is deleted.
            answers = iter([retained, real()])
            monkeypatch.setattr(syncer, "list_shards", lambda: next(answers))
            assert syncer.sync() == []
            assert table.get(parent) is not None
            assert reader.judged_again(), "the child stopped reading its parent's lease"
            assert not initialized.is_set()
            # Gone from every listing since: deleted, counted, logged, and the child starts.
            monkeypatch.setattr(syncer, "list_shards", lambda: list(retained))
            with caplog.at_level("ERROR", logger="kclpy.leases.shard_sync"):
                assert syncer.sync() == []
            assert table.get(parent) is None
            assert initialized.wait(10), "the child still waits on the parent"
            assert metrics.registry.get_sample_value(
                "kclpy_data_lost_to_retention_total", {"shard_id": parent}) == 1
            (error,) = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
            assert parent in error and "lost" in error and children[0] in error
            assert syncer.sync() == [] and {lease.lease_key for lease in table.list_leases()} \
                == set(children), "nothing more to do, and no lease made again"
        finally:
            consumer.request_shutdown()
            assert consumer.join(10)


# -- over real HTTP ----------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def moto_url(moto_server: LocalEndpoint) -> str:
    return moto_server.url


def test_a_table_of_another_stream_is_refused_and_left_as_it_is(
    aws: tuple[Any, LeaseTable],
) -> None:
    """An application name reused for another stream: its leases looked like a former
    incarnation of the new stream and were replaced, their checkpoints lost."""
    kinesis, table = aws
    make_stream(kinesis, "orders", 2)
    make_stream(kinesis, "payments", 2)
    ShardSyncer(kinesis, table, SyncedStream("orders"), initial_position=TRIM_HORIZON).sync()
    before = {lease.lease_key: lease for lease in table.list_leases()}
    assert {lease.stream_name for lease in before.values()} == {"orders"}
    arn = kinesis.describe_stream_summary(
        StreamName="payments")["StreamDescriptionSummary"]["StreamARN"]
    for stream in (SyncedStream("payments"), SyncedStream(arn=arn)):
        with pytest.raises(ConfigError, match="holds the leases of stream 'orders'") as error:
            ShardSyncer(kinesis, table, stream, initial_position=TRIM_HORIZON).sync()
        assert error.value.option == "application_name"
    after = {lease.lease_key: lease for lease in table.list_leases()}
    assert after == before
    assert [a.incarnation for a in after.values()] == [b.incarnation for b in before.values()]
    # the stream itself, by name or by ARN, is of course not refused
    orders = kinesis.describe_stream_summary(
        StreamName="orders")["StreamDescriptionSummary"]["StreamARN"]
    assert ShardSyncer(kinesis, table, SyncedStream(arn=orders)).sync() == []


def test_leases_without_a_stream_name_are_not_judged(aws: tuple[Any, LeaseTable]) -> None:
    """Java's leases, and kclpy's from before kclpyStreamName, cannot tell their stream."""
    kinesis, table = aws
    make_stream(kinesis, "payments", 1)
    table.create(Lease(lease_key="shardId-000000000007", checkpoint=Position.trim_horizon()))
    created = ShardSyncer(kinesis, table, SyncedStream("payments")).sync()
    assert [lease.stream_name for lease in created] == ["payments"]


@pytest.mark.integration
def test_over_http_moto_server_paginates_and_syncs(moto_url: str) -> None:
    kinesis = boto3.client("kinesis", endpoint_url=moto_url, region_name=REGION)
    dynamodb = boto3.client("dynamodb", endpoint_url=moto_url, region_name=REGION)
    name = f"s-{uuid.uuid4().hex}"
    make_stream(kinesis, name, 5)
    table = LeaseTable(dynamodb, f"app-{uuid.uuid4().hex}")
    table.create_if_missing()
    syncer = ShardSyncer(
        kinesis, table, SyncedStream(name), page_size=2, initial_position=TRIM_HORIZON
    )
    created = syncer.sync()
    assert len(created) == 5
    assert {lease.lease_key for lease in table.list_leases()} == syncer.known_shard_ids
    assert syncer.sync() == []


@pytest.mark.integration
def test_over_http_kinesis_mock_paginates_and_follows_a_split(
    request: pytest.FixtureRequest,
) -> None:
    endpoint = request.getfixturevalue("kinesis_mock")
    moto_url = request.getfixturevalue("moto_url")
    kinesis = boto3.client("kinesis", endpoint_url=endpoint.url, region_name=REGION, verify=False)
    dynamodb = boto3.client("dynamodb", endpoint_url=moto_url, region_name=REGION)
    name = f"s-{uuid.uuid4().hex}"
    make_stream(kinesis, name, 3)
    table = LeaseTable(dynamodb, f"app-{uuid.uuid4().hex}")
    table.create_if_missing()
    syncer = ShardSyncer(kinesis, table, SyncedStream(name), page_size=1)
    assert len(syncer.sync()) == 3
    parent, children = split_first_shard(kinesis, name)
    created = {lease.lease_key: lease.checkpoint for lease in syncer.sync()}
    assert created == dict.fromkeys(children, Position.trim_horizon())
    assert parent in syncer.known_shard_ids


class LeftTheStream:
    """What AWS answers once a split parent's records are past the retention, which
    kinesis-mock cannot age out: ListShards without the parent (its children still name it)
    and GetShardIterator of it with ResourceNotFoundException. ``gone`` is set by the first
    such answer, or from the start; the listing leaves the parent out only once it is."""

    def __init__(self, kinesis: Any, stream: str, parent: str, *, gone: bool) -> None:
        self._kinesis = kinesis
        self._stream = stream
        self._parent = parent
        self.gone = threading.Event()
        if gone:
            self.gone.set()

    def listed(self, request: dict[str, Any]) -> tuple[int, dict[str, Any]] | None:
        if "NextToken" in request or not self.gone.is_set():
            return None
        answer = self._kinesis.list_shards(**request)
        body: dict[str, Any] = {"Shards": [s for s in answer["Shards"]
                                           if s["ShardId"] != self._parent]}
        if "NextToken" in answer:
            body["NextToken"] = answer["NextToken"]
        return 200, body

    def not_found(self, request: dict[str, Any]) -> tuple[int, dict[str, Any]] | None:
        if request.get("ShardId") != self._parent:
            return None
        self.gone.set()
        return 400, {"__type": "ResourceNotFoundException",
                     "message": f"Shard {self._parent} in stream {self._stream} does not exist"}


def split_with_children_written(kinesis: Any, prefix: str
                                ) -> tuple[str, str, list[str], list[bytes]]:
    """A stream whose one shard got a record and was split, and eight records written to
    the children: the stream, the parent, the children and those records."""
    from tests.support.streams import create_stream, put_plain

    stream = f"{prefix}-{uuid.uuid4().hex[:8]}"
    create_stream(kinesis, stream, 1)
    put_plain(kinesis, stream, [b"trimmed"])
    parent, children = split_first_shard(kinesis, stream)
    wait_for_stream_active(kinesis, stream)
    payloads = [f"child-{i}".encode() for i in range(8)]
    assert {shard_id for shard_id, _ in put_plain(kinesis, stream, payloads)} <= set(children)
    return stream, parent, children, payloads


def read_through_proxy(world: LeftTheStream, kinesis_mock: LocalEndpoint, config: Any,
                         parent: str, payloads: list[bytes]) -> tuple[list[bytes], float | None]:
    """Run a worker through the fault proxy answering as ``world`` until the children's
    ``payloads`` are processed: every payload it processed, and the parent's loss counter."""
    from kclpy import Worker
    from tests.support.faultproxy import FaultProxy
    from tests.support.recording import Ledger, RecordingProcessor
    from tests.support.workers import running

    ledger = Ledger()
    with FaultProxy(kinesis_mock.url, seed=1) as proxy:
        proxy.set_rule("ListShards", respond=world.listed)
        proxy.set_rule("GetShardIterator", respond=world.not_found)
        worker = Worker(config.replace(kinesis_endpoint=proxy.url),
                        lambda: RecordingProcessor(ledger))
        with running(worker):
            wait_for(lambda: set(payloads) <= set(ledger.payloads()), 60,
                     "the children's records")
            lost = worker.metrics.registry.get_sample_value(
                "kclpy_data_lost_to_retention_total", {"shard_id": parent})
    return ledger.payloads(), lost


@pytest.mark.integration
def test_over_http_a_worker_starts_the_children_of_a_parent_the_retention_removed(
        kinesis_mock: LocalEndpoint, moto_server: LocalEndpoint,
        caplog: pytest.LogCaptureFixture) -> None:
    """Over real HTTP: an application stopped before it read a split parent, for longer than
    the retention period. The worker deletes the parent's lease (ERROR, counted) and reads
    its children. kinesis-mock cannot age data out, so the fault proxy answers what AWS
    answers once the parent's records are past the retention (``LeftTheStream``);
    everything else is the emulator's, and the lease table is moto's server. On the code
    before the fix the children wait on the parent's lease for ever."""
    from kclpy import KCLConfig
    from tests.support.streams import dynamodb_client, kinesis_client

    caplog.set_level("INFO", logger="kclpy")
    kinesis = kinesis_client(kinesis_mock.url)
    stream, parent, children, payloads = split_with_children_written(kinesis, "aged")
    config = KCLConfig(
        application_name=f"app-{uuid.uuid4().hex[:8]}", stream_name=stream, region=REGION,
        dynamodb_endpoint=moto_server.url, initial_position="TRIM_HORIZON",
        failover_time_ms=3000, idle_time_between_reads_ms=100, shard_sync_interval_ms=500,
        parent_shard_poll_interval_ms=200)
    table = LeaseTable(dynamodb_client(moto_server.url), config.application_name)
    table.create_if_missing()
    # Where the application stood when it stopped: every lease made, none read.
    made = ShardSyncer(kinesis, table, SyncedStream(stream), initial_position=TRIM_HORIZON).sync()
    assert sorted(lease.lease_key for lease in made) == sorted([parent, *children])

    processed, lost = read_through_proxy(LeftTheStream(kinesis, stream, parent, gone=True),
                                           kinesis_mock, config, parent, payloads)
    assert b"trimmed" not in processed
    assert table.get(parent) is None
    assert lost == 1
    assert any(parent in r.getMessage() and "lost" in r.getMessage()
               for r in caplog.records if r.levelname == "ERROR")


@pytest.mark.integration
@pytest.mark.parametrize("assigner", ["worker", "leader"])
def test_over_http_the_holder_of_a_shard_that_left_the_stream_frees_its_children_at_once(
        kinesis_mock: LocalEndpoint, moto_server: LocalEndpoint,
        caplog: pytest.LogCaptureFixture, assigner: str) -> None:
    """Over real HTTP: the worker holds the split parent while it is listed, and its first
    read of it is answered as AWS answers once the parent's records are past the
    retention (ResourceNotFoundException; from then on ListShards leaves the parent out,
    its children still naming it). The holder ends the parent at SHARD_END itself and the
    children are read with no shard sync after start-up (the interval is ten minutes), in
    both assigner modes; the loss is reported once. On the code before the fix the consumer
    failed, the lease was released and taken again, and the children waited for the next
    shard sync."""
    from kclpy import KCLConfig
    from tests.support.streams import dynamodb_client, kinesis_client

    caplog.set_level("INFO", logger="kclpy")
    kinesis = kinesis_client(kinesis_mock.url)
    stream, parent, children, payloads = split_with_children_written(kinesis, "gone")
    config = KCLConfig(
        application_name=f"app-{uuid.uuid4().hex[:8]}", stream_name=stream, region=REGION,
        dynamodb_endpoint=moto_server.url, initial_position="TRIM_HORIZON",
        failover_time_ms=3000, idle_time_between_reads_ms=100,
        shard_sync_interval_ms=600_000, parent_shard_poll_interval_ms=200,
        lease_assigner=assigner,
        # the parent's lease stays to be read at SHARD_END: under load the lease cleanup
        # (once the children had begun) deleted it before the test read it
        cleanup_leases_upon_shard_completion=False)
    table = LeaseTable(dynamodb_client(moto_server.url), config.application_name)
    # the parent's first read: the retention has removed it from then on
    world = LeftTheStream(kinesis, stream, parent, gone=False)
    processed, lost = read_through_proxy(world, kinesis_mock, config, parent, payloads)
    assert world.gone.is_set()
    assert b"trimmed" not in processed
    ended = table.get(parent)
    assert ended is not None and ended.checkpoint == Position.shard_end()
    assert lost == 1
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"
            and "left the stream unfinished" in r.getMessage()] == [
        f"shard {parent} left the stream unfinished: the stream's retention trimmed its "
        "records (those after checkpoint TRIM_HORIZON) before they were processed, and "
        "they are lost. Its holder ended it at SHARD_END so that its child shards "
        f"({', '.join(sorted(children))}) can start."]


# -- a stream deleted and created again under the same name -----------------------------------


@pytest.mark.parametrize(("checkpoint", "listed", "former"), [
    ("SHARD_END", shard("s0", start=1000), True),              # a closed shard never reopens
    ("SHARD_END", shard("s0", start=1000, closed=True), False),
    ("999", shard("s0", start=1000), True),                    # before the shard's first record
    ("1000", shard("s0", start=1000), False),
    ("5000", shard("s0", start=1000, closed=True), False),     # moto: closed shards end at 0
    (TRIM_HORIZON, shard("s0", start=1000), False),            # never checkpointed: harmless
    (LATEST, shard("s0", start=1000), False),
])
def test_a_lease_of_a_former_stream_of_the_same_name_is_told_apart(
        checkpoint: str, listed: Shard, former: bool) -> None:
    lease = Lease("s0", checkpoint=Position(checkpoint), lease_counter=3)
    assert (former_incarnation(lease, listed) is not None) is former


@pytest.mark.parametrize(("incarnation", "stream_epoch", "former"), [
    ("1700000000:1700000001000:abc", 1700000500, True),   # made for an older stream
    ("1700000500:1700000501000:abc", 1700000500, False),  # made for this one
    ("0:1700000001000:abc", 1700000500, False),           # stream epoch unknown when made
    (None, 1700000500, False),                            # made by Java or an older kclpy
    ("1700000000:1700000001000:abc", None, False),        # listed stream's epoch unknown
    ("1700000500.25:1700000501000:abc", 1700000500.75, True),  # the same second, not ms
    ("1700000500.25:1700000501000:abc", 1700000500.25, False),  # made for this one
    ("1700000500:1700000501000:abc", 1700000500.75, False),  # made before ms were kept
    # hand-written, not a time: unknown, as an unreadable epoch is (int(inf) would raise)
    ("1e999:1700000501000:abc", 1700000500, False),
    ("-inf:1700000501000:abc", 1700000500, False),
    ("nan:1700000501000:abc", 1700000500, False),
])
def test_a_lease_made_for_a_stream_created_at_another_time_is_of_a_former_stream(
        incarnation: str | None, stream_epoch: float | None, former: bool) -> None:
    """The sequence numbers do not tell (the checkpoint is after the new shard's first):
    the lease's incarnation names the creation time of the stream it was made for, to the
    millisecond (kinesis-mock deletes and creates a stream again within one second, and
    numbers the new shard's records as the old one's)."""
    lease = Lease("s0", checkpoint=Position("5000"), lease_counter=3, incarnation=incarnation)
    assert (former_incarnation(lease, shard("s0", start=1000), stream_epoch)
            is not None) is former


def test_a_shard_that_closes_between_the_listing_and_the_lease_read_is_not_a_former_stream(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by the simulator (seed 947): the listing shows the shard open, a merge closes
    it and its lease reaches SHARD_END before the sync reads the lease. A second listing,
    taken after the read, shows it closed: the lease is kept."""
    with mock_aws():
        kinesis = boto3.client("kinesis", region_name=REGION)
        kinesis.create_stream(StreamName="s", ShardCount=1)
        table = LeaseTable(boto3.client("dynamodb", region_name=REGION), "app")
        table.create_if_missing()
        syncer = ShardSyncer(kinesis, table, SyncedStream("s"), initial_position=TRIM_HORIZON)
        assert len(syncer.sync()) == 1
        listed = syncer.list_shards()
        (only,) = listed
        closed = dataclasses.replace(only, ending_sequence_number="9" * 20)
        assert not closed.is_open
        answers = iter([listed, [closed]])
        monkeypatch.setattr(syncer, "list_shards", lambda: next(answers))
        lease = table.get(only.shard_id)
        assert lease is not None
        table.guarded_update(lease.copy(lease_owner=None),
                             checkpoint_changes(Position.shard_end()))
        assert syncer.sync() == []
        kept = table.get(only.shard_id)
        assert kept is not None and kept.checkpoint == Position.shard_end()


def test_sync_replaces_the_lease_of_a_former_stream_at_the_initial_position(
        caplog: pytest.LogCaptureFixture) -> None:
    with mock_aws():
        kinesis = boto3.client("kinesis", region_name=REGION)
        kinesis.create_stream(StreamName="s", ShardCount=1)
        table = LeaseTable(boto3.client("dynamodb", region_name=REGION), "app")
        table.create_if_missing()
        # The former stream's shard of the same id, finished and checkpointed at SHARD_END.
        assert table.create(Lease("shardId-000000000000", checkpoint=Position.shard_end(),
                                  child_shard_ids=frozenset({"shardId-000000000001"})))
        syncer = ShardSyncer(kinesis, table, SyncedStream("s"), initial_position=LATEST)
        with caplog.at_level("WARNING", logger="kclpy.leases.shard_sync"):
            created = syncer.sync()
        assert [(lease.lease_key, lease.checkpoint.sequence_number) for lease in created] == [
            ("shardId-000000000000", LATEST)]
        fresh = table.get("shardId-000000000000")
        assert fresh is not None and not fresh.child_shard_ids
        assert fresh.checkpoint == Position.latest()
        assert any("created again" in r.getMessage() and "shardId-000000000000" in r.getMessage()
                   for r in caplog.records if r.levelname == "WARNING")
        assert syncer.sync() == [], "a lease of this incarnation is left alone"


def test_sync_replaces_a_former_streams_lease_written_without_a_counter() -> None:
    """The same lease as a hand-written or tool-written item without ``leaseCounter``: its
    delete expects the counter still absent (``leaseCounter = 0`` fails on it), so it is
    replaced too instead of leaving the open shard without a lease for good."""
    with mock_aws():
        kinesis = boto3.client("kinesis", region_name=REGION)
        kinesis.create_stream(StreamName="s", ShardCount=1)
        table = LeaseTable(boto3.client("dynamodb", region_name=REGION), "app")
        table.create_if_missing()
        table.client.put_item(TableName="app", Item={
            "leaseKey": {"S": "shardId-000000000000"}, "checkpoint": {"S": "SHARD_END"},
            "checkpointSubSequenceNumber": {"N": "0"}})
        syncer = ShardSyncer(kinesis, table, SyncedStream("s"), initial_position=LATEST)
        assert [lease.lease_key for lease in syncer.sync()] == ["shardId-000000000000"]
        fresh = table.get("shardId-000000000000")
        assert fresh is not None and fresh.checkpoint == Position.latest()
        assert not fresh.counter_absent


def _delete(kinesis: Any, stream: str) -> None:
    """Delete ``stream`` and wait until the endpoint no longer lists it."""
    kinesis.delete_stream(StreamName=stream)

    def gone() -> bool:
        try:
            kinesis.describe_stream_summary(StreamName=stream)
        except kinesis.exceptions.ResourceNotFoundException:
            return True
        return False

    wait_for(gone, 30, "the stream deleted")


@pytest.mark.integration
def test_a_stream_created_again_within_the_second_is_told_by_its_creation_milliseconds(
        kinesis_mock: LocalEndpoint, moto_server: LocalEndpoint) -> None:
    """kinesis-mock deletes and creates a stream again in well under a second, and within
    one second numbers the new shard's records exactly as the old one's: neither the
    creation second nor the checkpoint tells the old lease from a lease of the new stream;
    the millisecond does. (A run whose second life starts in the next second is told by the
    second too, and passes either way.)"""
    from kclpy.leases.streams import _created_at
    from tests.support.streams import (
        create_stream,
        dynamodb_client,
        kinesis_client,
        put_plain,
    )

    kinesis = kinesis_client(kinesis_mock.url)
    table = LeaseTable(dynamodb_client(moto_server.url), f"app-{uuid.uuid4().hex[:8]}")
    table.create_if_missing()
    stream = f"again-{uuid.uuid4().hex[:8]}"

    def syncer() -> ShardSyncer:
        summary = kinesis.describe_stream_summary(StreamName=stream)["StreamDescriptionSummary"]
        return ShardSyncer(kinesis, table, SyncedStream(stream, epoch=_created_at(summary)),
                           initial_position=TRIM_HORIZON)

    # both lives within one second, as far as the machine allows: at the start of one
    time.sleep(1 - time.time() % 1)
    create_stream(kinesis, stream, 1)
    put_plain(kinesis, stream, [b"first-life"])
    (lease,) = syncer().sync()
    shard_id = lease.lease_key
    record = kinesis.get_records(ShardIterator=kinesis.get_shard_iterator(
        StreamName=stream, ShardId=shard_id, ShardIteratorType="TRIM_HORIZON")["ShardIterator"])
    checkpoint = record["Records"][0]["SequenceNumber"]
    held = table.take(lease, "a")
    table.guarded_update(held, checkpoint_changes(Position(checkpoint)))
    _delete(kinesis, stream)
    create_stream(kinesis, stream, 1)
    again = syncer()
    (replaced,) = again.sync()
    assert replaced.lease_key == shard_id
    assert replaced.checkpoint == Position.trim_horizon()
    assert again.sync() == [], "the new lease is the new stream's"


@pytest.mark.integration
def test_a_stream_created_again_under_its_name_is_consumed_from_the_initial_position(
        kinesis_mock: LocalEndpoint, moto_server: LocalEndpoint,
        caplog: pytest.LogCaptureFixture) -> None:
    """Over real HTTP: a worker consumes and checkpoints a stream, which is then deleted and
    created again with the lease table kept. The next worker finds the old lease made for
    a stream created at another time (its incarnation: kinesis-mock numbers the new shard's
    records as the old one's, and at times the whole first life fits in one second),
    replaces the lease (WARNING) and processes the new stream's records."""
    from kclpy import KCLConfig, Worker
    from tests.support.recording import Ledger, RecordingProcessor
    from tests.support.streams import create_stream, kinesis_client, put_plain
    from tests.support.workers import running

    # INFO from every part of the workers: a failure report then tells what worker b did
    # (it failed once in a full CI run and never alone)
    caplog.set_level("INFO", logger="kclpy")
    kinesis = kinesis_client(kinesis_mock.url)
    stream = f"again-{uuid.uuid4().hex[:8]}"
    create_stream(kinesis, stream, 1)
    put_plain(kinesis, stream, [b"first-life"])
    ledger = Ledger()
    config = KCLConfig(
        application_name=f"app-{uuid.uuid4().hex[:8]}", stream_name=stream, region=REGION,
        kinesis_endpoint=kinesis_mock.url, dynamodb_endpoint=moto_server.url,
        initial_position="TRIM_HORIZON", failover_time_ms=3000,
        idle_time_between_reads_ms=100, shard_sync_interval_ms=1000)
    with running(Worker(config, lambda: RecordingProcessor(ledger))):
        wait_for(lambda: b"first-life" in ledger.payloads(), 60, "the first stream read")
    _delete(kinesis, stream)
    create_stream(kinesis, stream, 1)
    put_plain(kinesis, stream, [b"second-life"])
    with running(Worker(config.replace(worker_id="b"), lambda: RecordingProcessor(ledger))):
        wait_for(lambda: b"second-life" in ledger.payloads(), 60, "the new stream read")
    assert ledger.payloads() == [b"first-life", b"second-life"]
    assert any("created again" in r.getMessage() for r in caplog.records
               if r.levelname == "WARNING")


@pytest.mark.integration
def test_a_stopped_worker_leaves_no_shard_sync_under_way(
        kinesis_mock: LocalEndpoint, moto_server: LocalEndpoint) -> None:
    """Over real HTTP, ListShards answered 2 s late: a worker asked to stop while its shard
    sync waits for that answer returns from run() only once the sync is over, so a stopped
    worker creates and deletes no lease (its late sync, judged on its last scan, raced the
    next worker over a stream created again meanwhile)."""
    from kclpy import KCLConfig, Worker
    from tests.support.faultproxy import FaultProxy
    from tests.support.recording import Ledger, RecordingProcessor
    from tests.support.streams import create_stream, kinesis_client
    from tests.support.workers import running

    stream = f"stopsync-{uuid.uuid4().hex[:8]}"
    create_stream(kinesis_client(kinesis_mock.url), stream, 1)
    ledger = Ledger()
    with FaultProxy(kinesis_mock.url, seed=1) as proxy:
        config = KCLConfig(
            application_name=f"app-{uuid.uuid4().hex[:8]}", stream_name=stream, region=REGION,
            kinesis_endpoint=proxy.url, dynamodb_endpoint=moto_server.url,
            initial_position="TRIM_HORIZON", failover_time_ms=3000,
            idle_time_between_reads_ms=100, shard_sync_interval_ms=200)
        worker = Worker(config, lambda: RecordingProcessor(ledger))
        syncer = f"kclpy-shard-sync-{config.worker_id}"
        with running(worker):
            assert worker.wait_started(60)
            listed = proxy.requests("ListShards")
            proxy.set_rule("ListShards", latency_s=2.0)
            wait_for(lambda: proxy.requests("ListShards") > listed, 30, "a slow ListShards")
        assert not any(t.name == syncer for t in threading.enumerate()), (
            "the shard sync outlived run()")
