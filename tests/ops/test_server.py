"""The ops endpoint over real HTTP: a stand-in worker for the protocol details, and a real
Worker against kinesis-mock and moto's server for what an operator scrapes."""

from __future__ import annotations

import json
import logging
import re
import socket
import struct
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import Counter, Gauge, Histogram

from kclpy import Worker
from kclpy.local import LocalEndpoint
from kclpy.metrics import (
    BYTES_PROCESSED,
    MILLIS_BEHIND_LATEST,
    PROCESS_RECORDS,
    RECORDS_PROCESSED,
    SHARD_CONSUMER_STATE,
    Metrics,
)
from kclpy.ops import RunningServer, serve_worker
from kclpy.ops.monitor import exported_names
from kclpy.ops.server import MAX_HEAD_BYTES, HostCheck
from tests.support.e2e import worker_config
from tests.support.recording import Ledger, RecordingProcessor
from tests.support.scrape import get, scrape
from tests.support.streams import create_stream, kinesis_client, put_plain, unique_name
from tests.support.waiting import wait_for
from tests.support.workers import running

ROOT = Path(__file__).resolve().parents[2]


def total(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str) -> float:
    return sum(value for (sample, _), value in samples.items() if sample == name)


# -- the protocol, with a stand-in worker ------------------------------------------------


class FakeWorker:
    """What serve_worker reads from a Worker, and nothing else."""

    def __init__(self) -> None:
        self.metrics = Metrics()
        self.healthy = False
        self.kinesis = None

    def status(self) -> dict[str, Any]:
        return {"worker_id": "w-1", "stream": "s", "application": "a",
                "held_leases": ["shard-1"],
                "shards": {"shard-1": {"state": "PROCESSING", "checkpoint": "42",
                                       "checkpoint_sub_sequence_number": 0,
                                       "millis_behind_latest": 0}}}


@pytest.fixture
def fake_server() -> Iterator[tuple[FakeWorker, RunningServer]]:
    worker = FakeWorker()
    with serve_worker(worker, lag_window_s=None) as server:  # type: ignore[arg-type]
        yield worker, server


def test_healthz_follows_the_worker(fake_server: tuple[FakeWorker, RunningServer]) -> None:
    worker, server = fake_server
    assert get(server.url + "/healthz")[0] == 503
    worker.healthy = True
    assert get(server.url + "/healthz")[:1] == (200,)
    worker.healthy = False
    status, _, body = get(server.url + "/healthz")
    assert status == 503 and "not being renewed" in body


def test_metrics_are_the_workers_registry_in_both_formats(
        fake_server: tuple[FakeWorker, RunningServer]) -> None:
    worker, server = fake_server
    worker.metrics.shard("shard-1").inc(RECORDS_PROCESSED, by=7)
    status, content_type, body = get(server.url + "/metrics")
    assert status == 200 and content_type.startswith("text/plain")
    assert 'kclpy_records_processed_total{shard_id="shard-1"} 7.0' in body
    status, content_type, body = get(server.url + "/metrics",
                                     accept="application/openmetrics-text; version=1.0.0")
    assert content_type.startswith("application/openmetrics-text")
    assert body.rstrip().endswith("# EOF")


def test_status_is_the_workers_status_plus_health(
        fake_server: tuple[FakeWorker, RunningServer]) -> None:
    worker, server = fake_server
    status, content_type, body = get(server.url + "/status")
    assert (status, content_type) == (200, "application/json")
    document = json.loads(body)
    assert document == {**worker.status(), "healthy": False}


def test_unknown_paths_are_404(fake_server: tuple[FakeWorker, RunningServer]) -> None:
    _, server = fake_server
    assert get(server.url + "/")[0] == 404
    assert get(server.url + "/metrics/extra")[0] == 404


