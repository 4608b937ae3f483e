"""The IAM policies of docs/iam.md against what kclpy calls.

Statically, every Kinesis, DynamoDB and CloudWatch operation kclpy's code can call is allowed
by some documented policy, and every action a policy allows is one the code can need. By
recording, each role's real runs against kinesis-mock and moto's server go through a
recording proxy, and every request of a run is allowed by that role's own policies, action
and resource. Each check is also shown to fail once a policy loses what a call needs.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import boto3
import pytest
from botocore.stub import Stubber

from kclpy import Worker
from kclpy.leases.table import LeaseTable
from kclpy.local import LocalEndpoint
from tests.support import aws_calls
from tests.support.cli import endpoints, run_cli
from tests.support.e2e import EndToEnd, produce_mixed, running, worker_config
from tests.support.faultproxy import Call, FaultProxy
from tests.support.iam import (
    PAGE,
    ROLES,
    Names,
    Statement,
    actions_of,
    assert_allowed,
    denied,
    documented_policies,
    needless,
    not_allowed_anywhere,
    operations_in_code,
    role_statements,
)
from tests.support.recording import Ledger
from tests.support.state import Ops
from tests.support.streams import dynamodb_client, put_plain
from tests.support.waiting import wait_for
from tests.support.workers import running as running_worker

NAMES = Names(region="us-east-1", account="000000000000", stream="s", application="app",
              consumer="app", state_table="app-state", namespace="app")
STREAM_ARN = "arn:aws:kinesis:us-east-1:000000000000:stream/s"


def code_actions() -> set[str]:
    return {action for service, operation in operations_in_code()
            for action in actions_of(service, operation)}


# -- static ---------------------------------------------------------------------------------


def test_the_page_has_one_policy_per_name_the_roles_attach() -> None:
    policies = documented_policies()
    assert set(policies) == {name for names in ROLES.values() for name in names}
    assert all(statements for statements in policies.values())


def test_the_code_scan_finds_the_calls_made_through_wrappers_and_clients() -> None:
    """Calls handed to ``table.call(...)`` and made on a client directly are both found, and
    the emulator-only code is left out: otherwise the next test would prove nothing."""
    found = operations_in_code()
    for operation in [("kinesis", "GetRecords"), ("kinesis", "SubscribeToShard"),
                      ("dynamodb", "UpdateItem"), ("dynamodb", "TransactWriteItems"),
                      ("dynamodb", "Query"), ("cloudwatch", "PutMetricData")]:
        assert operation in found, operation
    assert ("kinesis", "CreateStream") not in found, "kclpy/local's demo is not a role's"
    assert all(not where.startswith("kclpy/local/") for places in found.values()
               for where in places)


def test_every_operation_the_code_can_call_is_allowed_by_a_documented_policy() -> None:
    assert not_allowed_anywhere(documented_policies(), code_actions()) == []


def test_every_action_a_policy_allows_is_one_the_code_can_need() -> None:
    """Least privilege: no action is in a policy "just in case"."""
    needed = {a.lower() for a in code_actions()}
    allowed = {a for statements in documented_policies().values() for s in statements
               for a in s.actions}
    assert sorted(a for a in allowed if a.lower() not in needed) == []


def test_an_action_taken_out_of_every_policy_fails_the_static_check() -> None:
    policies = {name: tuple(s.without_action("kinesis:SubscribeToShard") for s in statements)
                for name, statements in documented_policies().items()}
    assert not_allowed_anywhere(policies, code_actions()) == ["kinesis:SubscribeToShard"]


# -- the whole run's calls ------------------------------------------------------------------


def _caller_seen_from(module: str) -> str | None:
    """What the run recorder attributes a call to when the code that makes it is ``module``."""
    namespace: dict[str, Any] = {"__name__": module, "aws_calls": aws_calls, "sys": sys}
    exec("def call():\n    return aws_calls.kclpy_caller(sys._getframe())\n", namespace)
    return namespace["call"]()  # type: ignore[no-any-return]


def test_the_run_recorder_keeps_kclpy_calls_and_leaves_the_tests_and_the_emulators() -> None:
    assert _caller_seen_from("kclpy.leases.table") == "kclpy.leases.table"
    assert _caller_seen_from("kclpy") == "kclpy"
    assert _caller_seen_from("kclpy.local.demo") is None, "kclpy/local is not a role's"
    assert _caller_seen_from("tests.support.streams") is None, "a test's own call"
    assert _caller_seen_from("kclpyx.other") is None


def test_a_call_made_through_kclpy_in_this_process_is_recorded() -> None:
    """The recorder is installed in every test process (``conftest.py``), and a call made by
    kclpy's lease table on a stubbed client is recorded with the module that made it."""
    client = boto3.client("dynamodb", region_name="us-east-1")
    with Stubber(client) as stub:
        stub.add_response("get_item", {})
        assert LeaseTable(client, "app").get("shard-0") is None
    assert aws_calls.recorded()[("dynamodb", "GetItem")].startswith("kclpy.")


