"""Lease assignment by load against count, in virtual time: Zipf shard traffic (the top 5 %
of the shards carry half the bytes, 100 KB/s per shard on average) on workers of three
speeds (500, 1,000 and 1,500 KB per CPU second, drawn at random), the real lease
coordinators of ``tests/simulation/scale.py`` against the in-memory DynamoDB.

For each size and each assignment it prints one JSON line: seconds from a cold start until
the busiest worker's load is within 1.15 x the fleet's average (count: until the lease
counts are balanced), then, over the watch that follows, the largest and the median
busiest / average ratio, and the lease moves per hour in the second half of the watch.
Load balancing runs with reports every 10 s and a round every 20 s
(``workerMetricsReporterFreqInMillis = 10000``, ``varianceBalancingFrequency = 1`` with a
10 s failover time) so that a run settles in simulated minutes.

    python bench/load_sim.py                       # 200 x 5, 400 x 8, 1000 x 10
    python bench/load_sim.py --sizes 100x4 --watch-s 600
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kclpy.leases.load import LoadSettings
from tests.simulation.scale import ScaleSpec, run_load, skewed


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="200x5,400x8,1000x10")
    parser.add_argument("--watch-s", type=float, default=1800.0)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    for size in args.sizes.split(","):
        shards, workers = (int(part) for part in size.split("x"))
        for mode in ("load", "count"):
            settings = (LoadSettings(report_interval_s=10.0, balance_interval_s=20.0)
                        if mode == "load" else None)
            run = run_load(ScaleSpec(shards, workers, seed=args.seed + 1),
                           skewed(shards, workers, args.seed), settings,
                           watch_s=args.watch_s, calm_s=args.watch_s / 2,
                           settle_limit_s=1800.0)
            print(json.dumps({
                "shards": shards, "workers": workers, "assignment": mode,
                "settled_s": run.settled_after_s,
                "max_ratio": round(max(run.ratios), 3) if run.ratios else None,
                "median_ratio": round(statistics.median(run.ratios), 3) if run.ratios else None,
                "moves_per_hour": round(run.moves_per_hour, 1),
                "violations": len(run.violations)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
