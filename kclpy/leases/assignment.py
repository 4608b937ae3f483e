"""Lease assignment strategies: which leases move to whom, chosen by name from one registry.

A strategy is the rule both deciders share (the Java KCL 3.x's ``LeaseAssignmentDecider``):
the worker-decides taker (``taker.py``, every worker for itself) asks it which live leases to
steal this cycle, and a leader (``leading.py``) asks it which live leases to move to whom in
a pass. Free and expired leases are not its business: every strategy takes and assigns them
by count (``balancing.py``'s rules for a taker, ``leader.plan`` for a leader), since a shard
without history has no known load and nothing may wait for a report to be consumed.

``leaseAssignment`` / ``--lease-assignment`` names an entry; ``composition.py`` looks it up
here and hands the strategy to whichever decider ``leaseAssigner`` picks, so a strategy
written outside the package (:func:`register_assignment_strategy`) runs under either
without a change to them, and no other module compares a strategy's name
(``tests/system/test_project.py`` checks). Two are built in:

- ``count`` (:data:`COUNT`): equal lease counts, the Java KCL 2.x rule;
- ``load`` (:data:`LOAD`): equal measured load, the Java KCL 3.x idea (``load.py`` measures
  and publishes it; the rules are :func:`choose_steals` and :func:`project` below).

This module sits below the options (``config.py`` checks a name against the registry), so
it reads a worker's load reports through the objects it is handed, never by importing them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

from kclpy.errors import ConfigError
from kclpy.leases.lease import Lease

if TYPE_CHECKING:
    from kclpy.leases.load import LoadBalancing, LoadSettings, WorkerLoad


@dataclass(frozen=True)
class TakerView:
    """What the worker-decides taker knows when it chooses its steals, after it chose the
    free leases to take: a strategy reads what it needs and ignores the rest, so adding a
    value here changes no strategy."""

    #: the lease table as this cycle scanned it
    leases: Sequence[Lease]
    #: the keys this worker holds
    held: AbstractSet[str]
    #: whether a lease's owner renews it, judged on this worker's clock
    live: Callable[[Lease], bool]
    #: leases this worker lost in the last cycle: never stolen back at once
    no_steal: Collection[str]
    #: this worker is taking free leases or waiting for a handoff to it this cycle
    busy: bool
    #: the steals of the count rule, as ``balancing.py`` chose them (the Java KCL 2.x
    #: ``DynamoDBLeaseTaker``'s), for a strategy that falls back on counting
    count_steals: Sequence[Lease]
    #: this worker's load reports, for a strategy that ``uses_load`` (else None)
    load: LoadBalancing | None = None


@dataclass(frozen=True)
class FleetView:
    """What a leader knows when it chooses its moves, after it assigned the free leases."""

    #: the live workers' reports (their load, when they measure it)
    live: Mapping[str, WorkerLoad]
    #: live worker -> the live leases it owns as scanned (one being handed off counts for
    #: the worker it goes to)
    owned: Mapping[str, Sequence[Lease]]
    #: the free leases this pass assigns, each to its worker
    assigned: Sequence[tuple[Lease, str]]
    #: live worker -> how many leases it owns once ``assigned`` are taken
    counts: Mapping[str, int]
    #: live worker -> those of its leases that may move now (not being handed off, not
    #: moved lately)
    movable: Mapping[str, Sequence[Lease]]
    #: live worker -> its tie-break among workers that look alike (drawn per pass)
    order: Mapping[str, float]
    settings: LoadSettings
    #: lease key -> the last KB/s a report measured for it (None: what ``live`` reports)
    known_kbps: Mapping[str, float] | None = None


class AssignmentStrategy(Protocol):
    """A rule for spreading live leases over the workers, known by ``name``."""

    @property
    def name(self) -> str:
        """What ``leaseAssignment`` / ``--lease-assignment`` say."""

    @property
    def uses_load(self) -> bool:
        """Every worker measures its load and publishes it in ``<lease table>-kclpyWorkerLoad``
        (``load.py``), and a worker-decides taker is handed its reports (``TakerView.load``).
        A leader reads the reports whatever the strategy: they are how it tells who lives."""

    def steals(self, view: TakerView) -> list[Lease]:
        """The worker-decides taker: the live leases of other workers to ask for now."""

    def moves(self, view: FleetView) -> list[tuple[Lease, str]]:
        """A leader: the live leases to move, each to the worker that should hold it."""

    def balance_interval_s(self, settings: LoadSettings) -> float | None:
        """How often a leader moves leases, at most; None: at every pass. A lease it moved
        stays put for two such intervals (two passes with None)."""


@dataclass(frozen=True)
class CountAssignment:
    """Equal lease counts: a taker steals as the Java KCL 2.x does; a leader moves one lease
    at a time from the worker with the most to the one with the fewest until the counts
    are within one of each other (one decider sees one view, so nothing flaps)."""

    name: str = "count"
    uses_load: bool = False

    def steals(self, view: TakerView) -> list[Lease]:
        return list(view.count_steals)

    def moves(self, view: FleetView) -> list[tuple[Lease, str]]:
        return by_count(view.counts, view.movable, view.order)

    def balance_interval_s(self, settings: LoadSettings) -> float | None:
        return None


@dataclass(frozen=True)
class LoadAssignment:
    """Equal measured load (``load.py``'s reports, damped by ``dampeningPercentage``). A
    taker steals by load once per balancing round; a leader moves leases from the busiest
    workers to the idlest at most once per round, each lease at most once per two rounds.
    While the fleet reports no traffic at all (an idle stream, or before the first reports)
    there is no load to balance, and both count instead, so a fleet still spreads its leases
    before data flows."""

    name: str = "load"
    uses_load: bool = True

    def steals(self, view: TakerView) -> list[Lease]:
        load = view.load
        if load is None:
            raise ValueError(f"the {self.name} assignment reads load reports: "
                             "the taker was given none")
        traffic, reports = load.balancing_round(view.held, busy=view.busy)
        if not traffic:
            return list(view.count_steals)
        if reports is None:
            return []
        owned: dict[str, list[Lease]] = {}
        owners: dict[str, str] = {}
        stopped: set[str] = set()
        for lease in view.leases:
            owner = lease.lease_owner
            if owner is None or lease.is_finished or lease.parked is not None:
                continue
            if not view.live(lease):
                stopped.add(owner)
                continue
            owners[lease.lease_key] = owner
            if owner != load.worker_id and lease.checkpoint_owner is None:
                owned.setdefault(owner, []).append(lease)
        stopped.discard(load.worker_id)
        fleet = project({w: r for w, r in reports.items() if w not in stopped}, owners,
                        load.known_kbps)
        return choose_steals(fleet[load.worker_id], fleet, owned, load.settings, view.no_steal)

    def moves(self, view: FleetView) -> list[tuple[Lease, str]]:
        if sum(report.kbps for report in view.live.values()) <= 0:
            return by_count(view.counts, view.movable, view.order)
        owners = {lease.lease_key: worker for worker, keys in view.owned.items()
                  for lease in keys}
        owners.update((lease.lease_key, worker) for lease, worker in view.assigned)
        known_kbps = view.known_kbps
        if known_kbps is None:
            known_kbps = {key: kbps for report in view.live.values()
                          for key, kbps in report.lease_kbps.items()}
        return by_load(project(view.live, owners, known_kbps), view.movable, view.settings)

    def balance_interval_s(self, settings: LoadSettings) -> float | None:
        return settings.balance_interval_s


COUNT = CountAssignment()
LOAD = LoadAssignment()

#: the strategies by name, in registration order (what ``--help`` lists)
_STRATEGIES: dict[str, AssignmentStrategy] = {}


def register_assignment_strategy(strategy: AssignmentStrategy) -> None:
    """Make ``strategy`` a value of ``leaseAssignment`` (``--lease-assignment``,
    ``KCLPY_LEASE_ASSIGNMENT``), under either ``leaseAssigner``. Register it before the
    configuration is read, in every worker process of the application: every worker must
    spread leases by the same rule. A built-in strategy's name is refused; a strategy of the
    same name registered again (its module executed again) replaces the earlier one."""
    name = strategy.name
    if not name.isidentifier():
        raise ValueError(f"{name!r} is not an assignment strategy name")
    held = _STRATEGIES.get(name)
    if held is not None and held is not strategy and held in (COUNT, LOAD):
        raise ValueError(f"{name!r} already names the built-in assignment strategy")
    _STRATEGIES[name] = strategy


def assignment_strategy(name: str, option: str = "leaseAssignment") -> AssignmentStrategy:
    """The strategy ``name`` names; a ``ConfigError`` naming ``option`` and listing the
    known names otherwise."""
    strategy = _STRATEGIES.get(str(name))
    if strategy is None:
        raise ConfigError(
            option, f"{name!r} is not one of {', '.join(assignment_strategy_names())}")
    return strategy


def assignment_strategy_names() -> tuple[str, ...]:
    """The strategies' names, the built-in ones first."""
    return tuple(_STRATEGIES)


def by_count(counts: Mapping[str, int], movable: Mapping[str, Sequence[Lease]],
             order: Mapping[str, float]) -> list[tuple[Lease, str]]:
    """A leader's moves by count: from the worker with the most leases (that has one to
    move) to the one with the fewest, while they differ by more than one."""
    move: list[tuple[Lease, str]] = []
    counts = dict(counts)
    left = {worker: list(keys) for worker, keys in movable.items()}
    while True:
        ranked = sorted(counts, key=lambda w: (counts[w], order[w]))
        low = ranked[0]
        high = next((w for w in reversed(ranked)
                     if left[w] and counts[w] - counts[low] > 1), None)
        if high is None:
            return move
        lease = left[high].pop()
        move.append((lease, low))
        counts[high] -= 1
        counts[low] += 1


def by_load(live: Mapping[str, WorkerLoad], movable: Mapping[str, Sequence[Lease]],
            settings: LoadSettings) -> list[tuple[Lease, str]]:
    """A leader's moves by load: each worker below the average, idlest first, chooses its
    steals (:func:`choose_steals`) on the loads as updated by every move chosen before it,
    so two workers never choose the same excess."""
    loads = dict(live)
    owned = {worker: list(keys) for worker, keys in movable.items()}
    move: list[tuple[Lease, str]] = []
    chosen: set[str] = set()
    average = sum(r.load for r in loads.values()) / len(loads)
    for thief_id in sorted(loads, key=lambda w: (loads[w].load, w)):
        thief = loads[thief_id]
        if thief.load >= average:
            break
        others = {w: keys for w, keys in owned.items() if w != thief_id}
        for lease in choose_steals(thief, loads, others, settings, chosen):
            victim_id = lease.lease_owner
            assert victim_id is not None
            victim, thief = loads[victim_id], loads[thief_id]
            kbps = victim.lease_kbps.get(lease.lease_key, 0.0)
            there = victim.lease_load(lease.lease_key)
            here = thief.load_of_kbps(kbps)
            victim_leases = dict(victim.lease_kbps)
            victim_leases.pop(lease.lease_key, None)
            loads[victim_id] = replace(victim, load=victim.load - there,
                                       kbps=victim.kbps - kbps, lease_kbps=victim_leases)
            loads[thief_id] = replace(thief, load=thief.load + (there if here is None else here),
                                      kbps=thief.kbps + kbps,
                                      lease_kbps={**thief.lease_kbps, lease.lease_key: kbps})
            owned[victim_id] = [k for k in owned[victim_id] if k.lease_key != lease.lease_key]
            chosen.add(lease.lease_key)
            move.append((lease, thief_id))
    return move


def project(
    reports: Mapping[str, WorkerLoad],
    owners: Mapping[str, str],
    known_kbps: Mapping[str, float],
) -> dict[str, WorkerLoad]:
    """Each report as of the lease table: the leases ``owners`` (lease key -> worker, a
    lease being handed off counted for the worker it goes to) gives each reporter now,
    those in its report at the KB/s it reported, those it gained since (or holds but has
    not measured for a whole interval yet) at ``known_kbps`` - what their previous owner
    reported - and those it lost since not at all; the load at the reporter's own cost per
    KB/s. A report predates the moves made since: judged as it is, a worker that just took
    a lease looks idle enough to take again, and its victim busy enough to lose another,
    so the same lease can go back and forth. A lease nobody measured yet weighs the
    average of the known ones."""
    average_kbps = sum(known_kbps.values()) / len(known_kbps) if known_kbps else 0.0
    measured = [r for r in reports.values() if r.kbps > 0]
    fleet_cost = (sum(r.load for r in measured) / sum(r.kbps for r in measured)
                  if measured else None)
    keys: dict[str, list[str]] = {worker: [] for worker in reports}
    for key, owner in owners.items():
        if owner in keys:
            keys[owner].append(key)
    projected: dict[str, WorkerLoad] = {}
    for worker, report in reports.items():
        lease_kbps = {key: report.lease_kbps[key] if key in report.lease_kbps
                      else known_kbps.get(key, average_kbps) for key in keys[worker]}
        kbps = sum(lease_kbps.values())
        cost = report.load / report.kbps if report.kbps > 0 else fleet_cost
        load = report.load if cost is None else cost * kbps
        projected[worker] = replace(report, load=load, kbps=kbps, lease_kbps=lease_kbps)
    return projected


def choose_steals(
    mine: WorkerLoad,
    fleet: Mapping[str, WorkerLoad],
    owned: Mapping[str, list[Lease]],
    settings: LoadSettings,
    no_steal: Collection[str] = (),
) -> list[Lease]:
    """The leases ``mine`` should ask for, given every fresh report (``fleet``, this
    worker's included) and the leases each other worker holds. Pure, so every rule is
    tested without a table.

    A *victim* is a worker above the average by more than the threshold, or above this
    worker by more than twice the threshold (of the average): the second rule is what still
    balances the rest of the fleet when one worker is far above the average with a lease
    that cannot move (a single hot shard), which lifts the average above everyone else.
    From each victim, most loaded first, this worker takes leases worth at most the damped
    half of the gap between them divided by the number of workers that see the same victim
    (so that they do not all take the same excess at once), and stops once it took the
    damped part of its own deficit under the average; a lease is taken only if
    this worker stays below what the victim keeps and within the threshold above the
    average, so no lease can come back in the next round. When none fits,
    ``allow_overshoot`` allows one move that lowers the pair's sum of squared loads
    (:meth:`_Thief.overshoot`).
    """
    if len(fleet) < 2:
        return []
    average = sum(r.load for r in fleet.values()) / len(fleet)
    if average <= 0 or mine.load >= average:
        return []
    gap = 2 * settings.threshold * average
    ceiling = average * (1 + settings.threshold)

    def is_victim(victim: WorkerLoad, thief: WorkerLoad) -> bool:
        return victim.load > ceiling or victim.load - thief.load > gap

    thief = _Thief(mine, room=ceiling - mine.load,
                   kbps_room=math.inf if settings.max_kbps is None
                   else settings.max_kbps - mine.kbps)
    victims = sorted((r for w, r in fleet.items() if w in owned and is_victim(r, mine)),
                     key=lambda r: (-r.load, r.worker_id))
    for victim in victims:
        thieves = sum(1 for r in fleet.values() if r.load < average and is_victim(victim, r))
        quota = settings.dampening * (victim.load - thief.load) / 2 / max(1, thieves)
        left = victim.load
        candidates = sorted(
            (lease for lease in owned[victim.worker_id] if lease.lease_key not in no_steal),
            key=lambda lease: (-victim.lease_load(lease.lease_key), lease.lease_key))
        before = len(thief.chosen)
        for lease in candidates:
            taken = thief.take(victim, lease, left, quota)
            if taken is not None:
                quota -= taken[1]
                left -= taken[0]
        if len(thief.chosen) == before and settings.allow_overshoot:
            thief.overshoot(victim, candidates, left)
        if (thief.room <= 0 or thief.load >= average
                or thief.load - mine.load >= settings.dampening * (average - mine.load)):
            break
    return thief.chosen


class _Thief:
    """What one balancing round has chosen so far, and the room left."""

    def __init__(self, mine: WorkerLoad, *, room: float, kbps_room: float) -> None:
        self.mine = mine
        self.load = mine.load
        self.room = room
        self.kbps_room = kbps_room
        self.chosen: list[Lease] = []

    def take(self, victim: WorkerLoad, lease: Lease, left: float,
             budget: float) -> tuple[float, float] | None:
        """Choose ``lease`` if it fits ``budget`` and the rules; (its load on the victim,
        its load here) when chosen. ``left`` is what the victim keeps so far."""
        kbps = victim.lease_kbps.get(lease.lease_key, 0.0)
        there = victim.lease_load(lease.lease_key)
        here = self.mine.load_of_kbps(kbps)
        cost = there if here is None else here
        if not (0 < cost <= min(budget, self.room) and kbps <= self.kbps_room
                and self.load + cost <= left - there):
            return None
        self._choose(lease, cost, kbps)
        return there, cost

    def overshoot(self, victim: WorkerLoad, candidates: list[Lease], left: float) -> None:
        """No lease fits the share: take the one whose move lowers the two workers' sum of
        squared loads the most, if any does. That sum falls with every such move and would
        rise with the move back, so no lease can flap; and unlike "stay below the victim"
        it lets a fast worker take a hot lease off a slow one although it is then the
        busier of the two (others take load from it next)."""
        best: tuple[float, Lease, float, float] | None = None
        for lease in candidates:
            kbps = victim.lease_kbps.get(lease.lease_key, 0.0)
            there = victim.lease_load(lease.lease_key)
            here = self.mine.load_of_kbps(kbps)
            cost = there if here is None else here
            if cost <= 0 or kbps > self.kbps_room:
                continue
            change = ((self.load + cost) ** 2 + (left - there) ** 2
                      - self.load ** 2 - left ** 2)
            if change < 0 and (best is None or change < best[0]):
                best = (change, lease, cost, kbps)
        if best is not None:
            self._choose(best[1], best[2], best[3])

    def _choose(self, lease: Lease, cost: float, kbps: float) -> None:
        self.chosen.append(lease)
        self.load += cost
        self.room -= cost
        self.kbps_room -= kbps


register_assignment_strategy(COUNT)
register_assignment_strategy(LOAD)