def test_the_actions_granted_elsewhere_are_no_policys_and_the_page_names_each() -> None:
    page = PAGE.read_text()
    for action in aws_calls.GRANTED_ELSEWHERE:
        assert not_allowed_anywhere(documented_policies(), [action]) == [action]
        assert f"`{action}`" in page
    calls = {("kinesis", "ListStreams"): "kclpy.leases.streams",
             ("sts", "AssumeRole"): "kclpy.spark.reading",
             ("sts", "GetCallerIdentity"): "kclpy.somewhere"}
    assert aws_calls.not_allowed(calls, documented_policies()) == [
        "sts:GetCallerIdentity (made by kclpy.somewhere) needs sts:GetCallerIdentity, which "
        "no policy in docs/iam.md allows"]


def test_the_run_check_names_a_recorded_operation_no_policy_allows() -> None:
    calls = {("kinesis", "SubscribeToShard"): "kclpy.retrieval.subscription",
             ("dynamodb", "UpdateItem"): "kclpy.leases.table"}
    assert aws_calls.not_allowed(calls, documented_policies()) == []
    policies = {name: tuple(s.without_action("kinesis:SubscribeToShard") for s in statements)
                for name, statements in documented_policies().items()}
    assert aws_calls.not_allowed(calls, policies) == [
        "kinesis:SubscribeToShard (made by kclpy.retrieval.subscription) needs "
        "kinesis:SubscribeToShard, which no policy in docs/iam.md allows"]


def _call(service: str, operation: str, **parameters: Any) -> Call:
    return Call(service, operation, parameters)


def test_the_role_check_holds_actions_resources_and_conditions() -> None:
    """The check a recorded run goes through, on requests made up to hit each rule."""
    worker = role_statements("polling worker", NAMES)
    allowed = [_call("kinesis", "GetRecords", ShardIterator="i"),
               _call("kinesis", "ListShards", StreamName="s"),
               _call("dynamodb", "Query", TableName="app",
                     IndexName="LeaseOwnerToLeaseKeyIndex")]
    assert denied(worker, allowed, NAMES) == []
    assert denied(worker, [_call("kinesis", "ListShards", StreamName="other")], NAMES) == [
        "kinesis:ListShards on arn:aws:kinesis:us-east-1:000000000000:stream/other "
        "(for kinesis ListShards)"]
    assert denied(worker, [_call("dynamodb", "Query", TableName="app")], NAMES), \
        "the owner index is allowed, the table itself is not"
    without = tuple(s.without_action("kinesis:GetRecords") for s in worker)
    assert denied(without, allowed[:1], NAMES) == [
        f"kinesis:GetRecords on {STREAM_ARN} (for kinesis GetRecords)"]
    assert denied(worker, [_call("kinesis", "SubscribeToShard",
                                 ConsumerARN=f"{STREAM_ARN}/consumer/app:1")], NAMES), \
        "a polling worker's policy does not cover fan-out"

    state = role_statements("exactly-once worker", NAMES)
    transaction = _call("dynamodb", "TransactWriteItems", TransactItems=[
        {"Update": {"TableName": "app"}}, {"ConditionCheck": {"TableName": "app-state"}},
        {"Put": {"TableName": "elsewhere"}}])
    assert denied(state, [transaction], NAMES) == [
        "dynamodb:PutItem on arn:aws:dynamodb:us-east-1:000000000000:table/elsewhere "
        "(for dynamodb TransactWriteItems)"]

    metrics = role_statements("metrics-publishing worker", NAMES)
    assert denied(metrics, [_call("cloudwatch", "PutMetricData", Namespace="app")],
                  NAMES) == []
    assert denied(metrics, [_call("cloudwatch", "PutMetricData", Namespace="other")], NAMES)


