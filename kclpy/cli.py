"""Console scripts. ``kclpy-worker`` runs a worker; exit codes: 0 after a clean shutdown,
2 for a bad configuration (one line naming the option), 1 for a fatal error."""

from __future__ import annotations

import argparse
import inspect
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn, cast

from kclpy.config import (
    OPTIONS,
    KCLConfig,
    build_config,
    convert_cli_value,
    from_environment,
    from_properties,
    read_properties,
)
from kclpy.errors import ConfigError
from kclpy.loading import load_object
from kclpy.metrics import Metrics
from kclpy.processor import IRecordProcessor
from kclpy.worker import Worker

log = logging.getLogger("kclpy")

_PROCESSOR_METHODS = ("initialize", "process_records", "lease_lost", "shard_ended",
                      "shutdown_requested")
LOCAL_DEMO_NAME = "kclpy-demo"


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line naming the option, with exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _worker_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="kclpy-worker",
        description="Consume a Kinesis stream with a kclpy record processor.")
    parser.add_argument("--processor", metavar="SPEC",
                        help="pkg.module:Class or path/to/file.py:Class (an IRecordProcessor)")
    parser.add_argument("--properties", metavar="FILE",
                        help="MultiLangDaemon .properties file (flags win over it)")
    parser.add_argument("--local", action="store_true",
                        help="start the embedded local AWS endpoint (demo stream included)")
    parser.add_argument("--processes", metavar="N", default="1",
                        help="run N worker processes sharing the lease table (all cores)")
    parser.add_argument("--spark-batch", metavar="SPEC",
                        help="hand micro-batches to foreach_batch(df, batch_id) at SPEC "
                             "(pkg.module:function) instead of running a processor")
    parser.add_argument("--spark-decode", metavar="SPEC",
                        help="with --spark-batch: decode(record) -> dict of extra columns")
    parser.add_argument("--log-level", default="INFO",
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    for option in OPTIONS:
        if option.name in ("executable_name",):
            continue
        if option.kind == "bool":
            parser.add_argument(option.flag, dest=option.name, nargs="?", const="true",
                                metavar="BOOL", help=option.help)
        else:
            parser.add_argument(option.flag, dest=option.name, metavar=option.kind.upper(),
                                help=option.help)
    return parser


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


def parse_worker_args(argv: Sequence[str] | None) -> tuple[KCLConfig, argparse.Namespace]:
    """Merge properties file, environment and flags (flags win) into a validated config."""
    args = _worker_parser().parse_args(argv)
    values: dict[str, Any] = {}
    labels: dict[str, str] = {}
    env_values, env_labels = from_environment()
    values.update(env_values)
    labels.update(env_labels)
    if args.properties:
        path = Path(args.properties)
        prop_values, prop_labels = from_properties(read_properties(path),
                                                   base_dir=path.resolve().parent)
        values.update(prop_values)
        labels.update(prop_labels)
    for option in OPTIONS:
        raw = getattr(args, option.name, None)
        if raw is not None:
            values[option.name] = convert_cli_value(option.name, raw)
            labels[option.name] = option.flag
    if args.local:
        values.setdefault("stream_name", LOCAL_DEMO_NAME)
        values.setdefault("application_name", LOCAL_DEMO_NAME)
        values.setdefault("initial_position", "TRIM_HORIZON")
        values.setdefault("region", "us-east-1")
    config = build_config(values, labels)
    if not args.processes.isdigit() or int(args.processes) < 1:
        raise ConfigError("--processes", f"{args.processes!r} is not a whole number >= 1")
    args.processes = int(args.processes)
    if args.spark_decode and not args.spark_batch:
        raise ConfigError("--spark-decode", "needs --spark-batch")
    if args.spark_batch and (args.processor or args.local):
        raise ConfigError("--spark-batch", "cannot be combined with --processor or --local")
    if not args.processor and not config.executable_name and not args.spark_batch:
        raise ConfigError("--processor", "is required (or executableName in --properties, "
                          "or --spark-batch)")
    return config, args


def _processor_factory(config: KCLConfig, args: argparse.Namespace, metrics: Metrics
                       ) -> Callable[[], IRecordProcessor]:
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
            from kclpy.supervisor import run_processes

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

    with serve_worker(worker, worker.config.metrics_host, port) as server:
        log.info("serving /metrics, /healthz and /status on %s", server.url)
        worker.run()


def main() -> None:
    sys.exit(worker_main())
