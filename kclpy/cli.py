"""Console scripts. ``kclpy-worker`` runs a worker; exit codes: 0 after a clean shutdown,
2 for a bad configuration (one line naming the option), 1 for a fatal error."""

from __future__ import annotations

import argparse
import contextlib
import inspect
import logging
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import boto3
from botocore.exceptions import BotoCoreError

from kclpy.arguments import early_log_level, early_worker_id, parse_worker_args
from kclpy.config import OPTIONS_BY_NAME, SUPERVISED, KCLConfig
from kclpy.errors import ConfigError, cannot_heal
from kclpy.loading import current_folder_last, load_object
from kclpy.metrics import Metrics
from kclpy.processor import IRecordProcessor
from kclpy.progress import reporting_progress
from kclpy.redaction import add_secrets, configure_logging, redact
from kclpy.sessions import aws_session
from kclpy.state.processor import StatefulProcessor
from kclpy.supervisor import run_processes
from kclpy.worker import Worker

if TYPE_CHECKING:
    from kclpy.local.server import LocalServers

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
    if missing and issubclass(cls, StatefulProcessor):
        raise ConfigError("--processor", f"{spec!r} is a kclpy.StatefulProcessor: it needs "
                          "--state-store (a DynamoDB table name or a database URL)")
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
    argv = list(sys.argv[1:] if argv is None else argv)
    supervised = SUPERVISED in os.environ
    # before parsing: a .properties file logs what it changes while it is read
    _configure_logging(early_log_level(argv),
                       early_worker_id(argv) if supervised else None)
    current_folder_last()
    metrics = Metrics()
    labels: dict[str, str] = {}
    try:
        with _said_by_the_supervisor() if supervised else contextlib.nullcontext():
            config, args = parse_worker_args(argv)
        labels = args.labels
        add_secrets((config.lag_webhook, config.state_store))
        if args.processes > 1:
            if args.local:
                return _local_processes(config, argv, args.processes)
            return run_processes(argv, args.processes, config)
        if args.spark_batch:
            return _spark_main(config, args)
        factory = _processor_factory(config, args, metrics)
    except ConfigError as exc:
        return _config_error(exc, labels)
    except _CannotStart as exc:
        return _cannot_start(exc)
    from kclpy.worker import WorkerFatalError

    try:
        if args.local:
            with _local_servers(config) as servers:
                config, session = _on_local_endpoint(config, servers)
                _run(Worker(config, factory, metrics=metrics, session=session),
                     args.progress_interval)
        else:
            session = _session_with_credentials(config)
            _run(Worker(config, factory, metrics=metrics, session=session),
                 args.progress_interval)
    except ConfigError as exc:
        return _config_error(exc, labels)
    except _CannotStart as exc:
        return _cannot_start(exc)
    except WorkerFatalError as exc:
        log.error("worker stopped on a fatal error: %s", exc)
        log.debug("the fatal error's traceback", exc_info=True)
        return 1
    except Exception as exc:
        if cannot_heal(exc):
            print(f"kclpy-worker: error: {redact(str(exc))} (retrying cannot help: check the "
                  "credentials and their permissions)", file=sys.stderr)
            return 1
        log.error("worker failed: %s: %s (--log-level DEBUG shows the traceback)",
                  type(exc).__name__, exc)
        log.debug("the failure's traceback", exc_info=True)
        return 1
    return 0


def _config_error(exc: ConfigError, labels: dict[str, str]) -> int:
    """One line naming the option as the user gave it (flag, properties key, environment
    variable); exit code 2."""
    print(f"kclpy-worker: error: {redact(user_label(exc, labels))}", file=sys.stderr)
    return 2


def user_label(exc: ConfigError, labels: dict[str, str]) -> str:
    """``exc``'s message under the user's name for its option: the worker raises with the
    keyword (``stream_arn``) or the flag (``--stream-arn``), the user may have written
    ``streamArn`` in a .properties file."""
    option = exc.option
    if option in OPTIONS_BY_NAME:
        return f"{labels.get(option, OPTIONS_BY_NAME[option].flag)}: {exc.message}"
    by_flag = {OPTIONS_BY_NAME[name].flag: label for name, label in labels.items()
               if name in OPTIONS_BY_NAME}
    return f"{by_flag.get(option, option)}: {exc.message}"


class _CannotStart(Exception):
    """Start-up met something retrying cannot fix (no credentials at all, a local server
    that would not start)."""


def _cannot_start(exc: _CannotStart) -> int:
    print(f"kclpy-worker: error: {redact(str(exc))}", file=sys.stderr)
    return 1


def _session_with_credentials(config: KCLConfig) -> boto3.session.Session:
    """A session whose credentials resolved: without any, every start-up attempt would fail
    the same way, so the worker is not started at all."""
    session = aws_session(config.region)
    try:
        credentials = session.get_credentials()
    except BotoCoreError as exc:
        raise _CannotStart(f"AWS credentials could not be loaded: {exc}") from None
    if credentials is not None:
        add_secrets((credentials.secret_key, credentials.token))
    if credentials is None:
        raise _CannotStart(
            "no AWS credentials found (the standard chain: AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY, AWS_PROFILE or ~/.aws/credentials, an instance or "
            "container role); or try --local")
    return session


