"""The scan budget: workers scan as often as their saved renewals pay for, and a fleet's
DynamoDB bill - requests and capacity - never exceeds a Java KCL 2.x fleet's."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest

from kclpy.leases.budget import (
    JAVA_RENEWALS_PER_FAILOVER,
    ScanBudget,
    java_taker_interval,
    scan_pages,
    scan_units,
)

HOUR = 3600.0
STEP = 0.05


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Bill:
    requests: float
    units: float
    scans: int
    longest_gap: float
    shortest_gap: float


def run_hour(
    failover: float, held: int, leases: int, *, renewals: bool, share: float | None = None
) -> Bill:
    """One simulated hour of a worker holding ``held`` leases in a fleet where the average
    is ``share`` (default: ``held``): a renewal per held lease every failover / 2 (unless its
    processor checkpoints often enough that none is needed) and a scan whenever the budget
    allows one."""
    clock = Clock()
    budget = ScanBudget(failover, clock=clock)
    budget.observe(share=held if share is None else share, leases=leases)
    requests = units = 0.0
    scans: list[float] = []
    next_renewal = failover / 2
    while clock.now < HOUR:
        if renewals and clock.now >= next_renewal:
            for _ in range(held):
                budget.spend_renewal()
            requests += held
            units += held
            next_renewal += failover / 2
        if budget.next_scan_in() == 0.0:
            budget.spend_scan()
            requests += scan_pages(leases)
            units += scan_units(leases)
            scans.append(clock.now)
        clock.now += STEP
    gaps = [b - a for a, b in itertools.pairwise(scans)]
    return Bill(requests, units, len(scans), max(gaps), min(gaps))


def java_bill(failover: float, held: int, leases: int) -> tuple[float, float]:
    """Requests and capacity (write-unit equivalents) of a Java worker in one hour."""
    renewals = HOUR * held * JAVA_RENEWALS_PER_FAILOVER / failover
    scans = HOUR / java_taker_interval(failover)
    return renewals + scans * scan_pages(leases), renewals + scans * scan_units(leases)


@pytest.mark.parametrize(
    ("failover", "held", "leases"),
    [
        (10.0, 3, 8),
        (3.0, 3, 8),
        (10.0, 1, 2),
        (10.0, 0, 8),
        (10.0, 400, 1200),
        (10.0, 10, 10_000),
        (2.0, 8, 8),
    ],
)
@pytest.mark.parametrize("renewals", [True, False], ids=["renewing", "checkpointing"])
def test_the_bill_never_exceeds_the_java_workers(
    failover: float, held: int, leases: int, renewals: bool
) -> None:
    bill = run_hour(failover, held, leases, renewals=renewals)
    java_requests, java_units = java_bill(failover, held, leases)
    slack = 1.0 + 3 * scan_pages(leases)  # the burst allowance, spent once
    assert bill.requests <= java_requests + slack
    assert bill.units <= java_units + 3 * scan_units(leases) + 1.0
    assert bill.longest_gap <= java_taker_interval(failover) + STEP, "never slower than Java"
    assert bill.shortest_gap >= 0.5 - STEP, "never more often than the floor"


def test_saved_renewals_buy_scans() -> None:
    idle = run_hour(10.0, 0, 8, renewals=True)
    renewing = run_hour(10.0, 3, 8, renewals=True)
    checkpointing = run_hour(10.0, 3, 8, renewals=False)
    assert idle.scans < renewing.scans < checkpointing.scans
    # 3 held leases at a 10 s failover save 0.3 requests/s renewing at failover / 2 and
    # 0.9 requests/s when checkpoints make renewals unnecessary.
    assert HOUR / renewing.scans == pytest.approx(1 / (0.3 + 1 / 20.05), rel=0.05)
    assert HOUR / checkpointing.scans == pytest.approx(1 / (0.9 + 1 / 20.05), rel=0.05)


def test_every_worker_of_a_fleet_scans_alike_and_the_fleet_pays_what_java_would() -> None:
    # 8 leases over 3 workers: 3, 3 and 2; processors checkpoint, so nobody renews.
    loads = [3, 3, 2]
    bills = [run_hour(10.0, held, 8, renewals=False, share=8 / 3) for held in loads]
    assert len({bill.scans for bill in bills}) == 1, "the worker with 2 leases is not slower"
    java = sum(java_bill(10.0, held, 8)[0] for held in loads)
    assert sum(bill.requests for bill in bills) <= java + 3 * len(loads)
    renewing = [run_hour(10.0, held, 8, renewals=True, share=8 / 3) for held in loads]
    assert renewing[2].scans > renewing[0].scans, "fewer renewals leave more for scans"
    assert sum(bill.requests for bill in renewing) <= java + 3 * len(loads)


def test_a_big_table_is_scanned_as_often_as_its_read_capacity_allows() -> None:
    # 10,000 leases over a thousand workers: a scan reads 100 write-unit equivalents, so
    # the capacity saved by renewing 10 leases less often buys few scans.
    bill = run_hour(10.0, 10, 10_000, renewals=True)
    java_requests, java_units = java_bill(10.0, 10, 10_000)
    assert bill.units == pytest.approx(java_units, rel=0.05), "capacity is what limits scans"
    assert bill.requests < java_requests


def test_the_first_scan_is_never_delayed() -> None:
    budget = ScanBudget(10.0, clock=Clock())
    assert budget.next_scan_in() == 0.0
