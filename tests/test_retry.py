from __future__ import annotations

import ast
import random
from pathlib import Path
from typing import Any

import pytest
from botocore.exceptions import (
    ClientError,
    ConnectionClosedError,
    ConnectTimeoutError,
    EndpointConnectionError,
    ReadTimeoutError,
)
from botocore.parsers import ResponseParserError
from hypothesis import given
from hypothesis import strategies as st

import kclpy
from kclpy.retry import (
    CONNECTION,
    EQUAL,
    NO_JITTER,
    SERVER_ERROR,
    THROTTLED,
    Backoff,
    GaveUp,
    RetryPolicy,
    RetryStopped,
    classify,
    is_not_found,
    is_throttle,
    is_transient,
    retrying,
)


class RecordingRng(random.Random):
    """Answers the upper bound, and remembers each range asked for."""

    def __init__(self) -> None:
        super().__init__(0)
        self.ranges: list[tuple[float, float]] = []

    def uniform(self, a: float, b: float) -> float:
        self.ranges.append((a, b))
        return b


def client_error(code: str, status: int = 400, operation: str = "GetRecords") -> ClientError:
    response: Any = {
        "Error": {"Code": code, "Message": "m"},
        "ResponseMetadata": {"HTTPStatusCode": status},
    }
    return ClientError(response, operation)


def test_ceiling_doubles_from_base_until_the_cap_and_jitter_starts_at_zero() -> None:
    rng = RecordingRng()
    backoff = Backoff(base_s=0.1, cap_s=1.0, rng=rng)
    delays = [backoff.next_delay() for _ in range(7)]
    assert rng.ranges == [(0.0, b) for b in (0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0)]
    assert delays == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0]
    assert backoff.attempt == 7


def test_reset_starts_over_from_base() -> None:
    rng = RecordingRng()
    backoff = Backoff(base_s=0.5, cap_s=8.0, rng=rng)
    for _ in range(4):
        backoff.next_delay()
    backoff.reset()
    assert backoff.attempt == 0
    assert backoff.next_delay() == 0.5


def test_full_jitter_spreads_over_the_whole_range() -> None:
    backoff = Backoff(base_s=1.0, cap_s=1.0, rng=random.Random(42))
    delays = [backoff.next_delay() for _ in range(2000)]
    assert all(0.0 <= d <= 1.0 for d in delays)
    # full jitter, not "equal jitter": the lower half of the range is used too
    assert min(delays) < 0.05
    assert max(delays) > 0.95


@given(
    base=st.floats(min_value=0.001, max_value=10.0),
    extra=st.floats(min_value=0.0, max_value=100.0),
    failures=st.integers(min_value=0, max_value=3000),
    seed=st.integers(min_value=0, max_value=2**32),
)
def test_every_delay_is_within_zero_and_the_capped_exponential(
    base: float, extra: float, failures: int, seed: int
) -> None:
    cap = base + extra
    backoff = Backoff(base_s=base, cap_s=cap, rng=random.Random(seed))
    for _ in range(failures):
        backoff.next_delay()
    bound = cap if failures > 60 else min(cap, base * 2**failures)
    delay = backoff.next_delay()
    assert 0.0 <= delay <= bound


@pytest.mark.parametrize(("base", "cap"), [(0.0, 1.0), (-1.0, 1.0), (2.0, 1.0)])
def test_rejects_nonsense_bounds(base: float, cap: float) -> None:
    with pytest.raises(ValueError):
        Backoff(base_s=base, cap_s=cap)


@pytest.mark.parametrize(
    "code",
    [
        "ProvisionedThroughputExceededException",
        "KMSThrottlingException",
        "LimitExceededException",
        "ThrottlingException",
        "RequestLimitExceeded",
        "Throttling",
        "TooManyRequestsException",
        "TooManyRequests",
    ],
)
def test_throttling_codes(code: str) -> None:
    assert classify(client_error(code)) == THROTTLED


def test_http_429_is_throttling_whatever_the_code() -> None:
    assert classify(client_error("SomethingNew", 429)) == THROTTLED


