"""Lease assignment by load (kclpy.leases.load): the steal rules, the meter, the options."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import pytest

from kclpy import KCLConfig, Worker
from kclpy.arguments import parse_worker_args
from kclpy.cli import worker_main
from kclpy.config import build_config, from_properties
from kclpy.leases.assignment import LOAD, TakerView, choose_steals, project
from kclpy.leases.dynamo import LeaseTableThrottled
from kclpy.leases.lease import Lease
from kclpy.leases.load import (
    LOAD_TABLE_SUFFIX,
    LoadBalancing,
    LoadMeter,
    LoadSettings,
    LoadTable,
    WorkerLoad,
    load_balancing,
)
from kclpy.local import LocalEndpoint
from kclpy.metrics import Metrics
from tests.support.fleet import load_flags
from tests.support.recording import Ledger, RecordingProcessor
from tests.support.streams import (
    REGION,
    create_stream,
    dynamodb_client,
    kinesis_client,
    put_plain,
    unique_name,
    wait_for,
)
from tests.support.workers import running

if TYPE_CHECKING:
    from mypy_boto3_dynamodb import DynamoDBClient

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = LoadSettings()


def report(worker: str, leases: dict[str, float], speed: float = 1.0) -> WorkerLoad:
    """A worker's report: its load is its KB/s over its speed (CPU percent)."""
    kbps = sum(leases.values())
    return WorkerLoad(worker, kbps / speed, kbps, kbps, kbps / speed, leases)


def owned(*reports: WorkerLoad) -> dict[str, list[Lease]]:
    return {r.worker_id: [Lease(key, lease_owner=r.worker_id) for key in r.lease_kbps]
            for r in reports}


def test_an_idle_worker_takes_damped_load_from_the_busiest() -> None:
    busy = report("busy", {f"b{i}": 10.0 for i in range(10)})  # 100
    other = report("other", {f"o{i}": 10.0 for i in range(5)})  # 50
    mine = report("me", {})
    steals = choose_steals(mine, {r.worker_id: r for r in (busy, other, mine)},
                           owned(busy, other), SETTINGS)
    # average 50, ceiling 55: only "busy" is a victim; the damped half gap is 30
    assert [lease.lease_owner for lease in steals] == ["busy"] * 3


def test_workers_within_the_threshold_move_nothing() -> None:
    fleet = [report("a", {"a0": 52.0}), report("b", {"b0": 50.0}), report("c", {"c0": 48.0})]
    by_id = {r.worker_id: r for r in fleet}
    for mine in fleet:
        assert choose_steals(mine, by_id, owned(*fleet), SETTINGS) == []


def test_no_lease_is_taken_that_would_make_the_thief_the_busier_one() -> None:
    """One hot shard on a worker: moving it would only move the problem."""
    hot = report("hot", {"h0": 90.0})
    mine = report("me", {"m0": 10.0})
    assert choose_steals(mine, {"hot": hot, "me": mine}, owned(hot), SETTINGS) == []


def test_overshoot_takes_the_smallest_lease_that_helps_only_when_allowed() -> None:
    victim = report("v", {"big": 60.0, "mid": 30.0})  # 90
    mine = report("me", {"m0": 30.0})  # 30; average 60, damped quota 18: nothing fits
    fleet = {"v": victim, "me": mine}
    assert [lease.lease_key for lease in choose_steals(mine, fleet, owned(victim),
                                                        SETTINGS)] == ["mid"]
    strict = LoadSettings(allow_overshoot=False)
    assert choose_steals(mine, fleet, owned(victim), strict) == []


def test_a_slower_thief_counts_a_lease_at_its_own_cost() -> None:
    """The thief converts a lease's KB/s into its own load with its own ratio: a slow
    worker takes less throughput for the same load."""
    victim = report("v", {f"v{i}": 10.0 for i in range(10)})  # 100 KB/s at speed 1
    slow = report("slow", {"s0": 10.0}, speed=0.5)  # 10 KB/s = load 20
    steals = choose_steals(slow, {"v": victim, "slow": slow}, owned(victim), SETTINGS)
    # average 60; quota 0.6 * (100 - 20) / 2 = 24 of its load = 12 KB/s: one lease of 10
    assert len(steals) == 1


def test_the_throughput_cap_stops_taking_load() -> None:
    busy = report("busy", {f"b{i}": 10.0 for i in range(10)})
    mine = report("me", {"m0": 5.0})
    capped = LoadSettings(max_kbps=12)
    steals = choose_steals(mine, {"busy": busy, "me": mine}, owned(busy), capped)
    assert steals == []  # the first 10 KB/s lease would take it to 15 KB/s


def test_leases_that_must_not_be_stolen_back_are_left() -> None:
    busy = report("busy", {"b0": 50.0, "b1": 50.0})
    mine = report("me", {})
    fleet = {"busy": busy, "me": mine}
    assert choose_steals(mine, fleet, owned(busy), SETTINGS, no_steal={"b0", "b1"}) == []


