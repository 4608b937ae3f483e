"""LeaseTable against moto (in-process for speed, and moto's server over real HTTP)."""

from __future__ import annotations

import random
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import boto3
import pytest
from botocore.exceptions import ClientError
from botocore.stub import Stubber
from moto import mock_aws

from kclpy.errors import LeaseLostError
from kclpy.leases.dynamo import LeaseTableThrottled
from kclpy.leases.lease import Lease, new_incarnation
from kclpy.leases.table import OWNER_INDEX, LeaseChanged, LeaseTable
from kclpy.local import LocalEndpoint
from kclpy.metrics import Metrics
from kclpy.position import SHARD_END, TRIM_HORIZON, Position

REGION = "us-east-1"


@pytest.fixture(autouse=True)
def _aws_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_DYNAMODB", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)


@pytest.fixture
def dynamodb() -> Iterator[Any]:
    with mock_aws():
        yield boto3.client("dynamodb", region_name=REGION)


@pytest.fixture
def metrics() -> Metrics:
    return Metrics()


@pytest.fixture
def table(dynamodb: Any, metrics: Metrics) -> LeaseTable:
    lease_table = LeaseTable(dynamodb, "app", metrics=metrics)
    lease_table.create_if_missing()
    return lease_table


def java_item(key: str, **overrides: dict[str, Any]) -> dict[str, Any]:
    """An item exactly as the Java KCL 2.x/3.x leaves it, with attributes we do not model."""
    item: dict[str, Any] = {
        "leaseKey": {"S": key},
        "leaseOwner": {"S": "java-worker"},
        "leaseCounter": {"N": "41"},
        "checkpoint": {"S": "49590338271490256608559692538361571095921575989136588898"},
        "checkpointSubSequenceNumber": {"N": "3"},
        "ownerSwitchesSinceCheckpoint": {"N": "2"},
        "parentShardId": {"SS": ["shardId-000000000000"]},
        "startingHashKey": {"S": "0"},
        "endingHashKey": {"S": "340282366920938463463374607431768211455"},
        "throughputKBps": {"N": "12.5"},
        "javaOnly": {"M": {"nested": {"L": [{"S": "x"}, {"N": "1"}]}}},
    }
    item.update(overrides)
    return item


def raw(table: LeaseTable, key: str) -> dict[str, Any]:
    item: dict[str, Any] = table.client.get_item(
        TableName=table.table_name, Key={"leaseKey": {"S": key}}, ConsistentRead=True
    )["Item"]
    return item


def put_java(table: LeaseTable, item: dict[str, Any]) -> Lease:
    table.client.put_item(TableName=table.table_name, Item=item)
    lease = table.get(item["leaseKey"]["S"])
    assert lease is not None
    return lease


def requests(metrics: Metrics, operation: str) -> float:
    value = metrics.registry.get_sample_value(
        "kclpy_dynamodb_requests_total", {"operation": operation}
    )
    return value or 0.0


def throttles(metrics: Metrics, operation: str) -> float:
    value = metrics.registry.get_sample_value("kclpy_throttles_total", {"operation": operation})
    return value or 0.0


# -- table creation ----------------------------------------------------------------------


def test_creates_missing_table_on_demand_once(dynamodb: Any) -> None:
    table = LeaseTable(dynamodb, "my-app")
    assert table.create_if_missing() is True
    described = dynamodb.describe_table(TableName="my-app")["Table"]
    assert described["TableStatus"] == "ACTIVE"
    assert described["KeySchema"] == [{"AttributeName": "leaseKey", "KeyType": "HASH"}]
    assert described["BillingModeSummary"]["BillingMode"] == "PAY_PER_REQUEST"
    assert table.create_if_missing() is False


class _ScriptedClient:
    """A DynamoDB client whose answers are scripted per operation; records every call."""

    def __init__(self, **script: list[Any]) -> None:
        self.script = script
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def __getattr__(self, operation: str) -> Callable[..., Any]:
        def call(**kwargs: Any) -> Any:
            self.calls.append((operation, kwargs))
            answer = self.script[operation].pop(0)
            if isinstance(answer, Exception):
                raise answer
            return answer

        return call


