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
the queue as a gap found by the lag detector does (``queue.add``). A cancel names each gap
it drops as the operator saw it (``Seen``): the position it starts after and where it ended
then. The start alone is not enough: a gap found again with the same start, or one that
starts inside it, is merged into it and moves its end, so by the time the cancel applies the
start may name records nobody showed the operator. A cancel drops a gap only while it ends
where the operator saw it end, or before; a gap that grew since is refused, not cut: it
stays queued whole, and ``applied`` says why so the holder logs it and the command reports
it (look again, cancel it as it is now). Cutting would keep the part after the seen end as a
gap of its own, but a gap starts after a checkpoint and the seen end is a time or a record
whose checkpoint the queue does not know; finding it means reading the shard, which the
holder folding a request in does not do. A refusal costs at worst the reading of records the
operator meant to skip; nothing is lost. A gap queued after the operator looked, or merged
into one that starts earlier, is never dropped by the cancel either.

A cancel written by a kclpy before this one names the start alone (``cancel``: pairs); it is
still read, and refused like a grown gap, since what its operator saw is unknown. This
version writes the seen gaps under another key (``drop``), which such a kclpy reads as
neither an add nor a cancel: unreadable, left in the set, never applied by the start alone.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timezone

from kclpy.recovery import queue as gaps
from kclpy.recovery.queue import RecoveryRequest

Start = tuple[str, int]
Queue = tuple[RecoveryRequest, ...]


@dataclass(frozen=True)
class Seen:
    """A gap as the operator saw it: the position it starts after (its key in the queue) and
    where it ended then, which is what a cancel of it may drop and no more."""

    start: str
    start_sub: int
    #: None: a cancel written by an older kclpy, which named the start alone
    end_ms: int | None = None
    last_sequence: str | None = None

    @classmethod
    def of(cls, gap: RecoveryRequest) -> Seen:
        return cls(gap.start, gap.start_sub, gap.end_ms, gap.last_sequence)

    def to_json(self) -> dict[str, object]:
        return {"start": self.start, "startSub": self.start_sub, "endMs": self.end_ms,
                "lastSequence": self.last_sequence}

    @classmethod
    def from_json(cls, value: dict[str, object]) -> Seen:
        end_ms, last = value.get("endMs"), value.get("lastSequence")
        return cls(str(value["start"]), _whole(value["startSub"]),
                   None if end_ms is None else _whole(end_ms),
                   None if last is None else str(last))

    def describe(self) -> str:
        after = f"the gap after {_start_text((self.start, self.start_sub))}"
        return after if self.end_ms is None else (
            f"{after} {end_text(self.end_ms, self.last_sequence)}")


@dataclass(frozen=True)
class QueueRequest:
    """One operator request: add ``add``, or drop the gaps ``cancel`` names as seen."""

    #: unique per command run: the set element stays the same when the command is retried
    id: str
    #: when the operator made it (epoch ms): requests apply in this order
    at_ms: int
    add: RecoveryRequest | None = None
    cancel: tuple[Seen, ...] = ()

    def to_text(self) -> str:
        body: dict[str, object] = {"v": 1, "id": self.id, "at": self.at_ms}
        if self.add is not None:
            body["add"] = self.add.to_json()
        else:
            body["drop"] = [seen.to_json() for seen in self.cancel]
        return json.dumps(body, separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_text(cls, text: str) -> QueueRequest:
        try:
            body = json.loads(text)
            add = body.get("add")
            cancel = (*(Seen(str(start), int(sub)) for start, sub in body.get("cancel", ())),
                      *(Seen.from_json(seen) for seen in body.get("drop", ())))
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
        return "cancel " + ", ".join(seen.describe() for seen in self.cancel)


def adding(request: RecoveryRequest, now_ms: int) -> QueueRequest:
    return QueueRequest(uuid.uuid4().hex, now_ms, add=request)


def cancelling(seen: Iterable[RecoveryRequest], now_ms: int) -> QueueRequest:
    """A cancel of the gaps ``seen``, each as it was when the operator saw it."""
    return QueueRequest(uuid.uuid4().hex, now_ms,
                        cancel=tuple(dict.fromkeys(Seen.of(gap) for gap in seen)))


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


def apply(queue: Queue, requests: Iterable[QueueRequest]) -> Queue:
    """``queue`` with ``requests`` applied in the order given."""
    return applied(queue, requests)[0]


def applied(queue: Queue, requests: Iterable[QueueRequest]) -> tuple[Queue, list[str]]:
    """``queue`` with ``requests`` applied in the order given, and why each gap a cancel
    named was kept: the holder logs it, the command refuses with it. A gap no longer queued
    under its start (finished, or merged into one that starts earlier) gets no note: there
    is nothing left of it the cancel could drop."""
    notes: list[str] = []
    for request in requests:
        if request.add is not None:
            queue = gaps.add(queue, request.add)
            continue
        for seen in request.cancel:
            queue, note = _cancelled(queue, seen)
            if note is not None:
                notes.append(note)
    return queue, notes


def _cancelled(queue: Queue, seen: Seen) -> tuple[Queue, str | None]:
    start = (seen.start, seen.start_sub)
    gap = next((r for r in queue if (r.start, r.start_sub) == start), None)
    if gap is None:
        return queue, None
    if seen.end_ms is None:
        return queue, (f"a cancel of {seen.describe()} written by an older kclpy names "
                       "no end, so what its operator saw is unknown: the gap stays queued; "
                       "cancel it again")
    if not gap.ends_within(seen.end_ms, seen.last_sequence):
        return queue, (f"{seen.describe()} has grown since it was seen (it ends "
                       f"{end_text(gap.end_ms, gap.last_sequence)} now): the gap stays "
                       "queued whole; look again (kclpy recovery list) and cancel it as "
                       "it is now")
    return tuple(r for r in queue if (r.start, r.start_sub) != start), None


def end_text(end_ms: int, last_sequence: str | None) -> str:
    """A gap's end as ``kclpy recovery list`` shows it (``ENDS``) and ``cancel --ends``
    takes it."""
    if last_sequence is not None:
        return f"through {last_sequence}"
    return "before " + datetime.fromtimestamp(end_ms / 1000, timezone.utc).isoformat(
        timespec="milliseconds")


def _whole(value: object) -> int:
    if not isinstance(value, int):
        raise ValueError(f"expected a whole number, got {value!r}")
    return value


def _start_text(start: Start) -> str:
    return start[0] if start[1] == 0 else f"{start[0]}/{start[1]}"