def fill_500_shards(metrics: Metrics) -> None:
    """The per-shard series of a worker holding 500 shards (about 0.8 MB of /metrics)."""
    for n in range(500):
        shard = f"shardId-{n:012d}"
        scope = metrics.shard(shard)
        scope.inc(RECORDS_PROCESSED, by=n)
        scope.inc(BYTES_PROCESSED, by=n)
        scope.call(PROCESS_RECORDS, 0.01)
        scope.set(MILLIS_BEHIND_LATEST, n)
        for state in ("WAITING_ON_PARENTS", "INITIALIZING", "PROCESSING", "SHUTTING_DOWN",
                      "DONE"):
            scope.set(SHARD_CONSUMER_STATE, state == "PROCESSING", state)


def raw(server: RunningServer, request: bytes) -> bytes:
    """The whole answer to ``request`` sent as is over one connection."""
    with socket.create_connection((server.host, server.port), timeout=10) as sock:
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


def cut(sock: socket.socket) -> bool:
    """Whether the server closed ``sock`` (a read finds the end, or the peer reset it)."""
    try:
        return sock.recv(1024, socket.MSG_DONTWAIT) == b"" or cut(sock)
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


def test_dribbling_clients_are_cut_at_the_deadline_and_healthz_answers_meanwhile() -> None:
    """Twenty clients each sending a request one byte at a time, more than there are
    answering threads: each byte arrives well within any per-read timeout, yet every one is
    cut once ``timeout_s`` since its accept has passed, and /healthz answers 200 at every
    round while they are connected."""
    worker = FakeWorker()
    worker.healthy = True
    request = b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: " + b"a" * 4000
    with serve_worker(worker, lag_window_s=None, max_connections=3,  # type: ignore[arg-type]
                      timeout_s=0.5) as server:
        dribblers = [socket.create_connection((server.host, server.port), timeout=10)
                     for _ in range(20)]
        try:
            sent = 0
            live = set(range(len(dribblers)))

            def one_round() -> bool:
                nonlocal sent
                for i in sorted(live):
                    try:
                        dribblers[i].send(request[sent:sent + 1])
                    except OSError:
                        live.discard(i)
                    else:
                        if cut(dribblers[i]):
                            live.discard(i)
                sent += 1
                assert sent < len(request), "a dribbler finished its request uncut"
                assert get(server.url + "/healthz")[:1] == (200,)
                return not live

            wait_for(one_round, 60, "every dribbler cut")
        finally:
            for sock in dribblers:
                sock.close()
        refused = scrape(server)
    assert refused[("kclpy_ops_requests_refused_total", (("reason", "timeout"),))] == 20


def test_answers_past_max_connections_are_busy_but_healthz_is_not() -> None:
    """While ``max_connections`` renders are under way, one more /metrics is answered 503
    at once; /healthz is answered by the accepting thread and is not refused."""
    worker = FakeWorker()
    worker.healthy = True
    release = threading.Event()
    entered = threading.Event()
    real_collect = worker.metrics.registry.collect

    def blocked_collect() -> Any:
        entered.set()
        release.wait(30)
        yield from real_collect()

    worker.metrics.registry.collect = blocked_collect  # type: ignore[method-assign]
    with (serve_worker(worker, lag_window_s=None, max_connections=1,  # type: ignore[arg-type]
                       ) as server, ThreadPoolExecutor(1) as pool):
        first = pool.submit(get, server.url + "/metrics")
        assert entered.wait(10)
        try:
            assert get(server.url + "/metrics")[0::2] == (503, "busy\n")
            assert get(server.url + "/healthz")[:1] == (200,)
        finally:
            release.set()
        assert first.result()[0] == 200


def test_the_oldest_half_sent_request_is_dropped_for_a_new_connection() -> None:
    worker = FakeWorker()
    worker.healthy = True
    with serve_worker(worker, lag_window_s=None, max_pending=4) as server:  # type: ignore[arg-type]
        holders = [socket.create_connection((server.host, server.port), timeout=10)
                   for _ in range(4)]
        try:
            for sock in holders:
                sock.sendall(b"GET /healthz HTTP/1.1\r\n")
            assert get(server.url + "/healthz")[:1] == (200,)
            assert holders[0].recv(1024).startswith(b"HTTP/1.1 503")
        finally:
            for sock in holders:
                sock.close()


