"""``kclpy monitor``: its flags, and the handler that runs the service until a stop signal."""

from __future__ import annotations

import argparse
import errno
import logging
import sys
import threading
import urllib.parse
from collections.abc import Callable
from typing import IO, Any

import boto3
import botocore.config
from botocore.exceptions import NoRegionError

from kclpy.arguments import LOG_LEVELS, OneLineParser
from kclpy.errors import ConfigError
from kclpy.ops.monitor.service import Monitor, TableDiscovery
from kclpy.ops.monitor.watch import ApplicationWatch
from kclpy.ops.monitor.web import serve_monitor
from kclpy.ops.webhook import redacted
from kclpy.signals import on_stop_signals

log = logging.getLogger("kclpy.monitor")


def add_flags(parser: OneLineParser, *, url: Callable[[str], str],
              seconds: Callable[[str], float],
              whole: Callable[[int, int], Callable[[str], int]]) -> None:
    """The monitor's flags; ``url``, ``seconds`` and ``whole`` are the command table's
    argument types, so that every ``kclpy`` command checks a value the same way."""
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--application-name", action="append", metavar="APP",
                       help="an application to watch (repeatable); its lease table is "
                            "named after it")
    which.add_argument("--all-applications", action="store_true",
                       help="watch every KCL 2.x lease table of the account and region "
                            "(listed again every 5 minutes)")
    stream = parser.add_mutually_exclusive_group()
    stream.add_argument("--stream-name", help="the stream of tables whose leases do not name "
                        "it (Java KCL); picks one stream of a multi-stream table")
    stream.add_argument("--stream-arn", help="the stream's ARN (instead of its name)")
    parser.add_argument("--port", required=True, type=whole(0, 65535), metavar="N",
                        help="port of the page, the JSON API and /metrics (0: a free port)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                        help="a host name the endpoint answers besides its address "
                             "(repeatable; the Host check against DNS rebinding)")
    parser.add_argument("--window-s", type=seconds, default=300.0, metavar="S",
                        help="length of the evaluation window (default 300)")
    parser.add_argument("--interval-s", type=seconds, default=30.0, metavar="S",
                        help="time between two samples of an application, at most half "
                             "the window; sets the cost (default 30)")
    parser.add_argument("--failover-s", type=seconds, default=10.0, metavar="S",
                        help="the workers' failover time: leases not renewed for this long "
                             "mean no live worker (default 10)")
    parser.add_argument("--records-limit", type=whole(1, 10000), default=1000, metavar="N",
                        help="GetRecords Limit when counting records behind (default 1000)")
    parser.add_argument("--lag-webhook", type=_webhook_url, metavar="URL",
                        help="POST each status change here as JSON (retried; credentials "
                             "in the URL are used, never logged)")
    parser.add_argument("--region", help="AWS region (default: the boto3 chain)")
    parser.add_argument("--kinesis-endpoint", type=url, metavar="URL",
                        help="Kinesis endpoint URL (default: the boto3 chain)")
    parser.add_argument("--dynamodb-endpoint", type=url, metavar="URL",
                        help="DynamoDB endpoint URL (default: the boto3 chain)")
    parser.add_argument("--log-level", default="INFO", choices=LOG_LEVELS)


def _webhook_url(text: str) -> str:
    """An http(s) URL; a bad one is not echoed, since it may carry credentials."""
    if urllib.parse.urlsplit(text).scheme not in ("http", "https"):
        raise argparse.ArgumentTypeError("not an http(s) URL (not shown: it may carry "
                                         "credentials)")
    return text


def check(args: argparse.Namespace) -> str | None:
    """Two observations must fit in a window, or no checkpoint could be seen to move."""
    if args.interval_s > args.window_s / 2:
        return "argument --interval-s: must be at most half of --window-s"
    if args.failover_s > args.window_s:
        return "argument --failover-s: must be at most --window-s"
    return None


def clients(args: argparse.Namespace) -> tuple[Any, Any]:
    """``(kinesis, dynamodb)`` from the flags. A monitor runs for months: it retries as a
    worker's clients do, and one slow answer costs one application's sample."""
    session = boto3.session.Session(region_name=args.region)
    config = botocore.config.Config(retries={"mode": "standard", "total_max_attempts": 3},
                                    connect_timeout=5, read_timeout=20,
                                    max_pool_connections=4)
    try:
        return (session.client("kinesis", endpoint_url=args.kinesis_endpoint, config=config),
                session.client("dynamodb", endpoint_url=args.dynamodb_endpoint,
                               config=config))
    except NoRegionError:
        raise ConfigError("--region", "no region configured (set --region or "
                         "AWS_DEFAULT_REGION)") from None


def build(args: argparse.Namespace, kinesis: Any, dynamodb: Any) -> Monitor:
    """The monitor the flags describe (not started)."""

    def watch(name: str) -> ApplicationWatch:
        return ApplicationWatch(name, kinesis, dynamodb, window_s=args.window_s,
                                failover_s=args.failover_s, records_limit=args.records_limit,
                                stream_name=args.stream_name, stream_arn=args.stream_arn)

    names = list(dict.fromkeys(args.application_name or []))
    return Monitor([watch(name) for name in names], interval_s=args.interval_s,
                   make_watch=watch if args.all_applications else None,
                   discovery=TableDiscovery(dynamodb) if args.all_applications else None,
                   lag_webhook=args.lag_webhook)


def run(args: argparse.Namespace, out: IO[str]) -> int:
    """Serve until SIGTERM or Ctrl-C; exit 0 then. A port that cannot be bound is a usage
    error naming ``--port`` (or ``--host`` for an address this host does not have)."""
    kinesis, dynamodb = clients(args)
    monitor = build(args, kinesis, dynamodb)
    try:
        server = serve_monitor(monitor, args.host, args.port,
                               allowed_hosts=args.allowed_host)
    except OSError as exc:
        monitor.stop()
        option = "--port" if exc.errno in (errno.EADDRINUSE, errno.EACCES) else "--host"
        raise ConfigError(option, f"cannot serve on {args.host}:{args.port}: "
                         f"{exc.strerror or exc}") from None
    stop = threading.Event()
    with on_stop_signals(lambda signum: stop.set()), server:
        monitor.start()
        watching = ", ".join(args.application_name or ["every lease table"])
        print(f"kclpy monitor: watching {watching} on {server.url} (every "
              f"{args.interval_s:g}s, window {args.window_s:g}s"
              + (f", webhook {redacted(args.lag_webhook)}" if args.lag_webhook else "")
              + "); Ctrl-C stops.", file=sys.stderr, flush=True)
        out.write(f"{server.url}\n")
        out.flush()
        stop.wait()
        monitor.stop()
    return 0
