"""``bench/leader_failover.py``'s harness on a tiny fleet (two workers, two shards, 2 s
failover), each way of assigning: both stops of a round are measured on every shard the
stopped worker held, and the one it stops is never the leader unless asked. Nothing is
timed."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import leader_failover
from kclpy.local import LocalEndpoint

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("assigner", leader_failover.ASSIGNERS)
def test_a_round_measures_sigterm_and_kill_on_every_shard_of_the_stopped_worker(
        kinesis_mock: LocalEndpoint, moto_server: LocalEndpoint, tmp_path: Path,
        assigner: str) -> None:
    terminated, killed, leaders = leader_failover.run_round(
        kinesis_mock.url, moto_server.url, assigner, failover_ms=2000, shards=2, workers=2,
        victim="other", workdir=tmp_path)
    for gaps in (terminated, killed):
        assert len(gaps.processing) == 1, "each of two workers held one of two shards"
        assert set(gaps.started) == set(gaps.processing)
        assert all(seconds > 0 for seconds in gaps.processing.values())
    assert leaders == 0, "the leader is not the worker stopped"