def test_meter_rates_per_lease_and_cpu() -> None:
    now = [0.0]
    cpu = [0.0]
    totals: dict[str, tuple[float, float]] = {"a": (0, 0), "b": (0, 0)}
    meter = LoadMeter("w", lambda: totals, clock=lambda: now[0], cpu_seconds=lambda: cpu[0],
                      ema_alpha=0.5)
    meter.sample({"a", "b"})
    now[0], cpu[0] = 10.0, 5.0
    totals.update(a=(100, 10 * 1024 * 10), b=(10, 1024 * 10))
    load = meter.sample({"a", "b"})
    # a lease's rate from the first whole interval it was held; the process's CPU a moving
    # average over the first (empty) interval and this one
    assert load.lease_kbps == {"a": pytest.approx(10.0), "b": pytest.approx(1.0)}
    assert load.cpu_percent == pytest.approx(25.0)
    # the load is the held leases' KB/s at the CPU a KB/s cost: 50 % for 11 KB/s
    assert load.load == pytest.approx(50.0)
    # a lease taken during the interval showed only part of it: not reported until it was
    # held for a whole one; a lease given away counts no more at once
    totals["c"] = (10, 1024 * 50)
    now[0] = 20.0
    load = meter.sample({"a", "c"})
    assert set(load.lease_kbps) == {"a"}
    assert load.kbps == pytest.approx(load.lease_kbps["a"])
    totals["c"] = (20, 1024 * 150)
    now[0] = 30.0
    load = meter.sample({"a", "c"})
    assert load.lease_kbps["c"] == pytest.approx(10.0)
    assert load.kbps == pytest.approx(sum(load.lease_kbps.values()))


def test_a_report_is_judged_as_of_the_lease_table() -> None:
    """A worker that took a lease since its report counts it at what its previous owner
    reported, and the giver no longer counts it: neither looks idle or busy for a move
    already made, so the taker does not take a second lease for the same gap."""
    giver = report("giver", {"a": 20.0, "b": 10.0, "c": 10.0})
    taker = report("taker", {"t": 20.0})
    reports = {"giver": giver, "taker": taker}
    victims = {"giver": [Lease("a", lease_owner="giver"), Lease("c", lease_owner="giver")]}
    # "b" moved to the taker after both reports: judged on them, the taker takes again
    assert choose_steals(taker, reports, victims, SETTINGS) != []
    projected = project(reports, {"a": "giver", "c": "giver", "t": "taker", "b": "taker"},
                        {"b": 10.0})
    assert projected["giver"].load == pytest.approx(30.0)
    assert projected["taker"].load == pytest.approx(30.0)
    assert projected["taker"].lease_kbps == {"t": 20.0, "b": 10.0}
    assert choose_steals(projected["taker"], projected, victims, SETTINGS) == []


def test_java_3_keys_drive_the_options() -> None:
    values, labels = from_properties({
        "streamName": "s", "applicationName": "a", "leaseAssignment": "load",
        "reBalanceThresholdPercentage": "20", "dampeningPercentage": "80",
        "allowThroughputOvershoot": "false", "maxThroughputPerHostKBps": "2048",
        "varianceBalancingFrequency": "5", "workerMetricsEMAAlpha": "0.25",
        "workerMetricsReporterFreqInMillis": "5000"})
    config = build_config(values, labels)
    assert (config.lease_assignment, config.rebalance_threshold_percentage,
            config.dampening_percentage, config.allow_throughput_overshoot,
            config.max_throughput_per_host_kbps, config.variance_balancing_frequency,
            config.worker_metrics_ema_alpha, config.worker_metrics_reporter_freq_ms) == (
        "load", 20, 80, False, 2048, 5, 0.25, 5000)


@pytest.mark.parametrize("settings", [
    LoadSettings(threshold=0.10, dampening=0.6, balance_interval_s=4.0, report_interval_s=4.0),
    LoadSettings(threshold=0.25, dampening=0.8, allow_overshoot=False, max_kbps=2048.0,
                 balance_interval_s=12.0, report_interval_s=5.0, ema_alpha=0.25),
])
def test_a_fleets_load_flags_give_its_workers_those_settings(
        settings: LoadSettings, monkeypatch: pytest.MonkeyPatch) -> None:
    """tests/leases/test_load_real.py predicts with the settings its worker processes balance with:
    the flags ``load_flags`` makes, parsed as ``kclpy-worker`` parses them."""
    monkeypatch.chdir(ROOT)
    config, _ = parse_worker_args([
        "--stream-name", "s", "--application-name", "a", "--failover-time-ms", "2000",
        "--processor", "examples/printing_processor.py:PrintingProcessor",
        *load_flags(settings, failover_s=2.0)])
    balancing = load_balancing(config, cast("DynamoDBClient", None), Metrics())
    assert balancing is not None and balancing.settings == settings
    with pytest.raises(ValueError, match="multiple of 2 x the failover time"):
        load_flags(settings, failover_s=5.0)


