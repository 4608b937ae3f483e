"""Garbage through the whole retrieval path, into a processor: nothing raises out of the
consumer, and every input record reaches the processor as all of its user records or as one
raw record counted as corrupt (or, outside the shard's hash range, is counted as filtered).

tests/retrieval/test_retrieval_fuzz.py fuzzes ``deaggregate`` and the parse on their own. Here
the same payloads travel as a real GetRecords answer: a botocore client whose HTTP layer is replaced
by a ``before-send`` handler serving the pages, so the request signing, kclpy's own parse
hook, the fetcher's retries and de-aggregation, the consumer's delivery and checkpoints all
run as in production. Pages may first be answered with random bytes, a truncated body, a
throttle or a server error, which the fetcher must retry without losing its place.
"""

from __future__ import annotations

import base64
import functools
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import boto3
from botocore.awsrequest import AWSPreparedRequest, AWSResponse
from botocore.compat import HTTPHeaders
from botocore.config import Config
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kclpy.consumer import ConsumerSettings, ShardConsumer
from kclpy.leases.lease import Lease
from kclpy.metrics import Metrics
from kclpy.position import SHARD_END, Position
from kclpy.processor import (
    InitializeInput,
    IRecordProcessor,
    LeaseLostInput,
    ProcessRecordsInput,
    ShardEndedInput,
    ShutdownRequestedInput,
)
from kclpy.retrieval.kpl import CORRUPT_REASONS
from kclpy.retrieval.page import ChildShard
from kclpy.retrieval.pipeline import Batching, ShardPipeline
from kclpy.retrieval.polling import PollingSource
from kclpy.retrieval.source import ShardAddress, reading_start
from kclpy.retry import Backoff
from tests.support.aggregates import MAX_HASH_KEY, expected_outcome, payload, sub_records_of
from tests.support.checkpoints import CheckpointWriterBase
from tests.support.scripted import Host, Readers

if TYPE_CHECKING:
    from mypy_boto3_kinesis import KinesisClient

SHARD = "shardId-000000000000"
FUZZ = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

#: what the first request for a page gets before the page itself
FAULTS = ("none", "random bytes", "truncated", "throttle", "server error")


class _Body:
    """The ``raw`` of an AWSResponse: botocore reads the body through ``stream()``."""

    def __init__(self, data: bytes) -> None:
        self._data = data

    def stream(self, **_: Any) -> list[bytes]:
        return [self._data]