def client_error(code: str, operation: str = "UpdateItem") -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": code}}, operation)


def test_waits_until_the_table_is_usable() -> None:
    client: Any = _ScriptedClient(
        describe_table=[
            client_error("ResourceNotFoundException", "DescribeTable"),
            {"Table": {"TableStatus": "CREATING"}},
            {"Table": {"TableStatus": "CREATING"}},
            {"Table": {"TableStatus": "ACTIVE"}},
        ],
        create_table=[{}],
    )
    sleeps: list[float] = []
    table = LeaseTable(client, "t", sleep=sleeps.append, clock=lambda: 0.0)
    assert table.create_if_missing() is True
    assert [op for op, _ in client.calls].count("describe_table") == 4
    assert len(sleeps) == 2


def test_losing_the_creation_race_is_not_an_error() -> None:
    client: Any = _ScriptedClient(
        describe_table=[
            client_error("ResourceNotFoundException", "DescribeTable"),
            {"Table": {"TableStatus": "UPDATING"}},
        ],
        create_table=[client_error("ResourceInUseException", "CreateTable")],
    )
    table = LeaseTable(client, "t", sleep=lambda _: None)
    assert table.create_if_missing() is False


def test_gives_up_waiting_after_the_timeout() -> None:
    now = [0.0]

    def sleep(seconds: float) -> None:
        now[0] += seconds

    client: Any = _ScriptedClient(describe_table=[{"Table": {"TableStatus": "CREATING"}}] * 10)
    table = LeaseTable(client, "t", sleep=sleep, clock=lambda: now[0])
    with pytest.raises(TimeoutError, match="CREATING"):
        table.create_if_missing(timeout_s=3)


# -- reading items the Java KCL wrote ----------------------------------------------------


def test_reads_java_items_with_sentinels_sub_sequences_and_parents(table: LeaseTable) -> None:
    put_java(table, java_item("shardId-000000000001"))
    put_java(
        table,
        java_item(
            "shardId-000000000002",
            checkpoint={"S": SHARD_END},
            checkpointSubSequenceNumber={"N": "0"},
            parentShardId={"SS": ["shardId-a", "shardId-b"]},
        ),
    )
    item = java_item("shardId-000000000003", checkpoint={"S": TRIM_HORIZON})
    del item["leaseOwner"]
    put_java(table, item)

    leases = {lease.lease_key: lease for lease in table.list_leases()}
    assert set(leases) == {"shardId-000000000001", "shardId-000000000002", "shardId-000000000003"}
    first = leases["shardId-000000000001"]
    assert first.lease_owner == "java-worker"
    assert first.lease_counter == 41
    assert first.checkpoint == Position(
        "49590338271490256608559692538361571095921575989136588898", 3)
    assert first.owner_switches_since_checkpoint == 2
    assert first.parent_shard_ids == {"shardId-000000000000"}
    assert first.ending_hash_key == "340282366920938463463374607431768211455"
    assert leases["shardId-000000000002"].is_shard_end
    assert leases["shardId-000000000002"].parent_shard_ids == {"shardId-a", "shardId-b"}
    assert leases["shardId-000000000003"].lease_owner is None
    assert leases["shardId-000000000003"].checkpoint.sentinel == TRIM_HORIZON


def test_get_returns_none_for_a_missing_lease(table: LeaseTable) -> None:
    assert table.get("nope") is None


