"""The transaction handle (kclpy/state/transaction.py): reads see the transaction's own writes,
a record's writes can be taken back, and what one transaction holds is counted against the
store's limits."""

from __future__ import annotations

import pytest

from kclpy.state.transaction import (
    DELETED,
    Limits,
    StateTransaction,
    Versioned,
    encoded_size,
)


def test_reads_see_staged_writes_and_a_record_can_be_undone() -> None:
    store = {"a": Versioned(1, 3)}
    txn = StateTransaction(lambda key: store.get(key, Versioned(None, 0)), Limits(2, 10_000))
    txn.begin_record()
    assert txn.update("a", lambda n: n + 1) == 2
    txn.put("b", {"x": [1]})
    assert (txn.get("a"), txn.get("b"), txn.versions) == (2, {"x": [1]}, {"a": 3, "b": 0})
    txn.begin_record()
    txn.delete("a")
    txn.put("c", 1)
    assert txn.get("a", "gone") == "gone" and txn.over_limits()
    txn.undo_record()
    assert (txn.get("a"), "c" in txn.writes, txn.over_limits()) == (2, False, False)
    with pytest.raises(TypeError):
        txn.put("d", object())
    with pytest.raises(ValueError):
        txn.put("d", None)


def empty_store(key: str) -> Versioned:
    return Versioned(None, 0)


def test_a_key_written_again_counts_once_at_its_latest_size() -> None:
    limit = encoded_size("k", DELETED) + encoded_size("k", "x" * 100)
    txn = StateTransaction(empty_store, Limits(10, limit))
    txn.put("k", "x" * 200)
    assert txn.over_limits()
    txn.put("k", "x" * 100)
    assert not txn.over_limits(), "the first, larger value is no longer counted"
    txn.delete("k")
    txn.put("k", "x" * 100)
    assert not txn.over_limits(), "nor is a delete staged in between"


def test_a_key_only_read_is_an_item_of_the_commit() -> None:
    store = {"a": Versioned(1, 4), "b": Versioned(2, 9)}
    txn = StateTransaction(lambda key: store.get(key, Versioned(None, 0)), Limits(1, 10_000))
    assert txn.get("a") == 1 and txn.get("missing", "default") == "default"
    assert txn.versions == {"a": 4, "missing": 0}, "read as absent: checked absent at commit"
    assert txn.over_limits() and txn.empty, "two checks, no write"
    store["a"] = Versioned(100, 5)
    assert txn.get("a") == 100 and txn.versions["a"] == 4, "the version first read is kept"


def test_outgoing_writes_count_as_items_and_bytes_and_go_with_their_record() -> None:
    txn = StateTransaction(empty_store, Limits(2, 10_000))
    txn.begin_record()
    txn.emit({"Put": {"TableName": "orders", "Item": {"id": {"S": "1"}}}})
    assert not txn.empty and not txn.over_limits()
    txn.begin_record()
    txn.emit({"Put": {"TableName": "orders", "Item": {"id": {"S": "2"}}}})
    txn.put("k", 1)
    assert txn.over_limits()
    txn.undo_record()
    assert len(txn.outgoing) == 1 and not txn.over_limits()
    assert StateTransaction(empty_store, Limits(10, 50)).over_limits() is False
    big = StateTransaction(empty_store, Limits(10, 50))
    big.emit({"Put": {"Item": "x" * 100}})
    assert big.over_limits(), "bytes count as well as items"


def test_a_key_read_as_absent_gets_a_new_incarnation_per_transaction_and_one_read_keeps_its_own(
        ) -> None:
    """The incarnation a created key will carry is drawn when the transaction first finds it
    absent, and differs between transactions: a key created again is another life. An
    undone record takes it back with its version."""
    store = {"a": Versioned(1, 4, "life-1")}

    def read(key: str) -> Versioned:
        return store.get(key, Versioned(None, 0))

    first, second = (StateTransaction(read, Limits(10, 10_000)) for _ in range(2))
    for txn in (first, second):
        txn.put("new", 1)
        assert txn.get("a") == 1 and txn.incarnations["a"] == "life-1"
    assert None is not first.incarnations["new"] != second.incarnations["new"] is not None
    first.begin_record()
    first.put("other", 1)
    first.undo_record()
    assert set(first.incarnations) == {"new", "a"}
