"""Exponential backoff with full jitter, and the one place that decides what is worth retrying.

Full jitter (a uniform draw between zero and the capped exponential) rather than a fixed or
"equal" jitter: many fetch threads throttled by the same shard limit would otherwise retry in
lock-step and be throttled again together. See the AWS Architecture Blog, "Exponential Backoff
And Jitter".

``classify`` is shared by the Kinesis fetcher and the DynamoDB lease code so that both agree on
what a throttle is, and both feed the same metric labels.
"""

from __future__ import annotations

import random

from botocore.exceptions import ClientError, ConnectionError, HTTPClientError
from botocore.parsers import ResponseParserError

THROTTLED = "throttled"
SERVER_ERROR = "server_error"
CONNECTION = "connection"
#: enhanced fan-out: the shard's previous subscription is still open
IN_USE = "in_use"

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


def error_code(exc: ClientError) -> str:
    """The AWS error code of a failed call ('' when the answer named none)."""
    return str(exc.response.get("Error", {}).get("Code", ""))


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


class Backoff:
    """Capped exponential backoff with full jitter: attempt n waits U(0, min(cap, base * 2**n)).

    Not thread-safe: each retrying loop owns one, so that one caller's success does not reset
    another's backoff.
    """

    def __init__(
        self, base_s: float = 0.1, cap_s: float = 5.0, rng: random.Random | None = None
    ) -> None:
        if base_s <= 0 or cap_s < base_s:
            raise ValueError(f"need 0 < base_s <= cap_s, got base_s={base_s}, cap_s={cap_s}")
        self.base_s = base_s
        self.cap_s = cap_s
        self._rng = rng if rng is not None else random.Random()
        self._attempt = 0

    @property
    def attempt(self) -> int:
        """Failures since the last success; callers use it to give up after N tries."""
        return self._attempt

    def ceiling(self) -> float:
        """The upper bound of the next delay (before jitter)."""
        return min(self.cap_s, self.base_s * 2.0 ** min(self._attempt, 1023))

    def next_delay(self) -> float:
        """The delay before the next retry, and count one more failure."""
        delay = self._rng.uniform(0.0, self.ceiling())
        self._attempt += 1
        return delay

    def reset(self) -> None:
        """Start over after a success, so a later throttle begins with a short delay again."""
        self._attempt = 0
