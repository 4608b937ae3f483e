"""The local AWS of ``kclpy local`` and ``kclpy-worker --local``, without Docker.

moto serves DynamoDB and CloudWatch from a thread of this process. Kinesis is kinesis-mock (a
Node.js child process), the only emulator here with SubscribeToShard, so enhanced fan-out runs
locally too; or, when fan-out is not needed and Node.js is not wanted, moto's own Kinesis,
which is enough for polling.
"""

from __future__ import annotations

import argparse
import errno
import socket
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO

from kclpy.local.demo import local_session, seed_demo_stream
from kclpy.local.endpoints import LOOPBACK, LocalEndpointError, ProcessEndpoint, start_embedded
from kclpy.local.kinesis_mock import require_node, start_kinesis_mock
from kclpy.signals import on_stop_signals

#: the credentials every local endpoint accepts; printed, so the user's real ones are never
#: sent to an emulator (nor anywhere else by a command pointed at one)
LOCAL_ACCESS_KEY_ID = "kclpy-local"
LOCAL_SECRET_ACCESS_KEY = "kclpy-local"  # noqa: S105
#: how often ``kclpy local`` checks that kinesis-mock is still running
_WATCH_INTERVAL_S = 0.5


@dataclass(frozen=True)
class LocalServers:
    """Where each AWS API is served, and the kinesis-mock child (None: moto serves Kinesis)."""

    kinesis_url: str
    #: moto: DynamoDB and CloudWatch
    moto_url: str
    kinesis_mock: ProcessEndpoint | None

    def environment(self, region: str) -> dict[str, str]:
        """The variables that point boto3 (and so kclpy, the AWS CLI, any SDK that reads
        the standard ones) at these servers, with credentials they accept."""
        return {
            "AWS_ENDPOINT_URL_KINESIS": self.kinesis_url,
            "AWS_ENDPOINT_URL_DYNAMODB": self.moto_url,
            "AWS_ENDPOINT_URL_CLOUDWATCH": self.moto_url,
            "AWS_ACCESS_KEY_ID": LOCAL_ACCESS_KEY_ID,
            "AWS_SECRET_ACCESS_KEY": LOCAL_SECRET_ACCESS_KEY,
            "AWS_DEFAULT_REGION": region,
            "AWS_REGION": region,
        }


@contextmanager
def local_servers(*, host: str = LOOPBACK, port: int = 0, kinesis_port: int = 0,
                  kinesis_mock: bool = True) -> Iterator[LocalServers]:
    """moto, and kinesis-mock unless ``kinesis_mock`` is False, for the block; both stopped
    (the child's process group ended) on the way out. LocalEndpointError when kinesis-mock
    cannot run (no Node.js: the message names the ``local`` extra)."""
    if kinesis_mock:
        require_node()
    with start_embedded(host, port) as moto:
        if not kinesis_mock:
            yield LocalServers(moto.url, moto.url, None)
            return
        with start_kinesis_mock(host=host, port=kinesis_port) as mock:
            yield LocalServers(mock.url, moto.url, mock)


def local_command(args: argparse.Namespace, out: IO[str]) -> int:
    """Start the servers, print the ``export`` lines, and wait for a stop signal: exit 0
    after a clean stop, 1 when a server could not start or kinesis-mock died, 2 for a port
    it cannot listen on or without the Node.js kinesis-mock needs."""
    for option, port in (("--port", args.port), ("--kinesis-port", args.kinesis_port)):
        problem = _cannot_listen(args.host, port)
        if problem is not None:
            where = option if problem.errno in (errno.EADDRINUSE, errno.EACCES) else "--host"
            print(f"kclpy local: error: {where}: cannot listen on {args.host} port {port}: "
                  f"{problem.strerror or problem}", file=sys.stderr)
            return 2
    if not args.no_kinesis_mock:
        try:
            require_node()
        except LocalEndpointError as exc:
            print(f"kclpy local: error: {exc} (or --no-kinesis-mock: Kinesis from moto, "
                  "polling only)", file=sys.stderr)
            return 2
    stop = threading.Event()
    with on_stop_signals(lambda signum: stop.set()):
        try:
            with local_servers(host=args.host, port=args.port, kinesis_port=args.kinesis_port,
                               kinesis_mock=not args.no_kinesis_mock) as servers:
                if args.demo_stream:
                    seed_demo_stream(local_session(args.region), servers.kinesis_url,
                                     args.demo_stream)
                for name, value in servers.environment(args.region).items():
                    out.write(f"export {name}={value}\n")
                out.flush()
                print(f"kclpy local: serving Kinesis on {servers.kinesis_url}, DynamoDB and "
                      f"CloudWatch on {servers.moto_url}; paste the lines above into a shell. "
                      "Ctrl-C stops.", file=sys.stderr, flush=True)
                return _wait(stop, servers)
        except LocalEndpointError as exc:
            print(f"kclpy local: error: {exc}", file=sys.stderr)
            return 1


def _cannot_listen(host: str, port: int) -> OSError | None:
    """Why a server could not listen on ``host``:``port`` now, if it could not: a busy port
    or an address this machine does not have is one line naming the flag, not a traceback
    from moto or three failed starts of kinesis-mock."""
    if port == 0 and host in (LOOPBACK, "localhost"):
        return None
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            # as the servers themselves bind: TIME_WAIT leftovers of an earlier run are no
            # obstacle
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
    except OSError as exc:
        return exc
    return None


def _wait(stop: threading.Event, servers: LocalServers) -> int:
    mock = servers.kinesis_mock
    while not stop.wait(_WATCH_INTERVAL_S):
        if mock is not None and mock.process.poll() is not None:
            print(f"kclpy local: error: kinesis-mock exited with code {mock.process.returncode}; "
                  f"its last output:\n{mock.log_tail()}", file=sys.stderr)
            return 1
    print("kclpy local: stopped", file=sys.stderr, flush=True)
    return 0
