"""The IAM policies of docs/iam.md, and what each AWS request needs from them.

A policy is read from the page itself (each ``### `NAME` policy`` heading's JSON block), so
the page a user copies from is the one the tests check. A request recorded by the fault
proxy (``FaultProxy(record_calls=True)``) becomes the IAM actions and resource ARNs AWS
would authorise it by, and :func:`denied` says which of them a set of statements does not
allow, as IAM evaluates an Allow: an action pattern, a resource pattern, and the
``StringEquals`` conditions kclpy's policies use.
"""

from __future__ import annotations

import ast
import functools
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

import botocore.session
from botocore import xform_name

from tests.support.faultproxy import Call

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "iam.md"

#: which policies each role attaches, as the table at the top of docs/iam.md says
ROLES: dict[str, tuple[str, ...]] = {
    "polling worker": ("worker",),
    "fan-out worker": ("worker", "fan-out"),
    "exactly-once worker": ("worker", "state-store"),
    "metrics-publishing worker": ("worker", "cloudwatch"),
    "operator": ("operator",),
    "monitor": ("monitor",),
    "spark source": ("spark-source",),
    "spark fan-out source": ("spark-source", "spark-fan-out"),
    "spark source, ends in DynamoDB": ("spark-source", "spark-metadata-table"),
    "spark source, ends in S3": ("spark-source", "spark-metadata-bucket"),
}

#: the services kclpy calls, by their IAM prefix
SERVICES = ("kinesis", "dynamodb", "cloudwatch", "s3")

#: S3 operations whose IAM action has another name (the others are named as the operation)
S3_ACTIONS = {"ListObjectsV2": "ListBucket", "DeleteObjects": "DeleteObject",
              "HeadObject": "GetObject"}

#: a TransactWriteItems entry -> the IAM action it is authorised by
TRANSACT_ENTRIES = {"Put": "PutItem", "Update": "UpdateItem", "Delete": "DeleteItem",
                    "ConditionCheck": "ConditionCheckItem"}

#: the actions a role's policy allows that one ordinary run may not make, and when they are
#: made; any other action a run's policies allow and the run did not make is one too many
CONDITIONAL = {
    "dynamodb:UpdateTable": "adds the lease owner index, with a leader only",
    "dynamodb:Query": "reads the lease owner index, with a leader only",
    "dynamodb:DeleteItem": "lease clean-up after a shard ends; the leader's lock given up; "
                           "a state key deleted",
    "dynamodb:GetItem": "the leader's lock; a lease read again after a lost write",
    "dynamodb:PutItem": "checkpoint set creating a cleaned-up lease again",
    "dynamodb:ConditionCheckItem": "a state key only read",
    "kinesis:ListStreamConsumers": "a registration lost to another worker's",
    "dynamodb:ListTables": "kclpy monitor --all-applications only",
    "dynamodb:DescribeTable": "kclpy monitor --all-applications only",
}

#: kclpy's own code that only ever talks to a local emulator (the demo, endpoint probes,
#: moto's corrections): not a role's
LOCAL_ONLY = ROOT / "kclpy" / "local"

_HEADING = re.compile(r"^### `(?P<name>[a-z-]+)` policy\s*$")
_PLACEHOLDER = re.compile(r"\b(REGION|ACCOUNT|STREAM|APPLICATION|CONSUMER|STATE_TABLE|NAMESPACE"
                          r"|METADATA_TABLE|BUCKET|PREFIX)\b")


@dataclass(frozen=True)
class Statement:
    actions: tuple[str, ...]
    resources: tuple[str, ...]
    conditions: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    def without_action(self, action: str) -> Statement:
        return Statement(tuple(a for a in self.actions if a != action), self.resources,
                         self.conditions)


