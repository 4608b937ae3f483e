"""Makes moto answer where it parts from AWS in ways kclpy's production code must not know of.

kclpy speaks to AWS as AWS documents it; an emulator that answers otherwise is corrected
here, once, for both moto in a thread (``kclpy-worker --local``, ``kclpy.local``'s server) and
moto in-process (unit tests call :func:`install` before ``mock_aws``). Each correction says
which request AWS answers differently and is tested against the AWS behaviour, so a moto
release that fixes the quirk (or changes it) shows up as a failing test, not as a workaround
in the shard-sync code.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

#: how many ListShards continuation tokens are remembered; a token older than this many
#: pages is answered as moto answers it (an unknown stream), as AWS answers an expired one
TOKENS_REMEMBERED = 4096

_STREAM_PARAMS = ("StreamName", "StreamARN")
_installed = False
_install_lock = threading.Lock()


class _TokenStreams:
    """The stream each ListShards continuation token was issued for.

    AWS takes ``NextToken`` alone (it refuses the stream beside it); moto 5.x needs the
    stream again and checks that the request's other parameters match those of the first
    page. Remembering what the first page named lets a follow-up that names only the token be
    completed exactly as moto expects.
    """

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._streams: OrderedDict[str, dict[str, str]] = OrderedDict()
        self._lock = threading.Lock()

    def remember(self, token: str, stream: dict[str, str]) -> None:
        with self._lock:
            self._streams[token] = stream
            self._streams.move_to_end(token)
            while len(self._streams) > self._capacity:
                self._streams.popitem(last=False)

    def recall(self, token: str) -> dict[str, str]:
        with self._lock:
            return dict(self._streams.get(token, {}))


def install() -> None:
    """Apply every correction to the imported moto; idempotent and thread-safe."""
    global _installed
    with _install_lock:
        if _installed:
            return
        _complete_list_shards_tokens(_TokenStreams(TOKENS_REMEMBERED))
        _installed = True


def _complete_list_shards_tokens(streams: _TokenStreams) -> None:
    from moto.kinesis.responses import KinesisResponse

    original: Callable[[KinesisResponse], Any] = KinesisResponse.list_shards

    def list_shards(self: KinesisResponse) -> Any:
        params: dict[str, Any] = self.params
        token = params.get("NextToken")
        if token and not any(params.get(name) for name in _STREAM_PARAMS):
            params.update(streams.recall(token))
        named = {name: params[name] for name in _STREAM_PARAMS if params.get(name)}
        result = original(self)
        execute = result.execute_result

        def execute_result(context: Any) -> Any:
            response = execute(context)
            issued = _next_token(response)
            if issued and named:
                streams.remember(issued, named)
            return response

        result.execute_result = execute_result
        return result

    KinesisResponse.list_shards = list_shards  # type: ignore[method-assign]


def _next_token(response: Any) -> str | None:
    """The ``NextToken`` of a serialised ListShards answer (status, headers, JSON body)."""
    body = response[2] if isinstance(response, tuple) and len(response) == 3 else None
    if isinstance(body, bytes):
        body = body.decode("utf-8")
    if not isinstance(body, str) or "NextToken" not in body:
        return None
    token = json.loads(body).get("NextToken")
    return token if isinstance(token, str) else None