@pytest.mark.parametrize(("text", "option"), [
    ("leaseAssignment = fair\n", "leaseAssignment"),
    ("dampeningPercentage = 150\n", "dampeningPercentage"),
    ("dampeningPercentage = 0\n", "dampeningPercentage"),
    ("workerMetricsEMAAlpha = 0\n", "workerMetricsEMAAlpha"),
    ("workerMetricsEMAAlpha = half\n", "workerMetricsEMAAlpha"),
    ("reBalanceThresholdPercentage = -1\n", "reBalanceThresholdPercentage"),
    ("varianceBalancingFrequency = 0\n", "varianceBalancingFrequency"),
    ("maxThroughputPerHostKBps = lots\n", "maxThroughputPerHostKBps"),
    ("allowThroughputOvershoot = maybe\n", "allowThroughputOvershoot"),
])
def test_bad_load_options_exit_2_naming_the_key(
        text: str, option: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    path = tmp_path / "app.properties"
    path.write_text("streamName = s\napplicationName = a\n" + text)
    code = worker_main(["--properties", str(path),
                        "--processor", "examples/printing_processor.py:PrintingProcessor"])
    assert code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and option in lines[0], lines


def test_bad_flag_exits_2_naming_it(capsys: pytest.CaptureFixture[str],
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    code = worker_main(["--stream-name", "s", "--application-name", "a", "--processor",
                        "examples/printing_processor.py:PrintingProcessor",
                        "--lease-assignment", "random"])
    assert code == 2
    assert "--lease-assignment" in capsys.readouterr().err


@pytest.mark.integration
def test_over_http_workers_publish_their_load_and_withdraw_it_on_shutdown(
        embedded_endpoint: LocalEndpoint) -> None:
    """Two workers with ``--lease-assignment load`` on the local endpoint: each publishes
    its load in ``<lease table>-kclpyWorkerLoad`` (the records its processors handled, per
    lease), every record is delivered, and a stopping worker deletes its report. A lease is
    measured once held for a whole report interval, so traffic keeps flowing until a
    report shows it."""
    url = embedded_endpoint.url
    kinesis, dynamodb = kinesis_client(url), dynamodb_client(url)
    stream, app = unique_name("load-stream"), unique_name("load-app")
    create_stream(kinesis, stream, 2)
    put_plain(kinesis, stream, [b"x" * 500] * 200)
    ledger = Ledger()

    def worker(name: str) -> Worker:
        return Worker(KCLConfig(
            application_name=app, stream_name=stream, region=REGION, worker_id=name,
            kinesis_endpoint=url, dynamodb_endpoint=url, initial_position="TRIM_HORIZON",
            failover_time_ms=3000, idle_time_between_reads_ms=100, max_records=20,
            lease_assignment="load", worker_metrics_reporter_freq_ms=200),
            lambda: RecordingProcessor(ledger))

    def reports() -> dict[str, dict[str, Any]]:
        items = dynamodb.scan(TableName=app + LOAD_TABLE_SUFFIX)["Items"]
        return {item["workerId"]["S"]: item for item in items}

    with running(worker("a")), running(worker("b")):
        wait_for(lambda: sum(len(v) for v in ledger.by_shard().values()) == 200, 60,
                 "every record delivered")
        wait_for(lambda: set(reports()) == {"a", "b"}, 30, "both workers' reports")

        def traffic_reported() -> bool:
            put_plain(kinesis, stream, [b"y" * 500] * 20)
            return sum(float(r["kbps"]["N"]) for r in reports().values()) > 0

        wait_for(traffic_reported, 30, "a report of the traffic", interval=0.2)
        leases = {key for r in reports().values() for key in r["leases"]["M"]}
        assert leases <= {"shardId-000000000000", "shardId-000000000001"}
    assert reports() == {}


class FailingTable(LoadTable):
    """A load table DynamoDB keeps throttling."""

    def __init__(self) -> None:
        super().__init__(cast("DynamoDBClient", None), "t-kclpyWorkerLoad")

    def publish(self, load: WorkerLoad) -> None:
        raise LeaseTableThrottled("PutItem throttled")

    def read_all(self) -> list[WorkerLoad]:
        raise LeaseTableThrottled("Scan throttled")


def test_an_unreachable_load_table_only_falls_back_to_the_count_rule() -> None:
    """Reports that cannot be written or read cost the round, never the taker's cycle: the
    count rule's steals are made as for an idle fleet."""
    now = [0.0]
    meter = LoadMeter("me", dict, clock=lambda: now[0], cpu_seconds=lambda: 0.0)
    balancing = LoadBalancing(meter, FailingTable(), SETTINGS, clock=lambda: now[0])
    count_steal = Lease("s", lease_owner="other")
    view = TakerView([count_steal], set(), live=lambda lease: True, no_steal=(), busy=False,
                     count_steals=[count_steal], load=balancing)
    assert LOAD.steals(view) == [count_steal]
