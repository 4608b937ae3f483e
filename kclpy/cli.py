"""Console scripts. ``kclpy-worker`` runs a worker; exit codes: 0 after a clean shutdown,
2 for a bad configuration (one line naming the option), 1 for a fatal error."""

from __future__ import annotations

import argparse
import inspect
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

from kclpy.arguments import parse_worker_args
from kclpy.config import KCLConfig
from kclpy.errors import ConfigError
from kclpy.loading import load_object
from kclpy.metrics import Metrics
from kclpy.processor import IRecordProcessor
from kclpy.state.processor import StatefulProcessor
from kclpy.supervisor import run_processes
from kclpy.worker import Worker

log = logging.getLogger("kclpy")

_PROCESSOR_METHODS = ("initialize", "process_records", "lease_lost", "shard_ended",
                      "shutdown_requested")


def load_processor_class(spec: str, *, base_dir: Path | None = None) -> type[IRecordProcessor]:
    """Import ``pkg.module:Class`` or ``path/to/file.py:Class``; ConfigError naming
    --processor when it does not import or is not a processor class."""
    cls = load_object(spec, "--processor", base_dir=base_dir)
    if not inspect.isclass(cls):
        raise ConfigError("--processor", f"{spec!r} is not a class")
    missing = [m for m in _PROCESSOR_METHODS if not callable(getattr(cls, m, None))]
    if missing:
        raise ConfigError("--processor", f"{spec!r} is not a record processor "
                          f"(missing {', '.join(missing)})")
    if inspect.isabstract(cls):
        raise ConfigError("--processor", f"{spec!r} is abstract")
    # Duck-typed on purpose: a class with the five callbacks is a processor even when it
    # does not inherit from IRecordProcessor (e.g. written against amazon_kclpy's base).
    return cast("type[IRecordProcessor]", cls)


def _processor_factory(config: KCLConfig, args: argparse.Namespace, metrics: Metrics
                       ) -> Callable[[], IRecordProcessor] | Callable[[], StatefulProcessor]:
    if args.processor and config.state_store:
        cls = load_object(args.processor, "--processor")
        if not (inspect.isclass(cls) and issubclass(cls, StatefulProcessor)):
            raise ConfigError("--processor", f"{args.processor!r} is not a "
                              "kclpy.StatefulProcessor (needed with --state-store)")
        return cls
    if args.processor:
        return load_processor_class(args.processor, base_dir=None)
    from kclpy.multilang import multilang_processor_factory

    assert config.executable_name is not None
    stray: Any = config.stray_stdout
    return multilang_processor_factory(
        config.executable_name, cwd=config.properties_dir or Path.cwd(), metrics=metrics,
        response_timeout_s=float(config.timeout_in_seconds), stray_stdout=stray)


def worker_main(argv: Sequence[str] | None = None) -> int:
    metrics = Metrics()
    try:
        config, args = parse_worker_args(argv)
        if args.processes > 1:
            return run_processes(list(sys.argv[1:] if argv is None else argv), args.processes)
        if args.spark_batch:
            return _spark_main(config, args)
        factory = _processor_factory(config, args, metrics)
    except ConfigError as exc:
        print(f"kclpy-worker: error: {exc}", file=sys.stderr)
        return 2
    _configure_logging(args.log_level)
    from kclpy.worker import WorkerFatalError

    try:
        if args.local:
            from kclpy.local import start_embedded
            from kclpy.local.demo import local_session, seed_demo_stream

            with start_embedded() as endpoint:
                config = config.replace(kinesis_endpoint=endpoint.url,
                                        dynamodb_endpoint=endpoint.url)
                session = local_session(config.region or "us-east-1")
                seed_demo_stream(session, endpoint.url, config.stream_label)
                _run(Worker(config, factory, metrics=metrics, session=session))
        else:
            _run(Worker(config, factory, metrics=metrics))
    except ConfigError as exc:
        print(f"kclpy-worker: error: {exc}", file=sys.stderr)
        return 2
    except WorkerFatalError as exc:
        log.error("worker stopped on a fatal error: %s", exc)
        return 1
    except Exception as exc:
        log.exception("worker failed: %s", exc)
        return 1
    return 0


#: At DEBUG these print request headers and canonical requests, session tokens included.
_CREDENTIAL_LEAKING_LOGGERS = ("botocore", "boto3", "urllib3", "s3transfer")


def _configure_logging(level: str) -> None:
    """kclpy's own loggers at ``level``; the AWS SDK's never below INFO, because at DEBUG
    they log credentials (the session token in headers), and credentials are never logged."""
    logging.basicConfig(
        level=level, format="%(asctime)s %(levelname)s [%(threadName)s] %(name)s: %(message)s")
    for name in _CREDENTIAL_LEAKING_LOGGERS:
        logger = logging.getLogger(name)
        if logger.getEffectiveLevel() < logging.INFO:
            logger.setLevel(logging.INFO)


def _spark_main(config: KCLConfig, args: argparse.Namespace) -> int:
    """--spark-batch: a worker whose shards feed Spark micro-batches (kclpy[spark])."""
    try:
        from kclpy.spark import run_spark_batch_worker
    except ImportError as exc:
        raise ConfigError("--spark-batch", f"needs the spark extra: pip install "
                          f"'kclpy[spark]' ({exc})") from None
    _configure_logging(args.log_level)
    return run_spark_batch_worker(config, args.spark_batch, decode_spec=args.spark_decode)


def _run(worker: Worker) -> None:
    """Run the worker, with its /metrics, /healthz and /status endpoint when configured."""
    port = worker.config.metrics_port
    if port is None:
        worker.run()
        return
    from kclpy.ops.server import serve_worker

    cfg = worker.config
    with serve_worker(worker, cfg.metrics_host, port, lag_window_s=cfg.lag_window_s,
                      lag_interval_s=cfg.lag_interval_s, lag_webhook=cfg.lag_webhook) as server:
        log.info("serving /metrics, /healthz and /status on %s", server.url)
        worker.run()


def main() -> None:
    sys.exit(worker_main())
