"""Backoff is real: a worker whose every GetRecords is throttled does not hammer the service,
and reads again soon after the throttling stops.

The bound on requests is derived from the backoff's own parameters, not from a guess. With
capped full jitter, attempt i waits U(0, min(cap, base * 2**i)); the first, uncapped delays
can be arbitrarily short, but once capped they average cap / 2, so only an astronomically
unlucky run fits many of them into the window. ``max_requests`` is the count the proxy
exceeds with probability below one in a million; a hot loop exceeds it a hundredfold.
"""

from __future__ import annotations

import math
import time
from fractions import Fraction

import pytest

from kclpy import KCLConfig, Worker
from kclpy.local import LocalEndpoint
from kclpy.retry import Backoff
from tests.support.faultproxy import FaultProxy
from tests.support.recording import Ledger, RecordingProcessor
from tests.support.streams import create_stream, kinesis_client, put_plain, unique_name
from tests.support.waiting import wait_for
from tests.support.workers import running

THROTTLED_FOR_S = 10.0
SHARDS = 2


def irwin_hall_cdf(x: Fraction, n: int) -> Fraction:
    """P(U1 + ... + Un <= x) for n independent uniforms on [0, 1], exactly."""
    if x <= 0:
        return Fraction(0)
    if x >= n:
        return Fraction(1)
    total = sum((-1) ** k * math.comb(n, k) * (x - k) ** n for k in range(math.floor(x) + 1))
    return Fraction(total, math.factorial(n))


def max_requests(window_s: float, base_s: float, cap_s: float, tail: float = 1e-6) -> int:
    """Requests one retry loop makes within ``window_s`` except with probability ``tail``.

    One request starts the window, then one more per delay that ends inside it. The delays
    below the cap are counted as if they took no time at all; of the capped ones, k fit into
    the window with probability P(sum of k U(0, cap) <= window), the Irwin-Hall CDF at
    window / cap.
    """
    uncapped = 0
    while base_s * 2**uncapped < cap_s:
        uncapped += 1
    x = Fraction(window_s) / Fraction(cap_s)
    capped = 1
    while irwin_hall_cdf(x, capped) > tail:
        capped += 1
    return 1 + uncapped + capped


def test_the_bound_is_tight_enough_to_tell_backoff_from_a_hot_loop() -> None:
    bound = max_requests(10.0, 0.1, 5.0)
    assert 15 <= bound <= 25
    # A loop retrying every 100 ms without growing would make 100 requests in 10 s.
    assert bound < 10.0 / 0.1
    assert max_requests(20.0, 0.1, 5.0) > bound
    assert irwin_hall_cdf(Fraction(1, 2), 1) == Fraction(1, 2)
    assert irwin_hall_cdf(Fraction(1), 2) == Fraction(1, 2)


def throttled_per_shard(worker: Worker, shards: list[str]) -> dict[str, float]:
    registry = worker.metrics.registry
    return {
        shard: registry.get_sample_value(
            "kclpy_get_records_errors_total", {"shard_id": shard, "kind": "throttled"}
        )
        or 0.0
        for shard in shards
    }


@pytest.mark.integration
@pytest.mark.slow
def test_full_throttling_is_backed_off_and_reading_resumes_after_it(
    kinesis_mock: LocalEndpoint, moto_server: LocalEndpoint
) -> None:
    kinesis = kinesis_client(kinesis_mock.url)
    stream = unique_name("backoff")
    create_stream(kinesis, stream, SHARDS)
    shards = [s["ShardId"] for s in kinesis.list_shards(StreamName=stream)["Shards"]]
    before = [f"before-{n}".encode() for n in range(40)]
    during = [f"during-{n}".encode() for n in range(40)]
    put_plain(kinesis, stream, before)
    # The fetchers of the worker use the backoff's defaults.
    backoff = Backoff()
    ledger = Ledger()
    with FaultProxy(kinesis_mock.url, seed=3) as proxy:
        config = KCLConfig(
            application_name=unique_name("backoff-app"),
            stream_name=stream,
            region="us-east-1",
            kinesis_endpoint=proxy.url,
            dynamodb_endpoint=moto_server.url,
            initial_position="TRIM_HORIZON",
            failover_time_ms=10_000,
            idle_time_between_reads_ms=100,
        )
        worker = Worker(config, lambda: RecordingProcessor(ledger))
        with running(worker):
            wait_for(lambda: len(ledger.records) >= len(before), 60, "records before throttling")

            proxy.set_rule("GetRecords", throttle_rate=1.0)
            requests_before = proxy.requests("GetRecords")
            throttles_before = throttled_per_shard(worker, shards)
            started = time.monotonic()
            put_plain(kinesis, stream, during)

            def window_over() -> bool:
                throttled = throttled_per_shard(worker, shards)
                every_shard = all(throttled[s] > throttles_before[s] for s in shards)
                return every_shard and time.monotonic() - started >= THROTTLED_FOR_S

            wait_for(window_over, THROTTLED_FOR_S + 30, "the throttled window", interval=0.1)
            proxy.clear()
            lifted = time.monotonic()
            window_s = lifted - started
            requests = proxy.requests("GetRecords") - requests_before
            throttled = throttled_per_shard(worker, shards)

            wait_for(
                lambda: len(ledger.records) >= len(before) + len(during),
                backoff.cap_s + 30,
                "records produced during the throttling",
            )
            resumed_after_s = time.monotonic() - lifted

    bound = max_requests(window_s, backoff.base_s, backoff.cap_s)
    per_shard = {s: throttled[s] - throttles_before[s] for s in shards}
    print(
        f"{window_s:.1f} s of throttling: {requests} GetRecords in all, per shard {per_shard}, "
        f"bound {bound} per shard; all records processed {resumed_after_s:.1f} s after the "
        f"throttling stopped (backoff cap {backoff.cap_s:g} s)"
    )
    assert requests <= SHARDS * bound, f"{requests} requests in {window_s:.1f} s: a hot loop"
    for shard, count in per_shard.items():
        assert 2 <= count <= bound, f"{shard}: {count} throttled GetRecords"
    assert sorted(ledger.payloads()) == sorted(before + during)
    for shard, records in ledger.by_shard().items():
        positions = [(seq, sub) for seq, sub, _ in records]
        assert positions == sorted(positions), f"{shard} out of order"