@contextlib.contextmanager
def _local_servers(config: KCLConfig) -> Iterator[LocalServers]:
    """What ``--local`` runs on: moto in this process, and with fan-out kinesis-mock (the
    emulator with SubscribeToShard) as a child process; one that cannot start is a start-up
    failure, not a worker failure."""
    from kclpy.local import LocalEndpointError
    from kclpy.local.server import local_servers

    with contextlib.ExitStack() as stack:
        try:
            servers = stack.enter_context(local_servers(kinesis_mock=config.fan_out))
        except LocalEndpointError as exc:
            raise _CannotStart(str(exc)) from None
        yield servers


def _on_local_endpoint(config: KCLConfig, servers: LocalServers
                       ) -> tuple[KCLConfig, boto3.session.Session]:
    """``config`` pointed at the local servers for every AWS API it may call (CloudWatch
    included), the demo stream seeded, and a session with dummy credentials: nothing leaves
    the machine, and the user's real credentials are never used."""
    from kclpy.local.demo import local_session, seed_demo_stream

    config = config.replace(kinesis_endpoint=servers.kinesis_url,
                            dynamodb_endpoint=servers.moto_url,
                            cloudwatch_endpoint=servers.moto_url)
    session = local_session(config.region or "us-east-1")
    seed_demo_stream(session, servers.kinesis_url, config.stream_label)
    return config, session


def _local_processes(config: KCLConfig, argv: list[str], processes: int) -> int:
    """``--local --processes N``: one set of local servers, started and seeded here, shared
    by the N workers (each its own would give each worker every shard of its own copy)."""
    from kclpy.local.demo import local_session, seed_demo_stream

    with _local_servers(config) as servers:
        region = config.region or "us-east-1"
        seed_demo_stream(local_session(region), servers.kinesis_url, config.stream_label)
        # lowest precedence (below .properties and flags), as --local's own defaults are
        shared = {
            "KCLPY_STREAM_NAME": config.stream_name or "",
            "KCLPY_APPLICATION_NAME": config.application_name,
            "KCLPY_INITIAL_POSITION": config.initial_position,
            "KCLPY_REGION": region,
            "KCLPY_KINESIS_ENDPOINT": servers.kinesis_url,
            "KCLPY_DYNAMODB_ENDPOINT": servers.moto_url,
            "KCLPY_CLOUDWATCH_ENDPOINT": servers.moto_url,
            "AWS_ACCESS_KEY_ID": "kclpy-local",
            "AWS_SECRET_ACCESS_KEY": "kclpy-local",
        }
        for name in ("AWS_SESSION_TOKEN", "AWS_PROFILE"):
            os.environ.pop(name, None)
        os.environ.update({k: v for k, v in shared.items() if v})
        return run_processes([arg for arg in argv if arg != "--local"], processes, config)


def _configure_logging(level: str, worker_id: str | None = None) -> None:
    """kclpy's own loggers at ``level``, through handlers that mask credentials whatever
    logger a record comes from (kclpy.redaction). ``worker_id``: the worker is one of a
    supervisor's, whose children share one terminal; each line names the worker it comes
    from."""
    who = "" if worker_id is None else f"[{worker_id.replace('%', '%%')}] "
    configure_logging(level, f"%(asctime)s %(levelname)s {who}[%(threadName)s] %(name)s: "
                             "%(message)s")


@contextlib.contextmanager
def _said_by_the_supervisor() -> Iterator[None]:
    """A supervised worker loads the configuration its supervisor loaded and logged about
    already (an unknown key, an ignored Java key): said again by each child, every such line
    would appear N + 1 times. Errors are still shown."""
    loader = logging.getLogger("kclpy.config")
    level = loader.level
    loader.setLevel(logging.ERROR)
    try:
        yield
    finally:
        loader.setLevel(level)


def _spark_main(config: KCLConfig, args: argparse.Namespace) -> int:
    """--spark-batch: a worker whose shards feed Spark micro-batches (kclpy[spark])."""
    try:
        from kclpy.spark import run_spark_batch_worker
    except ImportError as exc:
        raise ConfigError("--spark-batch", f"needs the spark extra: pip install "
                          f"'kinesis-kclpy[spark]' ({exc})") from None
    return run_spark_batch_worker(config, args.spark_batch, decode_spec=args.spark_decode,
                                  progress_interval_s=args.progress_interval)


def _run(worker: Worker, progress_interval_s: float) -> None:
    """Run the worker, with its /metrics, /healthz and /status endpoint when configured,
    and a progress line every ``progress_interval_s`` (0: none)."""
    with serving(worker), reporting_progress(worker.metrics, worker.status,
                                             progress_interval_s):
        worker.run()


@contextlib.contextmanager
def serving(worker: Worker) -> Iterator[None]:
    """/metrics, /healthz and /status while the block runs, when a metrics port is set."""
    port = worker.config.metrics_port
    if port is None:
        yield
        return
    from kclpy.ops.server import serve_worker

    cfg = worker.config
    with serve_worker(worker, cfg.metrics_host, port, lag_window_s=cfg.lag_window_s,
                      lag_interval_s=cfg.lag_interval_s, lag_webhook=cfg.lag_webhook,
                      allowed_hosts=(cfg.ops_allowed_hosts or "").split(",")) as server:
        log.info("serving /metrics, /healthz and /status on %s", server.url)
        yield


def main() -> None:
    sys.exit(worker_main())
