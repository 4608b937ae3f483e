"""A webhook receiver for the tests of the lag webhook (the worker's and the monitor's)."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class Receiver:
    """An HTTP server on a free loopback port that keeps every POST; the first ``fail``
    requests get a 500."""

    def __init__(self, fail: int = 0) -> None:
        self.posts: list[tuple[dict[str, str], dict[str, Any]]] = []
        self.fail = fail
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                with receiver.lock:
                    failing = receiver.fail > 0
                    receiver.fail -= 1
                    if not failing:
                        receiver.posts.append((dict(self.headers), json.loads(body)))
                self.send_response(500 if failing else 204)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                return

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = int(self.httpd.server_address[1])
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def documents(self) -> list[dict[str, Any]]:
        with self.lock:
            return [document for _, document in self.posts]


@contextlib.contextmanager
def receiving(fail: int = 0) -> Iterator[Receiver]:
    """A :class:`Receiver` serving until the block ends."""
    server = Receiver(fail=fail)
    server.thread.start()
    try:
        yield server
    finally:
        server.httpd.shutdown()
        server.httpd.server_close()
