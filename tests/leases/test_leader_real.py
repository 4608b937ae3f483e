"""``--lease-assigner leader`` over real HTTP: worker processes on kinesis-mock and the local
DynamoDB (conditional writes atomic), the leader SIGKILLed."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import pytest

from kclpy.leases.load import LEADER_ITEM, LOAD_TABLE_SUFFIX, WORKER_ID, WRITTEN_AT
from kclpy.leases.serializer import ASSIGNMENT_NOTICE
from kclpy.leases.table import OWNER_INDEX
from kclpy.local import LocalEndpoint
from tests.support.fleet import Producer, fleet
from tests.support.streams import (
    create_stream,
    dynamodb_client,
    kinesis_client,
    put_plain,
    unique_name,
    wait_for,
)

pytestmark = pytest.mark.integration


def _lock(dynamodb_url: str, application: str) -> tuple[str, int] | None:
    """The leader lock as the load table holds it: (leader, term)."""
    client = dynamodb_client(dynamodb_url)
    try:
        item: dict[str, Any] = client.get_item(
            TableName=application + LOAD_TABLE_SUFFIX, Key={WORKER_ID: {"S": LEADER_ITEM}},
            ConsistentRead=True).get("Item", {})
    except client.exceptions.ResourceNotFoundException:
        return None
    if not item:
        return None
    return item["leader"]["S"], int(item["term"]["N"])


def test_leader_sigkilled_another_leads_and_nothing_is_lost(
    kinesis_mock: LocalEndpoint, moto_server: LocalEndpoint, tmp_path: Path
) -> None:
    """Three workers with a leader assign six shards (the lease table gets the owner index,
    the lock lives in the load table, not among the leases), balance 2/2/2; the leader is
    SIGKILLed: a survivor wins a later term of the lock, the dead leader's leases go to the
    survivors (3/3), a survivor told of its new lease by a notice on one it held, and every
    record put before, during and after is processed. Every
    worker's report carries the wall-clock time it was written (``writtenAt``, what a new
    leader orders idle workers by)."""
    kinesis = kinesis_client(kinesis_mock.url)
    stream = unique_name("leader")
    create_stream(kinesis, stream, 6)
    application = unique_name("app")
    started = time.time()
    with fleet(kinesis_mock.url, moto_server.url, stream, application, tmp_path,
               extra_args=["--lease-assigner", "leader"]) as group, \
            Producer(kinesis, stream, "ld") as producer:
        workers = {name: group.start(name) for name in ("w1", "w2", "w3")}
        counts = wait_for(lambda: group.settled(set(workers)), 60, "a balanced fleet")
        assert sorted(counts.values()) == [2, 2, 2]
        described = dynamodb_client(moto_server.url).describe_table(TableName=application)
        assert OWNER_INDEX in {i["IndexName"]
                               for i in described["Table"].get("GlobalSecondaryIndexes", [])}
        assert LEADER_ITEM not in group.lease_items()
        reports = dynamodb_client(moto_server.url).scan(
            TableName=application + LOAD_TABLE_SUFFIX)["Items"]
        written = {item[WORKER_ID]["S"]: float(item[WRITTEN_AT]["N"]) for item in reports
                   if item[WORKER_ID]["S"] != LEADER_ITEM}
        assert set(written) == set(workers)
        assert all(started - 1 <= at <= time.time() + 1 for at in written.values()), written
        lock = _lock(moto_server.url, application)
        assert lock is not None
        leader, term = lock
        victim = workers.pop(leader)
        victim.signal(signal.SIGKILL)
        victim.process.wait(10)

        def new_leader() -> tuple[str, int] | None:
            now = _lock(moto_server.url, application)
            return now if now is not None and now[0] != leader and now[1] > term else None

        # the lock expires one failover time (2 s) after its last renewal on the reader's
        # clock; the bound is for a machine shared by many test processes
        wait_for(new_leader, 30, "a survivor taking the leader lock over")
        counts = wait_for(lambda: group.settled(set(workers)), 60,
                          "the dead leader's leases on the survivors")
        assert sorted(counts.values()) == [3, 3]
        # a survivor that held leases was told of the one it got, on one it held
        # (``LeaseTable.notify_holder``), by a write its renewals went on through
        noticed = [key for key, item in group.lease_items().items()
                   if ASSIGNMENT_NOTICE in item]
        assert noticed, "the new leader notified no holder"
        sent = producer.stop()
        wait_for(lambda: group.ledger.processed_all(set(sent)), 60, "every record processed")
    assert set(group.ledger.payloads()) == set(sent)


def test_with_a_leader_every_worker_stops_by_itself_when_caught_up(
    kinesis_mock: LocalEndpoint, moto_server: LocalEndpoint, tmp_path: Path
) -> None:
    """``--stop-when-caught-up`` with a leader: only the leader scans the lease table, so a
    worker that does not lead asks for scans of its own once its shards are drained, to see
    every other lease renewed elsewhere. Two workers held mid-batch until the leader has
    spread four shards 2/2, then let go: both exit 0 by themselves and every record put is
    processed."""
    kinesis = kinesis_client(kinesis_mock.url)
    stream = unique_name("drain")
    create_stream(kinesis, stream, 4)
    sent = [f"dr-{n}" for n in range(120)]
    put_plain(kinesis, stream, [payload.encode() for payload in sent])
    application = unique_name("app")
    # a 6 s failover time: the first leader waits 2 s for the other's first report before
    # it assigns (a lease moved later could not be handed off while its processor is held)
    with fleet(kinesis_mock.url, moto_server.url, stream, application, tmp_path,
               failover_ms=6000,
               extra_args=["--lease-assigner", "leader", "--stop-when-caught-up"]) as group:
        names = ("w1", "w2")
        for name in names:
            group.hold_path(name).touch()
        workers = [group.start(name) for name in names]
        counts = wait_for(lambda: group.settled(set(names)), 60, "four shards spread 2/2")
        assert sorted(counts.values()) == [2, 2]
        lock = _lock(moto_server.url, application)
        assert lock is not None and lock[0] in names
        for name in names:
            group.hold_path(name).unlink()
        # a bound for a machine shared by many test processes: drained in seconds, then a
        # few scans a third of the failover time (2 s) apart
        codes = [worker.process.wait(120) for worker in workers]
    assert codes == [0, 0]
    assert set(group.ledger.payloads()) == set(sent)
