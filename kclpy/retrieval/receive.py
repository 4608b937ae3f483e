"""GetRecords bodies received into reused buffers instead of a new bytes object per page.

Why: botocore reads a body in 64 KiB chunks and joins them into one new ``bytes``. For a
full page (up to 10 MiB of data, about 14 MB of JSON) that is a fresh multi-megabyte
allocation per page, which the C allocator serves from memory the kernel must map and zero
again each time. Measured on the benchmark machine, reading 1,000,000 records of 100 B
(100 pages of 3 MB) cost about 250,000 page faults and 0.8 s of system CPU in the fetch
thread, a fifth of the whole worker's CPU; received into buffers that are used again, it
costs almost none (docs/benchmarks.md).

How: the client's HTTP session is wrapped (:class:`PooledSession`). For a GetRecords
request it asks botocore's session to leave the body unread, then receives a successful body
of known length into a pooled ``bytearray``; botocore sees a response whose ``content`` is a
``memoryview`` of that buffer. :mod:`kclpy.retrieval.parse` parses it (orjson copies every
value out) and gives the buffer back with :func:`release`. Everything else stays botocore's:
signing, credentials, endpoints, retries, the connection pool, proxies, TLS and timeouts,
and other operations, error answers, bodies without a ``Content-Length`` and small bodies,
which are read the ordinary way. Wrapping the session rather than answering in a
``before-send`` handler keeps the handlers that answer instead of the network (moto's
in-process mock, test doubles) working: they answer before the session is reached.

The session is ``client._endpoint.http_session``, a private botocore attribute (unchanged
since botocore 1.0). Without it nothing is pooled and everything else works as before.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from botocore.awsrequest import AWSPreparedRequest, AWSResponse
from botocore.exceptions import ConnectionClosedError, HTTPClientError, ReadTimeoutError
from urllib3.exceptions import ProtocolError
from urllib3.exceptions import ReadTimeoutError as URLLib3ReadTimeoutError

__all__ = ["POOL", "BufferPool", "PooledSession", "install", "release", "searchable"]

#: bodies below this are read the ordinary way: the allocator reuses memory for them anyway
MIN_POOLED_BYTES = 256 * 1024
#: buffers are sized in these steps, so a page a little larger than the last may need no new one
_STEP = 64 * 1024
#: idle buffers kept; more fetch threads than this at once allocate as before
_MAX_IDLE = 4
#: a buffer more than this many times larger than the body it held is not kept: once a
#: worker has caught up, the buffers sized for full pages go
_OVERSIZE = 4
_CHUNK = 64 * 1024


class _Buffer(bytearray):
    """A pool buffer. Its own type says where a body came from: the only views of it are
    the ones :meth:`PooledSession.send` makes, each from the buffer's start
    (:func:`searchable` relies on that)."""

    __slots__ = ()


class BufferPool:
    """Receive buffers shared by every fetch thread of the process. Thread-safe."""

    def __init__(self, max_idle: int = _MAX_IDLE) -> None:
        self._max_idle = max_idle
        self._idle: list[bytearray] = []
        self._lock = threading.Lock()

    def take(self, size: int) -> bytearray:
        """A buffer of at least ``size`` bytes: the most recently returned one if it is large
        enough (likely still in cache and mapped), else a new one."""
        with self._lock:
            buffer = self._idle.pop() if self._idle else None
        if buffer is None or len(buffer) < size:
            buffer = _Buffer(-(-size // _STEP) * _STEP)
        return buffer

    def give(self, buffer: bytearray, used: int) -> None:
        """Return a buffer that held a body of ``used`` bytes."""
        if len(buffer) > max(used, MIN_POOLED_BYTES) * _OVERSIZE:
            return
        with self._lock:
            if len(self._idle) < self._max_idle:
                self._idle.append(buffer)

    def idle(self) -> list[bytearray]:
        """The buffers waiting to be taken, most recently returned last (for tests)."""
        with self._lock:
            return list(self._idle)


POOL = BufferPool()


class _PooledResponse(AWSResponse):
    """An answer whose body is already in a pooled buffer; ``content`` is a view of it."""

    def __init__(self, response: AWSResponse, body: memoryview) -> None:
        # botocore-stubs types the headers as http.client's; botocore passes its own mapping.
        headers: Any = response.headers
        super().__init__(response.url, response.status_code, headers, response.raw)
        self._content = body


# botocore encodes header values to bytes before sending; str as well, to be safe.
_GET_RECORDS_TARGETS = (b"Kinesis_20131202.GetRecords", "Kinesis_20131202.GetRecords")


class PooledSession:
    """A botocore HTTP session that receives large GetRecords bodies into pooled buffers;
    everything else goes to the wrapped session unchanged."""

    def __init__(self, session: Any) -> None:
        self.session = session

    def __getattr__(self, name: str) -> Any:
        # close() and anything else botocore's Endpoint asks of its session.
        return getattr(self.session, name)

    def send(self, request: AWSPreparedRequest) -> AWSResponse:
        if request.headers.get("X-Amz-Target") not in _GET_RECORDS_TARGETS:
            response: AWSResponse = self.session.send(request)
            return response
        request.stream_output = True
        response = self.session.send(request)
        with _as_botocore_errors(request):
            size = _poolable_length(response)
            if size is None:
                response.content  # noqa: B018 - read now, as botocore's session would have
                return response
            buffer = POOL.take(size)
            body = memoryview(buffer)[:size]
            try:
                _receive(response, body)
            except BaseException:
                body.release()
                POOL.give(buffer, size)
                raise
        return _PooledResponse(response, body)


def install(client: Any) -> None:
    """Wrap ``client``'s HTTP session in a :class:`PooledSession` (idempotent). A client
    without a session where botocore keeps it is left alone: nothing is pooled."""
    endpoint: Any = getattr(client, "_endpoint", None)
    session = getattr(endpoint, "http_session", None)
    if callable(getattr(session, "send", None)) and not isinstance(session, PooledSession):
        endpoint.http_session = PooledSession(session)


def release(body: object) -> None:
    """Give a parsed body's buffer back to :data:`POOL`; anything but a pooled body is left
    alone. The view is released, so a late reader fails instead of reading another page."""
    if isinstance(body, memoryview) and isinstance(body.obj, bytearray):
        buffer, size = body.obj, body.nbytes
        body.release()
        POOL.give(buffer, size)


def searchable(body: object) -> bytes | bytearray | None:
    """What ``body``'s bytes can be searched in with ``find`` (a memoryview has no
    ``find``), its first ``len(body)`` bytes being the body's; None if there is no such
    object. A pooled body is a view of the start of its buffer (:class:`_Buffer`); views of
    anything else may start anywhere in it."""
    if isinstance(body, bytes | bytearray):
        return body
    if isinstance(body, memoryview) and type(body.obj) is _Buffer:
        return body.obj
    return None


def _poolable_length(response: AWSResponse) -> int | None:
    """The body's length if it goes into a pooled buffer: a success, not encoded, of a
    stated length worth pooling."""
    if response.status_code != 200 or response.headers.get("content-encoding"):
        return None
    try:
        size = int(response.headers.get("content-length", ""))
    except ValueError:
        return None
    return size if size >= MIN_POOLED_BYTES else None


def _receive(response: AWSResponse, body: memoryview) -> None:
    """Fill ``body`` from the socket. Chunks, not one read: urllib3 reads into a temporary
    of the size asked, and a temporary the size of the body is what the pool avoids."""
    raw = response.raw
    size = len(body)
    received = 0
    while received < size:
        n = raw.readinto(body[received : received + _CHUNK])
        if not n:
            raise ProtocolError(
                f"connection closed after {received} of {size} body bytes")
        received += n


@contextmanager
def _as_botocore_errors(request: AWSPreparedRequest) -> Iterator[None]:
    """Read errors raised as botocore's session raises them for the bodies it reads itself,
    so the fetcher's retry classification sees the same exceptions either way."""
    try:
        yield
    except URLLib3ReadTimeoutError as error:
        raise ReadTimeoutError(endpoint_url=request.url, error=error) from error
    except ProtocolError as error:
        raise ConnectionClosedError(
            error=error, request=request, endpoint_url=request.url) from error
    except Exception as error:
        raise HTTPClientError(error=error) from error
