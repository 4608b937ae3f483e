"""Run simulated histories: a soak, or the replay of one seed.

    python -m tests.simulation --histories 20000 --seed 5000      # seeds 5000..24999
    python -m tests.simulation --replay 6 --trace 200              # one seed, last 200 lines
    python -m tests.simulation --histories 100 --digests before.txt # each history's digest

Each history is a pure function of its seed once ``PYTHONHASHSEED`` is fixed, so the runner
re-executes itself with ``PYTHONHASHSEED=0`` when it is not. Histories run in ``--jobs``
child processes (the stand-ins are installed in those, never in the caller). The exit code
is 1 when a history broke an invariant; each failure prints its seed, the invariant, and the
command that replays it. ``--digests`` writes one line per history (seed, digest, scheduling
decisions, invariants broken): two runs of the same seeds on two versions of the code ran the
same histories if the files are equal, which is how a change meant only to make the
simulator cheaper is checked (docs/benchmarks.md, "The fleet simulator's cost").
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

REPLAY = "python -m tests.simulation --replay {seed}"


def _outcome(seed: int, trace: bool = False) -> dict[str, Any]:
    from tests.simulation.history import run_history

    started = time.perf_counter()
    outcome = run_history(seed, trace=trace)
    return {"seed": seed, "plan": outcome.plan.describe(), "digest": outcome.digest,
            "violations": [[v.invariant, str(v)] for v in outcome.violations],
            "seconds": time.perf_counter() - started, "switches": outcome.switches,
            "trace": outcome.trace}


def run_seeds(seeds: Sequence[int], jobs: int) -> list[dict[str, Any]]:
    """Run ``seeds`` in ``jobs`` child processes; their outcomes, in seed order."""
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    chunks = [list(seeds[i::jobs]) for i in range(jobs) if seeds[i::jobs]]
    children = [
        subprocess.Popen([sys.executable, "-m", "tests.simulation", "--child",
                          ",".join(map(str, chunk))], stdout=subprocess.PIPE, env=env)
        for chunk in chunks]
    outcomes: list[dict[str, Any]] = []
    for child in children:
        out, _ = child.communicate()
        if child.returncode != 0:
            raise RuntimeError(f"simulation child failed with exit code {child.returncode}")
        outcomes.extend(json.loads(line) for line in out.decode().splitlines() if line)
    return sorted(outcomes, key=lambda o: int(o["seed"]))


def _reexec_with_fixed_hash_seed() -> None:
    if os.environ.get("PYTHONHASHSEED") != "0":
        env = {**os.environ, "PYTHONHASHSEED": "0"}
        os.execve(sys.executable, [sys.executable, "-m", "tests.simulation", *sys.argv[1:]], env)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.simulation")
    parser.add_argument("--histories", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0, help="the first seed")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--replay", type=int, help="run this one seed here and show it")
    parser.add_argument("--trace", type=int, default=0,
                        help="with --replay: print the last N lines of the history's trace")
    parser.add_argument("--digests", metavar="PATH",
                        help="write each history's seed, digest, decisions and invariants here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    _reexec_with_fixed_hash_seed()
    if args.child is not None:
        import tests.simulation.history  # noqa: F401 (everything a history runs)

        # What is loaded now lives as long as the process: the collector's full passes
        # need not walk it again and again (a few per cent of a child's CPU).
        gc.freeze()
        for seed in map(int, args.child.split(",")):
            print(json.dumps(_outcome(seed)), flush=True)
        return 0
    if args.replay is not None:
        outcome = _outcome(args.replay, trace=args.trace > 0)
        print(outcome["plan"])
        if args.trace:
            print("\n".join((outcome["trace"] or [])[-args.trace:]))
        for _, text in outcome["violations"]:
            print(f"  {text}")
        print(f"digest {outcome['digest']} ({outcome['switches']} switches, "
              f"{outcome['seconds']:.2f}s)")
        return 1 if outcome["violations"] else 0
    started = time.perf_counter()
    outcomes = run_seeds(range(args.seed, args.seed + args.histories), args.jobs)
    failed = [o for o in outcomes if o["violations"]]
    if args.digests:
        with open(args.digests, "w") as out:
            for o in outcomes:
                broken = ",".join(sorted({v[0] for v in o["violations"]})) or "-"
                out.write(f"{o['seed']} {o['digest']} {o['switches']} {broken}\n")
    for outcome in failed:
        invariants = sorted({v[0] for v in outcome["violations"]})
        print(f"seed {outcome['seed']} broke {', '.join(invariants)} (digest "
              f"{outcome['digest']}): {outcome['violations'][0][1]}\n"
              f"  replay: {REPLAY.format(seed=outcome['seed'])}")
    print(f"{len(outcomes)} histories, {len(failed)} failed, "
          f"{time.perf_counter() - started:.1f}s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
