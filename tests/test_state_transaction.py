"""The transaction handle (kclpy/state/transaction.py): reads see the transaction's own writes,
a record's writes can be taken back, and what one transaction holds is counted against the
store's limits."""

from __future__ import annotations

import pytest

from kclpy.state.transaction import Limits, StateTransaction, Versioned


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
