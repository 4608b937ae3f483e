"""The alert rules of docs/operations.md, as the page writes them, evaluated over the scraped
metrics of a real worker (tests/support/promql.py): a healthy busy worker fires none; once
its DynamoDB stops answering, ``KclpyLeasesNotRenewed`` fires.

Minutes are compressed into seconds: the rules' ranges and ``for:`` durations are divided by
TIME_SCALE, and the worker's failover time is chosen long (a minute, ten "minutes" at that
scale) so that it still counts its leases as held while its writes hang, as a worker with a
long failover time or a hung renewer does.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from kclpy import KCLConfig, Worker
from kclpy.local import LocalEndpoint
from tests.support.faultproxy import ALL, FaultProxy
from tests.support.promql import Rule, Scrapes, by_name, firing, rules_from_yaml_block
from tests.support.recording import Ledger, RecordingProcessor
from tests.support.streams import create_stream, kinesis_client, put_plain, unique_name

ROOT = Path(__file__).resolve().parents[2]
TIME_SCALE = 10.0
SCRAPE_INTERVAL_S = 0.5


def documented_rules() -> list[Rule]:
    text = (ROOT / "docs" / "operations.md").read_text(encoding="utf-8")
    section = text.split("## Alerting", 1)[1]
    block = re.search(r"```yaml\n(.*?)```", section, re.DOTALL)
    assert block is not None
    return rules_from_yaml_block(block.group(1))


def test_every_documented_rule_parses() -> None:
    rules = by_name(documented_rules())
    assert "KclpyLeasesNotRenewed" in rules and len(rules) >= 9
    empty = Scrapes()
    for rule in rules.values():
        assert firing(rule, empty) == []


def test_every_rule_says_how_bad_and_what_to_do() -> None:
    """Alertmanager routes on ``severity`` and a pager shows ``summary``/``description``: a
    rule without them pages someone with a bare name."""
    for rule in documented_rules():
        assert rule.labels.get("severity") in ("critical", "warning"), rule.alert
        assert rule.annotations.get("summary"), rule.alert
        assert len(rule.annotations.get("description", "")) > 20, rule.alert


def test_the_old_rule_fired_on_a_busy_worker_and_the_new_one_does_not() -> None:
    """Checkpoints every batch renew the leases: the renewal counter stays at 0."""
    scrapes = Scrapes()
    for second in range(0, 600, 15):
        scrapes.add_text(second, (
            "kclpy_leases_held 4.0\n"
            "kclpy_lease_renewals_total 0.0\n"
            f'kclpy_checkpoints_total{{shard_id="shardId-0"}} {second * 2.0}\n'))
    old = Rule("old", "kclpy_leases_held > 0 and rate(kclpy_lease_renewals_total[2m]) == 0",
               120)
    assert firing(old, scrapes)
    assert firing(by_name(documented_rules())["KclpyLeasesNotRenewed"], scrapes) == []


class Producer:
    """Writes a few records every 0.2 s until stopped: a worker that is always busy."""

    def __init__(self, url: str, stream: str) -> None:
        self.kinesis = kinesis_client(url)
        self.stream = stream
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        n = 0
        while not self.stop.wait(0.2):
            put_plain(self.kinesis, self.stream, [f"r-{n + i}".encode() for i in range(5)])
            n += 5

    def __enter__(self) -> Producer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()


def scrape_for(worker: Worker, scrapes: Scrapes, seconds: float, start: float) -> None:
    """Scrapes stamped in real seconds: ``firing`` compresses the rules' durations, so the
    timeline must not be compressed as well (both made a "minute" 0.6 s, and one slow
    checkpoint under load fired an alert on a healthy worker)."""
    deadline = time.monotonic() + seconds
    pause = threading.Event()
    while time.monotonic() < deadline:
        text = generate_latest(worker.metrics.registry).decode()
        scrapes.add_text(time.monotonic() - start, text)
        pause.wait(SCRAPE_INTERVAL_S)


@pytest.fixture
def running_worker(embedded_endpoint: LocalEndpoint) -> Iterator[tuple[Worker, FaultProxy]]:
    stream = unique_name("alerts")
    create_stream(kinesis_client(embedded_endpoint.url), stream, 2)
    with FaultProxy(embedded_endpoint.url) as dynamodb, Producer(embedded_endpoint.url, stream):
        config = KCLConfig(
            application_name=unique_name("alerts-app"), stream_name=stream,
            region="us-east-1", kinesis_endpoint=embedded_endpoint.url,
            dynamodb_endpoint=dynamodb.url, initial_position="TRIM_HORIZON",
            failover_time_ms=60_000, idle_time_between_reads_ms=200,
            shutdown_grace_ms=1_000)
        worker = Worker(config, lambda: RecordingProcessor(Ledger()))
        thread = threading.Thread(target=worker.run, kwargs={"install_signal_handlers": False},
                                  daemon=True)
        thread.start()
        try:
            assert worker.wait_started(60)
            yield worker, dynamodb
        finally:
            dynamodb.clear()
            worker.shutdown()
            thread.join(120)


@pytest.mark.integration
@pytest.mark.slow
def test_no_rule_fires_on_a_healthy_busy_worker_and_a_stalled_one_is_caught(
        running_worker: tuple[Worker, FaultProxy]) -> None:
    worker, dynamodb = running_worker
    rules = documented_rules()
    start = time.monotonic()
    healthy = Scrapes()
    scrape_for(worker, healthy, 20, start)
    assert sum(v for (name, _), points in healthy.series.items()
               if name == "kclpy_checkpoints_total" for _, v in points[-1:]) > 0
    for rule in rules:
        assert firing(rule, healthy, time_scale=TIME_SCALE) == [], rule.alert

    # DynamoDB stops answering: renewals and checkpoints hang (each request held for longer
    # than the stall lasts, shorter than the client's read timeout)
    dynamodb.set_rule(ALL, latency_s=25)
    stalled = Scrapes()
    stalled.series = {key: list(points) for key, points in healthy.series.items()}
    scrape_for(worker, stalled, 22, start)
    fired = firing(by_name(rules)["KclpyLeasesNotRenewed"], stalled, time_scale=TIME_SCALE)
    assert fired and min(fired) > max(healthy.times())
