"""``kclpy monitor`` watching four applications of real ``kclpy-worker`` processes side by
side, over real HTTP (moto's server for DynamoDB and Kinesis, a webhook receiver here): a
shard an operator parks, a fleet whose every worker is SIGKILLed, a processor that stops
checkpointing, and a healthy application. Each reaches its status within one window plus
one round (counted in the monitor's rounds, not in seconds), each change is POSTed once,
and the healthy one never leaves OK."""

from __future__ import annotations

import functools
import json
import signal
import urllib.request
from collections import defaultdict
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from kclpy.local import LocalEndpoint
from kclpy.ops.monitor import ApplicationWatch, Monitor, serve_monitor
from kclpy.ops.monitor.watch import AppView
from tests.support.cli import endpoints, run_cli
from tests.support.fleet import Fleet, fleet
from tests.support.streams import (
    create_stream,
    dynamodb_client,
    kinesis_client,
    put_plain,
    unique_name,
)
from tests.support.waiting import wait_for
from tests.support.webhooks import Receiver, receiving

WINDOW_S = 6.0
INTERVAL_S = 1.0
#: the workers' failover time, and the monitor's: longer, as an operator may set it, so
#: that a healthy worker's renewal late on this shared machine is not a dead fleet
WORKER_FAILOVER_S = 3.0
FAILOVER_S = 5.0
SHARD = "shardId-000000000000"
#: the rounds a status may take: a window of them, the round under way and the next
ROUNDS = round(WINDOW_S / INTERVAL_S) + 2


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    with receiving() as server:
        yield server


def status(monitor: Monitor, app: str) -> tuple[str, dict[str, str]] | None:
    view: AppView | None = monitor.view(app)
    if view is None:
        return None
    return view.status, {s.shard_id: s.status for s in view.shards}


def checkpointed(group: Fleet, records: int) -> bool:
    return sum(1 for _ in group.ledger.records()) >= records and bool(
        [e for e in group.ledger.events("checkpoint") if e["ok"]])


@pytest.mark.integration
@pytest.mark.slow
def test_parked_dead_stopped_and_healthy_applications_side_by_side(
        moto_server: LocalEndpoint, receiver: Receiver, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    url = moto_server.url
    kinesis = kinesis_client(url)
    names = {kind: unique_name(f"mon-{kind}") for kind in ("healthy", "parked", "dead",
                                                          "stopped")}
    with ExitStack() as stack:
        fleets: dict[str, Fleet] = {}
        for kind, name in names.items():
            create_stream(kinesis, name, 1)
            workdir = tmp_path / kind
            workdir.mkdir()
            fleets[kind] = stack.enter_context(fleet(url, url, name, name, workdir,
                                                     failover_ms=round(WORKER_FAILOVER_S * 1000)))
            fleets[kind].start(f"{kind}-w")
            put_plain(kinesis, name, [f"{kind}-{n}".encode() for n in range(3)])
        for kind, group in fleets.items():
            wait_for(functools.partial(checkpointed, group, 3), 120,
                     f"{kind} processed its records")

        watches = [ApplicationWatch(name, kinesis, dynamodb_client(url), window_s=WINDOW_S,
                                    failover_s=FAILOVER_S, records_limit=100)
                   for name in names.values()]
        hook = f"http://127.0.0.1:{receiver.port}/hook"
        monitor = Monitor(watches, interval_s=INTERVAL_S, lag_webhook=hook)
        server = stack.enter_context(serve_monitor(monitor))
        monitor.start()
        stack.callback(monitor.stop)
        wait_for(lambda: all(status(monitor, n) == ("OK", {SHARD: "OK"})
                             for n in names.values()), 60, "every application OK",
                 seen=lambda: [status(monitor, n) for n in names.values()])

        # the faults, each followed by records nobody will checkpoint
        fleets["stopped"].hold_path("stopped-w").touch()
        code, _, err = run_cli(capsys, "shard", "park", "--application-name",
                               names["parked"], "--shard-id", SHARD, "--reason",
                               "poison <record>", *endpoints(moto_server, moto_server))
        assert code == 0, err
        fleets["dead"].workers[0].signal(signal.SIGKILL)
        fleets["dead"].workers[0].process.wait(30)
        for kind in ("parked", "dead", "stopped"):
            put_plain(kinesis, names[kind], [f"{kind}-late-{n}".encode() for n in range(5)])
        faulted = monitor.rounds

        expected = {"parked": "STOP", "dead": "STOP", "stopped": "STOP"}
        reached: dict[str, int] = {}

        def all_reached() -> bool:
            for kind, shard_status in expected.items():
                now = status(monitor, names[kind])
                if kind not in reached and now == ("ERR", {SHARD: shard_status}):
                    reached[kind] = monitor.rounds
            healthy = status(monitor, names["healthy"])
            assert healthy == ("OK", {SHARD: "OK"}), healthy
            return len(reached) == len(expected)

        wait_for(all_reached, 120, "every faulted application in its status",
                 seen=lambda: {k: status(monitor, n) for k, n in names.items()})
        # one more round with the healthy one still OK
        monitor.wait_rounds(monitor.rounds + 1, 30)
        assert status(monitor, names["healthy"]) == ("OK", {SHARD: "OK"})
        for kind, at in reached.items():
            assert at - faulted <= ROUNDS, (kind, at - faulted)

        views = {kind: monitor.view(name) for kind, name in names.items()}
        parked = views["parked"]
        assert parked is not None and parked.shards[0].parked is not None
        assert parked.shards[0].parked["reason"] == "poison <record>"
        dead = views["dead"]
        assert dead is not None and dead.live_workers == ()
        assert dead.reasons[0].startswith("no live worker")
        stopped = views["stopped"]
        assert stopped is not None and stopped.live_workers == ("stopped-w",)
        assert "does not checkpoint" in stopped.shards[0].reason

        # the API says the same
        with urllib.request.urlopen(
                f"{server.url}/v1/applications/{names['dead']}/status", timeout=10) as answer:
            assert json.load(answer)["status"]["status"] == "ERR"

        # every change POSTed once: per shard (and per application) the POSTs chain, each
        # one's previous status the status of the POST before it (the first's: OK, the
        # status every application had, which was not POSTed)
        wait_for(lambda: {(d["application"], d["shard_id"]) for d in receiver.documents()}
                 >= {(names[k], key) for k in expected for key in (None, SHARD)}, 60,
                 "the webhook received every change", seen=receiver.documents)
        chains: dict[tuple[str, str | None], list[dict[str, Any]]] = defaultdict(list)
        for document in receiver.documents():
            chains[(document["application"], document["shard_id"])].append(document)
        assert not [key for key in chains if key[0] == names["healthy"]]
        for key, documents in chains.items():
            previous = "OK"
            for document in documents:
                assert document["previous_status"] == previous, (key, documents)
                assert document["status"] != previous, (key, documents)
                previous = document["status"]
        for kind in expected:
            assert chains[(names[kind], None)][-1]["status"] == "ERR"
            assert chains[(names[kind], SHARD)][-1]["status"] == "STOP"
