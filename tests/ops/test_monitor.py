"""``kclpy monitor`` over real HTTP (moto's server for DynamoDB and Kinesis, a recording
proxy in front), with a fake clock: every lease judged held or not, parked shards with
their reason, a fleet with no live worker, a checkpoint behind retention, the page (parsed),
the Burrow-style API, the metrics, the cost per round, and never a write."""

from __future__ import annotations

import base64
import dataclasses
import http.client
import json
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kclpy.leases import park as parking
from kclpy.leases.lease import Lease
from kclpy.leases.table import LeaseTable
from kclpy.local import LocalEndpoint
from kclpy.metrics import Metrics
from kclpy.ops.commands import parse_args
from kclpy.ops.lag import Lag, LagAlerts, Observation, ShardEvaluation, ShardStatus
from kclpy.ops.monitor import (
    ApplicationWatch,
    AppView,
    Monitor,
    ShardView,
    exported_names,
    serve_monitor,
)
from kclpy.ops.monitor.command import build
from kclpy.ops.monitor.page import render
from kclpy.ops.monitor.service import TableDiscovery, is_lease_table
from kclpy.position import Position
from kclpy.streams import StreamIdentifier, multi_stream_lease_key
from tests.support.cli import run_cli
from tests.support.faultproxy import FaultProxy
from tests.support.iam import Names, assert_allowed
from tests.support.promql import Rule, Scrapes, by_name, firing, rules_from_yaml_block
from tests.support.streams import (
    create_stream,
    dynamodb_client,
    kinesis_client,
    put_plain,
    unique_name,
)
from tests.support.waiting import wait_for
from tests.support.webhooks import Receiver, receiving

ROOT = Path(__file__).resolve().parents[2]
WINDOW_S = 20.0
INTERVAL_S = 5.0
FAILOVER_S = 10.0
#: what a lease owner or a park reason may say: markup that must stay text on the page
HOSTILE = '<script>alert("x")</script> & <b>'
SHARD = "shardId-000000000000"
FINISHED = "shardId-000000000990"
EXPIRED = "shardId-000000000999"

#: every DynamoDB operation that writes
WRITES = {"PutItem", "UpdateItem", "DeleteItem", "BatchWriteItem", "TransactWriteItems",
          "CreateTable", "DeleteTable", "UpdateTable"}


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class App:
    name: str
    stream: str
    held: str
    parked: str
    unleased: str
    table: LeaseTable


@pytest.fixture
def proxy(moto_server: LocalEndpoint) -> Iterator[FaultProxy]:
    with FaultProxy(moto_server.url, record_calls=True) as recording:
        yield recording


def make_app(url: str) -> App:
    """A stream of three shards with records on each; one lease held (by a worker whose
    name is markup), one parked by an operator with a reason that is markup (the child of a
    finished shard the stream no longer lists), one shard with no lease, and an unfinished
    lease of a shard the stream no longer lists (its records gone with the retention)."""
    kinesis = kinesis_client(url)
    stream = unique_name("mon")
    create_stream(kinesis, stream, 3)
    shards = sorted(s["ShardId"] for s in kinesis.list_shards(StreamName=stream)["Shards"])
    for n in range(30):
        put_plain(kinesis, stream, [f"r-{n}".encode()], partition_keys=[f"k{n}"])
    name = unique_name("mon-app")
    dynamodb = dynamodb_client(url)
    table = LeaseTable(dynamodb, name)
    table.create_if_missing()
    held, parked, unleased = shards
    table.create(Lease(held, lease_owner=HOSTILE, lease_counter=3, stream_name=stream,
                       checkpoint=Position.trim_horizon()))
    table.create(Lease(parked, stream_name=stream, checkpoint=Position.trim_horizon(),
                       parent_shard_ids=frozenset({FINISHED})))
    dynamodb.update_item(TableName=name, Key={"leaseKey": {"S": parked}},
                         UpdateExpression="SET kclpyParked = :p",
                         ExpressionAttributeValues={
                             ":p": {"S": parking.marker(HOSTILE, "an operator")}})
    table.create(Lease(FINISHED, stream_name=stream, checkpoint=Position.shard_end(),
                       child_shard_ids=frozenset({parked})))
    table.create(Lease(EXPIRED, stream_name=stream, lease_owner="w-old",
                       checkpoint=Position.trim_horizon()))
    return App(name, stream, held, parked, unleased, table)