@dataclass
class FakeKinesis:
    """Serves GetShardIterator and the pages of one shard; the last page closes it."""

    pages: list[list[bytes]]
    faults: list[str]
    garbage: bytes
    requests: int = 0
    served: list[int] = field(default_factory=list)

    def wire_record(self, page: int, index: int, data: bytes) -> dict[str, Any]:
        return {
            "SequenceNumber": str(10**20 + page * 1000 + index),
            "PartitionKey": f"outer-{page}-{index}",
            "Data": base64.b64encode(data).decode(),
            "ApproximateArrivalTimestamp": 1_700_000_000 + page,
        }

    def page_body(self, page: int) -> bytes:
        last = page == len(self.pages) - 1
        doc: dict[str, Any] = {
            "Records": [self.wire_record(page, i, d) for i, d in enumerate(self.pages[page])],
            "MillisBehindLatest": 0 if last else 5000,
        }
        if last:
            doc["ChildShards"] = []
        else:
            doc["NextShardIterator"] = f"page-{page + 1}"
        return json.dumps(doc).encode()

    def __call__(self, request: AWSPreparedRequest, **_: Any) -> AWSResponse:
        self.requests += 1
        target = request.headers["X-Amz-Target"]
        target = target.decode() if isinstance(target, bytes) else target
        operation = target.rsplit(".", 1)[-1]
        if operation == "GetShardIterator":
            return self.answer(200, json.dumps({"ShardIterator": "page-0"}).encode())
        assert operation == "GetRecords", operation
        body = request.body
        assert isinstance(body, bytes)
        page = int(json.loads(body)["ShardIterator"].split("-")[1])
        fault, self.faults[page] = self.faults[page], "none"
        if fault == "random bytes":
            return self.answer(200, self.garbage)
        if fault == "truncated":
            full = self.page_body(page)
            return self.answer(200, full[: len(full) // 2])
        if fault == "throttle":
            return self.answer(400, json.dumps({
                "__type": "ProvisionedThroughputExceededException", "message": "slow down"
            }).encode())  # fmt: skip
        if fault == "server error":
            return self.answer(500, json.dumps({"__type": "InternalFailure"}).encode())
        self.served.append(page)
        return self.answer(200, self.page_body(page))

    @staticmethod
    def answer(status: int, body: bytes) -> AWSResponse:
        headers = HTTPHeaders.from_dict(
            {"Content-Type": "application/x-amz-json-1.1", "x-amzn-RequestId": "fuzz"}
        )
        return AWSResponse("http://127.0.0.1:9/", status, headers, _Body(body))


class Collecting(IRecordProcessor):
    """Keeps what it was handed and checkpoints every batch, as most processors do."""

    def __init__(self) -> None:
        self.records: list[tuple[str, int, bytes]] = []
        self.ended = False

    def initialize(self, initialize_input: InitializeInput) -> None:
        pass

    def process_records(self, process_records_input: ProcessRecordsInput) -> None:
        for record in process_records_input.records:
            self.records.append(
                (record.sequence_number, record.sub_sequence_number, record.binary_data)
            )
        process_records_input.checkpointer.checkpoint()

    def lease_lost(self, lease_lost_input: LeaseLostInput) -> None:
        pass

    def shard_ended(self, shard_ended_input: ShardEndedInput) -> None:
        self.ended = True
        shard_ended_input.checkpointer.checkpoint()

    def shutdown_requested(self, shutdown_requested_input: ShutdownRequestedInput) -> None:
        pass


class Checkpoints(CheckpointWriterBase):
    """The lease side: accepts every fenced checkpoint write and keeps the last one."""

    def __init__(self) -> None:
        self.last: tuple[str, int] | None = None

    def update_checkpoint(
        self, lease_key: str, concurrency_token: str, position: Position
    ) -> None:
        self.last = (position.checkpoint, position.sub_sequence_number)

    def get_lease(self, lease_key: str) -> Lease | None:
        return None


def expected_records(
    pages: Sequence[Sequence[bytes]], low: int | None, high: int | None
) -> tuple[list[tuple[str, int, bytes]], int, int]:
    """What the processor must see, and the corrupt and filtered counts, by the oracle of
    tests/retrieval/test_retrieval_fuzz.py."""
    out: list[tuple[str, int, bytes]] = []
    corrupt = filtered = 0
    for page_index, page in enumerate(pages):
        for index, data in enumerate(page):
            sequence = str(10**20 + page_index * 1000 + index)
            outcome = expected_outcome(data, low, high)
            if outcome in ("plain", "corrupt"):
                out.append((sequence, 0, data))
                corrupt += outcome == "corrupt"
            elif outcome == "filtered":
                filtered += len(sub_records_of(data))
            else:
                out.extend(
                    (sequence, sub, record.data) for sub, record in enumerate(sub_records_of(data))
                )
    return out, corrupt, filtered


bounds = st.one_of(
    st.just((None, None)),
    st.tuples(st.integers(0, MAX_HASH_KEY), st.integers(0, MAX_HASH_KEY)).map(sorted).map(tuple),
)


_SERVER_ID = "fuzz-fake-kinesis"


@functools.cache
def kinesis_client() -> KinesisClient:
    """One client for every example (making one costs more than an example); each example
    plugs its own fake server in and out. No retries in botocore, as in the worker."""
    session = boto3.session.Session(
        aws_access_key_id="fuzz", aws_secret_access_key="fuzz", region_name="us-east-1"
    )
    return session.client(
        "kinesis", endpoint_url="http://127.0.0.1:9",
        config=Config(retries={"total_max_attempts": 1}),
    )  # fmt: skip


def counter(metrics: Metrics, name: str) -> float:
    return metrics.registry.get_sample_value(name, {"shard_id": SHARD}) or 0.0


@FUZZ
@given(
    pages=st.lists(st.lists(payload, max_size=5), min_size=1, max_size=4),
    faults=st.data(),
    garbage=st.binary(max_size=64),
    hash_range=bounds,
)
def test_garbage_reaches_the_processor_accounted_for_and_nothing_raises(
    pages: list[list[bytes]], faults: st.DataObject, garbage: bytes,
    hash_range: tuple[int | None, int | None],
) -> None:  # fmt: skip
    fault_list = [faults.draw(st.sampled_from(FAULTS)) for _ in pages]
    server = FakeKinesis(pages, list(fault_list), garbage)
    client = kinesis_client()
    # A before-send handler that returns a response replaces the HTTP call.
    handler = cast("Callable[..., None]", server)
    client.meta.events.register("before-send.kinesis", handler, unique_id=_SERVER_ID)
    try:
        run_and_check(client, pages, fault_list, server, hash_range)
    finally:
        client.meta.events.unregister("before-send.kinesis", unique_id=_SERVER_ID)


def run_and_check(
    client: KinesisClient, pages: list[list[bytes]], fault_list: list[str], server: FakeKinesis,
    hash_range: tuple[int | None, int | None],
) -> None:  # fmt: skip
    low, high = hash_range
    lease = Lease(
        SHARD, lease_owner="fuzz", starting_hash_key=None if low is None else str(low),
        ending_hash_key=None if high is None else str(high),
    )  # fmt: skip
    metrics = Metrics()
    processor = Collecting()
    checkpoints = Checkpoints()
    ended: list[Sequence[ChildShard]] = []

    def fetcher(start: Position) -> ShardPipeline:
        source = PollingSource(
            client, ShardAddress(lease.lease_key, stream_name="fuzz"), idle_time_s=0.0,
            metrics=metrics, backoff=Backoff(base_s=0.001, cap_s=0.002))
        return ShardPipeline(
            source, reading_start(start, None),
            metrics=metrics, batching=Batching(
                hash_range=None if low is None or high is None else (low, high),
                filter_outside_hash_range=True),
        )  # fmt: skip

    consumer = ShardConsumer(
        lease, concurrency_token="token", processor_factory=lambda: processor,
        fence=checkpoints, readers=Readers(fetcher),
        host=Host(checkpoints, lambda shard_id, children: ended.append(children)),
        settings=ConsumerSettings(poll_timeout_s=0.01, task_backoff_s=0.001,
                                  max_task_backoff_s=0.002),
        metrics=metrics,
    )  # fmt: skip
    consumer.start()
    assert consumer.join(60), "the consumer did not finish the shard"

    assert consumer.error is None, repr(consumer.error)
    assert counter(metrics, "kclpy_processor_errors_total") == 0
    expected, corrupt, filtered = expected_records(pages, low, high)
    assert processor.records == expected
    assert sum(metrics.registry.get_sample_value(
        "kclpy_deaggregation_errors_total", {"shard_id": SHARD, "reason": reason}) or 0
        for reason in CORRUPT_REASONS) == corrupt
    assert counter(metrics, "kclpy_records_filtered_total") == filtered
    assert server.served == list(range(len(pages))), "every page once, in order"
    retried = sum(fault != "none" for fault in fault_list)
    assert server.requests == 1 + len(pages) + retried
    assert processor.ended and consumer.shard_ended
    assert checkpoints.last == (SHARD_END, 0)
    assert ended == [[]]
