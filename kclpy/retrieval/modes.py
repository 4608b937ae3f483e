"""Retrieval modes: how a shard's live pages are fetched, chosen by name from one registry.

A mode is an object whose one job is to build a shard's ``PageSource`` (the Java KCL's
``RetrievalSpecificConfig``, httpx's ``Client(transport=...)``): the worker's composition
and a Spark executor both look the configured name up here, so a mode written outside the
package (:func:`register_retrieval_mode`) is read by either without a change to them, and
no other module compares a mode's name. Both sides' words are in the one table: the
worker's ``polling`` / ``fanout`` and the Spark sources' ``getrecords``, ``efo`` and
``subscribetoshard``. Lag recovery's readers poll whatever the mode (they need a per-read
``Limit`` and a rate, which a pushed subscription cannot honour).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from kclpy.errors import ConfigError
from kclpy.metrics import Metrics
from kclpy.retrieval.source import PageSource, ShardAddress
from kclpy.retry import Backoff

if TYPE_CHECKING:
    from kclpy.retrieval.polling import Pacer


@dataclass(frozen=True)
class RetrievalContext:
    """What a worker or a Spark task has when it builds a shard's source: a mode takes what
    it needs and ignores the rest, so adding a value here changes no mode."""

    #: the Kinesis client (boto3), shared and thread-safe
    kinesis: Any
    address: ShardAddress
    metrics: Metrics
    #: the source's own backoff for its calls (GetRecords, iterators, subscriptions)
    backoff: Backoff
    #: the registered stream consumer, for a mode that ``needs_consumer``
    consumer_arn: str | None = None
    #: the most records one read returns (polling's GetRecords ``Limit``)
    max_records: int = 10_000
    #: the wait after an empty page at the tip (polling)
    idle_time_s: float = 1.0
    #: records that arrived at or after this time end the read (a Spark task's bound)
    until_ms: int | None = None
    #: an idle subscription looks for a closed shard this often (fan-out)
    shard_end_probe_s: float = 30.0
    #: ``--fanout-http-version``
    http_version: str = "auto"
    #: a records budget asked before each read (lag recovery's rate)
    pacer: Pacer | None = None


class RetrievalMode(Protocol):
    """A way of reading a shard live, known by ``name`` and ``aliases`` (any case)."""

    @property
    def name(self) -> str:
        """What ``retrievalMode`` / ``--retrieval-mode`` / Spark's ``consumerMode`` say."""

    @property
    def aliases(self) -> tuple[str, ...]:
        """Other words for the same mode (other connectors' names for it)."""

    @property
    def needs_consumer(self) -> bool:
        """Reads through a registered stream consumer: the worker (or the Spark driver)
        registers one before any shard is read, and ``kclpy-worker --local`` serves
        Kinesis with kinesis-mock, whose SubscribeToShard moto lacks."""

    def source(self, context: RetrievalContext) -> PageSource:
        """One shard's live page source."""


@dataclass(frozen=True)
class PollingMode:
    """``GetRecords`` through shard iterators (``retrieval/polling.py``)."""

    name: str = "polling"
    aliases: tuple[str, ...] = ("getrecords",)
    needs_consumer: bool = False

    def source(self, context: RetrievalContext) -> PageSource:
        from kclpy.retrieval.polling import PollingSource

        return PollingSource(
            context.kinesis, context.address, max_records=context.max_records,
            idle_time_s=context.idle_time_s, backoff=context.backoff,
            metrics=context.metrics, pacer=context.pacer, until_ms=context.until_ms)


@dataclass(frozen=True)
class FanOutMode:
    """Enhanced fan-out: ``SubscribeToShard`` through a registered consumer
    (``retrieval/fanout.py``); imported on use, since it brings the HTTP/2 client."""

    name: str = "fanout"
    aliases: tuple[str, ...] = ("efo", "subscribetoshard")
    needs_consumer: bool = True

    def source(self, context: RetrievalContext) -> PageSource:
        from kclpy.retrieval.fanout import FanOutSource

        if context.consumer_arn is None:
            raise ValueError(f"{self.name} reads through a registered consumer: "
                             "the context has no consumer_arn")
        return FanOutSource(
            context.kinesis, context.address, context.consumer_arn,
            http_version=context.http_version, shard_end_probe_s=context.shard_end_probe_s,
            backoff=context.backoff, metrics=context.metrics, until_ms=context.until_ms)


POLLING = PollingMode()
FAN_OUT = FanOutMode()

#: every word a mode is known by (lower case) -> the mode
_MODES: dict[str, RetrievalMode] = {}
#: the modes by their own names, in registration order (what ``--help`` lists)
_NAMES: dict[str, RetrievalMode] = {}


def register_retrieval_mode(mode: RetrievalMode) -> None:
    """Make ``mode`` a value of ``retrievalMode`` (``--retrieval-mode``,
    ``KCLPY_RETRIEVAL_MODE``) and of a Spark source's ``consumerMode``. Register it before
    the configuration is read, in every process that reads with it (a Spark executor
    imports the module that registers it too). A word another mode already has is refused,
    and so is a built-in mode's name: a name must mean one mode wherever it is read. A mode
    of the same name registered again (its module executed again) replaces the earlier one."""
    name = mode.name.lower()
    words = [name, *(alias.lower() for alias in mode.aliases)]
    for word in words:
        if not word.isidentifier():
            raise ValueError(f"{word!r} is not a retrieval mode name")
        held = _MODES.get(word)
        if held is not None and held is not mode and (
                held.name.lower() != name or held in (POLLING, FAN_OUT)):
            raise ValueError(f"{word!r} already names the retrieval mode {held.name!r}")
    for word in [word for word, held in _MODES.items() if held.name.lower() == name]:
        del _MODES[word]
    for word in words:
        _MODES[word] = mode
    _NAMES[name] = mode


def retrieval_mode(name: str, option: str = "retrievalMode") -> RetrievalMode:
    """The mode ``name`` (or an alias of it, any case) names; a ``ConfigError`` naming
    ``option`` and listing the known names otherwise."""
    mode = _MODES.get(str(name).lower())
    if mode is None:
        raise ConfigError(option, f"{name!r} is not one of {', '.join(retrieval_mode_names())}")
    return mode


def retrieval_mode_names() -> tuple[str, ...]:
    """The modes' own names (no aliases), the built-in ones first."""
    return tuple(_NAMES)


register_retrieval_mode(POLLING)
register_retrieval_mode(FAN_OUT)
