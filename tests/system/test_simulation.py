"""The fleet simulator (tests/simulation): 1,000 seeded histories, replay, and the holes it
found on the code before the first review's fixes (2026-11-26).

Histories run in two child processes (CI has two cores) with ``PYTHONHASHSEED=0``, so a seed
names one history exactly; every failure prints the command that replays it.

Holes 1-4 and 6 of the first review broke histories before they were fixed; ``FOUND`` keeps
the seeds that found them, each of which must now replay clean (they keep the classic world,
``history.CLASSIC_SEEDS``). Every other seed runs the grown world of the edge review
(2026-12-06), which found holes on fd986fc that are being fixed elsewhere: ``FOUND_36``
names a seed for each, which must replay exactly and is expected to break until its fix is
merged (then it moves to ``FOUND``), and ``OPEN`` (``tests/simulation/open_seeds.py``) lists
every default seed that breaks on fd986fc with the invariants it breaks, so the soak stays
green while the holes are open and fails as soon as a seed breaks anything else.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.multilang_apps.amazon_kclpy_dist import locked
from tests.simulation.__main__ import REPLAY, run_seeds
from tests.simulation.history import CLASSIC_SEEDS, plan_for
from tests.simulation.microbatch import MICROBATCH
from tests.simulation.open_seeds import OPEN_36

HISTORIES = 1000
CHUNKS = 4
JOBS = 2

#: seed, invariant, hole: what the simulator found on the code before the fixes
#: (tests/simulation/FOUND.md tells each story)
FOUND = [
    (6, "liveness", "hole 1"),
    (10, "exactly-once", "hole 2"),
    (1, "exactly-once", "hole 2"),
    (40, "exactly-once", "hole 3"),
    (471, "exactly-once", "hole 3"),
    (5, "liveness", "hole 4"),
    (625, "one-committer", "hole 4"),
    (159, "no-collateral-loss", "hole 6"),
    (947, "exactly-once", "re-created stream rule"),
    (338, "consumed-while-held", "shutdown stall"),
    (553, "consumed-while-held", "slow shard sync"),
    (844, "liveness", "gap after the store's position"),
    (139, "liveness", "incarnations ordered by clocks"),
    (186, "liveness", "gap lost by a reset"),
]

#: seed, invariant, hole: what the grown world (the edge review of 2026-12-06) found on
#: fd986fc (tests/simulation/FOUND.md, "Found on fd986fc by the grown world")
FOUND_36: list[tuple[int, str, str]] = [
    (19, "exactly-once", "hole 1"),
    (189, "liveness", "hole 2"),
    (7, "liveness", "hole 4"),
    (223, "operator-replay", "hole 6"),
    (794, "operator-partial", "hole 6"),
    (546, "exactly-once", "hole 7"),
    (72, "own-write-lost", "hole 9"),
    (21, "operator-partial", "new: the CLI's lost answer"),
    (169, "exactly-once", "new: live start behind a queued gap"),
    (559, "exactly-once", "conflict starvation near retention"),
    (173, "exactly-once", "world: SQLite's lock"),
    (706, "operator-partial", "the CLI's lost answer, resume"),
    (971, "operator-replay", "a replay moved a lagging shard forward"),
    (341, "exactly-once", "new: conflict starvation"),
    (458, "operator-partial", "new: a retry after another's write"),
    (464, "exactly-once", "new: live start before a queued gap's end"),
    (292, "exactly-once", "new: live from the checkpoint beside a queued gap"),
    # the micro-batch histories (FOUND.md, "The micro-batch path with zombie writers")
    (30, "committed-once", "hole 5"),
    (65, "committed-once", "hole 5"),
    (25, "liveness", "gap after shard end"),
    (1345, "liveness", "new: a finished parent taken for its gaps"),
    # the leader histories (FOUND.md, "Found by the leader histories")
    (260, "liveness", "shard sync on a scan from before a reset"),
    # after the leader's failover fixes (FOUND.md, "Open after the leader's failover fixes")
    (665, "no-collateral-loss", "the commit fence held leases while it waited"),
    (403, "liveness", "a new leader's listing from before a merge"),
    # after the leader's faster scans (FOUND.md, "Open after the leader's faster scans")
    (246, "liveness", "a handoff asked of a lease the leader gave up"),
    (604, "liveness", "a leader that never adopted a lease handed to it"),
    (711, "liveness", "a leader that never adopted a lease handed to it"),
    (836, "parked-consumed", "a lease lost under a SQL commit's lease write"),
    (918, "own-write-lost", "the invariant counted a write that fences nothing"),
]

#: the seeds of FOUND_36 whose holes are fixed (FOUND.md, "After the fixes were merged", "The
#: fifteen analysed", "The micro-batch path with zombie writers", "Found by the leader
#: histories", "Open after the leader's failover fixes" and "Open after the leader's faster
#: scans"): each must replay clean;
#: any other stays a strict xfail until its fix is merged
FIXED_36 = frozenset({19, 189, 7, 223, 794, 546, 72, 21, 169, 559, 173, 706, 971, 341, 458,
                      464, 292, 30, 65, 25, 1345, 260, 665, 403, 246, 604, 711, 836, 918})

#: seeds of FOUND_36 whose plan has moved on since they were found (the world grew): 260 was
#: a leader history on the SQL store and now plans the micro-batch path; its mechanism is
#: pinned by tests/system/test_sim_holes.py (FOUND.md, "Found by the leader histories")
MOVED_WORLD = frozenset({260})

#: found and not fixed: seed -> the invariants it breaks (tests/simulation/FOUND.md says what
#: and why). A chunk fails if such a seed breaks anything else, or stops breaking these.
OPEN: dict[int, frozenset[str]] = {**OPEN_36}


def _report(outcomes: list[dict[str, Any]]) -> str:
    return "\n".join(
        f"seed {o['seed']}: {o['violations'][0][1]}\n  replay: "
        f"{REPLAY.format(seed=o['seed'])}" for o in outcomes)


@pytest.mark.slow
# A hang guard, not a bound on speed: 250 histories, leader and micro-batch ones (whose
# children import pyspark) included, took over the suite's 300 s each with two suites
# sharing a 2-core machine.
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_histories(chunk: int) -> None:
    """A quarter of the 1,000 default seeds: no history may break an invariant."""
    size = HISTORIES // CHUNKS
    outcomes = run_seeds(range(chunk * size, (chunk + 1) * size), JOBS)
    assert len(outcomes) == size
    broken = [o for o in outcomes if o["violations"]]
    unexpected = [o for o in broken
                  if {v[0] for v in o["violations"]} - OPEN.get(int(o["seed"]), frozenset())]
    assert not unexpected, (f"{len(unexpected)} of {size} histories broke an invariant:\n"
                            + _report(unexpected[:10]))
    healed = {int(o["seed"]) for o in outcomes if not o["violations"]} & set(OPEN)
    assert not healed, f"seeds {sorted(healed)} no longer break: take them out of OPEN"


Runs = tuple[dict[int, dict[str, Any]], dict[int, dict[str, Any]]]


@pytest.fixture(scope="session")
def found_runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    """Every found seed's outcome, twice: in two fresh processes, one running the seeds in
    the opposite order of the other, so a history that depended on what ran before it in its
    process shows as two digests. Two children instead of one per seed and run: each child
    pays about a CPU second of imports, and the found seeds' tests paid it about a hundred
    times. Once per test run: the first pytest-xdist worker to need them leaves them in the
    run's shared temporary folder for the other, which ran the same two children again (a
    minute of a CI core)."""
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # the folder every worker's own basetemp is made in
    path = shared / "found_runs.json"
    with locked(shared / "found_runs.lock"):
        if not path.exists():
            seeds = sorted({seed for seed, _, _ in [*FOUND, *FOUND_36]})
            # the two children side by side: the other worker waits meanwhile, so one child
            # after the other would leave a core idle
            with ThreadPoolExecutor(2) as pool:
                runs = list(pool.map(lambda order: run_seeds(order, 1), (seeds, seeds[::-1])))
            path.write_text(json.dumps(runs))
        first, second = json.loads(path.read_text())
    return ({int(o["seed"]): o for o in first}, {int(o["seed"]): o for o in second})


@pytest.mark.parametrize(("seed", "invariant", "hole"), FOUND,
                         ids=[f"{hole}-seed-{seed}" for seed, _, hole in FOUND])
def test_found_seed_replays_exactly(seed: int, invariant: str, hole: str,
                                   found_runs: Runs) -> None:
    """The same seed in two fresh processes is the same history, to the digest of what every
    processor saw and committed, and to the number of scheduling decisions."""
    first, second = found_runs[0][seed], found_runs[1][seed]
    assert first["digest"] == second["digest"]
    assert first["switches"] == second["switches"]
    assert first["violations"] == second["violations"]


@pytest.mark.parametrize(("seed", "invariant", "hole"), FOUND,
                         ids=[f"{hole}-seed-{seed}" for seed, _, hole in FOUND])
def test_found_seed_is_clean(seed: int, invariant: str, hole: str, found_runs: Runs) -> None:
    """Each seed that found a hole must pass once the hole is fixed."""
    outcome = found_runs[0][seed]
    assert invariant not in {v[0] for v in outcome["violations"]}, _report([outcome])
    assert not outcome["violations"], _report([outcome])


@pytest.mark.parametrize(("seed", "invariant", "hole"), FOUND_36,
                         ids=[f"{hole}-seed-{seed}" for seed, _, hole in FOUND_36])
def test_found_36_seed_replays_exactly(seed: int, invariant: str, hole: str,
                                      found_runs: Runs) -> None:
    """A seed the grown world found a hole with is one history, in two fresh processes."""
    first, second = found_runs[0][seed], found_runs[1][seed]
    assert first["digest"] == second["digest"]
    assert first["violations"] == second["violations"]
    if seed not in FIXED_36:
        assert invariant in {v[0] for v in first["violations"]}, "no longer breaks: FIXED_36"


_OPEN_36_MARK = pytest.mark.xfail(strict=True, reason="still open: move the seed to FIXED_36 "
                                  "(and out of OPEN) when its fix is merged")


@pytest.mark.parametrize(("seed", "invariant", "hole"), [
    pytest.param(seed, invariant, hole, id=f"{hole}-seed-{seed}",
                 marks=() if seed in FIXED_36 else _OPEN_36_MARK)
    for seed, invariant, hole in FOUND_36])
def test_found_36_seed_is_clean(seed: int, invariant: str, hole: str,
                                found_runs: Runs) -> None:
    """Each hole the grown world found must be fixed: a fixed one's seed replays clean, an
    open one's is a strict xfail until it is."""
    outcome = found_runs[0][seed]
    assert invariant not in {v[0] for v in outcome["violations"]}, _report([outcome])
    if seed in FIXED_36:
        assert not outcome["violations"], _report([outcome])


