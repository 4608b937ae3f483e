"""A forwarding proxy that counts Kinesis calls, and the records GetRecords returned, per caller.

The fault proxy counts requests; what the Spark source's costs are about is records fetched
(each one spends the shard's read throughput) and who fetched them. Callers are told apart
by a tag in their User-Agent (the source's clients add ``kclpy-spark-driver`` or
``kclpy-spark-executor``); anything else counts as ``other``.
"""

from __future__ import annotations

import http.client
import json
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from urllib.parse import urlsplit

TAGS = ("kclpy-spark-driver", "kclpy-spark-executor")
_HOP_BY_HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length",
                         "proxy-connection", "te", "trailer", "upgrade"})


class CountingProxy:
    """Reverse proxy on a free loopback port; ``calls``/``records`` are read while it runs."""

    def __init__(self, upstream_url: str) -> None:
        upstream = urlsplit(upstream_url)
        if upstream.scheme != "http" or upstream.hostname is None:
            raise ValueError(f"upstream must be a plain http:// URL, not {upstream_url!r}")
        self.upstream = (upstream.hostname, upstream.port or 80)
        self.lock = threading.Lock()
        #: (caller tag, operation) -> requests
        self.calls: Counter[tuple[str, str]] = Counter()
        #: caller tag -> Kinesis records in successful GetRecords answers
        self.records: Counter[str] = Counter()
        #: caller tag -> bytes of successful GetRecords answers
        self.bytes: Counter[str] = Counter()
        #: access key id each request was signed with -> requests
        self.access_keys: Counter[str] = Counter()
        self._server = _Server(self)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever,
                                         kwargs={"poll_interval": 0.05}, daemon=True)

    def __enter__(self) -> CountingProxy:
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._server.shutdown()
        self._thread.join()
        self._server.server_close()

    def count(self, tag: str, operation: str) -> int:
        with self.lock:
            return self.calls[(tag, operation)]

    def reset(self) -> None:
        with self.lock:
            self.calls.clear()
            self.records.clear()
            self.bytes.clear()
            self.access_keys.clear()


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, proxy: CountingProxy) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.proxy = proxy


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: object) -> None:
        """Silent: a test's output is its assertions."""

    def do_POST(self) -> None:
        proxy = self.server.proxy
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        operation = self.headers.get("X-Amz-Target", "").rpartition(".")[2] or "?"
        agent = self.headers.get("User-Agent", "")
        tag = next((t for t in TAGS if t in agent), "other")
        signed = self.headers.get("Authorization", "")
        access_key = signed.partition("Credential=")[2].partition("/")[0]
        connection = http.client.HTTPConnection(*proxy.upstream, timeout=60)
        try:
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
            connection.request("POST", self.path, body=body, headers=headers)
            response = connection.getresponse()
            answer = response.read()
        finally:
            connection.close()
        records = 0
        if operation == "GetRecords" and response.status == 200:
            records = len(json.loads(answer).get("Records", []))
        with proxy.lock:
            proxy.calls[(tag, operation)] += 1
            proxy.access_keys[access_key] += 1
            if operation == "GetRecords" and response.status == 200:
                proxy.records[tag] += records
                proxy.bytes[tag] += len(answer)
        self.send_response(response.status)
        for key, value in response.getheaders():
            if key.lower() not in _HOP_BY_HOP:
                self.send_header(key, value)
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)