@pytest.mark.parametrize(
    ("code", "status"),
    [
        ("InternalFailure", 500),
        ("ServiceUnavailable", 503),
        ("SomethingNew", 502),
        ("InternalFailure", 400),
    ],
)
def test_server_errors(code: str, status: int) -> None:
    assert classify(client_error(code, status)) == SERVER_ERROR


@pytest.mark.parametrize(
    "exc",
    [
        EndpointConnectionError(endpoint_url="http://127.0.0.1:1"),
        ConnectionClosedError(endpoint_url="http://127.0.0.1:1"),
        ReadTimeoutError(endpoint_url="http://127.0.0.1:1"),
        ConnectTimeoutError(endpoint_url="http://127.0.0.1:1"),
    ],
)
def test_connection_errors(exc: Exception) -> None:
    assert classify(exc) == CONNECTION


@pytest.mark.parametrize(
    "exc",
    [
        client_error("ResourceNotFoundException"),
        client_error("AccessDeniedException"),
        client_error("InvalidArgumentException"),
        client_error("ExpiredIteratorException"),
        client_error("ConditionalCheckFailedException", operation="UpdateItem"),
        client_error("KMSAccessDeniedException"),
        ValueError("not an AWS error"),
    ],
)
def test_not_retryable(exc: Exception) -> None:
    assert classify(exc) is None


def test_a_garbled_response_is_retried_as_a_server_error() -> None:
    assert classify(ResponseParserError("not a GetRecords response")) == SERVER_ERROR


def test_a_client_error_without_metadata_is_not_retryable() -> None:
    assert classify(ClientError({}, "GetRecords")) is None


def test_only_a_resource_not_found_answer_reads_as_not_found() -> None:
    """One test for the callers that treat a missing stream, shard or table as a decision
    (the consumer's shard end, the CLI's exit code, the lease table's creation)."""
    missing = client_error("ResourceNotFoundException")
    assert is_not_found(missing) and classify(missing) is None
    for other in (client_error("ResourceInUseException"), client_error("AccessDeniedException"),
                  ClientError({}, "GetRecords"), KeyError("ResourceNotFoundException"), None):
        assert not is_not_found(other)


def cancelled(*reasons: str) -> ClientError:
    response: Any = {"Error": {"Code": "TransactionCanceledException", "Message": "m"},
                     "ResponseMetadata": {"HTTPStatusCode": 400},
                     "CancellationReasons": [{"Code": code} for code in reasons]}
    return ClientError(response, "TransactWriteItems")


def test_a_transaction_cancelled_only_by_throttling_or_a_conflict_is_throttled() -> None:
    assert classify(cancelled("None", "ThrottlingError")) == THROTTLED
    assert classify(cancelled("TransactionConflict", "None")) == THROTTLED
    assert classify(cancelled("ConditionalCheckFailed", "ThrottlingError")) is None
    assert classify(cancelled("None", "None")) is None


def test_the_jitters_of_a_policy() -> None:
    rng = RecordingRng()
    assert [RetryPolicy(1.0, 5.0).delay(n, rng) for n in range(4)] == [1.0, 2.0, 4.0, 5.0]
    assert rng.ranges == [(0.0, 1.0), (0.0, 2.0), (0.0, 4.0), (0.0, 5.0)]
    rng.ranges.clear()
    assert RetryPolicy(1.0, 5.0, jitter=EQUAL).delay(2, rng) == 4.0
    assert rng.ranges == [(2.0, 4.0)]
    rng.ranges.clear()
    assert [RetryPolicy(1.0, 30.0, jitter=NO_JITTER).delay(n, rng) for n in (0, 3, 9)] == [
        1.0, 8.0, 30.0]
    assert rng.ranges == []
    # the Java KCL's registration wait: fixed, plus up to 100 ms
    fixed = RetryPolicy(1.0, 1.0, jitter=NO_JITTER, spread_s=0.1)
    assert [fixed.delay(n, rng) for n in (0, 5)] == [1.1, 1.1]
    assert rng.ranges == [(0.0, 0.1), (0.0, 0.1)]


