"""Exactly-once state under chaos, over real HTTP: three worker processes on kinesis-mock
and moto's server, killed, frozen past the failover time and stopped while a shard splits
and commits are throttled, fail with 5xx or lose their answers. The stored counts and sums
must equal what was written; the plain at-least-once processor's show its duplicates."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import sqlalchemy as sa

from kclpy.local import LocalEndpoint
from tests.support.chaos import KILL, STOP, TERM, ChaosSettings, seed_from_environment
from tests.support.state_chaos import EXACTLY_ONCE, PLAIN, plain_table, run_state_chaos
from tests.support.streams import dynamodb_client, unique_name


def fresh_database(postgres_url: str) -> str:
    """A database of its own on the session's server, so runs never share tables."""
    name = unique_name("chaos").replace("-", "_")
    admin = sa.create_engine(postgres_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    admin.dispose()
    return postgres_url.rsplit("/", 1)[0] + f"/{name}"


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(600)
@pytest.mark.parametrize(("mode", "store", "max_lag_ms"), [
    (EXACTLY_ONCE, "dynamodb", None), (EXACTLY_ONCE, "postgresql", None),
    (PLAIN, "postgresql", None),
    # issue 22, hole 2: with lag recovery too, every gap a takeover leaves is applied once
    (EXACTLY_ONCE, "dynamodb", 1500), (EXACTLY_ONCE, "postgresql", 1500)],
    ids=["exactly-once-dynamodb", "exactly-once-postgresql", "plain-postgresql",
         "exactly-once-lag-recovery-dynamodb", "exactly-once-lag-recovery-postgresql"])
def test_state_under_chaos_is_exact_and_the_plain_processor_is_not(
    mode: str,
    store: str,
    max_lag_ms: int | None,
    kinesis_mock: LocalEndpoint,
    moto_server: LocalEndpoint,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    request: pytest.FixtureRequest,
) -> None:
    settings = ChaosSettings(seed=seed_from_environment(), chaos_s=45.0,
                             failover_ms=3000, checkpoint_every_batches=2)
    read_state: Callable[[], dict[str, int]]
    if store == "dynamodb":
        spec = unique_name("eo-state")
        dynamodb = dynamodb_client(moto_server.url)

        def read_state() -> dict[str, int]:
            try:
                items = dynamodb.scan(TableName=spec, ConsistentRead=True)["Items"]
            except dynamodb.exceptions.ResourceNotFoundException:
                return {}
            return {i["stateKey"]["S"]: json.loads(i["stateValue"]["S"]) for i in items}
    else:
        spec = fresh_database(request.getfixturevalue("postgres_url"))
        engine = sa.create_engine(spec)
        table = (plain_table(sa.MetaData()) if mode == PLAIN
                 else sa.Table("kclpy_state", sa.MetaData(), sa.Column("state_key"),
                               sa.Column("state_value")))

        def read_state() -> dict[str, int]:
            with engine.connect() as conn:
                if not sa.inspect(conn).has_table(table.name):
                    return {}
                rows = conn.execute(sa.select(*table.c)).all()
            return {key: int(value) if mode == PLAIN else json.loads(value)
                    for key, value in rows}

    def say(line: str) -> None:
        with capsys.disabled():
            print(line, flush=True)

    result = run_state_chaos(kinesis_mock.url, moto_server.url, tmp_path, settings,
                             mode=mode, store=spec, read_state=read_state, say=say,
                             max_lag_ms=max_lag_ms)
    say("\n".join(result.figure_lines()))
    assert result.produced >= 20_000
    assert all(result.disruptions[kind] >= 1 for kind in (KILL, STOP, TERM)), result.disruptions
    assert result.split is not None and len(result.split[1]) == 2
    assert set(result.sigterm_exit_codes) == {0}, f"logs in {result.logs}"
    assert result.commit_faults > 0 and result.throttles_injected > 0
    assert not result.checkpoint_regressions, result.checkpoint_regressions
    if max_lag_ms is not None:
        gaps = sum(log.read_text(errors="replace").count("recovering the gap after")
                   for log in result.logs.glob("*.log"))
        say(f"gaps recovered: {gaps}")
        assert gaps >= 1, "a takeover left a gap (else the variant tests nothing)"
    if mode == EXACTLY_ONCE:
        assert result.wrong_keys == {}, f"logs in {result.logs}"
        assert result.counted == result.produced
    else:
        # At-least-once: nothing lost; how many records come twice depends on where the
        # kills land (reported above; +1,336 on one run, 0 on another whose killed workers
        # had checkpointed). tests/test_state.py shows duplicates deterministically.
        assert result.counted >= result.produced, "a record was lost"
        assert all(stored >= want for want, stored in result.wrong_keys.values()
                   if want is not None and stored is not None)
