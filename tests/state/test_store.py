"""What every state store shares (kclpy/state/store.py and the package's ``open_store``): the
cache of committed values that spares a store the reads of keys only this worker updates,
and which store a ``state_store`` option names."""

from __future__ import annotations

from pathlib import Path

import pytest

from kclpy.errors import ConfigError
from kclpy.state import open_store
from kclpy.state import store as stores
from kclpy.state.dynamodb import DynamoDBStateStore
from kclpy.state.sql import SQLStateStore
from kclpy.state.store import CommittedCache
from kclpy.state.transaction import Limits, StateTransaction, Versioned


class Reads:
    """A store's reads, counted."""

    def __init__(self, values: dict[str, Versioned]) -> None:
        self.values = values
        self.keys: list[str] = []

    def __call__(self, key: str) -> Versioned:
        self.keys.append(key)
        return self.values.get(key, Versioned(None, 0))


def test_a_key_is_read_from_the_store_once_and_again_only_once_forgotten() -> None:
    reads = Reads({"a": Versioned(1, 3)})
    cache = CommittedCache()
    assert cache.read("a", reads) == Versioned(1, 3)
    assert cache.read("a", reads) == Versioned(1, 3)
    assert cache.read("absent", reads) == Versioned(None, 0)
    assert cache.read("absent", reads) == Versioned(None, 0), "absence is remembered too"
    cache.forget(["a", "never-read"])
    reads.values["a"] = Versioned(5, 4)
    assert cache.read("a", reads) == Versioned(5, 4)
    assert reads.keys == ["a", "absent", "a"]


def test_a_committed_transaction_becomes_the_cached_state_one_version_on() -> None:
    reads = Reads({"a": Versioned(1, 3), "b": Versioned(5, 2, "life-2"),
                   "gone": Versioned("x", 7, "life-1")})
    cache = CommittedCache()
    txn = StateTransaction(lambda key: cache.read(key, reads), Limits(10, 10_000))
    txn.update("a", lambda n: n + 1)
    txn.update("b", lambda n: n + 1)
    txn.put("new", [1])
    txn.delete("gone")
    cache.committed(txn)
    reads.keys.clear()
    assert cache.read("a", reads) == Versioned(2, 4), "a key without an incarnation keeps none"
    assert cache.read("b", reads) == Versioned(6, 3, "life-2")
    new = cache.read("new", reads)
    assert (new.value, new.version) == ([1], 1)
    assert new.incarnation is not None and new.incarnation == txn.incarnations["new"], (
        "a created key's incarnation is the one its commit wrote")
    assert cache.read("gone", reads) == Versioned(None, 0)
    assert reads.keys == [], "every committed key came from the cache"


def test_a_full_cache_starts_over_instead_of_growing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stores, "CACHE_SIZE", 2)
    reads = Reads({})
    cache = CommittedCache()
    cache.read("a", reads)
    cache.read("b", reads)
    cache.read("c", reads)  # would be the third: the cache is cleared first
    cache.read("c", reads)
    cache.read("a", reads)
    assert reads.keys == ["a", "b", "c", "a"]


def test_a_url_names_a_sql_store_and_anything_else_a_dynamodb_table(tmp_path: Path) -> None:
    assert isinstance(open_store(f"sqlite:///{tmp_path / 'state.db'}"), SQLStateStore)
    assert isinstance(open_store("orders-state"), DynamoDBStateStore)
    with pytest.raises(ConfigError, match=r"--state-store.*not a usable database URL"):
        open_store("nosuchdriver://host/db")
