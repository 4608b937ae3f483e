"""The scale simulator's figures for a fleet of real ``kclpy-worker`` processes, beside what
the simulator predicts for the same size and settings.

``bench/scale_sim.py`` measures fleets of up to 10,000 shards in virtual time: the real
lease code, but no processes, no HTTP and no scheduler of a loaded machine. This bench
checks it against reality at one point, the largest this machine holds (default 10 processes
on 100 shards; docs/benchmarks.md has the runs, and why the one that held was 5 x 50 with a
30 s failover time while other sessions loaded the machine): real worker processes (``python
-m kclpy``, default options but the failover time and ``--idle-time-between-reads-ms``, see
``Settings``) read a stream of ``--shards`` shards on the replay endpoint of
``bench/replay.py`` (one record each, so nothing is ever checkpointed - the simulator has no
consumers) and keep their leases in kclpy.local's moto (conditional writes atomic), served
from this process behind a meter that counts every DynamoDB request per worker (each process
names itself in its User-Agent, ``AWS_SDK_UA_APP_ID``), per operation and per table, and the
largest Scan answer.

The phases are the simulator's (``tests/simulation/scale.py``, ``run_scale``):

1. *cold start*: every process is started and held at its first DynamoDB request until all
   are there (the meter's gate), so Python's start-up on a loaded machine is not counted;
   from then until every lease is held by a live worker, none is being handed off, and the
   lease counts differ by at most one (read from the table every second, as the simulator
   probes);
2. *steady*: two failover times later, the requests over ``--steady-s`` (the simulator's
   120 s) per shard-hour and per worker-hour;
3. *20 % die*: SIGKILL, until balanced among the others again;
4. *20 % join*: new processes, gated as at the cold start, until balanced among all.

Leases moved counts owner changes between two workers (steals and handoffs) as the table
samples show them; a lease that changed hands twice between two samples counts once.

    python bench/fleet_scale.py                          # 10 processes x 100 shards
    python bench/fleet_scale.py --workers 5 --shards 50 --failover-ms 30000
    python bench/fleet_scale.py --workers 5 --shards 50 --failover-ms 30000 \
        --lease-assigner leader                          # one leader assigns (leader.py)
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import boto3
from botocore.config import Config

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(ROOT))

from consume import REGION, ReplayProcess, child_environment  # noqa: E402

import kclpy  # noqa: E402

if TYPE_CHECKING:
    from _typeshed.wsgi import StartResponse, WSGIApplication, WSGIEnvironment
    from mypy_boto3_dynamodb import DynamoDBClient

#: the bench's own reads of the lease table: neither counted nor gated
OBSERVER = "fleet-scale-observer"
#: as often as the simulator probes its fleet (each sample is a Scan that moto serves in
#: turn with the workers' requests)
_SAMPLE_S = 1.0
_RECORD_SIZE = 100


class IdleProcessor(kclpy.IRecordProcessor):
    """Reads and forgets; never checkpoints, so the only DynamoDB requests are the lease
    protocol's, as in the simulator."""

    def initialize(self, initialize_input: kclpy.InitializeInput) -> None:
        """Nothing to set up."""

    def process_records(self, process_records_input: kclpy.ProcessRecordsInput) -> None:
        """Nothing to keep."""

    def lease_lost(self, lease_lost_input: kclpy.LeaseLostInput) -> None:
        """Nothing to give up."""

    def shard_ended(self, shard_ended_input: kclpy.ShardEndedInput) -> None:
        shard_ended_input.checkpointer.checkpoint()

    def shutdown_requested(self, shutdown_requested_input: kclpy.ShutdownRequestedInput) -> None:
        """Nothing to save."""


def _app_id(user_agent: str) -> str:
    """The ``app/<id>`` botocore adds to its User-Agent from ``AWS_SDK_UA_APP_ID``."""
    for part in user_agent.split():
        if part.startswith("app/"):
            return part[4:]
    return "?"


