"""The ops endpoint against hostile clients: a seeded mix of clients that dribble their
request, lie about ``Content-Length``, cut or reset the connection, send garbage request
lines, oversized headers, or simply too many connections, round after round.

The server runs in a process of its own with its address space capped (``RLIMIT_AS``), so
memory it failed to bound would end it; after every round ``/healthz`` must answer 200, and
at the end the server's peak resident memory must be under a cap. No assertion is on time
beyond generous bounds of liveness.
"""

from __future__ import annotations

import random
import socket
import struct
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: the server's address space; a python process serving this endpoint maps ~300 MB
ADDRESS_SPACE = 1024 * 1024 * 1024
#: the server's peak resident memory; it starts at about 40 MB
PEAK_RSS_KB = 120 * 1024
#: whole-request deadline of the server under test (small, so dribblers are cut in-test)
TIMEOUT_S = 0.5
ROUNDS = 40
SEED = 20261207


@pytest.fixture
def server() -> Iterator[tuple[subprocess.Popen[str], int]]:
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.support.ops_subprocess", str(ADDRESS_SPACE),
         str(TIMEOUT_S)], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        port = int(process.stdout.readline())
        yield process, port
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(30)


def healthz(port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10) as answer:
        return int(answer.status)


class Hostile:
    """One attacking connection; ``step`` is called once a round until it returns False."""

    def __init__(self, port: int, rng: random.Random, payload: bytes, per_step: int,
                 reset_at_end: bool) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.sock.setblocking(False)
        self.payload, self.per_step, self.reset_at_end = payload, per_step, reset_at_end
        self.sent = 0

    def step(self) -> bool:
        chunk = self.payload[self.sent:self.sent + self.per_step]
        try:
            if chunk:
                self.sent += self.sock.send(chunk)
            if self.sock.recv(65536, socket.MSG_DONTWAIT) == b"":
                self.close()
                return False
        except BlockingIOError:
            pass
        except OSError:
            self.close()
            return False
        if self.sent >= len(self.payload) and self.reset_at_end:
            self.close(reset=True)
            return False
        return True

    def close(self, reset: bool = False) -> None:
        if reset:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.sock.close()


def _request(path: bytes, *headers: bytes) -> bytes:
    return b"GET " + path + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n" + b"".join(
        h + b"\r\n" for h in headers) + b"\r\n"


def kinds(rng: random.Random) -> list[Callable[[int], Hostile]]:
    """Each makes one hostile connection to a port."""
    def dribbler(port: int) -> Hostile:
        return Hostile(port, rng, _request(b"/metrics", b"X-Pad: " + b"a" * 2000), 1, False)

    def liar(port: int) -> Hostile:
        method = rng.choice([b"GET", b"POST"])
        payload = (method + b" /status HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: "
                   + str(rng.choice([10**9, 2**63, -5])).encode() + b"\r\n\r\nshort")
        return Hostile(port, rng, payload, len(payload), False)

    def cutter(port: int) -> Hostile:
        payload = _request(b"/metrics")[:rng.randrange(1, 30)]
        return Hostile(port, rng, payload, len(payload), True)

    def resetter(port: int) -> Hostile:
        payload = _request(rng.choice([b"/metrics", b"/status", b"/healthz"]))
        return Hostile(port, rng, payload, len(payload), True)

    def garbage(port: int) -> Hostile:
        payload = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 400))) + b"\r\n\r\n"
        return Hostile(port, rng, payload, len(payload), False)

    def oversized(port: int) -> Hostile:
        payload = _request(b"/healthz", b"X-Big: " + b"b" * rng.choice([20_000, 1_000_000]))
        return Hostile(port, rng, payload, 65536, False)

    def silent(port: int) -> Hostile:
        return Hostile(port, rng, b"", 1, False)

    return [dribbler, liar, cutter, resetter, garbage, oversized, silent]


def test_hostile_clients_leave_healthz_answering_and_memory_bounded(
        server: tuple[subprocess.Popen[str], int]) -> None:
    process, port = server
    rng = random.Random(SEED)
    makers = kinds(rng)
    live: list[Hostile] = []
    try:
        for _ in range(ROUNDS):
            for _ in range(20):
                live.append(rng.choice(makers)(port))
            live = [client for client in live if client.step()]
            assert process.poll() is None, "the server process ended"
            assert healthz(port) == 200
        # the dribblers and silent ones left are cut by the deadline; keep stepping them
        for _ in range(10_000):
            live = [client for client in live if client.step()]
            assert healthz(port) == 200
            if not live:
                break
        assert not live, f"{len(live)} hostile connections were never cut"
    finally:
        for client in live:
            client.close()
    assert process.stdin is not None and process.stdout is not None
    process.stdin.close()
    peak_kb = int(process.stdout.readline())
    assert process.wait(30) == 0
    assert peak_kb < PEAK_RSS_KB, f"peak resident memory {peak_kb} kB"
