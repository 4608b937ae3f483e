"""Conditional writes on kclpy's local moto endpoints are atomic, as DynamoDB's are.

Taking, renewing and checkpointing a lease are conditional writes; if two workers racing for
one lease could both succeed, the fleet tests would see duplicates the protocol prevents.
moto alone checks the condition and applies the write in separate steps, so a threaded server
in front of it lets several of these racing writers through in a good share of rounds. The
endpoints therefore hand moto one request at a time, which must not let one stuck client hold
up all the others.
"""

from __future__ import annotations

import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import pytest
from botocore.config import Config

from kclpy.local import LocalEndpoint
from tests.support.streams import dynamodb_client, unique_name

if TYPE_CHECKING:
    from mypy_boto3_dynamodb import DynamoDBClient

pytestmark = pytest.mark.integration

WRITERS = 8
ROUNDS = 30
# moto's window between checking the condition and applying the write grows with the update.
# With a lease-sized update like this one, an unserialised threaded server let more than one
# writer win in about a quarter of the rounds, so a regression fails this test.
OTHER_ATTRIBUTES = 10
# Exactly one attempt per write: a retried write could be refused by its own first attempt.
ONE_ATTEMPT = Config(retries={"total_max_attempts": 1, "mode": "standard"})
# Only a guard: if one writer died before the barrier, the others would wait there forever.
BARRIER_TIMEOUT_S = 60.0
# Only turns a hang into a failure; an answer normally takes milliseconds.
HANG_GUARD = Config(read_timeout=20, retries={"total_max_attempts": 1, "mode": "standard"})


def _create_lease_table(client: DynamoDBClient) -> str:
    table = unique_name("atomic")
    client.create_table(
        TableName=table,
        KeySchema=[{"AttributeName": "leaseKey", "KeyType": "HASH"}],
        AttributeDefinitions=[{"AttributeName": "leaseKey", "AttributeType": "S"}],
        BillingMode="PAY_PER_REQUEST",
    )
    client.get_waiter("table_exists").wait(TableName=table)
    client.put_item(TableName=table, Item={"leaseKey": {"S": "shard"}, "leaseCounter": {"N": "0"}})
    return table


def _take(
    client: DynamoDBClient, table: str, me: str, counter: str, barrier: threading.Barrier
) -> bool:
    """Take the lease if it is still at ``counter``, as a worker's take would."""
    others = "".join(f", attribute{i} = :me" for i in range(OTHER_ATTRIBUTES))
    barrier.wait()
    try:
        client.update_item(
            TableName=table,
            Key={"leaseKey": {"S": "shard"}},
            UpdateExpression=f"SET leaseOwner = :me{others} ADD leaseCounter :one",
            ConditionExpression="leaseCounter = :counter",
            ExpressionAttributeValues={
                ":me": {"S": me},
                ":one": {"N": "1"},
                ":counter": {"N": counter},
            },
        )
    except client.exceptions.ConditionalCheckFailedException:
        return False
    return True


@pytest.mark.parametrize("endpoint_fixture", ["moto_server", "embedded_endpoint"])
def test_of_writers_racing_on_one_condition_exactly_one_wins(
    endpoint_fixture: str, request: pytest.FixtureRequest
) -> None:
    endpoint: LocalEndpoint = request.getfixturevalue(endpoint_fixture)
    admin = dynamodb_client(endpoint.url)
    table = _create_lease_table(admin)
    names = [f"worker-{n}" for n in range(WRITERS)]
    clients = [dynamodb_client(endpoint.url, ONE_ATTEMPT) for _ in names]
    for client in clients:  # connected before the race, so they start it together
        client.describe_table(TableName=table)

    winners_per_round: list[list[str]] = []
    with ThreadPoolExecutor(max_workers=WRITERS) as pool:
        for counter in range(ROUNDS):
            barrier = threading.Barrier(WRITERS, timeout=BARRIER_TIMEOUT_S)
            takes = [
                pool.submit(_take, client, table, name, str(counter), barrier)
                for client, name in zip(clients, names, strict=True)
            ]
            winners_per_round.append(
                [name for name, take in zip(names, takes, strict=True) if take.result()]
            )

    assert [len(winners) for winners in winners_per_round] == [1] * ROUNDS, winners_per_round
    item = admin.get_item(TableName=table, Key={"leaseKey": {"S": "shard"}}, ConsistentRead=True)
    assert item["Item"]["leaseCounter"] == {"N": str(ROUNDS)}
    assert item["Item"]["leaseOwner"] == {"S": winners_per_round[-1][0]}


@pytest.mark.parametrize("endpoint_fixture", ["moto_server", "embedded_endpoint"])
def test_a_client_stuck_mid_request_does_not_hold_up_the_others(
    endpoint_fixture: str, request: pytest.FixtureRequest
) -> None:
    endpoint: LocalEndpoint = request.getfixturevalue(endpoint_fixture)
    url = urlsplit(endpoint.url)
    assert url.hostname is not None and url.port is not None
    head = (
        "POST / HTTP/1.1\r\n"
        f"Host: {url.netloc}\r\n"
        "Content-Type: application/x-amz-json-1.0\r\n"
        "X-Amz-Target: DynamoDB_20120810.ListTables\r\n"
        "Content-Length: 100\r\n\r\n{"
    )
    with socket.create_connection((url.hostname, url.port)) as stuck:
        stuck.sendall(head.encode())  # 99 bytes of the promised body never follow

        tables = dynamodb_client(endpoint.url, HANG_GUARD).list_tables()

    assert "TableNames" in tables