class MeteredDynamo:
    """WSGI middleware in front of kclpy.local's moto app: counts each DynamoDB request by
    (client, operation, table) and the largest Scan answer per table; requests of clients
    in the gate wait until it opens."""

    def __init__(self, app: WSGIApplication) -> None:
        self._app = app
        self._lock = threading.Lock()
        self._gate = threading.Condition(self._lock)
        self._gated: set[str] = set()
        self.waiting: set[str] = set()
        self.requests: Counter[tuple[str, str, str]] = Counter()
        self.largest_scan: Counter[str] = Counter()

    def __call__(self, environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        stream = environ["wsgi.input"]
        body = stream.read(int(environ.get("CONTENT_LENGTH") or 0))
        environ["wsgi.input"] = io.BytesIO(body)
        client = _app_id(environ.get("HTTP_USER_AGENT", ""))
        if client == OBSERVER:
            return self._app(environ, start_response)
        with self._gate:
            while client in self._gated:
                self.waiting.add(client)
                self._gate.wait()
            self.waiting.discard(client)
        operation = environ.get("HTTP_X_AMZ_TARGET", "").rpartition(".")[2]
        try:
            table = str(json.loads(body or b"{}").get("TableName", ""))
        except ValueError:
            table = ""
        answer = list(self._app(environ, start_response))
        with self._lock:
            self.requests[(client, operation, table)] += 1
            if operation == "Scan":
                try:
                    count = int(json.loads(b"".join(answer)).get("Count", 0))
                except ValueError:
                    count = 0
                self.largest_scan[table] = max(self.largest_scan[table], count)
        return answer

    def gate(self, clients: Iterable[str]) -> None:
        with self._gate:
            self._gated.update(clients)

    def open(self) -> None:
        with self._gate:
            self._gated.clear()
            self._gate.notify_all()

    def snapshot(self) -> Counter[tuple[str, str, str]]:
        with self._lock:
            return Counter(self.requests)


@contextmanager
def metered_dynamodb() -> Iterator[tuple[str, MeteredDynamo]]:
    """kclpy.local's moto app on a loopback port of this process, behind the meter."""
    from kclpy.local.moto_app import make_moto_server

    server = make_moto_server("127.0.0.1", 0)
    meter = MeteredDynamo(server.app)
    server.app = meter
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                              name="fleet-scale-dynamodb", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}", meter
    finally:
        meter.open()
        server.shutdown()
        server.server_close()
        thread.join(10)


@dataclass
class Sampler:
    """Reads the lease table every second: the owners, and the owner changes seen."""

    client: DynamoDBClient
    table: str
    owners: dict[str, str | None] = field(default_factory=dict)
    handing_off: bool = False
    #: some lease names an owner that has not taken it (``kclpyHolder`` differs)
    untaken: bool = False
    moved: int = 0
    taken_free: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def run(self) -> None:
        while not self._stop.wait(_SAMPLE_S):
            try:
                items = _scan(self.client, self.table)
            except self.client.exceptions.ResourceNotFoundException:
                continue
            owners = {i["leaseKey"]["S"]: i.get("leaseOwner", {}).get("S") for i in items}
            # a leader's assignment names the owner before the owner has taken the lease
            untaken = any(i.get("kclpyHolder", {}).get("S") != i.get("leaseOwner", {}).get("S")
                          for i in items)
            with self._lock:
                for key, owner in owners.items():
                    before = self.owners.get(key)
                    if owner is not None and owner != before:
                        if before is None:
                            self.taken_free += 1
                        else:
                            self.moved += 1
                self.owners = owners
                self.handing_off = any("checkpointOwner" in i for i in items)
                self.untaken = untaken

    def stop(self) -> None:
        self._stop.set()

    def balanced(self, live: set[str], shards: int) -> bool:
        """The simulator's ``balanced_by_count`` on the table: every lease held by a live
        worker that took it, none being handed off, counts (live workers without a lease:
        0) within one."""
        with self._lock:
            if len(self.owners) < shards or self.handing_off or self.untaken:
                return False
            if not set(self.owners.values()) <= live:
                return False
            counts = Counter({worker: 0 for worker in live})
            counts.update(str(owner) for owner in self.owners.values())
            return max(counts.values()) - min(counts.values()) <= 1

    def moves(self) -> tuple[int, int]:
        with self._lock:
            return self.moved, self.taken_free