def watch(app: App, url: str, clock: FakeClock, **kw: Any) -> ApplicationWatch:
    return ApplicationWatch(app.name, kinesis_client(url), dynamodb_client(url),
                            window_s=WINDOW_S, failover_s=FAILOVER_S, records_limit=10,
                            clock=clock, **kw)


def rounds(monitor: Monitor, clock: FakeClock, n: int) -> None:
    for _ in range(n):
        monitor.run_once()
        clock.now += INTERVAL_S


@pytest.mark.integration
def test_every_lease_is_judged_held_or_not_and_a_dead_fleet_is_an_error(
        moto_server: LocalEndpoint) -> None:
    app = make_app(moto_server.url)
    clock = FakeClock()
    events: list[dict[str, Any]] = []
    monitor = Monitor([watch(app, moto_server.url, clock)], interval_s=INTERVAL_S,
                      notify=events.append, clock=clock)
    monitor.run_once()
    first = monitor.view(app.name)
    assert first is not None and first.streams == (app.stream,)
    shards = {s.shard_id: s for s in first.shards}
    # before a failover time has passed, the owner's silence proves nothing
    assert first.live_workers == (HOSTILE, "w-old")
    assert shards[app.held].status == "OK"  # held: consuming, until a window says not
    assert shards[app.held].records_behind == 10 and not shards[app.held].records_exact
    mark = shards[app.parked].parked
    assert mark is not None and mark["reason"] == HOSTILE and mark["by"] == "an operator"
    assert shards[app.parked].status == "WARN", shards[app.parked].reason
    assert shards[EXPIRED].behind_retention and not shards[FINISHED].behind_retention
    assert first.unleased_shards == (f"{app.stream}/{app.unleased}",)
    assert first.status == "ERR" and "retention" in first.reasons[0]

    rounds(monitor, clock, 5)
    view = monitor.view(app.name)
    assert view is not None
    shards = {s.shard_id: s for s in view.shards}
    assert shards[app.held].status == "STOP"
    assert "is not being renewed" in shards[app.held].reason
    assert shards[app.parked].status == "STOP"
    assert view.live_workers == ()
    assert any(r.startswith("no live worker") for r in view.reasons), view.reasons
    # one event per change, none for a first OK
    changes = {key: [e["status"] for e in events if e["shard_id"] == key]
               for key in (None, app.held, app.parked, EXPIRED)}
    assert changes == {None: ["ERR"], app.held: ["STOP"], app.parked: ["WARN", "STOP"],
                       EXPIRED: []}


def lag_alerts_document() -> dict[str, Any]:
    events: list[dict[str, Any]] = []
    observation = Observation(time=0.0, checkpoint="1", sub_sequence_number=0,
                              lag=Lag(3, True, 1500))
    LagAlerts(Metrics(), "app", events.append).publish(
        {"s": ShardEvaluation(ShardStatus.STOP, "why", 1.0, observation)})
    return events[0]


@pytest.mark.integration
def test_the_webhook_document_is_the_workers_plus_the_stream(
        moto_server: LocalEndpoint) -> None:
    app = make_app(moto_server.url)
    clock = FakeClock()
    events: list[dict[str, Any]] = []
    monitor = Monitor([watch(app, moto_server.url, clock)], interval_s=INTERVAL_S,
                      notify=events.append, clock=clock)
    monitor.run_once()
    shard_events = [e for e in events if e["shard_id"] == app.parked]
    assert set(shard_events[0]) == set(lag_alerts_document()) | {"stream"}
    assert shard_events[0]["stream"] == app.stream
    assert shard_events[0]["application"] == app.name


