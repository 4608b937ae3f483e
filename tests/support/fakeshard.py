"""A shard as a list of records, for the read pipeline and the polling source: scripted
pages and errors, recorded calls and sleeps, and the pipelines built on it."""

from __future__ import annotations

import random
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import pytest
from aws_kinesis_agg.aggregator import RecordAggregator
from botocore.exceptions import ClientError

from kclpy.metrics import Metrics
from kclpy.position import AT_TIMESTAMP, LATEST, TRIM_HORIZON, Position
from kclpy.records import Record, Records
from kclpy.retrieval import parse
from kclpy.retrieval import polling as polling_module
from kclpy.retrieval.page import ChildShard, Page
from kclpy.retrieval.pipeline import Batching, ShardPipeline
from kclpy.retrieval.polling import PollingSource
from kclpy.retrieval.source import (
    AFTER_SEQUENCE_NUMBER,
    AT_SEQUENCE_NUMBER,
    ShardAddress,
)
from kclpy.retry import Backoff

SHARD = "shardId-000000000000"
#: the keywords ``make`` hands to the pipeline's ``Batching``
BATCHING = {option.name for option in fields(Batching)}
BASE_SEQ = 49_000_000_000_000_000_000


def seq(i: int) -> str:
    return str(BASE_SEQ + i * 10)


def plain(i: int, data: bytes | None = None) -> Record:
    return Record(
        sequence_number=seq(i),
        partition_key=f"pk-{i}",
        timestamp_millis=1_700_000_000_000 + i,
        data=data if data is not None else f"plain-{i}".encode(),
    )


def aggregate(i: int, n: int, explicit_hash_keys: list[str] | None = None) -> Record:
    agg = RecordAggregator()
    for j in range(n):
        ehk = explicit_hash_keys[j] if explicit_hash_keys else None
        agg.add_user_record(f"pk-{i}-{j}", f"agg-{i}-{j}".encode(), ehk)
    partition_key, _, data = agg.clear_and_get().get_contents()
    return Record(
        sequence_number=seq(i),
        partition_key=partition_key,
        timestamp_millis=1_700_000_000_000 + i,
        data=data,
    )


def error(code: str, status: int = 400, operation: str = "GetRecords") -> ClientError:
    response: Any = {
        "Error": {"Code": code, "Message": "m"},
        "ResponseMetadata": {"HTTPStatusCode": status},
    }
    return ClientError(response, operation)


def payloads(results: list[Page[Records]]) -> list[bytes]:
    return [r.binary_data for result in results for r in result.records]


def positions(records: list[Record]) -> list[tuple[int, int]]:
    return [r.extended_sequence_number for r in records]


@dataclass
class FakeShard:
    """One shard as a list of Kinesis records; iterators are ``it-<index>-<n>`` tokens.

    ``errors[operation]`` is consumed front to back: each call raises the next one, if any.
    """

    records: list[Record]
    page_size: int = 3
    closed: bool = False
    child_shards: list[ChildShard] = field(default_factory=list)
    millis_behind: int | None = None
    errors: dict[str, list[Exception]] = field(default_factory=dict)
    shard_iterator_calls: list[dict[str, Any]] = field(default_factory=list)
    get_records_calls: list[tuple[str, int]] = field(default_factory=list)
    called: threading.Condition = field(default_factory=threading.Condition)
    _issued: int = 0

    def _raise_scripted(self, operation: str) -> None:
        pending = self.errors.get(operation)
        if pending:
            raise pending.pop(0)

    def get_shard_iterator(self, **params: Any) -> dict[str, Any]:
        self.shard_iterator_calls.append(params)
        self._raise_scripted("GetShardIterator")
        kind = params["ShardIteratorType"]
        seqs = [int(r.sequence_number) for r in self.records]
        if kind == TRIM_HORIZON:
            index = 0
        elif kind == LATEST:
            index = len(self.records)
        elif kind == AT_SEQUENCE_NUMBER:
            index = next(
                (k for k, s in enumerate(seqs) if s >= int(params["StartingSequenceNumber"])),
                len(seqs),
            )
        elif kind == AFTER_SEQUENCE_NUMBER:
            index = next(
                (k for k, s in enumerate(seqs) if s > int(params["StartingSequenceNumber"])),
                len(seqs),
            )
        elif kind == AT_TIMESTAMP:
            millis = params["Timestamp"].timestamp() * 1000
            arrivals = [r.timestamp_millis or 0 for r in self.records]
            index = next((k for k, a in enumerate(arrivals) if a >= millis), len(arrivals))
        else:
            raise AssertionError(kind)
        self._issued += 1
        return {"ShardIterator": f"it-{index}-{self._issued}"}

    def page(self, iterator: str, limit: int) -> Page[Sequence[Record]]:
        with self.called:
            self.get_records_calls.append((iterator, limit))
            self.called.notify_all()
        self._raise_scripted("GetRecords")
        match = re.fullmatch(r"it-(\d+)-\d+", iterator)
        assert match, iterator
        index = int(match.group(1))
        batch = self.records[index : index + min(limit, self.page_size)]
        after = index + len(batch)
        at_end = after >= len(self.records)
        self._issued += 1
        next_iterator = None if self.closed and at_end else f"it-{after}-{self._issued}"
        millis = self.millis_behind if self.millis_behind is not None else (0 if at_end else 5000)
        return Page(
            records=list(batch),
            millis_behind_latest=millis,
            child_shards=list(self.child_shards) if next_iterator is None else [],
            next_shard_iterator=next_iterator,
            size_bytes=sum(len(r.binary_data) for r in batch),
        )

    def wait_for_calls(self, n: int, timeout: float = 10.0) -> bool:
        with self.called:
            return self.called.wait_for(lambda: len(self.get_records_calls) >= n, timeout)