def test_an_action_the_run_did_not_need_is_reported_unless_only_some_runs_need_it() -> None:
    operator = role_statements("operator", NAMES)
    reads = [_call("kinesis", "ListShards", StreamName="s")]
    widened = (*operator, Statement(("kinesis:PutRecords", "dynamodb:PutItem"), ("*",)))
    assert "kinesis:PutRecords" in needless(widened, reads, NAMES)
    assert "dynamodb:PutItem" not in needless(widened, reads, NAMES), \
        "PutItem is one only some operator commands need"


def test_a_resource_taken_out_of_a_policy_fails_the_role_check() -> None:
    worker = role_statements("fan-out worker", NAMES)
    subscribe = _call("kinesis", "SubscribeToShard", ConsumerARN=f"{STREAM_ARN}/consumer/app:1")
    assert denied(worker, [subscribe], NAMES) == []
    narrowed = tuple(Statement(s.actions, tuple(r for r in s.resources if "consumer" not in r)
                               or ("arn:aws:kinesis:us-east-1:000000000000:stream/none",),
                               s.conditions) for s in worker)
    assert denied(narrowed, [subscribe], NAMES)


# -- recorded runs ------------------------------------------------------------------------


@dataclass
class Recorded:
    """Recording proxies in front of kinesis-mock and moto's server (and CloudWatch on moto)."""

    kinesis: FaultProxy
    dynamodb: FaultProxy
    cloudwatch: FaultProxy

    def calls(self) -> list[Call]:
        return self.kinesis.calls() + self.dynamodb.calls()

    def operations(self) -> set[str]:
        return {call.operation for call in self.calls()}


@contextmanager
def recording(e2e: EndToEnd) -> Iterator[Recorded]:
    with ExitStack() as stack:
        proxies = [stack.enter_context(FaultProxy(url, record_calls=True))
                   for url in (e2e.kinesis_url, e2e.dynamodb_url, e2e.dynamodb_url)]
        yield Recorded(*proxies)


def run_names(e2e: EndToEnd, stream: str, application: str) -> Names:
    """The run's names, with the account kinesis-mock gives its ARNs; consumer, namespace
    and state table as the runs here name them (after the application)."""
    arn = e2e.kinesis.describe_stream_summary(StreamName=stream)[
        "StreamDescriptionSummary"]["StreamARN"]
    _, _, _, region, account, _ = arn.split(":", 5)
    return Names(region=region, account=account, stream=stream, application=application,
                 consumer=application, namespace=application,
                 state_table=f"{application}-state")