def _scan(client: DynamoDBClient, table: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    request: dict[str, Any] = {"TableName": table, "ConsistentRead": True}
    while True:
        page = client.scan(**request)
        items.extend(page.get("Items", []))
        if "LastEvaluatedKey" not in page:
            return items
        request["ExclusiveStartKey"] = page["LastEvaluatedKey"]


@dataclass(frozen=True)
class Settings:
    workers: int = 10
    shards: int = 100
    failover_s: float = 10.0
    steady_s: float = 120.0
    churn: float = 0.2
    seed: int = 0
    #: a phase gives up after this many failover times (the simulator's limit)
    phase_limit_failovers: float = 60.0
    #: how often a consumer polls its (idle) shard: the simulator runs no consumers, and on a
    #: machine shared with other work a fleet polling 100 idle shards every second starves
    #: its own renewers (leases expire on their holders), which measures the machine
    idle_reads_ms: int = 10_000
    #: how long every process may take to reach its first DynamoDB request
    start_timeout_s: float = 600.0
    #: ``--lease-assigner`` of every worker (and the simulator's ``Fleet(leader=...)``)
    lease_assigner: str = "worker"


class Fleet:
    """The worker processes."""

    def __init__(self, settings: Settings, kinesis_url: str, dynamodb_url: str, stream: str,
                 application: str, logs: Path) -> None:
        self.settings = settings
        self._args = [
            "--stream-name", stream, "--application-name", application,
            "--processor", "fleet_scale:IdleProcessor", "--region", REGION,
            "--kinesis-endpoint", kinesis_url, "--dynamodb-endpoint", dynamodb_url,
            "--initial-position", "TRIM_HORIZON",
            "--failover-time-ms", str(round(settings.failover_s * 1000)),
            "--idle-time-between-reads-ms", str(settings.idle_reads_ms),
            "--lease-assigner", settings.lease_assigner,
        ]  # fmt: skip
        self._logs = logs
        self.processes: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, worker_id: str) -> None:
        env = {**child_environment(), "AWS_SDK_UA_APP_ID": worker_id,
               "PYTHONPATH": os.pathsep.join([str(BENCH), str(ROOT)])}
        with (self._logs / f"{worker_id}.log").open("wb") as log:
            self.processes[worker_id] = subprocess.Popen(
                [sys.executable, "-m", "kclpy", *self._args, "--worker-id", worker_id],
                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)

    def kill(self, worker_id: str) -> None:
        process = self.processes[worker_id]
        process.send_signal(signal.SIGKILL)
        process.wait()

    def live(self) -> set[str]:
        return {w for w, p in self.processes.items() if p.poll() is None}

    def stop_all(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes.values():
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def died(self) -> list[str]:
        return [w for w, p in self.processes.items() if p.poll() not in (None, -signal.SIGKILL)]


def _wait(condition: Callable[[], bool], timeout: float, what: str,
          fleet: Fleet | None = None) -> float:
    """Seconds until ``condition`` held; a worker that exits on its own fails the run."""
    started = time.monotonic()
    while not condition():
        if fleet is not None and fleet.died():
            raise RuntimeError(f"worker(s) {fleet.died()} exited while waiting for {what}")
        if time.monotonic() - started > timeout:
            raise RuntimeError(f"{what}: not within {timeout:g} s")
        time.sleep(0.05)
    return time.monotonic() - started


def _admit(meter: MeteredDynamo, fleet: Fleet, worker_ids: list[str], timeout: float) -> None:
    """Start ``worker_ids`` held at their first DynamoDB request; release them together."""
    meter.gate(worker_ids)
    for worker_id in worker_ids:
        fleet.start(worker_id)
    _wait(lambda: meter.waiting >= set(worker_ids), timeout,
          f"{len(worker_ids)} process(es) to reach DynamoDB", fleet)
    meter.open()


def measure(settings: Settings, kinesis_url: str, stream: str, logs: Path) -> dict[str, Any]:
    """The real fleet's figures, under the simulator's names (``summary``)."""
    application = f"fleet-scale-{uuid.uuid4().hex[:12]}"
    rng = random.Random(settings.seed)
    limit = settings.phase_limit_failovers * settings.failover_s
    figures: dict[str, Any] = {"shards": settings.shards, "workers": settings.workers,
                               "failover_s": settings.failover_s}
    with ExitStack() as stack:
        dynamodb_url, meter = stack.enter_context(metered_dynamodb())
        # the dummy credentials child_environment() gives the workers: nothing reaches AWS
        observer = boto3.session.Session(
            region_name=REGION, aws_access_key_id="bench", aws_secret_access_key="bench",
        ).client(
            "dynamodb", endpoint_url=dynamodb_url,
            config=Config(user_agent_appid=OBSERVER, retries={"mode": "standard"}))
        fleet = Fleet(settings, kinesis_url, dynamodb_url, stream, application, logs)
        stack.callback(fleet.stop_all)
        sampler = Sampler(observer, application)
        threading.Thread(target=sampler.run, name="fleet-scale-sampler", daemon=True).start()
        stack.callback(sampler.stop)

        def phase(name: str, live: set[str]) -> None:
            moved, free = sampler.moves()
            figures[f"{name}_s"] = round(_wait(
                lambda: sampler.balanced(live, settings.shards), limit,
                f"{name}: balanced among {len(live)}", fleet), 1)
            figures[f"{name}_moved"] = sampler.moves()[0] - moved
            figures[f"{name}_taken_free"] = sampler.moves()[1] - free
            print(f"{name}: balanced among {len(live)} after {figures[f'{name}_s']} s, "
                  f"{figures[f'{name}_moved']} lease(s) moved", flush=True)

        ids = [f"w{index:03d}" for index in range(settings.workers)]
        _admit(meter, fleet, ids, settings.start_timeout_s)
        phase("start", set(ids))
        time.sleep(2 * settings.failover_s)  # the simulator's wait before its steady window
        before = meter.snapshot()
        started = time.monotonic()
        time.sleep(settings.steady_s)
        steady = meter.snapshot() - before
        steady_s = time.monotonic() - started
        figures.update(_cost(steady, steady_s, settings, application))

        churn = max(1, round(settings.churn * settings.workers))
        for worker_id in rng.sample(sorted(fleet.live()), churn):
            fleet.kill(worker_id)
        phase("die", fleet.live())
        joined = [f"j{index:03d}" for index in range(churn)]
        _admit(meter, fleet, joined, settings.start_timeout_s)
        phase("join", fleet.live())
        figures["largest_scan_items"] = meter.largest_scan[application]
    return figures


def _cost(steady: Counter[tuple[str, str, str]], seconds: float, settings: Settings,
          application: str) -> dict[str, Any]:
    hours = seconds / 3600
    by_op: Counter[str] = Counter()
    by_worker: Counter[str] = Counter()
    for (client, operation, _), count in steady.items():
        by_op[operation] += count
        by_worker[client] += count
    total = sum(by_op.values())
    lease_table = sum(n for (_, _, table), n in steady.items() if table == application)
    return {
        "requests_per_shard_hour": round(total / settings.shards / hours, 1),
        "requests_by_operation_per_shard_hour": {
            op: round(n / settings.shards / hours, 1) for op, n in sorted(by_op.items())},
        "requests_per_worker_hour": round(total / settings.workers / hours),
        "busiest_worker_requests_per_hour": round(max(by_worker.values(), default=0) / hours),
        "lease_table_share": round(lease_table / total, 3) if total else None,
        "steady_s": round(seconds, 1),
    }


def simulate(settings: Settings) -> dict[str, Any]:
    """The simulator's figures for the same size and settings."""
    from tests.simulation.scale import Fleet, ScaleSpec, run_scale, summary

    spec = ScaleSpec(settings.shards, settings.workers, failover_s=settings.failover_s,
                     seed=settings.seed, churn=settings.churn, steady_s=settings.steady_s,
                     phase_limit_failovers=settings.phase_limit_failovers)
    return summary(run_scale(spec, fleet=Fleet(spec, leader=settings.lease_assigner == "leader")))


#: (label, key): the figures compared, in the order printed
FIGURES = (
    ("cold start to held and balanced, s", "start_s"),
    ("leases moved during the cold start", "start_moved"),
    ("20 % die: balanced again after, s", "die_s"),
    ("leases moved after the deaths", "die_moved"),
    ("20 % join: balanced again after, s", "join_s"),
    ("leases moved after the joins", "join_moved"),
    ("DynamoDB requests per shard-hour", "requests_per_shard_hour"),
    ("DynamoDB requests per worker-hour", "requests_per_worker_hour"),
    ("largest single scan, items", "largest_scan_items"),
)


def ratio(real: Any, simulated: Any) -> float | None:
    if not isinstance(real, int | float) or not isinstance(simulated, int | float):
        return None
    if simulated == 0:
        return None if real else 1.0
    return round(real / simulated, 2)


def compare(real: dict[str, Any], simulated: dict[str, Any]) -> list[dict[str, Any]]:
    rows = [{"figure": label, "key": key, "real": real.get(key), "simulated": simulated.get(key),
             "ratio": ratio(real.get(key), simulated.get(key))} for label, key in FIGURES]
    operations = sorted(set(real["requests_by_operation_per_shard_hour"])
                        | set(simulated["requests_by_operation_per_shard_hour"]))
    for op in operations:
        mine = real["requests_by_operation_per_shard_hour"].get(op, 0.0)
        theirs = simulated["requests_by_operation_per_shard_hour"].get(op, 0.0)
        rows.append({"figure": f"  {op} per shard-hour", "key": op, "real": mine,
                     "simulated": theirs, "ratio": ratio(mine, theirs)})
    return rows


def run(settings: Settings, kinesis_url: str, stream: str, logs: Path) -> list[dict[str, Any]]:
    simulated = simulate(settings)
    real = measure(settings, kinesis_url, stream, logs)
    return compare(real, simulated)


def _show(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return f"{value:,}" if isinstance(value, int) else f"{value:,.1f}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=10)
    parser.add_argument("--shards", type=int, default=100)
    parser.add_argument("--failover-ms", type=int, default=10_000)
    parser.add_argument("--steady-s", type=float, default=120.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--idle-reads-ms", type=int, default=10_000,
                        help="--idle-time-between-reads-ms of every worker")
    parser.add_argument("--logs", type=Path, help="where the workers' logs go (default: a "
                        "temporary folder, kept)")
    parser.add_argument("--lease-assigner", choices=("worker", "leader"), default="worker",
                        help="--lease-assigner of every worker, and of the simulated fleet")
    args = parser.parse_args(argv)
    settings = Settings(args.workers, args.shards, args.failover_ms / 1000, args.steady_s,
                        seed=args.seed, idle_reads_ms=args.idle_reads_ms,
                        lease_assigner=args.lease_assigner)
    logs = args.logs or Path(os.environ.get("TMPDIR", "/tmp")) / f"fleet-scale-{os.getpid()}"
    logs.mkdir(parents=True, exist_ok=True)
    stream = f"fleet:{settings.shards}:1:{_RECORD_SIZE}"
    print(f"{settings.workers} worker processes x {settings.shards} shards, failover "
          f"{settings.failover_s:g} s; worker logs in {logs}", flush=True)
    with ReplayProcess(sys.executable, [stream]) as replay:
        rows = run(settings, replay.url, "fleet", logs)
    print(f"{'figure':<42}{'real':>12}{'simulated':>12}{'real/sim':>10}")
    for row in rows:
        print(f"{row['figure']:<42}{_show(row['real']):>12}{_show(row['simulated']):>12}"
              f"{_show(row['ratio']):>10}")
    print(json.dumps(rows), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
