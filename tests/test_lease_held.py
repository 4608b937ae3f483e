"""HeldSet (kclpy/leases/held.py): the leases a worker holds, their locks, and who is told when
one goes; first through the coordinator that owns it, then directly."""

from __future__ import annotations

from kclpy.leases.table import LeaseTable
from tests.support.determinism import Clock
from tests.support.leases import (
    coordinator,
    create,
    fetch,
)


def test_held_leases_are_copies(table: LeaseTable, clock: Clock) -> None:
    create(table, "s1")
    a, _ = coordinator(table, "A", clock)
    a.run_taker_once()
    a.held_leases()["s1"].lease_counter = 999
    held = a.get_held("s1")
    assert held is not None
    held.concurrency_token = "forged"
    assert a.get_held("s1") == fetch(table, "s1")
    again = a.get_held("s1")
    assert again is not None and again.concurrency_token != "forged"
    assert a.get_held("nope") is None
