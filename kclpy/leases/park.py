"""Parked shards: a lease marked so that no kclpy worker takes it.

The mark is kclpy's own attribute ``kclpyParked`` (the Java KCL ignores attributes it does
not know, as it does ``kclpyRecovery``): a JSON object saying who parked the shard, when and
why, and for a shard the ``park`` processor-error policy parked, the last error and the
attempt count. The lease keeps its checkpoint, so a resumed shard starts where it stopped.

Two writers set it. An operator (``kclpy shard park``) takes the lease from its holder in
the same write. A worker whose processor keeps failing on one batch (``park`` policy) marks
the lease through its fence while still holding it, then releases it the way any consumer
that ended is released: if the worker dies in between, the lease expires and, being marked,
is still not taken.

The reason and the error are cut to ``MAX_TEXT_BYTES`` UTF-8 bytes each (the cut counted in
the text), so the mark, JSON-escaped, stays far below DynamoDB's 400 KB item limit: a
processor's exception message can be any size, and a park write the table refuses would
release the lease unmarked, to be taken, failed on and parked again, for ever.
"""

from __future__ import annotations

import json
import time
from typing import Any, Protocol

from kclpy.leases import serializer as ser
from kclpy.leases.lease import Lease
from kclpy.leases.serializer import UpdateBuilder, s

#: UTF-8 bytes kept of the reason and of the error; JSON escaping at most sextuples a byte
#: (a control character becomes ``\u00XX``), so the mark stays under 50 KB
MAX_TEXT_BYTES = 4096


class FencedWriter(Protocol):
    """``LeaseFence.update``: a write only the current holder of the lease may make."""

    def update(self, lease_key: str, token: str | None, changes: UpdateBuilder, *,
               what: str) -> Lease: ...


def marker(reason: str, by: str, *, error: str | None = None,
           attempts: int | None = None, since_ms: int | None = None) -> str:
    """The attribute's value: who parked the shard, when (epoch ms) and why."""
    value: dict[str, Any] = {"reason": bounded(reason), "by": by,
                             "atMs": int(time.time() * 1000)}
    if error is not None:
        value["error"] = bounded(error)
    if attempts is not None:
        value["attempts"] = attempts
    if since_ms is not None:
        value["failingSinceMs"] = since_ms
    return json.dumps(value, separators=(",", ":"))


def bounded(text: str, limit: int = MAX_TEXT_BYTES) -> str:
    """``text`` cut to at most ``limit`` UTF-8 bytes, on a character boundary, and the
    number of bytes cut said at its end."""
    data = text.encode("utf-8", "surrogatepass")
    if len(data) <= limit:
        return text
    kept = data[:limit].decode("utf-8", "ignore")
    return f"{kept}... [{len(data) - len(kept.encode('utf-8', 'surrogatepass'))} more bytes]"


def describe(value: str | None) -> dict[str, Any] | None:
    """The mark as a JSON object; a hand-written plain string (or JSON nested too deep to
    decode, which raises RecursionError, not a decode error) is taken as the reason."""
    if value is None:
        return None
    try:
        parsed = json.loads(value)
    except (json.JSONDecodeError, RecursionError):
        return {"reason": bounded(value)}
    return parsed if isinstance(parsed, dict) else {"reason": bounded(value)}


def park_held(fence: FencedWriter, lease_key: str, token: str, value: str) -> None:
    """Mark a lease this worker holds in the tenure ``token`` as parked; the caller then
    lets the lease go. Raises as the fence does (``ShutdownException`` when the lease was
    lost meanwhile: then whoever holds it now carries on)."""
    fence.update(lease_key, token, UpdateBuilder().set(ser.PARKED, s(value)), what="park")
