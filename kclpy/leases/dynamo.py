"""One DynamoDB table as kclpy uses it: requests counted, throttling retried, created on demand.

Throttling (``kclpy.retry.classify``) is retried here with the table's ``RetryPolicy``
because every caller would otherwise repeat the same loop; when it persists the caller gets
``TableThrottled`` (``LeaseTableThrottled`` for the lease table) and decides - the
checkpointer, for one, maps it to ``ThrottlingException``. A transaction cancelled only for
throttling or a concurrent transaction counts as throttled; one cancelled by a failed
condition does not.

The lease table (``table.py``) and the stores of other features (a stateful processor's
state table) are built on ``DynamoTable``, so they share one retry and creation policy.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from botocore.exceptions import BotoCoreError, ClientError

from kclpy.errors import KCLError
from kclpy.metrics import DYNAMODB_REQUESTS, NOWHERE, THROTTLES, Metrics
from kclpy.retry import GaveUp, RetryPolicy, error_code, is_not_found, is_throttle, retrying

if TYPE_CHECKING:
    from mypy_boto3_dynamodb import DynamoDBClient

log = logging.getLogger(__name__)

T = TypeVar("T")

CONDITION_FAILED = "ConditionalCheckFailedException"
#: UPDATING tables serve reads and writes (e.g. while Java KCL 3.x adds its owner index).
_USABLE_STATUSES = frozenset({"ACTIVE", "UPDATING"})


class TableThrottled(KCLError):
    """DynamoDB throttled a request on every attempt."""


class LeaseTableThrottled(TableThrottled):
    """DynamoDB throttled a lease-table request on every attempt."""


#: failures of a request that say nothing about a condition (who owns a lease)
TABLE_ERRORS = (TableThrottled, ClientError, BotoCoreError)


def cancellation_reasons(exc: ClientError) -> list[dict[str, Any]]:
    reasons: list[dict[str, Any]] = [
        dict(reason) for reason in exc.response.get("CancellationReasons") or []
    ]
    return reasons


class DynamoTable:
    """One table and the client that reaches it. Thread-safe: it holds no mutable state
    besides the client's. ``hash_key`` (and ``range_key``, when the table's items are
    queried by hash key) name the string keys the table is created with."""

    #: what the table is, for messages
    kind = "DynamoDB"
    #: what persistent throttling raises
    throttled: type[TableThrottled] = TableThrottled

    def __init__(
        self,
        client: DynamoDBClient,
        table_name: str,
        *,
        hash_key: str,
        range_key: str | None = None,
        metrics: Metrics | None = None,
        max_attempts: int = 5,
        backoff_s: tuple[float, float] = (0.05, 2.0),
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        self.client = client
        self.table_name = table_name
        self.hash_key = hash_key
        self.range_key = range_key
        self._metrics = metrics if metrics is not None else NOWHERE
        # short waits, (base, cap): a lease renewal must land within the failover time
        self._retries = RetryPolicy(*backoff_s, max_attempts=max_attempts)
        self._sleep = sleep
        self._clock = clock
        self._rng = rng if rng is not None else random.Random()

    # -- plumbing ------------------------------------------------------------------------

    def call(self, operation: str, fn: Callable[..., T], **kwargs: Any) -> T:
        """One logical request: counted per attempt, throttling retried, the rest raised."""
        def attempt() -> T:
            self._metrics.inc(DYNAMODB_REQUESTS, operation)
            return fn(**kwargs)

        def throttled(exc: BaseException) -> bool:
            if not is_throttle(exc):
                return False
            self._metrics.inc(THROTTLES, operation)
            return True

        try:
            return retrying(attempt, self._retries, retry_on=throttled, wait=self._sleep,
                            rng=self._rng)
        except GaveUp as gave_up:
            raise self.throttled(
                f"{operation} on {self.table_name} throttled {gave_up.attempts} times"
            ) from gave_up.last

    def _status(self) -> str | None:
        try:
            described = self.call(
                "DescribeTable", self.client.describe_table, TableName=self.table_name
            )
        except ClientError as exc:
            if is_not_found(exc):
                return None
            raise
        return described["Table"].get("TableStatus")

    # -- the table itself ----------------------------------------------------------------

    def create_if_missing(self, *, wait: bool = True, timeout_s: float = 120) -> bool:
        """Create the table (PAY_PER_REQUEST) unless it exists; True if this call created it.

        Several workers may start at once: losing the creation race is not an error.
        """
        created = False
        if self._status() is None:
            keys: list[tuple[str, Literal["HASH", "RANGE"]]] = [(self.hash_key, "HASH")]
            if self.range_key is not None:
                keys.append((self.range_key, "RANGE"))
            try:
                self.call(
                    "CreateTable",
                    self.client.create_table,
                    TableName=self.table_name,
                    KeySchema=[{"AttributeName": name, "KeyType": kind} for name, kind in keys],
                    AttributeDefinitions=[{"AttributeName": name, "AttributeType": "S"}
                                          for name, _ in keys],
                    BillingMode="PAY_PER_REQUEST",
                )
                created = True
                log.info("created %s table %s", self.kind, self.table_name)
            except ClientError as exc:
                if error_code(exc) != "ResourceInUseException":
                    raise
        if wait:
            self._wait_usable(timeout_s)
        return created

    def _wait_usable(self, timeout_s: float) -> None:
        deadline = self._clock() + timeout_s
        while True:
            status = self._status()
            if status in _USABLE_STATUSES:
                return
            if self._clock() >= deadline:
                state = status or "missing"
                raise TimeoutError(
                    f"{self.kind} table {self.table_name} still {state} after {timeout_s}s")
            self._sleep(1.0)