@pytest.mark.parametrize(("request_bytes", "status"), [
    (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n", b"400"),
    (b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n folded\r\n\r\n", b"400"),
    (b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nHost: evil.example\r\n\r\n", b"400"),
    (b"POST /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 99\r\n\r\n", b"405"),
    # one byte past the bound, so the server has read all of it before it answers
    (b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX: ".ljust(MAX_HEAD_BYTES + 1, b"a"),
     b"431"),
    (b"GET /healthz HTTP/1.1\r\nHost: rebound.example:8080\r\n\r\n", b"421"),
    (b"GET /healthz HTTP/1.1\r\n\r\n", b"421"),
    (b"GET /healthz HTTP/1.1\r\nHost: localhost:1\r\n\r\n", b"503"),
    (b"GET /healthz HTTP/1.0\nHost: 127.0.0.1\n\n", b"503"),
])
def test_malformed_misdirected_and_odd_requests(request_bytes: bytes, status: bytes) -> None:
    with serve_worker(FakeWorker(), lag_window_s=None) as server:  # type: ignore[arg-type]
        assert raw(server, request_bytes).split(b" ", 2)[1] == status


def test_allowed_hosts_adds_names_and_a_wildcard_bind_answers_any_address() -> None:
    with serve_worker(FakeWorker(), lag_window_s=None,  # type: ignore[arg-type]
                      allowed_hosts=["Ops.Example"]) as server:
        assert raw(server, b"GET /healthz HTTP/1.1\r\nHost: ops.example.\r\n\r\n"
                   ).startswith(b"HTTP/1.1 503")
        assert raw(server, b"GET /healthz HTTP/1.1\r\nHost: other.example\r\n\r\n"
                   ).startswith(b"HTTP/1.1 421")
    # a wildcard bind (checked without binding one: tests serve on loopback only)
    wildcard = HostCheck("0.0.0.0")
    assert all(wildcard.allows(host) for host in ("10.1.2.3:9000", "[fd00::1]", "localhost"))
    assert not any(wildcard.allows(host) for host in ("rebound.example", "10.1.2.3:x", ""))
    assert not HostCheck("10.1.2.3").allows("10.9.9.9")


def test_status_bounds_and_escapes_a_failures_message() -> None:
    class Failing(FakeWorker):
        def status(self) -> dict[str, Any]:
            status = super().status()
            status["shards"]["shard-1"]["failure"] = {
                "error_type": "ValueError", "attempts": 2,
                "message": "\x1b[2J\rforged line\n" + "x" * 10_000}
            return status

    with serve_worker(Failing(), lag_window_s=None) as server:  # type: ignore[arg-type]
        status, _, body = get(server.url + "/status")
    failure = json.loads(body)["shards"]["shard-1"]["failure"]
    assert status == 200 and failure["error_type"] == "ValueError"
    assert failure["message"].startswith("\\x1b[2J\\rforged line\\n")
    assert failure["message"].endswith("[9817 more characters]")
    assert len(failure["message"]) < 300


def test_a_stalled_request_is_dropped_after_the_timeout() -> None:
    """Half a request, then nothing (a slow-loris client): answered 408 and closed."""
    with (serve_worker(FakeWorker(), lag_window_s=None,  # type: ignore[arg-type]
                       timeout_s=0.5) as server,
          socket.create_connection((server.host, server.port), timeout=10) as sock):
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        assert sock.recv(1024).startswith(b"HTTP/1.1 408 Request Timeout\r\n")
        assert sock.recv(1024) == b""


def test_each_connection_serves_one_request() -> None:
    with serve_worker(FakeWorker(), lag_window_s=None) as server:  # type: ignore[arg-type]
        with socket.create_connection((server.host, server.port), timeout=10) as sock:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
        assert b"Connection: close" in answer and answer.endswith(b"unhealthy: leases are "
                                                                  b"not being renewed\n")


def test_a_scraper_that_hangs_up_early_is_not_an_error(
        caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]) -> None:
    worker = FakeWorker()
    fill_500_shards(worker.metrics)
    with serve_worker(worker, lag_window_s=None) as server:  # type: ignore[arg-type]
        for _ in range(5):
            sock = socket.create_connection((server.host, server.port), timeout=10)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            sock.recv(100)
            # reset, not a clean close: the server's next write fails
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()
        assert scrape(server)[("kclpy_millis_behind_latest",
                               (("shard_id", "shardId-000000000499"),))] == 499
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert "Traceback" not in capsys.readouterr().err


def test_concurrent_scrapes_render_one_at_a_time_and_all_get_a_fresh_answer() -> None:
    """Sixteen scrapes at once of 500 shards' metrics: every one gets the whole answer, and
    no two renders ran at the same time (the renderer is counted from inside)."""
    worker = FakeWorker()
    fill_500_shards(worker.metrics)
    inside = 0
    most = 0
    lock = threading.Lock()
    real_collect = worker.metrics.registry.collect

    def counting_collect() -> Any:
        nonlocal inside, most
        with lock:
            inside += 1
            most = max(most, inside)
        try:
            yield from real_collect()
        finally:
            with lock:
                inside -= 1

    worker.metrics.registry.collect = counting_collect  # type: ignore[method-assign]
    with (serve_worker(worker, lag_window_s=None) as server,  # type: ignore[arg-type]
          ThreadPoolExecutor(16) as pool):
        answers = list(pool.map(lambda _: get(server.url + "/metrics"), range(16)))
    assert all(status == 200 and "shardId-000000000499" in body
               for status, _, body in answers)
    assert most == 1


def test_binds_loopback_by_default_and_stop_frees_the_port() -> None:
    server = serve_worker(FakeWorker(), lag_window_s=None)  # type: ignore[arg-type]
    assert server.host == "127.0.0.1" and server.url == f"http://127.0.0.1:{server.port}"
    server.stop()
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", server.port), 2):
        pass


# -- a real worker -----------------------------------------------------------------------


@pytest.fixture
def two_shards(kinesis_mock: LocalEndpoint) -> tuple[Any, str]:
    kinesis = kinesis_client(kinesis_mock.url)
    stream = unique_name("ops")
    create_stream(kinesis, stream, 2)
    return kinesis, stream


@pytest.mark.integration
def test_scraped_metrics_move_as_records_are_processed(
        two_shards: tuple[Any, str], kinesis_mock: LocalEndpoint,
        moto_server: LocalEndpoint) -> None:
    kinesis, stream = two_shards
    ledger = Ledger()
    worker = Worker(worker_config(kinesis_mock.url, moto_server.url, stream),
                    lambda: RecordingProcessor(ledger))
    with serve_worker(worker, lag_window_s=None) as server:
        before = scrape(server)
        assert total(before, "kclpy_records_processed_total") == 0
        assert total(before, "kclpy_leases_held") == 0
        assert total(before, "kclpy_millis_behind_latest") == 0
        put_plain(kinesis, stream, [f"a{n}".encode() for n in range(40)])
        with running(worker):
            wait_for(lambda: total(scrape(server), "kclpy_records_processed_total") == 40,
                     60, "40 records counted")
            during = scrape(server)
            assert total(during, "kclpy_leases_held") == 2
            shards = {dict(labels)["shard_id"] for name, labels in during
                      if name == "kclpy_records_processed_total"}
            assert shards == set(ledger.by_shard()) and len(shards) == 2
            for shard in shards:
                key = ("kclpy_millis_behind_latest", (("shard_id", shard),))
                assert key in during, f"no MillisBehindLatest for {shard}"
                assert during[("kclpy_bytes_processed_total", (("shard_id", shard),))] > 0
                assert during[("kclpy_process_records_seconds_count",
                               (("shard_id", shard),))] > 0
            assert total(during, "kclpy_get_records_seconds_count") > 0
            assert total(during, "kclpy_checkpoints_total") > 0
            put_plain(kinesis, stream, [f"b{n}".encode() for n in range(25)])
            wait_for(lambda: total(scrape(server), "kclpy_records_processed_total") == 65,
                     60, "65 records counted")
            wait_for(lambda: all(
                scrape(server)[("kclpy_millis_behind_latest", (("shard_id", s),))] == 0
                for s in shards), 30, "caught up")
        after = scrape(server)
        assert total(after, "kclpy_leases_held") == 0, "leases released on shutdown"
    assert len(ledger.records) == 65


@pytest.mark.integration
def test_healthz_is_200_while_renewing_and_503_after(
        two_shards: tuple[Any, str], kinesis_mock: LocalEndpoint,
        moto_server: LocalEndpoint) -> None:
    _, stream = two_shards
    ledger = Ledger()
    config = worker_config(kinesis_mock.url, moto_server.url, stream)
    first = Worker(config, lambda: RecordingProcessor(ledger))
    with serve_worker(first, lag_window_s=None) as server:
        assert get(server.url + "/healthz")[0] == 503, "not started"
        with running(first):
            wait_for(lambda: get(server.url + "/healthz")[0] == 200, 30, "healthy")
        assert get(server.url + "/healthz")[0] == 503, "shut down"
    second = Worker(config.replace(worker_id="second"), lambda: RecordingProcessor(ledger))
    with serve_worker(second, lag_window_s=None) as server, running(second):
        wait_for(lambda: get(server.url + "/healthz")[0] == 200, 30, "healthy")
        assert second.coordinator is not None
        second.coordinator.stop(release=False)
        assert get(server.url + "/healthz")[0] == 503, "renewer stopped, worker still running"


@pytest.mark.integration
def test_status_reports_leases_checkpoints_and_lag(
        two_shards: tuple[Any, str], kinesis_mock: LocalEndpoint,
        moto_server: LocalEndpoint) -> None:
    kinesis, stream = two_shards
    ledger = Ledger()
    config = worker_config(kinesis_mock.url, moto_server.url, stream)
    written = put_plain(kinesis, stream, [f"s{n}".encode() for n in range(30)])
    last = {shard: seq for shard, seq in written}  # the last sequence number per shard
    worker = Worker(config, lambda: RecordingProcessor(ledger))

    def status() -> dict[str, Any]:
        code, _, body = get(server.url + "/status")
        assert code == 200
        return dict(json.loads(body))

    def settled() -> dict[str, Any] | None:
        document = status()
        shards = document["shards"]
        if set(shards) != set(last):
            return None
        if any(shards[s]["checkpoint"] != last[s] or shards[s]["millis_behind_latest"] != 0
               for s in last):
            return None
        lag = document["lag"]["shards"]
        return document if len(lag) == 2 and all(s["records_behind"] == 0 for s in lag) \
            else None

    with serve_worker(worker, lag_window_s=30, lag_interval_s=0.2) as server, running(worker):
        document = wait_for(settled, 60, "checkpoints at the last records and lag sampled")
    assert document["worker_id"] == config.worker_id
    assert (document["application"], document["stream"]) == (config.application_name, stream)
    assert document["healthy"] is True
    assert sorted(document["held_leases"]) == sorted(last)
    for shard in document["shards"].values():
        assert shard["state"] == "PROCESSING"
        assert shard["checkpoint_sub_sequence_number"] == 0
    lag = document["lag"]
    assert lag["status"] == "OK" and lag["window_seconds"] == 30
    assert {s["shard_id"] for s in lag["shards"]} == set(last)
    for shard in lag["shards"]:
        assert shard["status"] == "OK"
        assert shard["checkpoint"] == last[shard["shard_id"]]
        assert shard["owner"] == config.worker_id


# -- the documents that describe the metrics ---------------------------------------------


def exposed_names(metrics: Metrics) -> set[str]:
    """The sample names each registered collector exposes (without OpenMetrics extras)."""
    names: set[str] = set()
    for collector in metrics.prometheus.collectors():
        if isinstance(collector, Counter):
            names.add(collector._name + "_total")
        elif isinstance(collector, Histogram):
            names.update(collector._name + s for s in ("_bucket", "_sum", "_count"))
        elif isinstance(collector, Gauge):
            names.add(collector._name)
    return names


def documented_names(metrics: Metrics) -> set[str]:
    """The names operators see, one per collector (histograms by their base name)."""
    names: set[str] = set()
    for collector in metrics.prometheus.collectors():
        if isinstance(collector, Counter):
            names.add(collector._name + "_total")
        elif isinstance(collector, (Gauge, Histogram)):
            names.add(collector._name)
    return names


def test_operations_doc_lists_every_metric_and_no_other() -> None:
    metrics = Metrics()
    metrics.register_spark()  # a plain worker has no kclpy_spark_* series
    registered = {family.name for family in metrics.registry.collect()}
    documented = documented_names(metrics)
    assert len(documented) == len(registered), "every collector is declared in kclpy/metrics.py"
    text = (ROOT / "docs" / "operations.md").read_text(encoding="utf-8")
    mentioned = set(re.findall(r"\bkclpy_[a-z_]+[a-z]", text))
    missing = documented - mentioned
    assert not missing, f"docs/operations.md does not describe {sorted(missing)}"
    # the page documents `kclpy monitor`'s own /metrics too
    known = exposed_names(metrics) | documented | exported_names()
    unknown = mentioned - known
    assert not unknown, f"docs/operations.md names metrics that do not exist: {sorted(unknown)}"


def grafana_exprs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "expr" and isinstance(value, str):
                yield value
            else:
                yield from grafana_exprs(value)
    elif isinstance(node, list):
        for item in node:
            yield from grafana_exprs(item)


def test_grafana_dashboard_parses_and_queries_only_existing_metrics() -> None:
    dashboard = json.loads((ROOT / "docs" / "grafana-dashboard.json").read_text("utf-8"))
    assert dashboard["title"] and dashboard["panels"]
    exprs = list(grafana_exprs(dashboard))
    assert len(exprs) >= 10
    known = exposed_names(Metrics())
    used: set[str] = set()
    for expr in exprs:
        names = set(re.findall(r"\bkclpy_[a-z_]+[a-z]", expr))
        assert names, f"panel query without a kclpy metric: {expr}"
        assert names <= known, f"unknown metric in {expr}: {sorted(names - known)}"
        used |= names
    for required in ("kclpy_records_processed_total", "kclpy_millis_behind_latest",
                     "kclpy_leases_held", "kclpy_get_records_seconds_bucket"):
        assert required in used


def test_ops_allowed_hosts_from_the_command_line_reaches_the_endpoint() -> None:
    from kclpy.arguments import parse_worker_args
    from kclpy.cli import serving

    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]
    config, _ = parse_worker_args([
        "--stream-name", "s", "--application-name", "a", "--processor", "x:Y",
        "--metrics-port", str(port), "--ops-allowed-hosts", "ops.example, scrape.example"])
    worker = FakeWorker()
    worker.config = config  # type: ignore[attr-defined]
    seen: list[bytes] = []
    with serving(worker):  # type: ignore[arg-type]
        for host in (b"scrape.example:9464", b"evil.example"):
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: " + host + b"\r\n\r\n")
                seen.append(sock.recv(1024).split(b" ", 2)[1])
    assert seen == [b"503", b"421"]