@pytest.mark.integration
def test_a_checkpoint_older_than_the_retention_is_behind_it(
        moto_server: LocalEndpoint) -> None:
    """The records after the held shard's checkpoint look 23 hours old to a clock a day
    ahead: 24 hours of retention, 90 % of it gone."""
    app = make_app(moto_server.url)
    clock = FakeClock()
    ahead = watch(app, moto_server.url, clock,
                  wall_clock=lambda: time.time() + 23 * 3600)
    view = ahead.sample()
    held = next(s for s in view.shards if s.shard_id == app.held)
    assert held.behind_retention and view.status == "ERR"
    fresh = watch(app, moto_server.url, clock).sample()
    assert not next(s for s in fresh.shards if s.shard_id == app.held).behind_retention


@pytest.mark.integration
def test_a_round_costs_the_documented_reads_and_writes_nothing(
        proxy: FaultProxy, moto_server: LocalEndpoint) -> None:
    app = make_app(moto_server.url)
    clock = FakeClock()
    monitor = Monitor([watch(app, proxy.url, clock)], interval_s=INTERVAL_S, clock=clock)
    rounds(monitor, clock, 4)
    calls = Counter(call.operation for call in proxy.calls())
    # per round: 1 Scan, 1 ListShards, and per listed unfinished lease 1 GetShardIterator
    # and 1 GetRecords (the probe's records limit is reached at once: never a second page)
    # plus DescribeStreamSummary once (the retention, read again every 10 minutes)
    leases_probed = 2
    assert calls == Counter({"Scan": 4, "ListShards": 4, "GetShardIterator": 4 * leases_probed,
                             "GetRecords": 4 * leases_probed, "DescribeStreamSummary": 1})
    assert not set(calls) & WRITES
    arn = kinesis_client(moto_server.url).describe_stream_summary(StreamName=app.stream)[
        "StreamDescriptionSummary"]["StreamARN"]
    _, _, _, region, account, _ = arn.split(":", 5)
    assert_allowed("monitor", proxy.calls(),
                   Names(region=region, account=account, stream=app.stream,
                         application=app.name))


