"""leases/assignment.py: one registry of lease assignment strategies, read by the options,
the worker-decides taker and the leader alike; a strategy registered from outside is asked
by both deciders, and what it says is what they do."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import kclpy
from kclpy.arguments import parse_worker_args, worker_parser
from kclpy.cli import worker_main
from kclpy.config import KCLConfig
from kclpy.errors import ConfigError
from kclpy.leases import assignment
from kclpy.leases.assignment import (
    COUNT,
    LOAD,
    FleetView,
    TakerView,
    assignment_strategy,
    assignment_strategy_names,
)
from kclpy.leases.coordinator import LeaseAssignment
from kclpy.leases.leader import plan
from kclpy.leases.lease import Lease
from kclpy.leases.load import LoadSettings, WorkerLoad
from kclpy.leases.table import LeaseTable
from tests.support.determinism import Clock
from tests.support.leases import coordinator, create, owners

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Grab:
    """Every live lease of another worker, at once (a taker); every movable lease to the
    worker with the fewest (a leader). Each view it was asked with is kept."""

    name: str = "grab"
    uses_load: bool = False
    taker_views: list[TakerView] = field(default_factory=list)
    fleet_views: list[FleetView] = field(default_factory=list)

    def steals(self, view: TakerView) -> list[Lease]:
        self.taker_views.append(view)
        return [lease for lease in view.leases
                if lease.lease_owner is not None and lease.lease_key not in view.held
                and view.live(lease) and lease.lease_key not in view.no_steal]

    def moves(self, view: FleetView) -> list[tuple[Lease, str]]:
        self.fleet_views.append(view)
        least = min(view.counts, key=lambda worker: (view.counts[worker], worker))
        return [(lease, least) for worker, leases in sorted(view.movable.items())
                if worker != least for lease in leases]

    def balance_interval_s(self, settings: LoadSettings) -> float | None:
        return None


@pytest.fixture
def grab(monkeypatch: pytest.MonkeyPatch) -> Iterator[Grab]:
    """A strategy registered from outside, for this test only."""
    monkeypatch.setattr(assignment, "_STRATEGIES", dict(assignment._STRATEGIES))
    strategy = Grab()
    kclpy.register_assignment_strategy(strategy)
    yield strategy


def test_count_and_load_are_the_built_in_strategies() -> None:
    assert assignment_strategy("count") is COUNT and assignment_strategy("load") is LOAD
    assert assignment_strategy_names()[:2] == ("count", "load")
    assert not COUNT.uses_load and LOAD.uses_load
    settings = LoadSettings(balance_interval_s=42.0)
    assert (COUNT.balance_interval_s(settings), LOAD.balance_interval_s(settings)) == (None, 42.0)
    assert kclpy.assignment_strategy is assignment_strategy


def test_an_unknown_strategy_names_the_option_and_lists_the_known_names(grab: Grab) -> None:
    with pytest.raises(ConfigError) as excinfo:
        assignment_strategy("random", "--lease-assignment")
    assert excinfo.value.option == "--lease-assignment"
    assert excinfo.value.message == "'random' is not one of count, load, grab"


def test_a_built_in_name_is_refused_and_a_strategy_registered_again_replaces_itself(
        grab: Grab) -> None:
    with pytest.raises(ValueError, match="'count' already names the built-in"):
        kclpy.register_assignment_strategy(Grab(name="count"))
    with pytest.raises(ValueError, match="not an assignment strategy name"):
        kclpy.register_assignment_strategy(Grab(name="by load"))
    again = Grab()
    kclpy.register_assignment_strategy(again)
    assert assignment_strategy("grab") is again, "the module executed again replaces it"
    assert assignment_strategy("count") is COUNT


def test_a_strategy_registered_before_the_options_are_read_is_accepted(grab: Grab) -> None:
    config = KCLConfig(application_name="a", stream_name="s", lease_assignment="grab")
    assert assignment_strategy(config.lease_assignment) is grab
    flags = ["--application-name", "a", "--stream-name", "s", "--processor",
             "examples/printing_processor.py:PrintingProcessor"]
    parsed, _ = parse_worker_args([*flags, "--lease-assignment", "grab"])
    assert parsed.lease_assignment == "grab"
    assert "choices: count, load, grab" in " ".join(worker_parser().format_help().split())


def test_an_unknown_strategy_is_one_line_naming_the_flag_and_exit_2(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    code = worker_main(["--application-name", "a", "--stream-name", "s", "--processor",
                        "examples/printing_processor.py:PrintingProcessor",
                        "--lease-assignment", "grab"])
    assert code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and "--lease-assignment" in lines[0], lines
    assert "'grab' is not one of count, load" in lines[0]


def test_a_worker_deciding_for_itself_steals_what_the_strategy_says(
        table: LeaseTable, clock: Clock, grab: Grab) -> None:
    """B holds two live leases and A none: the count rule would steal one (the target is
    one each), the registered strategy steals both - and A takes both in one cycle. C,
    counting, then steals one of them."""
    create(table, "s1", "s2", lease_owner="B")
    a, _ = coordinator(table, "A", clock, assignment=LeaseAssignment(grab))
    assert sorted(lease.lease_key for lease in a.run_taker_once()) == ["s1", "s2"]
    assert owners(table) == {"s1": "A", "s2": "A"}
    (view,) = grab.taker_views
    assert len(view.count_steals) == 1 and view.load is None and not view.busy
    counting, _ = coordinator(table, "C", clock)
    assert len(counting.run_taker_once()) == 1, "the count rule steals one"


def test_a_leader_moves_what_the_strategy_says(grab: Grab) -> None:
    """The leader assigns free leases by count whatever the strategy, then moves what the
    strategy says, seeing the counts as they are once the free leases are taken."""
    live = {w: WorkerLoad(w, 0.0, 0.0, 0.0, 0.0, {}, 1) for w in ("a", "b", "c")}
    leases = [Lease(f"a{i}", lease_owner="a", lease_counter=1) for i in range(3)]
    leases += [Lease("b0", lease_owner="b", lease_counter=1), Lease("free", lease_counter=1)]
    decided = plan(leases, live, is_expired=lambda lease: False, known_lease_keys=None,
                   no_move={"a2"}, strategy=grab, rng=random.Random(1))
    assert [(lease.lease_key, owner) for lease, owner in decided.assign] == [("free", "c")]
    assert [(lease.lease_key, owner) for lease, owner in decided.move] == [
        ("a0", "b"), ("a1", "b")], "a2 was moved lately"
    (view,) = grab.fleet_views
    assert dict(view.counts) == {"a": 3, "b": 1, "c": 1}
    assert sorted(lease.lease_key for lease in view.movable["a"]) == ["a0", "a1"]
    by_count = plan(leases, live, is_expired=lambda lease: False, known_lease_keys=None,
                    no_move={"a2"}, strategy=COUNT, rng=random.Random(1))
    assert len(by_count.move) == 1, "the count rule moves one lease: 3/1/1 -> 2/2/1"


def test_a_strategy_that_reads_load_reports_is_refused_without_them() -> None:
    with pytest.raises(ValueError, match="the load assignment reads load reports"):
        LeaseAssignment(LOAD)
    assert LeaseAssignment(COUNT).load is None
