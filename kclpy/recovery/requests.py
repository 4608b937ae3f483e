"""Operator requests to a shard's recovery queue (``kclpy recovery add`` / ``cancel``) while
a worker holds the shard: the lease item keeps them in a string set beside the queue until
the holder folds them in.

Why not write the queue itself: the holder keeps the queue in memory and rewrites the whole
attribute with each recovery checkpoint, so an operator's rewrite would be overwritten by
the next one - unless the operator bumped the lease counter, which ends the holder's tenure
(``lease_lost``, a new tenure one failover time later). Instead the operator ADDs one element
to ``kclpyRecoveryRequests``, conditional only on the lease still naming the owner it read;
the counter stays, so the holder's fenced writes still succeed. Every renewal answers with
the whole item, so the holder sees the element within one renewal; its next queue write
applies every request it sees and DELETEs exactly those elements, in the same fenced write.
An element added meanwhile is not in that DELETE and waits for the next write: nothing is
lost. An element is applied by the one write that removes it: nothing is applied twice; a
write that fails (the lease moved) removes nothing, and the next holder applies it instead.

A lease nobody holds has nobody to fold requests in: the operator writes its queue directly,
conditional on the counter it read (``kclpy.ops.control``), folding in any requests left in
the set by a holder that let go first.

Requests apply in the order they were made (their time, then their id). An add merges into
the queue as a gap found by the lag detector does (``queue.add``). A cancel names the gaps
it drops by the position they start after, as ``kclpy recovery list`` showed them: a gap
queued after the operator looked is never dropped by it.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable
from dataclasses import dataclass

from kclpy.recovery import queue as gaps
from kclpy.recovery.queue import RecoveryRequest

Start = tuple[str, int]


@dataclass(frozen=True)
class QueueRequest:
    """One operator request: add ``add``, or drop the gaps starting after ``cancel``."""

    #: unique per command run: the set element stays the same when the command is retried
    id: str
    #: when the operator made it (epoch ms): requests apply in this order
    at_ms: int
    add: RecoveryRequest | None = None
    cancel: tuple[Start, ...] = ()

    def to_text(self) -> str:
        body: dict[str, object] = {"v": 1, "id": self.id, "at": self.at_ms}
        if self.add is not None:
            body["add"] = self.add.to_json()
        else:
            body["cancel"] = [[start, sub] for start, sub in self.cancel]
        return json.dumps(body, separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_text(cls, text: str) -> QueueRequest:
        try:
            body = json.loads(text)
            add = body.get("add")
            cancel = tuple((str(start), int(sub)) for start, sub in body.get("cancel", ()))
            request = cls(id=str(body["id"]), at_ms=int(body["at"]),
                          add=None if add is None else RecoveryRequest.from_json(add),
                          cancel=cancel)
        except (TypeError, KeyError, ValueError, AttributeError, RecursionError,
                OverflowError) as exc:
            # RecursionError: JSON nested too deep to decode is as unreadable as a typo;
            # OverflowError: int() of an infinite time (JSON reads 1e309 as a float)
            raise ValueError(f"unreadable recovery request {text[:80]!r}: {exc!r}") from None
        if (request.add is None) == (not request.cancel):
            raise ValueError(f"unreadable recovery request {text[:80]!r}: neither an add nor "
                             "a cancel")
        return request

    def describe(self) -> str:
        if self.add is not None:
            return f"add the gap after {_start_text((self.add.start, self.add.start_sub))}"
        return "cancel the gap(s) after " + ", ".join(_start_text(s) for s in self.cancel)


def adding(request: RecoveryRequest, now_ms: int) -> QueueRequest:
    return QueueRequest(uuid.uuid4().hex, now_ms, add=request)


def cancelling(starts: Iterable[Start], now_ms: int) -> QueueRequest:
    return QueueRequest(uuid.uuid4().hex, now_ms, cancel=tuple(sorted(set(starts))))


def read(texts: Iterable[str]) -> tuple[list[tuple[str, QueueRequest]], list[str]]:
    """The readable requests of the set, each with its element, in the order they apply;
    and the unreadable elements (left in the item for an operator to remove: dropping one
    would silently drop a backfill)."""
    readable: list[tuple[str, QueueRequest]] = []
    unreadable: list[str] = []
    for text in texts:
        try:
            readable.append((text, QueueRequest.from_text(text)))
        except ValueError:
            unreadable.append(text)
    readable.sort(key=lambda pair: (pair[1].at_ms, pair[1].id))
    return readable, sorted(unreadable)


def apply(queue: tuple[RecoveryRequest, ...], requests: Iterable[QueueRequest]
          ) -> tuple[RecoveryRequest, ...]:
    """``queue`` with ``requests`` applied in the order given."""
    for request in requests:
        if request.add is not None:
            queue = gaps.add(queue, request.add)
        else:
            dropped = set(request.cancel)
            queue = tuple(r for r in queue if (r.start, r.start_sub) not in dropped)
    return queue


def _start_text(start: Start) -> str:
    return start[0] if start[1] == 0 else f"{start[0]}/{start[1]}"