@dataclass(frozen=True)
class Need:
    """One IAM authorisation a request needs: ``action`` on ``resource``, with the
    condition keys the request sets (``cloudwatch:namespace``)."""

    action: str
    resource: str
    context: Mapping[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        extra = "".join(f" ({k}={v})" for k, v in self.context.items())
        return f"{self.action} on {self.resource}{extra}"


@dataclass(frozen=True)
class Names:
    """What the upper-case names of docs/iam.md stand for in one run."""

    region: str
    account: str
    stream: str
    application: str = "none"
    consumer: str = "none"
    state_table: str = "none"
    namespace: str = "none"
    metadata_table: str = "none"
    bucket: str = "none"
    prefix: str = "none"

    def fill(self, text: str) -> str:
        values = {"REGION": self.region, "ACCOUNT": self.account, "STREAM": self.stream,
                  "APPLICATION": self.application, "CONSUMER": self.consumer,
                  "STATE_TABLE": self.state_table, "NAMESPACE": self.namespace,
                  "METADATA_TABLE": self.metadata_table, "BUCKET": self.bucket,
                  "PREFIX": self.prefix}
        return _PLACEHOLDER.sub(lambda m: values[m[1]], text)

    @property
    def stream_arn(self) -> str:
        return f"arn:aws:kinesis:{self.region}:{self.account}:stream/{self.stream}"


def _statements(document: Mapping[str, Any]) -> tuple[Statement, ...]:
    statements = []
    for raw in document["Statement"]:
        if raw["Effect"] != "Allow":
            raise ValueError(f"kclpy's policies only allow: {raw}")
        actions, resources = raw["Action"], raw["Resource"]
        statements.append(Statement(
            tuple([actions] if isinstance(actions, str) else actions),
            tuple([resources] if isinstance(resources, str) else resources),
            raw.get("Condition", {})))
    return tuple(statements)


def documented_policies(page: Path = PAGE) -> dict[str, tuple[Statement, ...]]:
    """Each ``### `NAME` policy`` heading's first JSON block, by NAME."""
    policies: dict[str, tuple[Statement, ...]] = {}
    name: str | None = None
    block: list[str] | None = None
    for line in page.read_text().splitlines():
        if block is not None:
            if line.startswith("```"):
                assert name is not None
                policies[name] = _statements(json.loads("\n".join(block)))
                name, block = None, None
            else:
                block.append(line)
        elif heading := _HEADING.match(line):
            name = heading["name"]
        elif name is not None and line.strip() == "```json":
            block = []
    return policies


def role_statements(role: str, names: Names,
                    policies: Mapping[str, tuple[Statement, ...]] | None = None
                    ) -> tuple[Statement, ...]:
    """The statements of ``role``'s own policies, with ``names`` filled in."""
    policies = documented_policies() if policies is None else policies
    return tuple(
        Statement(s.actions, tuple(names.fill(r) for r in s.resources),
                  {op: {k: names.fill(str(v)) for k, v in keys.items()}
                   for op, keys in s.conditions.items()})
        for policy in ROLES[role] for s in policies[policy])


def needs(call: Call, names: Names) -> list[Need]:
    """What AWS authorises ``call`` by. A Kinesis request naming no stream (GetRecords by
    iterator, ListShards by token) is on the run's stream: each recorded run reads one."""
    params = call.parameters
    if call.service == "kinesis":
        return [Need(f"kinesis:{call.operation}", _kinesis_resource(call.operation, params,
                                                                    names))]
    if call.service == "dynamodb":
        if call.operation == "TransactWriteItems":
            return [Need(f"dynamodb:{TRANSACT_ENTRIES[kind]}", _table_arn(entry, names))
                    for item in params["TransactItems"] for kind, entry in item.items()]
        return [Need(f"dynamodb:{call.operation}", _table_arn(params, names))]
    if call.service == "cloudwatch":
        return [Need(f"cloudwatch:{call.operation}", "*",
                     {"cloudwatch:namespace": str(params.get("Namespace"))})]
    if call.service == "s3":
        action = f"s3:{S3_ACTIONS.get(call.operation, call.operation)}"
        bucket = f"arn:aws:s3:::{params['Bucket']}"
        if call.operation == "ListObjectsV2":
            return [Need(action, bucket)]
        keys = ([o["Key"] for o in params["Delete"]["Objects"]]
                if call.operation == "DeleteObjects" else [params["Key"]])
        return [Need(action, f"{bucket}/{key}") for key in keys]
    raise ValueError(f"a call to a service kclpy does not use: {call}")


def _kinesis_resource(operation: str, params: Mapping[str, Any], names: Names) -> str:
    if "ConsumerARN" in params:
        return str(params["ConsumerARN"])
    stream_arn = (params.get("StreamARN")
                  or (f"arn:aws:kinesis:{names.region}:{names.account}:stream/"
                      f"{params['StreamName']}" if "StreamName" in params else names.stream_arn))
    if "ConsumerName" in params and operation != "RegisterStreamConsumer":
        # a consumer named by stream and name is authorised by its ARN, which ends in its
        # creation time: any one
        return f"{stream_arn}/consumer/{params['ConsumerName']}:0"
    return str(stream_arn)


def _table_arn(params: Mapping[str, Any], names: Names) -> str:
    arn = f"arn:aws:dynamodb:{names.region}:{names.account}:table/{params['TableName']}"
    return f"{arn}/index/{params['IndexName']}" if params.get("IndexName") else arn


def allows(statement: Statement, need: Need) -> bool:
    if not any(fnmatchcase(need.action.lower(), a.lower()) for a in statement.actions):
        return False
    if not any(fnmatchcase(need.resource, r) for r in statement.resources):
        return False
    for operator, keys in statement.conditions.items():
        if operator != "StringEquals":
            raise ValueError(f"no evaluation here for condition {operator}")
        for key, wanted in keys.items():
            allowed = wanted if isinstance(wanted, list) else [wanted]
            if need.context.get(key) not in allowed:
                return False
    return True


def denied(statements: Iterable[Statement], calls: Iterable[Call], names: Names
           ) -> list[str]:
    """Each need of ``calls`` no statement allows, once, naming the request that had it."""
    statements = tuple(statements)
    missing: dict[str, str] = {}
    for call in calls:
        for need in needs(call, names):
            if str(need) not in missing and not any(allows(s, need) for s in statements):
                missing[str(need)] = f"{need} (for {call.service} {call.operation})"
    return sorted(missing.values())


def needless(statements: Iterable[Statement], calls: Iterable[Call], names: Names
             ) -> list[str]:
    """The actions ``statements`` allow that ``calls`` never needed and that are not
    :data:`CONDITIONAL`: more than the run's role needs."""
    used = {need.action.lower() for call in calls for need in needs(call, names)}
    allowed = {action for s in statements for action in s.actions}
    return sorted(a for a in allowed if a.lower() not in used and a not in CONDITIONAL)


# -- what the code can call --------------------------------------------------------------


def client_operations() -> dict[str, tuple[str, str]]:
    """Each client method name of kclpy's services -> (service, operation)."""
    session = botocore.session.get_session()
    methods: dict[str, tuple[str, str]] = {}
    for service in SERVICES:
        for operation in session.get_service_model(service).operation_names:
            methods[xform_name(operation)] = (service, operation)
    return methods


@functools.cache
def operations_in_code(root: Path = ROOT / "kclpy") -> dict[tuple[str, str], list[str]]:
    """Every (service, operation) kclpy's code can call -> where: an attribute named like a
    client method that is called (``kinesis.list_shards(...)``) or handed to a call
    (``table.call("PutItem", client.put_item, ...)``), outside ``kclpy/local``."""
    methods = client_operations()
    found: dict[tuple[str, str], list[str]] = {}
    for path in sorted(root.rglob("*.py")):
        if LOCAL_ONLY in path.parents:
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            for candidate in (node.func, *node.args):
                if isinstance(candidate, ast.Attribute) and candidate.attr in methods:
                    where = f"{path.relative_to(ROOT)}:{candidate.lineno}"
                    found.setdefault(methods[candidate.attr], []).append(where)
    return found


def actions_of(service: str, operation: str) -> set[str]:
    """The IAM actions a call of ``operation`` can need (a transaction: each entry's)."""
    if (service, operation) == ("dynamodb", "TransactWriteItems"):
        return {f"dynamodb:{action}" for action in TRANSACT_ENTRIES.values()}
    if service == "s3":
        return {f"s3:{S3_ACTIONS.get(operation, operation)}"}
    return {f"{service}:{operation}"}


def not_allowed_anywhere(policies: Mapping[str, tuple[Statement, ...]],
                         actions: Iterable[str]) -> list[str]:
    """The ``actions`` no statement of any policy names."""
    named = {a.lower() for statements in policies.values() for s in statements
             for a in s.actions}
    return sorted(a for a in actions if a.lower() not in named)


def assert_allowed(role: str, calls: list[Call], names: Names, *,
                   policies: tuple[str, ...] | None = None) -> None:
    """Every call is allowed by the role's own policies, and those allow nothing the run
    did not need but what only some runs need (``CONDITIONAL``); ``policies`` narrows the
    second check to the ones this run's calls are all of (a CloudWatch proxy's)."""
    assert calls, f"nothing recorded for the {role}"
    statements = role_statements(role, names)
    assert denied(statements, calls, names) == [], \
        f"the {role}'s policies in docs/iam.md lack these"
    if policies is not None:
        documented = documented_policies()
        statements = tuple(s for name in policies for s in documented[name])
    assert needless(statements, calls, names) == [], \
        f"the {role}'s policies in docs/iam.md allow these, which it did not need"