class Page(HTMLParser):
    """What the page shows: each application's status, each shard row's id, status and
    depth, the SVG charts, the refresh, and every text and script tag."""

    def __init__(self) -> None:
        super().__init__()
        self.apps: dict[str, str] = {}
        self.rows: list[dict[str, str]] = []
        self.svgs = 0
        self.scripts = 0
        self.refresh: str | None = None
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = {k: v or "" for k, v in attrs}
        if tag == "section":
            self.apps[attributes["id"].removeprefix("app-")] = attributes["data-status"]
        elif tag == "tr" and "data-shard" in attributes:
            self.rows.append(attributes)
        elif tag == "svg":
            self.svgs += 1
        elif tag == "script":
            self.scripts += 1
        elif tag == "meta" and attributes.get("http-equiv") == "refresh":
            self.refresh = attributes["content"]

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def get(url: str) -> tuple[int, str, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.headers["Content-Type"], response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["Content-Type"], exc.read()


@pytest.mark.integration
def test_the_page_the_api_and_the_metrics_over_http(moto_server: LocalEndpoint) -> None:
    app = make_app(moto_server.url)
    clock = FakeClock()
    monitor = Monitor([watch(app, moto_server.url, clock)], interval_s=INTERVAL_S, clock=clock)
    rounds(monitor, clock, 5)
    with serve_monitor(monitor) as server:
        code, kind, body = get(server.url + "/")
        assert code == 200 and kind.startswith("text/html")
        page = Page()
        page.feed(body.decode())
        assert page.apps == {app.name: "ERR"}
        assert page.refresh == "5" and page.scripts == 0
        # lineage: the parked child right under its (unlisted) parent, one level deeper
        ids = [(row["data-shard"], row["data-status"]) for row in page.rows]
        assert [i for i, _ in ids] == [app.held, FINISHED, app.parked, EXPIRED]
        assert [row["data-depth"] for row in page.rows] == ["0", "0", "1", "0"]
        text = "".join(page.text)
        assert HOSTILE in text  # shown as text: owner and park reason
        assert "PARKED" in text and "BEHIND RETENTION" in text
        assert page.svgs >= 2

        code, kind, body = get(server.url + "/v1/applications")
        assert (code, json.loads(body)) == (200, {
            "error": False, "message": "application list returned",
            "applications": [app.name]})
        code, _, body = get(f"{server.url}/v1/applications/{app.name}/status")
        status = json.loads(body)["status"]
        assert code == 200 and status["status"] == "ERR"
        assert status["parked"] == [app.parked]
        assert {s["shard_id"] for s in status["shards"]} == {app.held, app.parked, EXPIRED}
        code, _, body = get(f"{server.url}/v1/applications/{app.name}/shards")
        shards = {s["shard_id"]: s for s in json.loads(body)["status"]["shards"]}
        assert set(shards) == {app.held, app.parked, FINISHED, EXPIRED}
        assert shards[app.parked]["parked"]["reason"] == HOSTILE
        assert shards[app.parked]["parents"] == [FINISHED]
        assert len(shards[app.held]["history"]) == 5
        code, _, body = get(f"{server.url}/v1/applications/nope/status")
        assert code == 404 and json.loads(body)["error"] is True

        code, _, body = get(server.url + "/metrics")
        assert code == 200
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for family in text_string_to_metric_families(body.decode())
                   for s in family.samples}
        where = (("application", app.name), ("shard_id", app.held), ("stream", app.stream))
        assert samples[("kclpy_shard_lag_status",
                        tuple(sorted((*where, ("status", "STOP")))))] == 1
        assert samples[("kclpy_monitor_shard_lag_records", where)] == 10
        assert samples[("kclpy_application_lag_status",
                        (("application", app.name), ("status", "ERR")))] == 1
        assert samples[("kclpy_monitor_shards_parked",
                        (("application", app.name), ("stream", app.stream)))] == 1
        assert samples[("kclpy_monitor_live_workers", (("application", app.name),))] == 0
        assert {name for name, _ in samples} <= exported_names()

        assert get(server.url + "/healthz")[0] == 200

        # a page for browsers: a name re-pointed at it (DNS rebinding) is refused, counted
        connection = http.client.HTTPConnection(server.host, server.port, timeout=10)
        connection.request("GET", "/", headers={"Host": "attacker.example"})
        assert connection.getresponse().status == 421
        connection.close()
        _, _, body = get(server.url + "/metrics")
        refused = {(s.name, s.labels.get("reason")): s.value
                   for family in text_string_to_metric_families(body.decode())
                   for s in family.samples if s.name.startswith("kclpy_ops_requests_refused")}
        assert refused[("kclpy_ops_requests_refused_total", "misdirected")] == 1
        assert {name for name, _ in refused} <= exported_names()


@pytest.mark.integration
def test_all_applications_finds_the_lease_tables_only(moto_server: LocalEndpoint) -> None:
    app = make_app(moto_server.url)
    dynamodb = dynamodb_client(moto_server.url)
    other = unique_name("not-leases")
    dynamodb.create_table(TableName=other, BillingMode="PAY_PER_REQUEST",
                          KeySchema=[{"AttributeName": "wid", "KeyType": "HASH"}],
                          AttributeDefinitions=[{"AttributeName": "wid",
                                                 "AttributeType": "S"}])
    found = TableDiscovery(dynamodb).lease_tables()
    assert app.name in found and other not in found
    assert not is_lease_table(dynamodb.describe_table(TableName=other)["Table"])
    args = parse_args(["monitor", "--all-applications", "--port", "0",
                       "--stream-name", app.stream, "--window-s", "20", "--interval-s", "5"])
    monitor = build(args, kinesis_client(moto_server.url), dynamodb)
    monitor.run_once()
    assert app.name in monitor.applications() and other not in monitor.applications()
    view = monitor.view(app.name)
    assert view is not None and view.streams == (app.stream,)


