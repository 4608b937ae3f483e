"""Enhanced fan-out consumer registration as the Java KCL does it: describe, register when
missing, wait until ACTIVE, throttling retried within the Java keys' bounds (botocore's
Stubber), and concurrent registration by several workers ending with one consumer (over
real HTTP against kinesis-mock); the inspector's consumer commands."""

from __future__ import annotations

import threading
from typing import Any

import boto3
import pytest
from botocore.stub import Stubber

from kclpy.errors import KinesisClientLibDependencyException
from kclpy.local import LocalEndpoint
from kclpy.retrieval.registration import (
    ConsumerNotActive,
    ConsumerRegistration,
    RegistrationSettings,
    deregister,
    list_consumers,
)
from tests.support.cli import run_cli
from tests.support.streams import create_stream, kinesis_client, unique_name

STREAM_ARN = "arn:aws:kinesis:us-east-1:123456789012:stream/orders"
CONSUMER_ARN = f"{STREAM_ARN}/consumer/app:1700000000"
WHO = {"StreamARN": STREAM_ARN, "ConsumerName": "app"}


def description(status: str) -> dict[str, Any]:
    return {"ConsumerDescription": {
        "ConsumerName": "app", "ConsumerARN": CONSUMER_ARN, "ConsumerStatus": status,
        "ConsumerCreationTimestamp": 1700000000, "StreamARN": STREAM_ARN}}


def stubbed(**settings: Any) -> tuple[ConsumerRegistration, Stubber, list[float]]:
    client = boto3.client("kinesis", region_name="us-east-1")
    waits: list[float] = []
    registration = ConsumerRegistration(
        client, "app", stream_arn=STREAM_ARN, settings=RegistrationSettings(**settings),
        sleep=waits.append)
    return registration, Stubber(client), waits


def test_an_active_consumer_is_used_as_it_is() -> None:
    registration, stub, waits = stubbed()
    stub.add_response("describe_stream_consumer", description("ACTIVE"), WHO)
    with stub:
        assert registration.get_or_create() == CONSUMER_ARN
    stub.assert_no_pending_responses()
    assert waits == []


def test_a_missing_consumer_is_registered_and_waited_for_until_active() -> None:
    registration, stub, waits = stubbed(backoff_s=0.5)
    stub.add_client_error("describe_stream_consumer", "ResourceNotFoundException",
                          expected_params=WHO)
    stub.add_response("register_stream_consumer", {"Consumer": {
        "ConsumerName": "app", "ConsumerARN": CONSUMER_ARN, "ConsumerStatus": "CREATING",
        "ConsumerCreationTimestamp": 1700000000}}, WHO)
    stub.add_response("describe_stream_consumer", description("CREATING"), WHO)
    stub.add_response("describe_stream_consumer", description("ACTIVE"), WHO)
    with stub:
        assert registration.get_or_create() == CONSUMER_ARN
    stub.assert_no_pending_responses()
    assert waits == [0.5, 0.5]


def test_losing_the_registration_race_describes_the_winners_consumer() -> None:
    registration, stub, _ = stubbed()
    stub.add_client_error("describe_stream_consumer", "ResourceNotFoundException")
    stub.add_client_error("register_stream_consumer", "ResourceInUseException")
    stub.add_response("describe_stream_consumer", description("ACTIVE"), WHO)
    with stub:
        assert registration.get_or_create() == CONSUMER_ARN
    stub.assert_no_pending_responses()


def test_throttling_is_retried_within_the_java_bounds_then_fails() -> None:
    registration, stub, waits = stubbed(describe_retries=3, backoff_s=1.0)
    for _ in range(2):
        stub.add_client_error("describe_stream_consumer", "LimitExceededException")
    stub.add_response("describe_stream_consumer", description("ACTIVE"), WHO)
    with stub:
        assert registration.get_or_create() == CONSUMER_ARN
    assert len(waits) == 2 and all(1.0 <= w <= 1.1 for w in waits)

    registration, stub, _ = stubbed(describe_retries=2)
    for _ in range(2):
        stub.add_client_error("describe_stream_consumer", "LimitExceededException")
    with stub, pytest.raises(KinesisClientLibDependencyException, match="throttled 2 times"):
        registration.get_or_create()


def test_a_consumer_that_never_becomes_active_is_an_error_naming_it() -> None:
    registration, stub, waits = stubbed(describe_retries=2)
    for _ in range(3):
        stub.add_response("describe_stream_consumer", description("CREATING"), WHO)
    with stub, pytest.raises(ConsumerNotActive, match="app was not ACTIVE after 2 looks"):
        registration.get_or_create()
    assert len(waits) == 2


# -- over real HTTP ----------------------------------------------------------------------------


@pytest.mark.integration
def test_workers_registering_at_once_end_with_one_consumer(kinesis_mock: LocalEndpoint) -> None:
    kinesis = kinesis_client(kinesis_mock.url)
    stream = unique_name("efo")
    create_stream(kinesis, stream, 1)
    settings = RegistrationSettings(backoff_s=0.2, describe_retries=50)
    arns: list[str] = []
    errors: list[BaseException] = []

    def register() -> None:
        try:  # each worker has its own client, as in separate processes
            arns.append(ConsumerRegistration(
                kinesis_client(kinesis_mock.url), "app", stream_name=stream,
                settings=settings).get_or_create())
        except BaseException as exc:  # collected for the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=register) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert len(set(arns)) == 1 and len(arns) == 4
    registration = ConsumerRegistration(kinesis, "app", stream_name=stream)
    consumers = list_consumers(kinesis, registration.stream_arn)
    assert [(c["ConsumerName"], c["ConsumerStatus"]) for c in consumers] == [("app", "ACTIVE")]
    assert deregister(kinesis, registration.stream_arn, "app")


@pytest.mark.integration
def test_the_inspector_lists_registers_and_deregisters_consumers(
        kinesis_mock: LocalEndpoint, moto_server: LocalEndpoint,
        capsys: pytest.CaptureFixture[str]) -> None:
    kinesis = kinesis_client(kinesis_mock.url)
    stream = unique_name("efo-cli")
    create_stream(kinesis, stream, 1)
    where = ["--application-name", "orders-app", "--stream-name", stream, "--region",
             "us-east-1", "--kinesis-endpoint", kinesis_mock.url, "--retry-backoff-ms", "200",
             "--describe-retries", "50"]
    code, out, err = run_cli(capsys, "register-consumer", *where)
    assert code == 0, err
    assert "/consumer/orders-app:" in out
    code, out, _ = run_cli(capsys, "consumers", *where)
    assert code == 0 and "orders-app" in out and "ACTIVE" in out and "1 consumer(s)" in out
    code, out, _ = run_cli(capsys, "deregister-consumer", *where)
    assert (code, out.strip()) == (0, "deregistered orders-app")
    code, out, _ = run_cli(capsys, "deregister-consumer", *where)
    assert code == 1 and out.startswith("no consumer orders-app")
    code, _, err = run_cli(capsys, "consumers", "--application-name", "a", "--region",
                           "us-east-1")
    assert code == 2 and "--stream-name" in err