@pytest.mark.integration
@pytest.mark.parametrize("assigner", ["worker", "leader"])
def test_a_polling_workers_and_the_operators_calls_are_allowed_by_their_policies(
        e2e: EndToEnd, ledger: Ledger, capsys: pytest.CaptureFixture[str],
        assigner: str) -> None:
    """A polling worker (publishing CloudWatch metrics through a proxy of its own), then the
    operator commands on its lease table, each recorded apart."""
    stream = e2e.stream("iam", 2)
    expected = produce_mixed(e2e.kinesis, stream, "a", plain=40, aggregates=2,
                             per_aggregate=5)
    with recording(e2e) as worker, recording(e2e) as operator:
        config = worker_config(worker.kinesis.url, worker.dynamodb.url, stream,
                               lease_assigner=assigner, metrics_level="SUMMARY",
                               cloudwatch_endpoint=worker.cloudwatch.url,
                               metrics_buffer_time_ms=200)
        with running(config, ledger):
            wait_for(lambda: len(ledger.records) >= len(expected), 120, "every record")
            wait_for(lambda: worker.cloudwatch.requests("PutMetricData") > 0, 30,
                     "metrics published")
        names = run_names(e2e, stream, config.application_name)
        assert_allowed("polling worker", worker.calls(), names)
        assert_allowed("metrics-publishing worker", worker.cloudwatch.calls(), names,
                       policies=("cloudwatch",))
        assert {"GetRecords", "UpdateItem", "Scan", "ListShards"} <= worker.operations()
        if assigner == "leader":
            assert {"UpdateTable", "Query"} <= worker.operations()

        shard = "shardId-000000000000"
        app = ["--application-name", config.application_name]
        on_stream = [*app, "--stream-name", stream]
        where = endpoints(LocalEndpoint(operator.kinesis.url),
                          LocalEndpoint(operator.dynamodb.url))
        put_plain(e2e.kinesis, stream, [b"behind"])
        commands = [
            ["leases", *app],
            ["status", *on_stream, "--window-seconds", "0.2", "--samples", "2"],
            ["consumers", *on_stream],
            ["register-consumer", *on_stream, "--retry-backoff-ms", "100",
             "--describe-retries", "50"],
            ["deregister-consumer", *on_stream],
            ["checkpoint", "set", *on_stream, "--all-shards", "--to", "TRIM_HORIZON",
             "--force"],
            ["shard", "park", *app, "--shard-id", shard],
            ["shard", "resume", *app, "--shard-id", shard],
            ["recovery", "list", *app],
        ]
        for command in commands:
            code, out, err = run_cli(capsys, *command, *where)
            # status exits with the lag's status; the rest succeed
            assert code in ((0, 1, 2, 3) if command[0] == "status" else (0,)), (command, err)
        assert_allowed("operator", operator.calls(), names)
        assert {"Scan", "UpdateItem", "RegisterStreamConsumer", "DeregisterStreamConsumer",
                "GetRecords"} <= operator.operations()


@pytest.mark.integration
def test_a_fan_out_workers_calls_are_allowed_by_its_policies(
        e2e: EndToEnd, ledger: Ledger) -> None:
    stream = e2e.stream("iam-efo", 2)
    expected = produce_mixed(e2e.kinesis, stream, "a", plain=30, aggregates=1,
                             per_aggregate=5)
    with recording(e2e) as worker:
        config = worker_config(worker.kinesis.url, worker.dynamodb.url, stream,
                               retrieval_mode="FANOUT", retry_backoff_ms=200,
                               max_describe_stream_consumer_retries=50)
        with running(config, ledger):
            wait_for(lambda: len(ledger.records) >= len(expected), 120, "every record")
        names = run_names(e2e, stream, config.application_name)
        assert {"RegisterStreamConsumer", "DescribeStreamConsumer",
                "SubscribeToShard"} <= worker.operations()
        assert_allowed("fan-out worker", worker.calls(), names)
        assert denied(role_statements("polling worker", names), worker.calls(), names), \
            "fan-out needs more than the polling worker's policy"


@pytest.mark.integration
def test_an_exactly_once_workers_calls_are_allowed_by_its_policies(e2e: EndToEnd) -> None:
    stream = e2e.stream("iam-eo", 1)
    written = put_plain(e2e.kinesis, stream, [b"add:2", b"set:5", b"del-if:9", b"del"])
    with recording(e2e) as worker:
        config = worker_config(worker.kinesis.url, worker.dynamodb.url, stream)
        config = config.replace(state_store=f"{config.application_name}-state")
        dynamodb = dynamodb_client(e2e.dynamodb_url)

        def checkpoint() -> str | None:
            try:
                item = dynamodb.get_item(TableName=config.application_name, ConsistentRead=True,
                                         Key={"leaseKey": {"S": "shardId-000000000000"}})
            except dynamodb.exceptions.ResourceNotFoundException:
                return None  # the worker has not created its lease table yet
            return item.get("Item", {}).get("checkpoint", {}).get("S")

        with running_worker(Worker(config, Ops)):
            wait_for(lambda: checkpoint() == written[-1][1], 120, "every record committed")
        names = run_names(e2e, stream, config.application_name)
        assert {"TransactWriteItems", "GetItem"} <= worker.operations()
        assert_allowed("exactly-once worker", worker.calls(), names)

