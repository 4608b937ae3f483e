"""The lease tests' shared parts: an in-process lease table (moto) whose operations a test
can make fail, an injected clock, and a coordinator built the way those tests want it.

The fixtures are imported by the test modules that use them
(``tests/leases/test_coordinator.py``, ``tests/leases/test_taker.py``,
``tests/leases/test_renewer.py``, ``tests/leases/test_held.py``), which keeps their generic
names (``client``, ``table``, ``clock``) out of every other test module.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Any

import boto3
import pytest
from botocore.exceptions import ClientError
from moto import mock_aws

from kclpy.leases.coordinator import CoordinatorSettings, LeaseAssignment, LeaseCoordinator
from kclpy.leases.lease import Lease
from kclpy.leases.table import LeaseTable
from kclpy.metrics import Metrics
from tests.support.determinism import Clock, FirstChoiceRandom

REGION = "us-east-1"
#: the failover time of every coordinator() unless a test says otherwise
FAILOVER = 10.0


class FlakyClient:
    """Delegates to a real client; ``fail[operation]`` makes that operation raise instead."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self.fail: dict[str, Callable[[], Exception]] = {}

    def __getattr__(self, name: str) -> Any:
        if name in self.fail:
            failure = self.fail[name]

            def fail(**kwargs: Any) -> Any:
                raise failure()

            return fail
        return getattr(self._client, name)


def client_error(code: str) -> Callable[[], Exception]:
    """A ClientError of ``code``, made when a FlakyClient's failing operation is called."""
    return lambda: ClientError({"Error": {"Code": code, "Message": code}}, "Op")


@pytest.fixture
def client() -> Iterator[Any]:
    """Typed Any: it stands in for a DynamoDBClient."""
    with mock_aws():
        yield FlakyClient(boto3.client("dynamodb", region_name=REGION))


@pytest.fixture
def table(client: Any) -> LeaseTable:
    """The lease table ``app``; two attempts per request and no real sleeps between them."""
    lease_table = LeaseTable(client, "app", max_attempts=2, sleep=lambda _: None)
    lease_table.create_if_missing()
    return lease_table


@pytest.fixture
def clock() -> Clock:
    """The coordinators' clock: it moves only when a test advances it."""
    return Clock()


class Lost:
    """A lease-lost listener that records what it was told."""

    def __init__(self) -> None:
        #: the lease keys, in the order they were lost
        self.shards: list[str] = []

    def __call__(self, lease_key: str) -> None:
        self.shards.append(lease_key)


def coordinator(
    table: LeaseTable, worker: str, clock: Callable[[], float], *,
    metrics: Metrics | None = None, rng: random.Random | None = None,
    assignment: LeaseAssignment | None = None, **settings: Any,
) -> tuple[LeaseCoordinator, Lost]:
    """A coordinator of ``worker`` that is deterministic (one renewal thread, the first
    choice wherever it picks at random) and the listener of the leases it loses;
    ``settings`` are the ``CoordinatorSettings`` a test changes."""
    settings.setdefault("failover_time_s", FAILOVER)
    settings.setdefault("renewal_threads", 1)
    # Steals here are outright takes, so these tests see the taker's rules alone; the
    # graceful handoff a steal starts by default is tested in tests/leases/test_handoff.py.
    settings.setdefault("graceful_handoff", False)
    c = LeaseCoordinator(table, worker, CoordinatorSettings(**settings), metrics=metrics,
                         clock=clock, rng=rng if rng is not None else FirstChoiceRandom(),
                         assignment=assignment)
    lost = Lost()
    c.add_lease_lost_listener(lost)
    return c, lost


def create(table: LeaseTable, *keys: str, **fields: Any) -> None:
    """Create one lease per key, each with ``fields``."""
    for key in keys:
        assert table.create(Lease(key, **fields))


def owners(table: LeaseTable) -> dict[str, str | None]:
    """Each lease's owner as the table has it now."""
    return {lease.lease_key: lease.lease_owner for lease in table.list_leases()}


def fetch(table: LeaseTable, key: str) -> Lease:
    """The lease ``key`` as stored; it must exist."""
    lease = table.get(key)
    assert lease is not None
    return lease


def sample(metrics: Metrics, name: str) -> float:
    """A metric without labels; 0 when it was never set."""
    return metrics.registry.get_sample_value(name) or 0.0


def run_fleet(
    coordinators: list[LeaseCoordinator], clock: Clock, cycles: int
) -> list[dict[str, str | None]]:
    """Taker cycles for every worker with three renewals of every worker in between, as the
    threads would interleave them; returns ownership after each cycle."""
    table = coordinators[0].table
    history = []
    for _ in range(cycles):
        for c in coordinators:
            c.run_taker_once()
        for _ in range(6):
            clock.advance(FAILOVER / 3)
            for c in coordinators:
                c.run_renewer_once()
        history.append(owners(table))
    return history


def take_one(table: LeaseTable, clock: Clock, **kwargs: Any) -> tuple[LeaseCoordinator, Lost, str]:
    """Worker A holding the one lease s1; its listener and the tenure's token."""
    create(table, "s1")
    a, lost = coordinator(table, "A", clock, **kwargs)
    (lease,) = a.run_taker_once()
    assert lease.concurrency_token is not None
    return a, lost, lease.concurrency_token
