"""Enhanced fan-out consumer registration, the way the Java KCL does it.

Every worker of an application shares one registered stream consumer (named after the
application unless told otherwise). Getting its ARN: describe it; when it does not exist,
register it - a worker that loses the race to another one gets ``ResourceInUseException``
and describes it again, so concurrent registration ends with one consumer and no error;
then wait until it is ``ACTIVE``. Throttling (``kclpy.retry.classify``) is retried with
the Java keys' bounds: ``registerStreamConsumerRetries`` registrations,
``maxDescribeStreamConsumerRetries`` descriptions, ``retryBackoffMillis`` (plus up to 100 ms
of jitter, as in Java) between them.

kclpy never deregisters a consumer by itself: a consumer outlives any one worker, and
removing it is an operator's decision (``kclpy deregister-consumer``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from botocore.exceptions import ClientError

from kclpy.errors import KCLError, KinesisClientLibDependencyException
from kclpy.retry import (
    NO_JITTER,
    GaveUp,
    RetryPolicy,
    error_code,
    is_not_found,
    is_throttle,
    retrying,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

ACTIVE = "ACTIVE"


class ConsumerNotActive(KCLError):
    """The consumer did not become ACTIVE within ``maxDescribeStreamConsumerRetries`` looks."""


@dataclass(frozen=True)
class RegistrationSettings:
    """The Java KCL's defaults."""

    #: registerStreamConsumerRetries
    register_retries: int = 10
    #: maxDescribeStreamConsumerRetries
    describe_retries: int = 10
    #: retryBackoffMillis, in seconds
    backoff_s: float = 1.0

    def __post_init__(self) -> None:
        if self.register_retries < 1 or self.describe_retries < 1 or self.backoff_s < 0:
            raise ValueError("retries must be at least 1 and the backoff not negative")

    def retries(self, attempts: int | None = None) -> RetryPolicy:
        """The Java KCL's wait between throttled calls: fixed, plus up to 100 ms."""
        return RetryPolicy(self.backoff_s, self.backoff_s, max_attempts=attempts,
                           jitter=NO_JITTER, spread_s=0.1)


class ConsumerRegistration:
    """One application's consumer of one stream. Not thread-safe; each worker has its own."""

    def __init__(
        self,
        kinesis: Any,
        consumer_name: str,
        *,
        stream_name: str | None = None,
        stream_arn: str | None = None,
        settings: RegistrationSettings = RegistrationSettings(),
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if not stream_name and not stream_arn:
            raise ValueError("a stream name or ARN is needed")
        self._kinesis = kinesis
        self.consumer_name = consumer_name
        self._stream_name = stream_name
        self._stream_arn = stream_arn
        self._settings = settings
        self._sleep = sleep

    @property
    def stream_arn(self) -> str:
        """The stream's ARN (DescribeStreamSummary once, when only the name was given)."""
        if self._stream_arn is None:
            summary = self._throttled(
                lambda: self._kinesis.describe_stream_summary(StreamName=self._stream_name),
                self._settings.describe_retries, "DescribeStreamSummary")
            self._stream_arn = str(summary["StreamDescriptionSummary"]["StreamARN"])
        return self._stream_arn

    def describe(self) -> dict[str, Any] | None:
        """The consumer's description, or None when it is not registered."""
        try:
            response = self._throttled(
                lambda: self._kinesis.describe_stream_consumer(
                    StreamARN=self.stream_arn, ConsumerName=self.consumer_name),
                self._settings.describe_retries, "DescribeStreamConsumer")
        except ClientError as exc:
            if is_not_found(exc):
                return None
            raise
        return dict(response["ConsumerDescription"])

    def get_or_create(self) -> str:
        """The ARN of the ACTIVE consumer, registering it first when missing."""
        described = self.describe()
        if described is None:
            log.info("registering stream consumer %s on %s", self.consumer_name, self.stream_arn)
            try:
                registered = self._throttled(
                    lambda: self._kinesis.register_stream_consumer(
                        StreamARN=self.stream_arn, ConsumerName=self.consumer_name),
                    self._settings.register_retries, "RegisterStreamConsumer")
                described = dict(registered["Consumer"])
            except ClientError as exc:
                if error_code(exc) != "ResourceInUseException":
                    raise
                log.info("stream consumer %s was registered by another worker",
                         self.consumer_name)
                described = self.describe()
                if described is None:
                    raise KinesisClientLibDependencyException(
                        f"stream consumer {self.consumer_name} is in use yet not found") from exc
        arn = str(described["ConsumerARN"])
        status = described.get("ConsumerStatus")
        looks = 0
        while status != ACTIVE:
            if looks >= self._settings.describe_retries:
                raise ConsumerNotActive(
                    f"stream consumer {self.consumer_name} was not ACTIVE after {looks} "
                    f"looks, {self._settings.backoff_s:g} s apart (status {status})")
            self._sleep(self._settings.backoff_s)
            looks += 1
            current = self.describe()
            status = None if current is None else current.get("ConsumerStatus")
        return arn

    def _throttled(self, call: Callable[[], T], attempts: int, operation: str) -> T:
        def retry_later(exc: BaseException, attempt: int, delay: float) -> None:
            log.info("%s throttled; retrying", operation)

        try:
            return retrying(call, self._settings.retries(attempts),
                            retry_on=is_throttle, wait=self._sleep, on_retry=retry_later)
        except GaveUp as gave_up:
            raise KinesisClientLibDependencyException(
                f"{operation} throttled {attempts} times") from gave_up.last


def list_consumers(kinesis: Any, stream_arn: str) -> list[dict[str, Any]]:
    """Every consumer registered on the stream (all applications')."""
    consumers: list[dict[str, Any]] = []
    request: dict[str, Any] = {"StreamARN": stream_arn}
    while True:
        page = kinesis.list_stream_consumers(**request)
        consumers.extend(page.get("Consumers", []))
        token = page.get("NextToken")
        if not token:
            return consumers
        request = {"StreamARN": stream_arn, "NextToken": token}


def deregister(kinesis: Any, stream_arn: str, consumer_name: str) -> bool:
    """Deregister the consumer; False when there was none."""
    try:
        kinesis.deregister_stream_consumer(StreamARN=stream_arn, ConsumerName=consumer_name)
    except ClientError as exc:
        if is_not_found(exc):
            return False
        raise
    return True