@pytest.mark.parametrize(("argv", "option"), [
    (["--port", "1"], "--application-name"),
    (["--application-name", "a", "--port", "70000"], "--port"),
    (["--application-name", "a", "--port", "1", "--interval-s", "20", "--window-s", "30"],
     "--interval-s"),
    (["--application-name", "a", "--port", "1", "--window-s", "-1"], "--window-s"),
    (["--application-name", "a", "--all-applications", "--port", "1"],
     "--all-applications"),
    (["--application-name", "a", "--port", "1", "--lag-webhook", "ftp://u:secret@h/"],
     "--lag-webhook"),
])
def test_bad_flags_exit_2_naming_the_option(argv: list[str], option: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "monitor", *argv)
    assert (code, out) == (2, "")
    assert err.startswith("kclpy monitor: error: ") and err.count("\n") == 1, err
    assert option in err and "secret" not in err


def test_a_busy_port_exits_2_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, _, err = run_cli(capsys, "monitor", "--application-name", "a", "--port",
                               str(port), "--region", "us-east-1")
    assert code == 2 and err.startswith("kclpy monitor: error: --port: cannot serve on")


def test_the_host_defaults_to_loopback() -> None:
    args = parse_args(["monitor", "--application-name", "a", "--port", "0"])
    assert args.host == "127.0.0.1"


# -- the docs: alert rules evaluated over the monitor's scrapes, the Grafana panel ---------

TIME_SCALE = 10.0


def operations_section(heading: str, language: str) -> str:
    text = (ROOT / "docs" / "operations.md").read_text(encoding="utf-8")
    section = text.split(heading, 1)[1]
    block = re.search(rf"```{language}\n(.*?)```", section, re.DOTALL)
    assert block is not None
    return block.group(1)


def monitor_rules() -> dict[str, Rule]:
    return dict(by_name(rules_from_yaml_block(
        operations_section("### Alert rules over the monitor", "yaml"))))


def make_healthy_app(url: str) -> tuple[str, Any]:
    """An application whose worker renews its lease and has read everything."""
    stream = unique_name("mon-ok")
    create_stream(kinesis_client(url), stream, 1)
    name = unique_name("mon-ok-app")
    dynamodb = dynamodb_client(url)
    table = LeaseTable(dynamodb, name)
    table.create_if_missing()
    table.create(Lease("shardId-000000000000", lease_owner="w-1", lease_counter=1,
                       stream_name=stream, checkpoint=Position.trim_horizon()))
    return name, dynamodb


def scraped(monitor: Monitor, clock: FakeClock, n: int,
            between: Callable[[], None] = lambda: None) -> Scrapes:
    scrapes = Scrapes()
    for _ in range(n):
        between()
        monitor.run_once()
        scrapes.add_text(clock.now * TIME_SCALE, generate_latest(monitor.registry).decode())
        clock.now += INTERVAL_S
    return scrapes


@pytest.mark.integration
def test_the_monitor_rules_fire_on_a_dead_application_and_not_on_a_healthy_one(
        moto_server: LocalEndpoint) -> None:
    rules = monitor_rules()
    assert set(rules) >= {"KclpyMonitorApplicationError", "KclpyMonitorNoLiveWorker",
                          "KclpyMonitorShardParked", "KclpyMonitorBehindRetention"}
    name, dynamodb = make_healthy_app(moto_server.url)

    def renew() -> None:
        dynamodb.update_item(TableName=name, Key={"leaseKey": {"S": "shardId-000000000000"}},
                             UpdateExpression="SET leaseCounter = leaseCounter + :one",
                             ExpressionAttributeValues={":one": {"N": "1"}})

    clock = FakeClock()
    healthy = Monitor([ApplicationWatch(name, kinesis_client(moto_server.url), dynamodb,
                                        window_s=WINDOW_S, failover_s=FAILOVER_S,
                                        clock=clock)], interval_s=INTERVAL_S, clock=clock)
    scrapes = scraped(healthy, clock, 10, renew)
    assert healthy.view(name) is not None
    assert [s.status for s in healthy.views()] == ["OK"]
    for rule in rules.values():
        assert firing(rule, scrapes, time_scale=TIME_SCALE) == [], rule.alert

    app = make_app(moto_server.url)
    dead = Monitor([watch(app, moto_server.url, clock)], interval_s=INTERVAL_S, clock=clock)
    scrapes = scraped(dead, clock, 10)
    fired = {alert for alert, rule in rules.items()
             if firing(rule, scrapes, time_scale=TIME_SCALE)}
    assert fired == {"KclpyMonitorApplicationError", "KclpyMonitorNoLiveWorker",
                     "KclpyMonitorShardParked", "KclpyMonitorBehindRetention"}


