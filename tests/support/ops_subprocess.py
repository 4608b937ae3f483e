"""An ops endpoint over a stand-in worker in a process of its own, for tests that attack it:
the attackers' memory and threads are not the server's, and the server's address space can
be capped (``RLIMIT_AS``), so a leak makes it fail rather than the machine.

``python -m tests.support.ops_subprocess LIMIT_BYTES TIMEOUT_S`` prints its port, serves
until its stdin closes, then prints its peak resident memory (``VmHWM``, kB) and exits.
"""

from __future__ import annotations

import resource
import sys
from pathlib import Path
from typing import Any


class _Worker:
    """What serve_worker reads from a Worker: a healthy one holding one shard."""

    def __init__(self) -> None:
        from kclpy.metrics import Metrics

        self.metrics = Metrics()
        self.healthy = True
        self.kinesis = None

    def status(self) -> dict[str, Any]:
        return {"worker_id": "w-1", "held_leases": ["shard-1"],
                "shards": {"shard-1": {"state": "PROCESSING", "checkpoint": "42",
                                       "checkpoint_sub_sequence_number": 0}}}


def main(argv: list[str]) -> None:
    limit, timeout_s = int(argv[0]), float(argv[1])
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    from kclpy.ops import serve_worker

    server = serve_worker(_Worker(), lag_window_s=None, timeout_s=timeout_s)  # type: ignore[arg-type]
    print(server.port, flush=True)
    sys.stdin.read()
    server.stop()
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            print(line.split()[1], flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