def test_classic_seeds_keep_their_world() -> None:
    """FOUND's seeds replay the world they were found in (FOUND.md's stories); the grown
    world's seeds do not."""
    assert {seed for seed, _, _ in FOUND} <= CLASSIC_SEEDS
    assert not {seed for seed, _, _ in FOUND_36} & CLASSIC_SEEDS


def test_the_micro_batch_seeds_and_only_they_run_the_micro_batch_path() -> None:
    """The seeds that found the micro-batch path's holes run it; the seeds found before it
    was hosted keep the world they were found in."""
    microbatch = {30, 65, 25, 1345, 665}
    assert {seed for seed, _, _ in FOUND_36} >= microbatch
    for seed, _, _ in [*FOUND, *FOUND_36]:
        if seed in MOVED_WORLD:
            continue
        assert (plan_for(seed).mode == MICROBATCH) == (seed in microbatch), seed


def test_found_seeds_are_documented() -> None:
    found = (Path(__file__).parents[1] / "simulation" / "FOUND.md").read_text()
    for seed, invariant, hole in [*FOUND, *FOUND_36]:
        assert f"| {seed} | `{invariant}` | {hole} " in found, (seed, hole)
        assert REPLAY.format(seed=seed) in found


def test_digests_file_names_each_history(tmp_path: Path) -> None:
    """``--digests`` writes what two versions of the code are compared on (a change meant
    only to make the simulator cheaper must leave every line as it was): one line per seed,
    with the digest and the number of scheduling decisions the soak itself reports."""
    path = tmp_path / "digests.txt"
    subprocess.run([sys.executable, "-m", "tests.simulation", "--histories", "2", "--seed",
                    "3", "--jobs", "1", "--digests", str(path)], check=True,
                   stdout=subprocess.DEVNULL, cwd=Path(__file__).parents[2])
    expected = run_seeds([3, 4], 1)
    assert path.read_text().splitlines() == [
        f"{o['seed']} {o['digest']} {o['switches']} "
        f"{','.join(sorted({v[0] for v in o['violations']})) or '-'}" for o in expected]
