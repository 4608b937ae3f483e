"""Fleets of 100 to 10,000 shards and 10 to 200 workers, in virtual time.

Each size runs ``tests/simulation/scale.py`` - the real lease coordinators (balancer, scan
budget, renewer, taker, fence) of every worker against the metered in-memory DynamoDB - in a
child process of its own, and prints one JSON line per size: seconds from a cold start to
every lease held and balanced, to balanced again after 20 % of the workers die and after
20 % join, leases moved in each phase, DynamoDB requests and capacity per shard-hour and per
worker-hour in the steady state beside a Java KCL 2.x fleet's (every worker renewing every
failover / 3 and scanning every 2 x failover), and the largest scan.

The wall time grows as workers x shards (every worker parses every lease at every scan): on
one core, 300 shards x 20 workers take about 30 s, 1,000 x 50 about five minutes; 10,000 x
200 is a soak of hours, run on purpose:

    python bench/scale_sim.py                          # every size but 10,000 x 200
    python bench/scale_sim.py --sizes 10000x200        # the soak
    python bench/scale_sim.py --sizes 100x10,1000x50 --jobs 2

With ``--lease-assigner leader`` one elected worker scans and assigns and the others Query
the owner index (``kclpy/leases/leader.py``): only one worker parses the table, so even
10,000 x 200 is minutes of one core rather than hours.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_SIZES = ("100x10,100x50,100x200,1000x10,1000x50,1000x200,10000x10,10000x50")


def _child(size: str, failover_s: float, seed: int, steal: int, assigner: str,
           kill_leader: bool) -> None:
    sys.path.insert(0, str(ROOT))
    from tests.simulation.scale import Fleet, ScaleSpec, run_scale, summary

    shards, workers = (int(part) for part in size.split("x"))
    spec = ScaleSpec(shards, workers, failover_s=failover_s, seed=seed,
                     kill_leader=True if kill_leader else None)
    result = run_scale(spec, fleet=Fleet(spec, max_leases_to_steal_at_one_time=steal,
                                         leader=assigner == "leader"))
    print(json.dumps({**summary(result), "max_leases_to_steal": steal, "assigner": assigner}),
          flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default=DEFAULT_SIZES,
                        help="comma-separated SHARDSxWORKERS (default: %(default)s)")
    parser.add_argument("--failover-s", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--max-leases-to-steal", type=int, default=1,
                        help="--max-leases-to-steal-at-one-time of every worker")
    parser.add_argument("--lease-assigner", choices=("worker", "leader"), default="worker",
                        help="worker: every worker scans (Java 2.x); leader: one elected "
                             "leader scans and assigns, the others query the owner index")
    parser.add_argument("--kill-leader", action="store_true",
                        help="with --lease-assigner leader: the leader is always among the "
                             "workers killed (by default the draw decides)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(args.child, args.failover_s, args.seed, args.max_leases_to_steal,
               args.lease_assigner, args.kill_leader)
        return 0
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    failed = 0
    for start in range(0, len(sizes), args.jobs):
        children = [subprocess.Popen(
            [sys.executable, __file__, "--child", size, "--failover-s", str(args.failover_s),
             "--seed", str(args.seed), "--max-leases-to-steal", str(args.max_leases_to_steal),
             "--lease-assigner", args.lease_assigner,
             *(["--kill-leader"] if args.kill_leader else [])],
            stdout=subprocess.PIPE, env=env)
            for size in sizes[start:start + args.jobs]]
        for child in children:
            out, _ = child.communicate()
            failed += child.returncode != 0
            sys.stdout.write(out.decode())
            sys.stdout.flush()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
