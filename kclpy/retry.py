"""Every retry of kclpy: one backoff formula, and the one place that decides what is worth
retrying and what is a throttle.

A ``RetryPolicy`` is a caller's base, cap, attempts and jitter; ``delay(n)`` is the wait
before retry n, the same formula for GetRecords, subscriptions, registration, the lease
table, shard sync, state commits, processor retries, start-up, CloudWatch, the lag webhook,
a Spark batch and its recorded end, and the supervisor's restarts. ``Backoff`` is that
policy with its own attempt count, for a loop that retries until a success resets it.

Full jitter (a uniform draw between zero and the capped exponential) is the default: many
fetch threads throttled by the same shard limit would otherwise retry in lock-step and be
throttled again together (the AWS Architecture Blog, "Exponential Backoff And Jitter").
Retries after a processor's failure keep "equal" jitter (at least half the ceiling, the
processor gets a breather), the supervisor's restarts none (one child, nothing to spread),
and registration the Java KCL's fixed wait plus up to 100 ms.

``retrying`` is the one loop around a call that may fail: the call, the policy, what is worth
retrying, and how to wait (a sleep, or an event's ``wait`` so that a shutdown ends the wait).
Callers keep only what is theirs: the error they raise when the attempts are spent
(:class:`GaveUp`) and what they count or log per failure. A loop of its own that catches,
backs off and tries again fails ``tests/test_retry.py``: written apart, retries drifted (a
second formula, a wait after the last attempt, attempts counted apart from the backoff's).

``classify`` is shared by Kinesis, DynamoDB (a cancelled transaction included) and
CloudWatch calls, so all agree on what a throttle is and feed the same metric labels.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from botocore.exceptions import ClientError, ConnectionError, HTTPClientError
from botocore.parsers import ResponseParserError

from kclpy.errors import KCLError

T = TypeVar("T")

THROTTLED = "throttled"
SERVER_ERROR = "server_error"
CONNECTION = "connection"
#: enhanced fan-out: the shard's previous subscription is still open
IN_USE = "in_use"

#: jitter: a uniform draw in [0, ceiling] ...
FULL = "full"
#: ... in [ceiling / 2, ceiling] ...
EQUAL = "equal"
#: ... or the ceiling itself
NO_JITTER = "none"
JITTERS = (FULL, EQUAL, NO_JITTER)

# Kinesis, KMS (behind an encrypted stream), DynamoDB, plus the codes botocore's own
# standard retry mode treats as throttling, so nothing botocore would retry is fatal here.
_THROTTLING_CODES = frozenset(
    {
        "ProvisionedThroughputExceededException",
        "KMSThrottlingException",
        "LimitExceededException",
        "ThrottlingException",
        "RequestLimitExceeded",
        "Throttling",
        "ThrottledException",
        "RequestThrottledException",
        "TooManyRequestsException",
        "TooManyRequests",
        "TransactionInProgressException",
        "BandwidthLimitExceeded",
        "RequestThrottled",
        "SlowDown",
        "EC2ThrottledException",
    }
)

_SERVER_ERROR_CODES = frozenset(
    {
        "InternalFailure",
        # the same failure sent as an exception event inside a SubscribeToShard stream,
        # where the member name (with its suffix) is the code
        "InternalFailureException",
        "InternalServerError",
        "InternalError",
        "ServiceUnavailable",
        "ServiceUnavailableException",
        "RequestTimeout",
        "RequestTimeoutException",
        "PriorRequestNotComplete",
    }
)


TRANSACTION_CANCELED = "TransactionCanceledException"
#: a cancelled DynamoDB transaction's reasons that say "try again", not "your condition is
#: false": the transaction's throttling and a concurrent transaction on one of its items
_RETRYABLE_REASONS = frozenset(
    {"ThrottlingError", "ProvisionedThroughputExceeded", "RequestLimitExceeded",
     "TransactionConflict"}
)


def error_code(exc: ClientError) -> str:
    """The AWS error code of a failed call ('' when the answer named none)."""
    return str(exc.response.get("Error", {}).get("Code", ""))


#: What Kinesis and DynamoDB answer for a stream, shard, consumer or table that does not exist.
NOT_FOUND = "ResourceNotFoundException"


def is_not_found(exc: BaseException | None) -> bool:
    """Whether ``exc`` is AWS saying the resource does not exist. Never retried (see
    :func:`classify`): each caller decides what a missing stream, shard or table means to it."""
    return isinstance(exc, ClientError) and error_code(exc) == NOT_FOUND


def classify(exc: BaseException) -> str | None:
    """The retryable kind of ``exc`` (``throttled``, ``server_error``, ``connection``), else None.

    None means retrying cannot help (missing stream, access denied, bad argument, a failed
    condition): the caller must surface the error instead of hiding it behind retries.
    """
    if isinstance(exc, ClientError):
        error = exc.response.get("Error", {})
        code = error.get("Code", "")
        if code in _THROTTLING_CODES:
            return THROTTLED
        if code == TRANSACTION_CANCELED:
            # throttled only when no item's condition failed (those reasons are "None")
            reasons = {str(reason.get("Code", "None"))
                       for reason in exc.response.get("CancellationReasons") or []}
            retryable = bool(reasons & _RETRYABLE_REASONS) and (
                reasons <= _RETRYABLE_REASONS | {"None"})
            return THROTTLED if retryable else None
        if code in _SERVER_ERROR_CODES:
            return SERVER_ERROR
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        if status == 429:  # Too Many Requests, whatever the service calls it
            return THROTTLED
        if isinstance(status, int) and status >= 500:
            return SERVER_ERROR
        return None
    # An unparseable 200 body is most likely a truncated answer; the next call gets a new one.
    if isinstance(exc, ResponseParserError):
        return SERVER_ERROR
    # botocore's ConnectionError covers EndpointConnectionError and ConnectTimeoutError;
    # HTTPClientError covers ReadTimeoutError and ConnectionClosedError.
    if isinstance(exc, (ConnectionError, HTTPClientError)):
        return CONNECTION
    return None


def spread(wait_s: float, low: float, high: float, rng: random.Random | None = None) -> float:
    """``wait_s`` times a factor drawn between ``low`` and ``high``: a periodic wait that is
    not a retry (a leader lock's reads) spread so a fleet's workers do not call in step. Kept
    here so that every random wait kclpy draws is drawn in this module."""
    uniform = rng.uniform if rng is not None else random.uniform
    return wait_s * uniform(low, high)


@dataclass(frozen=True)
class RetryPolicy:
    """How one kind of call is retried: retry n (from 0) waits up to
    ``min(cap_s, base_s * 2**n)``, drawn as ``jitter`` says, plus up to ``spread_s``.
    ``max_attempts`` bounds the calls (None: the caller decides when to stop)."""

    base_s: float
    cap_s: float
    max_attempts: int | None = None
    jitter: str = FULL
    spread_s: float = 0.0

    def __post_init__(self) -> None:
        # a base above the cap is allowed: every wait is the cap then
        if self.base_s < 0 or self.cap_s < 0 or self.spread_s < 0:
            raise ValueError(f"need base_s, cap_s and spread_s >= 0, got base_s={self.base_s}, "
                             f"cap_s={self.cap_s}, spread_s={self.spread_s}")
        if self.jitter not in JITTERS:
            raise ValueError(f"jitter must be one of {', '.join(JITTERS)}")
        if self.max_attempts is not None and self.max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")

    def ceiling(self, attempt: int) -> float:
        """The upper bound of retry ``attempt``'s wait before jitter."""
        return min(self.cap_s, self.base_s * 2.0 ** min(attempt, 1023))

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """The wait before retry ``attempt`` (0 for the first retry)."""
        # the module's draw is looked up per call, never held: the fleet simulator replaces
        # the module ``random`` of each kclpy module with its seeded one
        uniform = rng.uniform if rng is not None else random.uniform
        ceiling = self.ceiling(attempt)
        if self.jitter == FULL:
            wait = uniform(0.0, ceiling)
        elif self.jitter == EQUAL:
            wait = uniform(ceiling / 2, ceiling)
        else:
            wait = ceiling
        return wait + uniform(0.0, self.spread_s) if self.spread_s else wait

    def gives_up(self, attempts: int) -> bool:
        """True once ``attempts`` calls were made and no more are allowed."""
        return self.max_attempts is not None and attempts >= self.max_attempts

    def backoff(self, rng: random.Random | None = None) -> Backoff:
        return Backoff(policy=self, rng=rng)


#: the defaults of every shard read's backoff (the worker's getRecordsBackoffBaseMillis and
#: getRecordsBackoffCapMillis, the Spark source's getRecordsBackoffBase and ...Cap)
READ_BACKOFF_BASE_MS = 100
READ_BACKOFF_CAP_MS = 5_000


def read_policy(base_ms: int = READ_BACKOFF_BASE_MS, cap_ms: int = READ_BACKOFF_CAP_MS,
                max_attempts: int | None = None) -> RetryPolicy:
    """How a shard read retries GetRecords, iterators and subscriptions, wherever it runs:
    a worker's fetch threads without a limit (they retry until the shard's lease moves), a
    Spark task ``max_attempts`` times (a task that still fails is better retried by Spark)."""
    return RetryPolicy(base_ms / 1000, cap_ms / 1000, max_attempts=max_attempts)


class Backoff:
    """A ``RetryPolicy`` with its attempt count: a loop that retries until a success calls
    ``reset``. Capped exponential with full jitter unless the policy says otherwise.

    Not thread-safe: each retrying loop owns one, so that one caller's success does not reset
    another's backoff.
    """

    def __init__(
        self, base_s: float = 0.1, cap_s: float = 5.0, rng: random.Random | None = None,
        *, policy: RetryPolicy | None = None,
    ) -> None:
        if policy is None:
            if base_s <= 0 or cap_s < base_s:
                raise ValueError(f"need 0 < base_s <= cap_s, got base_s={base_s}, "
                                 f"cap_s={cap_s}")
            policy = RetryPolicy(base_s, cap_s)
        self.policy = policy
        self._rng = rng if rng is not None else random.Random()
        self._attempt = 0

    @property
    def base_s(self) -> float:
        return self.policy.base_s

    @property
    def cap_s(self) -> float:
        return self.policy.cap_s

    @property
    def attempt(self) -> int:
        """Failures since the last success; callers use it to give up after N tries."""
        return self._attempt

    def ceiling(self) -> float:
        """The upper bound of the next delay (before jitter)."""
        return self.policy.ceiling(self._attempt)

    def next_delay(self) -> float:
        """The delay before the next retry, and count one more failure."""
        delay = self.policy.delay(self._attempt, self._rng)
        self._attempt += 1
        return delay

    def reset(self) -> None:
        """Start over after a success, so a later throttle begins with a short delay again."""
        self._attempt = 0


class GaveUp(KCLError):
    """:func:`retrying` spent the policy's attempts; ``last`` (also the ``__cause__``) is
    the last failure, which a caller that reports failures as they are raises again."""

    def __init__(self, attempts: int, last: BaseException) -> None:
        super().__init__(f"gave up after {attempts} attempts")
        self.attempts = attempts
        self.last = last


class RetryStopped(KCLError):
    """:func:`retrying`'s wait was ended by a stop (its ``wait`` returned True) before the
    next attempt; ``__cause__`` is the last failure."""


def retrying(
    call: Callable[[], T],
    retries: RetryPolicy | Backoff,
    *,
    retry_on: Callable[[BaseException], bool],
    wait: Callable[[float], bool | None] | None = None,
    rng: random.Random | None = None,
    on_retry: Callable[[BaseException, int, float], None] | None = None,
) -> T:
    """``call()``'s result, calling again after each failure ``retry_on`` accepts.

    A failure ``retry_on`` refuses is raised as it is. Before each retry the wait is the
    policy's next delay; ``on_retry(failure, failures so far, delay)`` is told first, so a
    log line can say how long. ``wait(delay)`` returning True (an ``Event.wait`` that saw
    its event) raises :class:`RetryStopped`; None sleeps. The policy's ``max_attempts``
    spent raises :class:`GaveUp`. Both chain the last failure. Without ``max_attempts`` it
    retries until the call succeeds, is refused or is stopped.

    With a policy, the failures are this call's. With a :class:`Backoff` they are the
    backoff's, read afresh after each failure: they add up over calls, nested ones too (a
    read that retries a fresh iterator while the GetRecords inside retried throttles on the
    same backoff), until its owner resets it after a success of its own (a shard's reads: a
    fresh iterator whose read fails again is not a success).
    """
    policy = retries if isinstance(retries, RetryPolicy) else retries.policy
    failures = 0
    while True:
        try:
            return call()
        except Exception as exc:
            if not retry_on(exc):
                raise
            if isinstance(retries, Backoff):
                failures = retries.attempt
            if policy.gives_up(failures + 1):
                raise GaveUp(failures + 1, exc) from exc
            if isinstance(retries, Backoff):
                delay = retries.next_delay()
            else:
                # the module's draw unless given one (the fleet simulator seeds it)
                delay = policy.delay(failures, rng)
            failures += 1
            if on_retry is not None:
                on_retry(exc, failures, delay)
            if wait is None:
                # looked up per wait, as ``random`` is: the fleet simulator replaces both
                time.sleep(delay)
            elif wait(delay):
                raise RetryStopped(f"stopped after {failures} attempts") from exc


def is_throttle(exc: BaseException) -> bool:
    """``retry_on`` for calls that retry throttling only (a 5xx or a lost connection was
    already retried by botocore's own attempts)."""
    return classify(exc) == THROTTLED


def is_transient(exc: BaseException) -> bool:
    """``retry_on`` for calls that retry every retryable kind :func:`classify` knows."""
    return classify(exc) is not None