class Sleeps:
    def __init__(self) -> None:
        self.delays: list[float] = []

    def __call__(self, seconds: float) -> None:
        self.delays.append(seconds)


class UpperBound(random.Random):
    """Full jitter's worst case: always the top of the range, so delays are predictable."""

    def uniform(self, a: float, b: float) -> float:
        return b


def route_get_records(monkeypatch: pytest.MonkeyPatch) -> None:
    """Route the polling source's GetRecords to ``FakeShard.page`` when the client is a
    fake (a real client keeps kclpy's own parse)."""

    def get_records(client: Any, iterator: str, limit: int) -> Page[Sequence[Record]]:
        if isinstance(client, FakeShard):
            return client.page(iterator, limit)
        return parse.get_records(client, iterator, limit)

    def install(client: Any) -> None:
        if not isinstance(client, FakeShard):
            parse.install_fast_get_records(client)

    monkeypatch.setattr(polling_module, "get_records", get_records)
    monkeypatch.setattr(polling_module, "install_fast_get_records", install)


def make(
    shard: FakeShard,
    start: Position | None = None,
    *,
    sleeps: Sleeps | None = None,
    metrics: Metrics | None = None,
    max_records: int = 10000,
    idle_time_s: float = 1.0,
    **kwargs: Any,
) -> ShardPipeline:
    """A polling pipeline of ``shard``; ``kwargs`` are the pipeline's, or its ``Batching``'s."""
    source = PollingSource(
        shard,  # type: ignore[arg-type]
        ShardAddress(SHARD, stream_name="s"),
        max_records=max_records,
        idle_time_s=idle_time_s,
        backoff=Backoff(0.1, 1.0, rng=UpperBound()),
        metrics=metrics,
    )
    batching = {name: kwargs.pop(name) for name in BATCHING if name in kwargs}
    return ShardPipeline(
        source,
        start or Position.trim_horizon(),
        metrics=metrics,
        sleep=sleeps if sleeps is not None else Sleeps(),
        batching=Batching(**batching),
        **kwargs,
    )


def polling(client: Any, start: Position, address: ShardAddress, *,
            metrics: Metrics | None = None, sleep: Sleeps | None = None,
            hash_range: tuple[int, int] | None = None, **kwargs: Any) -> ShardPipeline:
    """A polling pipeline of a real (or stubbed) client; ``kwargs`` are the source's."""
    return ShardPipeline(PollingSource(client, address, metrics=metrics, **kwargs), start,
                         batching=Batching(hash_range=hash_range), metrics=metrics, sleep=sleep)


def sample(metrics: Metrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def drain(fetcher: ShardPipeline, limit: int = 100) -> list[Page[Records]]:
    results = []
    for _ in range(limit):
        result = fetcher.fetch_once()
        if result is not None:
            results.append(result)
            if result.shard_end:
                return results
        elif fetcher.finished:
            return results
    return results
