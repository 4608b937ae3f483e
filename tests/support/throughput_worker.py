"""``python -m tests.support.throughput_worker ARGS``: ``kclpy-worker`` whose measured load is
its throughput (KB/s), never its CPU.

``--lease-assignment load`` balances a worker's CPU when its process spent any, else its
KB/s (``kclpy.leases.load``). On a 2-core machine shared by other test runs, a worker's CPU
is mostly interpreter start-up, polling and the neighbours' cache misses, so a test that
must compare a real fleet with the simulator (where load is the shard traffic over the
worker's speed) would compare noise. This entry point builds the worker's load balancing
exactly as ``kclpy.leases.load.load_balancing`` does - same settings, table, counters and
rules - with a meter that reads no CPU, so the load balanced is the KB/s the worker's
processors handled: what the simulator's traffic is, on workers of equal speed.
"""

from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING

from kclpy import composition
from kclpy.cli import main
from kclpy.leases.load import LoadBalancing, LoadMeter, load_balancing, processed_by_lease
from kclpy.metrics import Metrics

if TYPE_CHECKING:
    from mypy_boto3_dynamodb import DynamoDBClient

    from kclpy.config import KCLConfig


def no_cpu() -> float:
    """A process clock that never moves: the meter falls back to KB/s."""
    return 0.0


def throughput_balancing(config: KCLConfig, client: DynamoDBClient,
                         metrics: Metrics) -> LoadBalancing | None:
    """``load_balancing`` with a meter blind to CPU."""
    balancing = load_balancing(config, client, metrics)
    if balancing is None:
        return None
    meter = LoadMeter(config.worker_id, functools.partial(processed_by_lease, metrics),
                      clock=time.monotonic, cpu_seconds=no_cpu,
                      ema_alpha=balancing.settings.ema_alpha)
    return LoadBalancing(meter, balancing.table, balancing.settings, clock=time.monotonic)


#: the name ``kclpy.composition.build_parts`` builds a worker's load balancing through; when
#: it moved (into the composition, from the worker) a patch of the old home went on silently
#: measuring CPU, and the real fleet stopped settling where the simulator does
SEAM = "load_balancing"


if __name__ == "__main__":
    if not hasattr(composition, SEAM):
        raise SystemExit(f"kclpy.composition has no {SEAM}: the worker's load balancing is "
                         "built elsewhere now; patch it there")
    setattr(composition, SEAM, throughput_balancing)
    main()