def test_the_grafana_panel_parses_and_reads_only_the_monitors_metrics() -> None:
    panel = json.loads(operations_section("### A Grafana panel", "json"))
    exprs = [target["expr"] for target in panel["targets"]]
    used = {name for expr in exprs for name in re.findall(r"\bkclpy_[a-z_]+", expr)}
    assert used and used <= exported_names(), used - exported_names()
    for expr in exprs:
        assert "application" in expr


# -- the page on its own, and the command as a process --------------------------------------


def shard_view(shard_id: str, parents: tuple[str, ...] = (), **kw: Any) -> ShardView:
    fields: dict[str, Any] = {
        "lease_key": shard_id, "shard_id": shard_id, "stream": "s", "status": "OK",
        "reason": "consuming", "complete": 1.0, "owner": "w-1", "checkpoint": "1",
        "lease_counter": 1, "records_behind": 0, "records_exact": True, "millis_behind": 0,
        "parents": parents, "children": (), "checkpoint_age_s": 4.0, "observed_s": 30.0,
        "history": ((20.0, 0, 0), (10.0, 1500, 3), (0.0, 0, 0))}
    fields.update(kw)
    return ShardView(**fields)


def test_the_page_shows_a_split_and_a_merge_as_lineage_and_marks_each_state() -> None:
    """0 split into 1 and 2, which merged into 3: 3 is listed once, under its first
    parent; a recovering shard and one parked since a time are marked, and the
    application's own name is escaped too."""
    shards = (
        shard_view("shardId-0", finished=True, checkpoint="SHARD_END"),
        shard_view("shardId-1", ("shardId-0",), recovering=True),
        shard_view("shardId-2", ("shardId-0",), owner=None, status="STOP",
                   parked={"reason": "bad <batch>", "by": "ops", "atMs": 1_795_000_000_000}),
        shard_view("shardId-3", ("shardId-1", "shardId-2"), waiting_on_parents=True,
                   checkpoint_age_s=None, history=()),
    )
    view = AppView(name="<app>", table="<app>", status="ERR", reasons=("why <not>",),
                   window_s=30.0, complete=1.0, streams=("s",), shards=shards,
                   owners=("w-1",), live_workers=("w-1",), unleased_shards=(),
                   evaluated_ms=1_795_000_000_000)
    page = Page()
    page.feed(render([view], 30.0, 1_795_000_030_000))
    assert page.apps == {"<app>": "ERR"} and page.scripts == 0 and page.refresh == "30"
    assert [(r["data-shard"], r["data-depth"]) for r in page.rows] == [
        ("shardId-0", "0"), ("shardId-1", "1"), ("shardId-3", "2"), ("shardId-2", "1")]
    text = "".join(page.text)
    assert "RECOVERING" in text and "FINISHED" in text and "WAITING ON PARENTS" in text
    assert "bad <batch> since 2026-11-18 11:06:40Z" in text
    assert "why <not>" in text and "\u2265 30s" in text  # an age not seen to change yet
    assert page.svgs == 3  # no chart without a history


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    """A webhook receiver whose first POST fails (500): the monitor must retry it."""
    with receiving(fail=1) as server:
        yield server