def test_a_policy_gives_up_after_its_attempts_and_a_backoff_follows_its_policy() -> None:
    policy = RetryPolicy(0.5, 4.0, max_attempts=3)
    assert [policy.gives_up(n) for n in (1, 2, 3)] == [False, False, True]
    assert not RetryPolicy(0.5, 4.0).gives_up(10**6)
    rng = RecordingRng()
    backoff = RetryPolicy(0.5, 4.0, jitter=EQUAL).backoff(rng)
    assert [backoff.next_delay() for _ in range(5)] == [0.5, 1.0, 2.0, 4.0, 4.0]
    assert backoff.attempt == 5


@pytest.mark.parametrize("changes", [{"base_s": -1.0}, {"cap_s": -0.01}, {"spread_s": -0.1},
                                     {"jitter": "half"}, {"max_attempts": 0}])
def test_a_policy_refuses_nonsense(changes: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        RetryPolicy(**{"base_s": 0.1, "cap_s": 1.0, **changes})


def _backoff_formulas(path: Path) -> list[str]:
    """Where ``path`` draws a jittered wait or raises 2 to a variable power: a backoff
    written again instead of asked of kclpy.retry."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "uniform"):
            found.append(f"{path.name}:{node.lineno} draws a jitter")
        if (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow)
                and isinstance(node.left, ast.Constant) and node.left.value == 2
                and not isinstance(node.right, ast.Constant)):
            found.append(f"{path.name}:{node.lineno} doubles a wait")
    return found


#: error codes that only a classification of errors has reason to name
_THROTTLE_CODES = ("LimitExceededException", "ProvisionedThroughputExceededException",
                   "ThrottlingException", "RequestLimitExceeded", "ThrottlingError")


class Flaky:
    """Fails with the given errors in turn, then answers ``"done"``."""

    def __init__(self, *errors: Exception) -> None:
        self.errors = list(errors)
        self.calls = 0

    def __call__(self) -> str:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return "done"


def test_the_runner_retries_what_it_is_told_and_waits_the_policys_delays() -> None:
    call = Flaky(client_error("ThrottlingException"), client_error("InternalFailure", 500))
    waits: list[float] = []
    told: list[tuple[str, int, float]] = []
    answer = retrying(call, RetryPolicy(1.0, 8.0, jitter=NO_JITTER), retry_on=is_transient,
                      wait=waits.append, on_retry=lambda exc, n, d: told.append(
                          (type(exc).__name__, n, d)))
    assert answer == "done" and call.calls == 3
    assert waits == [1.0, 2.0]
    assert told == [("ClientError", 1, 1.0), ("ClientError", 2, 2.0)]


def test_the_runner_raises_a_refused_failure_at_once() -> None:
    denied = client_error("AccessDeniedException")
    call = Flaky(client_error("ThrottlingException"), denied)
    with pytest.raises(ClientError) as raised:
        retrying(call, RetryPolicy(0.0, 0.0), retry_on=is_throttle, wait=lambda _: None)
    assert raised.value is denied and call.calls == 2


def test_the_runner_gives_up_after_the_policys_attempts_naming_the_last_failure() -> None:
    last = client_error("ThrottlingException")
    call = Flaky(client_error("ThrottlingException"), client_error("ThrottlingException"), last)
    with pytest.raises(GaveUp) as raised:
        retrying(call, RetryPolicy(0.0, 0.0, max_attempts=3), retry_on=is_throttle,
                 wait=lambda _: None)
    assert raised.value.attempts == 3 and raised.value.__cause__ is last
    assert call.calls == 3


def test_a_stop_during_the_wait_ends_the_runner_before_another_attempt() -> None:
    call = Flaky(client_error("ThrottlingException"), client_error("ThrottlingException"))
    with pytest.raises(RetryStopped):
        retrying(call, RetryPolicy(1.0, 1.0), retry_on=is_throttle, wait=lambda _: True)
    assert call.calls == 1


def test_every_retry_goes_through_kclpy_retry() -> None:
    """One backoff formula and one list of throttles: a module that needs either asks
    ``kclpy.retry`` (errors.py and the public API name ThrottlingException, the Java
    checkpoint error)."""
    package = Path(kclpy.__file__).parent
    found: list[str] = []
    for path in sorted(package.rglob("*.py")):
        if path.name == "retry.py" and path.parent == package:
            continue
        found += _backoff_formulas(path)
        if path.relative_to(package).as_posix() not in ("errors.py", "__init__.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Constant) and node.value in _THROTTLE_CODES:
                    found.append(f"{path.name}:{node.lineno} names {node.value}")
    assert found == []


#: calls that compute a retry's wait (a policy's ``delay``, a backoff's ``next_delay``, the
#: consumer's ``_backoff``) or sleep: in a loop that swallows an exception, a retry
_WAITS = frozenset({"delay", "next_delay", "_backoff", "sleep"})

#: loops that retry by hand, each with why kclpy.retry.retrying does not fit it: every
#: attempt is a different call, or a failure is answered with more than a wait. An entry
#: that is no longer found fails too, so this list only shrinks.
HAND_WRITTEN_RETRIES = {
    # each conflict halves the records the next attempt commits, and a landed predecessor
    # changes what is left to commit
    "state/processor.py:ExactlyOnceProcessor._commit",
}


def hand_written_retries(package: Path) -> list[str]:
    """The functions (``path:Class.function``) of ``package`` but ``retry.py`` with a loop
    that catches an exception without raising or returning from the handler, and computes a
    retry's wait or sleeps: a retry written again instead of handed to
    :func:`kclpy.retry.retrying`. A poll loop (a fixed interval on an event, a failure
    logged) computes no retry wait and is not one."""
    found = []
    for path in sorted(package.rglob("*.py")):
        relative = path.relative_to(package).as_posix()
        if relative == "retry.py":
            continue

        def visit(node: ast.AST, names: tuple[str, ...], relative: str = relative) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    visit(child, (*names, child.name))
                    continue
                if isinstance(child, (ast.While, ast.For)) and _retries(child):
                    found.append(f"{relative}:{'.'.join(names)}")
                visit(child, names)

        visit(ast.parse(path.read_text()), ())
    return sorted(set(found))


def _retries(loop: ast.While | ast.For) -> bool:
    inner = [node for statement in (*loop.body, *loop.orelse) for node in ast.walk(statement)]
    swallows = any(isinstance(node, ast.Try)
                   and any(not isinstance(handler.body[-1], (ast.Raise, ast.Return))
                           for handler in node.handlers)
                   for node in inner)
    waits = any(isinstance(node, ast.Call) and _called(node) in _WAITS for node in inner)
    return swallows and waits


def _called(call: ast.Call) -> str:
    if isinstance(call.func, ast.Attribute):
        return call.func.attr
    return call.func.id if isinstance(call.func, ast.Name) else ""


def test_no_module_writes_a_retry_loop_of_its_own() -> None:
    """One retry runner: a loop that catches, backs off and tries again is
    :func:`kclpy.retry.retrying`, which keeps what is retried, the attempts, the stop and
    the per-retry log line in one place (a hand-written loop drifted from it before: a
    second formula, a wait after the last attempt, attempts counted apart)."""
    found = hand_written_retries(Path(kclpy.__file__).parent)
    assert sorted(set(found) - HAND_WRITTEN_RETRIES) == [], "use kclpy.retry.retrying"
    assert sorted(HAND_WRITTEN_RETRIES - set(found)) == [], "no longer there: unlist it"


def test_the_retry_loop_check_sees_retries_and_not_poll_loops(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "m.py").write_text(
        "import time\n"
        "class Client:\n"
        "    def put(self, policy, call):\n"
        "        for attempt in range(3):\n"
        "            try:\n"
        "                return call()\n"
        "            except OSError:\n"
        "                time.sleep(policy.delay(attempt))\n"
        "    def renew(self, stop, call):\n"
        "        while not stop.is_set():\n"
        "            try:\n"
        "                call()\n"
        "            except Exception:\n"
        "                print('failed')\n"
        "            stop.wait(10)\n"
        "def fetch(backoff, call):\n"
        "    while True:\n"
        "        try:\n"
        "            return call()\n"
        "        except OSError:\n"
        "            pass\n"
        "        backoff.next_delay()\n"
        "def strict(call):\n"
        "    while True:\n"
        "        try:\n"
        "            return call()\n"
        "        except OSError:\n"
        "            raise\n"
        "        time.sleep(1)\n")
    (package / "retry.py").write_text((package / "m.py").read_text())
    assert hand_written_retries(package) == ["m.py:Client.put", "m.py:fetch"]
