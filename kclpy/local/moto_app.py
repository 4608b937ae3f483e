"""moto's backends behind a threaded werkzeug server that hands moto one request at a time.

Both the embedded endpoint and ``python -m kclpy.local.moto_server`` are built here, so the
two can never differ in what they guarantee.
"""

from __future__ import annotations

import io
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING

from werkzeug.serving import BaseWSGIServer, WSGIRequestHandler, make_server
from werkzeug.wsgi import get_input_stream

if TYPE_CHECKING:
    from _typeshed.wsgi import StartResponse, WSGIApplication, WSGIEnvironment


class SerialApp:
    """Runs each request of ``app`` alone, from the call through the response being read out.

    The lease protocol rests on DynamoDB applying each conditional write atomically. moto
    checks a condition and applies the write in separate steps without a lock, so on a server
    with a thread per request two workers taking the same lease at the same moment can both
    succeed, which DynamoDB never allows. The request body is read before taking the lock and
    the response body buffered under it, so a client that is slow to send or to read (or was
    stopped mid-request) cannot hold up everyone else's requests.
    """

    def __init__(self, app: WSGIApplication) -> None:
        self._app = app
        self._lock = threading.Lock()

    def __call__(self, environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        environ["wsgi.input"] = io.BytesIO(get_input_stream(environ).read())
        with self._lock:
            response = self._app(environ, start_response)
            try:
                return list(response)
            finally:
                close = getattr(response, "close", None)
                if close is not None:
                    close()


class _QuietRequestHandler(WSGIRequestHandler):
    """Keeps one access line per request out of the host application's logs; errors still log."""

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        return None


def make_moto_server(host: str, port: int) -> BaseWSGIServer:
    """A bound, not yet serving, server for moto's backends on ``host``:``port`` (0: any free).

    Connections are still accepted and parsed on a thread each, so an idle keep-alive
    connection never blocks another client; only moto itself sees one request at a time.
    """
    # moto registers every AWS backend on import (about half a second); importing it here
    # keeps importing kclpy.local cheap for everything that never serves moto in-process.
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app

    from kclpy.local import moto_quirks

    moto_quirks.install()
    app = SerialApp(DomainDispatcherApplication(create_backend_app))
    return make_server(host, port, app, threaded=True, request_handler=_QuietRequestHandler)