class _PagedScans:
    """Wraps a client so that every Scan returns at most two items (forces pagination)."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self.scans: list[dict[str, Any]] = []

    def scan(self, **kwargs: Any) -> Any:
        self.scans.append(kwargs)
        return self._client.scan(Limit=2, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def test_list_leases_follows_pagination_with_consistent_reads(table: LeaseTable) -> None:
    for i in range(5):
        assert table.create(Lease(f"shardId-{i}"))
    paged: Any = _PagedScans(table.client)
    leases = LeaseTable(paged, table.table_name).list_leases()
    assert sorted(lease.lease_key for lease in leases) == [f"shardId-{i}" for i in range(5)]
    assert len(paged.scans) == 3
    assert all(scan["ConsistentRead"] for scan in paged.scans)
    assert "ExclusiveStartKey" not in paged.scans[0]
    assert all("ExclusiveStartKey" in scan for scan in paged.scans[1:])


def test_list_leases_skips_items_that_are_not_leases(table: LeaseTable) -> None:
    table.create(Lease("good"))
    table.client.put_item(
        TableName=table.table_name,
        Item={"leaseKey": {"S": "bad"}, "leaseCounter": {"N": "1.5"}},
    )
    assert [lease.lease_key for lease in table.list_leases()] == ["good"]


# -- conditional writes ------------------------------------------------------------------


def test_create_is_conditional_on_absence(table: LeaseTable) -> None:
    assert table.create(Lease("s", checkpoint=Position.latest())) is True
    assert table.create(Lease("s", checkpoint=Position.trim_horizon(), lease_counter=9)) is False
    lease = table.get("s")
    assert lease is not None
    assert (lease.checkpoint.sequence_number, lease.lease_counter) == ("LATEST", 0)


def test_take_unowned_lease(table: LeaseTable) -> None:
    table.create(Lease("s"))
    lease = table.get("s")
    assert lease is not None
    taken = table.take(lease, "w1")
    assert (taken.lease_owner, taken.lease_counter) == ("w1", 1)
    assert taken.owner_switches_since_checkpoint == 0
    assert table.get("s") == taken


def test_take_from_another_owner_counts_a_switch_and_keeps_unknown_attributes(
    table: LeaseTable,
) -> None:
    lease = put_java(table, java_item("s", checkpointOwner={"S": "java-worker"}))
    taken = table.take(lease, "kclpy-worker")
    assert taken.lease_owner == "kclpy-worker"
    assert taken.lease_counter == 42
    assert taken.owner_switches_since_checkpoint == 3
    assert taken.checkpoint_owner is None
    item = raw(table, "s")
    assert item["throughputKBps"] == {"N": "12.5"}
    assert item["javaOnly"] == java_item("s")["javaOnly"]
    assert "checkpointOwner" not in item


def test_take_with_a_stale_counter_is_refused(table: LeaseTable) -> None:
    table.create(Lease("s"))
    stale = table.get("s")
    assert stale is not None
    table.take(stale, "w1")
    with pytest.raises(LeaseLostError):
        table.take(stale, "w2")
    current = table.get("s")
    assert current is not None and current.lease_owner == "w1"


def test_take_of_a_deleted_lease_does_not_recreate_it(table: LeaseTable) -> None:
    table.create(Lease("s"))
    lease = table.get("s")
    assert lease is not None
    assert table.delete(lease) is True
    with pytest.raises(LeaseLostError):
        table.take(lease, "w1")
    assert table.get("s") is None


def test_renew_bumps_the_counter_only(table: LeaseTable) -> None:
    lease = table.take(put_java(table, java_item("s")), "w1")
    renewed = table.renew(lease.copy(concurrency_token="tok"))
    assert renewed.lease_counter == lease.lease_counter + 1
    assert renewed.concurrency_token == "tok"
    assert renewed.copy(lease_counter=lease.lease_counter) == lease
    assert raw(table, "s")["throughputKBps"] == {"N": "12.5"}


def test_an_assignment_notice_leaves_the_holders_renewal_alone_and_comes_back_with_it(
    table: LeaseTable,
) -> None:
    """A leader notifies a holder on a lease it holds: the counter is untouched, so the
    holder's next renewal (fenced on the counter it holds) passes and returns the notice. A
    notice to a worker that does not hold the lease, or holds it handing it off, is refused."""
    table.create(Lease("s"))
    assigned = table.get("s")
    assert assigned is not None
    mine = table.take(assigned, "w1")
    assert not table.notify_holder(mine, "w2", "n1")
    assert table.notify_holder(mine, "w1", "n1")
    renewed = table.renew(mine)
    assert (renewed.lease_counter, renewed.assignment_notice) == (mine.lease_counter + 1, "n1")
    handing = table.set_checkpoint_owner(renewed, "w2")
    assert not table.notify_holder(handing, "w1", "n2")
    assert fetch_notice(table, "s") == "n1"
    untaken = table.assign(table.take(handing, "w1"), "w3")
    assert not table.notify_holder(untaken, "w3", "n3"), "assigned, not taken: nobody renews it"


def fetch_notice(table: LeaseTable, key: str) -> str | None:
    lease = table.get(key)
    assert lease is not None
    return lease.assignment_notice


def test_the_owner_index_is_added_once(table: LeaseTable) -> None:
    assert table.ensure_owner_index() is True
    assert table.ensure_owner_index() is False
    owner = table.take(table_lease(table, "s"), "w1")
    assert table.keys_owned_by(owner.lease_owner or "") == ["s"]


@pytest.mark.parametrize(("there_after", "raises"), [(True, False), (False, True)])
def test_a_worker_that_lost_the_race_to_add_the_owner_index_goes_on(
        there_after: bool, raises: bool) -> None:
    """A fleet started at once races to add the index; moto answers the losers' UpdateTable
    with an internal error where DynamoDB says ValidationException. Either way the index
    being there afterwards is success; an error that left no index is raised."""
    client = boto3.client("dynamodb", region_name=REGION)
    lease_table = LeaseTable(client, "app")
    index = {"IndexName": OWNER_INDEX,
             "KeySchema": [{"AttributeName": "leaseOwner", "KeyType": "HASH"}],
             "Projection": {"ProjectionType": "KEYS_ONLY"}}
    with Stubber(client) as stubber:
        stubber.add_response("describe_table", {"Table": {"TableName": "app"}})
        stubber.add_client_error("update_table", "InternalServerError", http_status_code=500)
        stubber.add_response("describe_table", {"Table": {
            "TableName": "app", "GlobalSecondaryIndexes": [index] if there_after else []}})
        if raises:
            with pytest.raises(ClientError):
                lease_table.ensure_owner_index()
        else:
            assert lease_table.ensure_owner_index() is False
        stubber.assert_no_pending_responses()


def table_lease(table: LeaseTable, key: str) -> Lease:
    table.create(Lease(key))
    lease = table.get(key)
    assert lease is not None
    return lease


def test_renew_fails_when_owner_or_counter_changed(table: LeaseTable) -> None:
    table.create(Lease("s"))
    lease = table.get("s")
    assert lease is not None
    mine = table.take(lease, "w1")
    with pytest.raises(LeaseLostError):
        table.renew(mine.copy(lease_owner="w2"))
    theirs = table.take(mine, "w2")
    with pytest.raises(LeaseLostError):
        table.renew(mine)
    assert table.renew(theirs).lease_owner == "w2"


def test_evict_during_a_handoff_clears_only_the_checkpoint_owner(table: LeaseTable) -> None:
    lease = put_java(table, java_item("s", checkpointOwner={"S": "old-owner"}))
    assert (lease.lease_owner, lease.checkpoint_owner) == ("java-worker", "old-owner")
    with pytest.raises(LeaseLostError):
        table.evict(lease.copy(checkpoint_owner="impostor"))
    evicted = table.evict(lease)
    assert (evicted.lease_owner, evicted.checkpoint_owner) == ("java-worker", None)
    assert evicted.lease_counter == lease.lease_counter + 1
    adopted = table.adopt(evicted)
    assert adopted.lease_owner == "java-worker"
    assert adopted.owner_switches_since_checkpoint == evicted.owner_switches_since_checkpoint + 1
    with pytest.raises(LeaseLostError):
        table.adopt(evicted)


def test_adopt_waits_for_the_previous_owner_to_let_go(table: LeaseTable) -> None:
    lease = put_java(table, java_item("s"))
    asked = table.set_checkpoint_owner(lease, "thief")
    with pytest.raises(LeaseLostError):
        table.adopt(asked)
    with pytest.raises(ValueError, match="no owner"):
        table.adopt(Lease("s"))


def test_writes_during_a_handoff_are_fenced_on_the_checkpoint_owner(table: LeaseTable) -> None:
    lease = put_java(table, java_item("s"))
    asked = table.set_checkpoint_owner(lease, "thief")
    with pytest.raises(LeaseChanged) as changed:
        table.renew(lease)
    current = changed.value.current
    assert current is not None
    assert (current.lease_owner, current.checkpoint_owner) == ("thief", "java-worker")
    handing_off = lease.copy(lease_owner="thief", checkpoint_owner="java-worker")
    renewed = table.renew(handing_off)
    assert renewed.lease_counter == asked.lease_counter + 1
    checkpointed = table.update_checkpoint(renewed, Position("12345"))
    assert checkpointed.checkpoint.sequence_number == "12345"
    with pytest.raises(LeaseChanged):
        table.renew(renewed.copy(checkpoint_owner="thief"))


def test_evict_clears_the_owner_so_anyone_can_take(table: LeaseTable) -> None:
    lease = put_java(table, java_item("s"))
    evicted = table.evict(lease)
    assert evicted.lease_owner is None
    assert evicted.checkpoint_owner is None
    assert evicted.lease_counter == 42
    assert table.take(evicted, "w2").lease_owner == "w2"


def test_evict_fails_for_a_lease_someone_else_took(table: LeaseTable) -> None:
    lease = put_java(table, java_item("s"))
    table.take(lease, "w2")
    with pytest.raises(LeaseLostError):
        table.evict(lease)


def test_update_checkpoint_resets_switches_and_clears_pending(table: LeaseTable) -> None:
    lease = put_java(
        table,
        java_item(
            "s",
            pendingCheckpoint={"S": "999"},
            pendingCheckpointSubSequenceNumber={"N": "1"},
            pendingCheckpointState={"B": b"state"},
        ),
    )
    assert lease.pending_checkpoint == Position("999", 1)
    updated = table.update_checkpoint(lease, Position("123456789", 5))
    assert updated.checkpoint == Position("123456789", 5)
    assert updated.owner_switches_since_checkpoint == 0
    assert updated.lease_counter == 42
    assert updated.lease_owner == "java-worker"
    item = raw(table, "s")
    for gone in (
        "pendingCheckpoint",
        "pendingCheckpointSubSequenceNumber",
        "pendingCheckpointState",
    ):
        assert gone not in item
    assert item["throughputKBps"] == {"N": "12.5"}
    assert item["parentShardId"] == {"SS": ["shardId-000000000000"]}


def test_update_checkpoint_is_fenced_on_counter_and_owner(table: LeaseTable) -> None:
    lease = put_java(table, java_item("s"))
    with pytest.raises(LeaseLostError):
        table.update_checkpoint(lease.copy(lease_owner="impostor"), Position.shard_end())
    table.renew(lease)
    with pytest.raises(LeaseLostError):
        table.update_checkpoint(lease, Position.shard_end())
    current = table.get("s")
    assert current is not None and current.checkpoint.sub_sequence_number == 3


def test_set_checkpoint_owner_writes_the_java_3_handoff(table: LeaseTable) -> None:
    lease = put_java(table, java_item("s"))
    handed = table.set_checkpoint_owner(lease, "new-worker")
    assert handed.lease_owner == "new-worker"
    assert handed.checkpoint_owner == "java-worker"
    assert handed.lease_counter == lease.lease_counter
    with pytest.raises(LeaseLostError):
        table.set_checkpoint_owner(handed, "third-worker")
    with pytest.raises(ValueError, match="no owner"):
        table.set_checkpoint_owner(Lease("s"), "w")


def test_update_child_shard_ids_adds_to_the_set_without_touching_the_counter(
    table: LeaseTable,
) -> None:
    lease = put_java(table, java_item("s"))
    table.update_child_shard_ids("s", ["c1"])
    table.update_child_shard_ids("s", ["c2", "c1"])
    table.update_child_shard_ids("s", [])
    current = table.get("s")
    assert current is not None
    assert current.child_shard_ids == {"c1", "c2"}
    assert current.lease_counter == lease.lease_counter


def test_update_child_shard_ids_never_creates_an_item(table: LeaseTable) -> None:
    with pytest.raises(LeaseLostError):
        table.update_child_shard_ids("missing", ["c1"])
    assert table.get("missing") is None


def test_delete_is_conditional_on_the_counter(table: LeaseTable) -> None:
    table.create(Lease("s"))
    lease = table.get("s")
    assert lease is not None
    table.take(lease, "w")
    assert table.delete(lease) is False
    assert table.get("s") is not None
    current = table.get("s")
    assert current is not None and table.delete(current) is True
    assert table.get("s") is None


def test_delete_leaves_a_lease_created_again_whose_counter_reached_the_one_read(
        table: LeaseTable) -> None:
    """Shard sync run by two workers over a stream created again: each reads the former
    lease, one replaces it, and the new lease's counter climbs back to the value the other
    read. That other's delete must not remove the new lease (then taken and read by a
    worker) on the strength of a counter alone."""
    table.create(Lease("s", incarnation=new_incarnation(1)))
    former = table.get("s")
    assert former is not None and former.incarnation is not None
    assert table.delete(former) is True
    table.create(Lease("s", incarnation=new_incarnation(2)))
    created = table.get("s")
    assert created is not None and created.lease_counter == former.lease_counter
    assert table.delete(former) is False
    assert table.get("s") is not None


def without_counter(table: LeaseTable, key: str) -> Lease:
    """A finished lease item written by hand or by a tool, with no ``leaseCounter``, as read."""
    table.client.put_item(TableName=table.table_name, Item={
        "leaseKey": {"S": key}, "checkpoint": {"S": SHARD_END},
        "checkpointSubSequenceNumber": {"N": "0"}})
    lease = table.get(key)
    assert lease is not None and lease.counter_absent
    return lease


def deletes_a_lease_without_a_counter(table: LeaseTable) -> None:
    """No counter is not ``leaseCounter = 0`` to DynamoDB: the delete of such an item expects
    it still without one, as a take does, and a copy read before a take is refused."""
    stale = without_counter(table, "s")
    table.take(stale, "w")
    assert table.delete(stale) is False, "taken since it was read"
    assert table.get("s") is not None
    table.client.delete_item(TableName=table.table_name, Key={"leaseKey": {"S": "s"}})
    assert table.delete(without_counter(table, "s")) is True
    assert table.get("s") is None


def test_delete_of_a_lease_without_a_counter(table: LeaseTable) -> None:
    deletes_a_lease_without_a_counter(table)


def test_delete_of_a_lease_created_without_an_incarnation(table: LeaseTable) -> None:
    """A Java KCL (or older kclpy) lease has no incarnation: deleted on its counter."""
    table.create(Lease("s"))
    lease = table.get("s")
    assert lease is not None and lease.incarnation is None
    assert table.delete(lease) is True
    assert table.get("s") is None


# -- request accounting and throttling ---------------------------------------------------


def test_every_request_is_counted_by_operation(table: LeaseTable, metrics: Metrics) -> None:
    before = requests(metrics, "UpdateItem")
    table.create(Lease("s"))
    lease = table.get("s")
    assert lease is not None
    table.renew(table.take(lease, "w"))
    assert requests(metrics, "PutItem") == 1
    assert requests(metrics, "GetItem") == 1
    assert requests(metrics, "UpdateItem") - before == 2


def test_throttling_is_retried_with_capped_jittered_backoff() -> None:
    updated = {
        "Attributes": {"leaseKey": {"S": "s"}, "leaseCounter": {"N": "2"}, "leaseOwner": {"S": "w"}}
    }
    client: Any = _ScriptedClient(
        update_item=[
            client_error("ProvisionedThroughputExceededException"),
            client_error("ThrottlingException"),
            client_error("RequestLimitExceeded"),
            updated,
        ]
    )
    sleeps: list[float] = []
    metrics = Metrics()
    table = LeaseTable(
        client,
        "t",
        metrics=metrics,
        backoff_s=(1.0, 3.0),
        sleep=sleeps.append,
        rng=random.Random(7),
    )
    lease = table.renew(Lease("s", lease_owner="w", lease_counter=1))
    assert lease.lease_counter == 2
    assert len(sleeps) == 3
    assert 0 <= sleeps[0] <= 1.0 and 0 <= sleeps[1] <= 2.0 and 0 <= sleeps[2] <= 3.0
    assert throttles(metrics, "UpdateItem") == 3
    assert requests(metrics, "UpdateItem") == 4


def test_persistent_throttling_raises_lease_table_throttled() -> None:
    client: Any = _ScriptedClient(scan=[client_error("ThrottlingException", "Scan")] * 3)
    metrics = Metrics()
    table = LeaseTable(
        client,
        "t",
        metrics=metrics,
        max_attempts=3,
        sleep=lambda _: None,
    )
    with pytest.raises(LeaseTableThrottled, match="Scan"):
        table.list_leases()
    assert throttles(metrics, "Scan") == 3
    assert client.script["scan"] == []


def test_other_errors_propagate_without_retry() -> None:
    client: Any = _ScriptedClient(get_item=[client_error("ResourceNotFoundException", "GetItem")])
    table = LeaseTable(client, "t", sleep=lambda _: None)
    with pytest.raises(ClientError, match="ResourceNotFoundException"):
        table.get("s")
    assert len(client.calls) == 1


# -- over real HTTP (moto server) --------------------------------------------------------


@pytest.fixture(scope="module")
def moto_url(moto_server: LocalEndpoint) -> str:
    return moto_server.url


@pytest.mark.integration
def test_over_http_java_items_and_fenced_writes(moto_url: str) -> None:
    client = boto3.client("dynamodb", endpoint_url=moto_url, region_name=REGION)
    table = LeaseTable(client, f"app-{uuid.uuid4().hex}")
    assert table.create_if_missing() is True
    java = put_java(table, java_item("shardId-000000000001"))
    assert java.checkpoint.sub_sequence_number == 3

    taken = table.take(java, "w1")
    renewed = table.renew(taken)
    with pytest.raises(LeaseLostError):
        table.renew(taken)
    checkpointed = table.update_checkpoint(renewed, Position("4959", 1))
    evicted = table.evict(checkpointed)
    assert evicted.lease_owner is None
    assert evicted.lease_counter == java.lease_counter + 4
    assert evicted.checkpoint.sequence_number == "4959"
    assert raw(table, "shardId-000000000001")["javaOnly"] == java_item("x")["javaOnly"]
    assert [lease.lease_key for lease in table.list_leases()] == ["shardId-000000000001"]


@pytest.mark.integration
def test_over_http_delete_of_a_lease_without_a_counter(embedded_endpoint: LocalEndpoint) -> None:
    """The same on kclpy.local's DynamoDB, whose conditions are atomic."""
    client = boto3.client("dynamodb", endpoint_url=embedded_endpoint.url, region_name=REGION)
    table = LeaseTable(client, f"app-{uuid.uuid4().hex}")
    table.create_if_missing()
    deletes_a_lease_without_a_counter(table)
