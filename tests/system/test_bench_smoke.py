"""The end-to-end benchmarks' harness works on a tiny input: every contender sees every
record once, child processes report back, the DynamoDB counter counts. Nothing is timed."""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest

from bench import (
    consume,
    dynamodb_cost,
    exactly_once,
    fleet_scale,
    kpl_steps,
    latency,
    replay,
    scale,
    spark_source,
)
from kclpy.local import LocalEndpoint

PLAIN, KPL = 120, 700


@pytest.fixture(scope="module")
def kinesis() -> Iterator[str]:
    streams = [replay.build_stream(0, replay.StreamSpec("plain", 2, PLAIN // 2, 50)),
               replay.build_stream(1, replay.StreamSpec("kpl", 1, KPL, 100, kpl=True))]
    with replay.ReplayServer(streams) as server:
        yield server.url


@pytest.mark.parametrize(("stream", "records", "size"), [("plain", PLAIN, 50),
                                                         ("kpl", KPL, 100)])
def test_boto3_loop_reads_every_user_record(kinesis: str, stream: str, records: int,
                                            size: int) -> None:
    measured = consume.consume_boto3(kinesis, stream, records, stream == "kpl")
    assert (measured.records, measured.bytes) == (records, records * size)
    assert measured.cpu_s > 0


@pytest.mark.parametrize(("stream", "records", "size"), [("plain", PLAIN, 50),
                                                         ("kpl", KPL, 100)])
def test_kclpy_worker_reads_every_user_record(kinesis: str, embedded_endpoint: LocalEndpoint,
                                              stream: str, records: int, size: int) -> None:
    measured = consume.consume_kclpy(kinesis, embedded_endpoint.url, stream, records,
                                     stream == "kpl", timeout_s=60)
    assert (measured.records, measured.bytes) == (records, records * size)


@pytest.mark.parametrize(("stream", "records", "size"), [("plain", PLAIN, 50),
                                                         ("kpl", KPL, 100)])
def test_fan_out_contenders_read_every_user_record(
        kinesis: str, embedded_endpoint: LocalEndpoint, stream: str, records: int,
        size: int) -> None:
    bare = consume.consume_boto3_subscribe(kinesis, stream, records, stream == "kpl")
    ours = consume.consume_kclpy(kinesis, embedded_endpoint.url, stream, records,
                                 stream == "kpl", timeout_s=60, retrieval_mode="fanout")
    for measured in (bare, ours):
        assert (measured.records, measured.bytes) == (records, records * size)


def test_a_contender_in_a_child_process_reports_its_measurement(kinesis: str) -> None:
    measured = consume.run_child(sys.executable, "boto3", kinesis, "http://127.0.0.1:9",
                                 "plain", PLAIN, kpl=False)
    assert measured.records == PLAIN


def test_a_failing_child_is_an_error(kinesis: str) -> None:
    with pytest.raises(RuntimeError, match="boto3 failed"):
        consume.run_child(sys.executable, "boto3", kinesis, "http://127.0.0.1:9", "nope",
                          PLAIN, kpl=False)


def test_tally_stops_the_clock_at_the_expected_count() -> None:
    tally = consume.Tally(5, consume._Clock())
    tally.add(3, 30)
    assert not tally.done.is_set()
    with pytest.raises(RuntimeError):
        tally.measurement()
    tally.add(2, 20)
    assert tally.done.is_set()
    assert tally.measurement().bytes == 50


def test_rss_is_read_from_proc() -> None:
    assert scale.rss() > 10 * scale.MB


def test_dynamodb_requests_are_counted_per_operation(embedded_endpoint: LocalEndpoint) -> None:
    counter = dynamodb_cost.RequestCounter()
    session = boto3.session.Session(region_name="us-east-1")
    counter.attach(session)
    client = session.client("dynamodb", endpoint_url=embedded_endpoint.url)
    client.list_tables()
    client.list_tables()
    assert counter.snapshot()["ListTables"] == 2


def test_java_figure_follows_its_intervals() -> None:
    renewals, scans = dynamodb_cost.java_per_shard_hour(shards=10, workers=2, failover_s=10.0)
    assert renewals == pytest.approx(1080)
    assert scans == pytest.approx(2 * 3600 / 20.05 / 10)


def test_the_kpl_step_breakdown_covers_every_step_and_every_user_record() -> None:
    spent, users = kpl_steps.kclpy_steps(kpl_steps.bodies(KPL))
    assert users == KPL
    assert set(spent) == set(kpl_steps.STEPS)


def test_exactly_once_bench_counts_one_commit_per_page_and_an_update_per_change(
        moto_server: LocalEndpoint) -> None:
    pages = exactly_once.batches(40, 20, 5)  # 5 keys: 10 state items, one commit per page
    stateful = exactly_once.run_stateful(moto_server.url, pages)
    plain = exactly_once.run_plain(moto_server.url, pages)
    assert stateful.requests["TransactWriteItems"] == 2
    assert stateful.requests["GetItem"] == 10, "each key read once, then cached"
    assert stateful.write_units == 2 * 2 * (10 + 1), "the lease item is written too"
    assert plain.requests == {"UpdateItem": 2 * 40 + 2}
    assert plain.write_units == 82


def test_latency_bench_times_every_record_for_every_contender(
        capsys: pytest.CaptureFixture[str]) -> None:
    latency.main(["--records", "3", "--interval-ms", "100"])
    lines = capsys.readouterr().out.splitlines()
    rows = [line for line in lines if "p50" in line]
    contenders = ["polling, defaults (1 s idle)", "polling, 200 ms idle", "fan-out",
                  "bare subscription loop"]
    assert [row.split(":")[0].strip() for row in rows] == contenders * 2, "on both endpoints"
    assert [line.split(" on ")[1].split(" (")[0] for line in lines if "records, one" in line
            ] == ["the replay endpoint in live mode", "kinesis-mock"]
    for row in rows:
        p50, p90, p99 = (float(v) for v in re.findall(r"p\d\d\s+(-?\d+)", row))
        assert 0 <= p50 <= p90 <= p99, row


@pytest.mark.parametrize("assigner", ["worker", "leader"])
def test_fleet_scale_bench_sets_each_real_figure_beside_the_simulated_one(
        tmp_path: Path, assigner: str) -> None:
    """Two worker processes on two shards, failover 1 s, each way of assigning: every phase
    ends balanced, each figure has a real value and the simulator's, and the meter counts
    what the workers ask of DynamoDB (the bench's own reads of the table left out)."""
    stream = replay.build_stream(0, replay.StreamSpec("fleet", 2, 1, 100))
    settings = fleet_scale.Settings(workers=2, shards=2, failover_s=1.0, steady_s=2.0,
                                    lease_assigner=assigner)
    with replay.ReplayServer([stream]) as server:
        rows = fleet_scale.run(settings, server.url, "fleet", tmp_path)
    by_key = {row["key"]: row for row in rows}
    assert {key for _, key in fleet_scale.FIGURES} <= set(by_key)
    assert all(row["real"] is not None and row["simulated"] is not None for row in rows)
    assert by_key["largest_scan_items"]["real"] == 2
    assert by_key["UpdateItem"]["real"] > 0, "renewals are counted"
    assert by_key["die_moved"]["real"] >= 1, "the dead worker's lease changed hands"
    if assigner == "leader":
        # every half failover time a few reads of the lock (a holder's own Query comes only
        # every 1.5-4.5 failover times: maybe not in a 2 s window)
        assert by_key["GetItem"]["real"] > 0, "the workers read the leader lock"


def test_spark_source_tells_start_up_from_the_steady_rate() -> None:
    """Rows after the first batch over the CPU they took; start-up is the first batch's CPU
    beyond its rows at that rate."""
    rates = spark_source.rates_from([spark_source.Point(0, 0.0, 10.0),
                                     spark_source.Point(100, 5.0, 13.0),
                                     spark_source.Point(300, 7.0, 15.0)], {})
    assert (rates.rows, rates.steady_per_cpu_s, rates.steady_per_s) == (300, 100.0, 100.0)
    assert (rates.startup_cpu_s, rates.startup_wall_s) == (2.0, 5.0)
    with pytest.raises(RuntimeError, match="too few batches"):
        spark_source.rates_from([spark_source.Point(0, 0.0, 0.0)], {})


def test_spark_source_counts_shards_at_kinesis_limits() -> None:
    # plain 1 KiB: 1,000 records/s and 1 MiB/s bind together; reads 2 MiB/s
    assert spark_source.shards_per_core(10_000, 1024, kpl=False) == (10.0, 10_000 / 2048)
    write, read = spark_source.shards_per_core(10_000, 200, kpl=True)
    assert write == 2 * read and 1.5 < write < 2.5


def test_async_kinesis_with_no_repetitions_is_left_out_not_summarised_empty(
        capsys: pytest.CaptureFixture[str]) -> None:
    options = argparse.Namespace(retrieval_mode="polling", async_kinesis_repetitions=0,
                                 async_kinesis_python=sys.executable)
    assert consume.contenders_for(options) == ["kclpy", "boto3"]
    assert "left out" in capsys.readouterr().out
    assert consume.contenders_for(argparse.Namespace(
        retrieval_mode="fanout", async_kinesis_repetitions=0,
        async_kinesis_python=sys.executable)) == ["kclpy", "boto3-subscribe"]
