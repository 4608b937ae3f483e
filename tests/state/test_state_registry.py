"""State stores are chosen by the spec's URL scheme from one registry, which a store of
one's own joins through the public API, and declare whether they keep positions of their
own: ``kclpy checkpoint set --state-store`` moves such a store's position through the
protocol, whatever the store."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, cast

import pytest

import kclpy
from kclpy.errors import ConfigError
from kclpy.leases.lease import Lease
from kclpy.leases.table import LeaseTable
from kclpy.local import LocalEndpoint
from kclpy.position import Position
from kclpy.state import _STORES, open_store
from kclpy.state.dynamodb import DynamoDBStateStore
from kclpy.state.transaction import Limits
from tests.support.cli import endpoints, run_cli
from tests.support.streams import (
    create_stream,
    dynamodb_client,
    kinesis_client,
    put_plain,
    unique_name,
)

SHARD = "shardId-000000000000"


@dataclass
class Move:
    lease_key: str
    position: Position
    tenure: int
    incarnation: str | None
    gaps: list[Position]


@dataclass
class PositionLedger:
    """A store that keeps positions of its own and only records what it is asked to do
    with them: what ``checkpoint set`` needs of a store, no more."""

    spec: str
    keeps_position: bool = True
    limits: Limits = field(default_factory=lambda: Limits(items=10, bytes=1000))
    opened: bool = False
    moves: list[Move] = field(default_factory=list)

    def open(self, dynamodb: Any) -> None:
        self.opened = True

    def move_position(self, lease_key: str, position: Position, *, tenure: int,
                      incarnation: str | None, gaps: Collection[Position]) -> None:
        self.moves.append(Move(lease_key, position, tenure, incarnation, list(gaps)))


@pytest.fixture
def ledgers(monkeypatch: pytest.MonkeyPatch) -> list[PositionLedger]:
    """Every ``ledger://`` store opened while the test runs; the scheme is unregistered
    after it."""
    made: list[PositionLedger] = []
    monkeypatch.setattr("kclpy.state._STORES", dict(_STORES))

    def factory(spec: str) -> kclpy.StateStore:
        made.append(PositionLedger(spec))
        return cast(kclpy.StateStore, made[-1])

    kclpy.register_store("ledger", factory)
    return made


def test_a_registered_scheme_opens_its_store_and_the_rest_keep_their_defaults(
        ledgers: list[PositionLedger]) -> None:
    store = open_store("ledger+v2://books/a")
    assert ledgers and store is cast(Any, ledgers[-1]) and ledgers[-1].spec == "ledger+v2://books/a"
    assert isinstance(open_store("my-state-table"), DynamoDBStateStore)
    with pytest.raises(ConfigError) as error:
        open_store("nosuch://x")
    assert error.value.option == "--state-store"


def test_a_scheme_must_be_one() -> None:
    with pytest.raises(ValueError, match="not a URL scheme"):
        kclpy.register_store("not a scheme", lambda spec: cast(kclpy.StateStore, None))


def test_the_stores_declare_whether_they_keep_positions_of_their_own() -> None:
    assert DynamoDBStateStore.keeps_position is False
    assert kclpy.SQLStateStore.keeps_position is True


@pytest.mark.integration
def test_checkpoint_set_moves_a_registered_stores_own_position(
        capsys: pytest.CaptureFixture[str], ledgers: list[PositionLedger],
        kinesis_mock: LocalEndpoint, moto_server: LocalEndpoint) -> None:
    kinesis = kinesis_client(kinesis_mock.url)
    stream = unique_name("registry")
    create_stream(kinesis, stream, 1)
    sequences = [seq for _, seq in put_plain(kinesis, stream, [b"a", b"b", b"c"])]
    app = unique_name("registry")
    table = LeaseTable(dynamodb_client(moto_server.url), app)
    table.create_if_missing()
    table.create(Lease(SHARD, lease_counter=3, checkpoint=Position(sequences[2])))
    code, _, err = run_cli(capsys, "checkpoint", "set", "--application-name", app,
                           "--stream-name", stream, "--shard-id", SHARD, "--to", sequences[0],
                           "--state-store", "ledger://books",
                           *endpoints(kinesis_mock, moto_server))
    assert code == 0, err
    (store,) = ledgers
    lease = table.get(SHARD)
    assert store.opened and lease is not None
    assert [(m.lease_key, m.position, m.incarnation, m.gaps) for m in store.moves] == [
        (SHARD, Position(sequences[0]), None, [])]
    # the store is moved while the lease is parked, at the counter that fences the
    # previous holder's commits out
    assert store.moves[0].tenure == lease.lease_counter - 1
    assert lease.checkpoint == Position(sequences[0]) and lease.parked is None