@pytest.mark.integration
def test_the_command_serves_posts_changes_and_exits_0_on_sigterm(
        moto_server: LocalEndpoint, receiver: Receiver) -> None:
    """As a process: the URL on stdout, the API answering, every change POSTed with the
    URL's credentials as a basic Authorization header (the failed first POST retried), and
    the credentials nowhere in its output."""
    app = make_app(moto_server.url)
    hook = f"http://user:s3cret-token@127.0.0.1:{receiver.port}/hook?key=s3cret-key"
    process = subprocess.Popen(
        [sys.executable, "-m", "kclpy.ops.commands", "monitor", "--application-name",
         app.name, "--port", "0", "--window-s", "10", "--interval-s", "1",
         "--lag-webhook", hook, "--log-level", "DEBUG",
         "--region", "us-east-1", "--kinesis-endpoint", moto_server.url,
         "--dynamodb-endpoint", moto_server.url],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        url = process.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:"), url

        def evaluated() -> dict[str, Any] | None:
            code, _, body = get(f"{url}/v1/applications/{app.name}/status")
            return json.loads(body)["status"] if code == 200 else None

        status = wait_for(evaluated, 60, "the first evaluation")
        assert status["application"] == app.name and status["status"] == "ERR"
        posted = wait_for(lambda: [d for d in receiver.documents() if d["shard_id"] is None],
                          60, "the application's change POSTed", seen=receiver.documents)
        assert posted[0]["status"] == "ERR" and posted[0]["application"] == app.name
        with receiver.lock:
            headers = receiver.posts[0][0]
            assert receiver.fail < 0  # the first POST was answered 500, then retried
        assert headers["Authorization"] == "Basic " + base64.b64encode(
            b"user:s3cret-token").decode()
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=60)
        assert process.returncode == 0, err
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert "s3cret" not in out + err
    assert f"webhook http://127.0.0.1:{receiver.port}/hook" in err


@pytest.mark.integration
def test_a_multi_stream_tables_streams_come_from_its_lease_keys(
        moto_server: LocalEndpoint) -> None:
    """Each stream of a multi-stream table judged apart, by the name in its lease keys; an
    older incarnation's leases (a stream deleted and created again) left out; and
    ``--stream-name`` picks one stream."""
    kinesis = kinesis_client(moto_server.url)
    streams = [unique_name("mon-ms") for _ in range(2)]
    name = unique_name("mon-ms-app")
    table = LeaseTable(dynamodb_client(moto_server.url), name)
    table.create_if_missing()
    identifiers = []
    for stream in streams:
        create_stream(kinesis, stream, 1)
        summary = kinesis.describe_stream_summary(StreamName=stream)
        identifier = StreamIdentifier.from_summary(summary["StreamDescriptionSummary"])
        identifiers.append(identifier)
        table.create(Lease(multi_stream_lease_key(identifier.serialize(), SHARD),
                           lease_owner="w-1", stream=identifier.serialize(),
                           checkpoint=Position.trim_horizon()))
    older = dataclasses.replace(identifiers[0],
                                creation_epoch=identifiers[0].creation_epoch - 60)
    table.create(Lease(multi_stream_lease_key(older.serialize(), SHARD), lease_owner="w-0",
                       stream=older.serialize(), checkpoint=Position.trim_horizon()))
    clock = FakeClock()
    dynamodb = dynamodb_client(moto_server.url)
    view = ApplicationWatch(name, kinesis, dynamodb, window_s=WINDOW_S,
                            failover_s=FAILOVER_S, clock=clock).sample()
    assert view.streams == tuple(sorted(streams))
    assert sorted((s.stream, s.shard_id, s.owner) for s in view.shards) == sorted(
        (stream, SHARD, "w-1") for stream in streams)
    assert {s.lease_key for s in view.shards} == {
        multi_stream_lease_key(i.serialize(), SHARD) for i in identifiers}
    one = ApplicationWatch(name, kinesis, dynamodb, window_s=WINDOW_S, failover_s=FAILOVER_S,
                           stream_name=streams[1], clock=clock).sample()
    assert one.streams == (streams[1],) and len(one.shards) == 1
