"""The ``kclpy-worker`` command line: flags, ``.properties`` file and environment merged
into one validated ``KCLConfig``.

It lives apart from ``cli.py`` because two entry points need it: the CLI that runs one
worker, and the supervisor that checks the configuration once before starting N of them.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from kclpy import __version__
from kclpy.config import (
    OPTIONS,
    KCLConfig,
    build_config,
    convert_cli_value,
    from_environment,
    from_properties,
    read_properties,
)
from kclpy.errors import ConfigError, closest
from kclpy.position import TRIM_HORIZON
from kclpy.retrieval.modes import retrieval_mode
from kclpy.streams import StreamConfig

LOCAL_DEMO_NAME = "kclpy-demo"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
#: flags given once per stream of a multi-stream application
_REPEATABLE = ("stream_name", "stream_arn")
#: where ``kclpy-worker --processes N`` hands its children a secret option given as a flag:
#: their argv is readable by every local user (``/proc/<pid>/cmdline``), their environment
#: is not. Read back with a flag's precedence, so the children see what the parent saw.
SECRET_FLAG_ENV = "KCLPY_FLAG_"  # noqa: S105 (a variable-name prefix)


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line naming the option, with exit code 2 (the
    exit code every kclpy command uses for a bad configuration); a misspelt flag gets a
    "did you mean", and no flag is taken from a prefix of its name: ``--stop-when`` is an
    error, not ``--stop-when-caught-up``, so a flag added later can never change what an
    existing command line means."""

    def __init__(self, *args: Any, usage_exit_code: int = 2, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        #: a check command (``kclpy status``) says UNKNOWN (3) on a usage error, as Nagios
        #: plugins do, so that a typo is never read as the application's ERROR (2)
        self.usage_exit_code = usage_exit_code

    def error(self, message: str) -> NoReturn:
        self.exit(self.usage_exit_code,
                  f"{self.prog}: error: {message}{self._suggestion(message)}\n")

    def parse_args(  # type: ignore[override]
            self, args: Sequence[str] | None = None,
            namespace: argparse.Namespace | None = None) -> argparse.Namespace:
        """As argparse, except that a flag left over is reported by the subcommand it was
        given to: with its exit code and a suggestion from that subcommand's own flags."""
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            self._command_parser(parsed).error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        """As argparse, plus the closest choice: a misspelt command (``kclpy shard prak``)
        or level gets the same "did you mean" as a misspelt flag."""
        try:
            super()._check_value(action, value)
        except argparse.ArgumentError as exc:
            close = closest(str(value), [str(choice) for choice in action.choices or ()])
            if close is None:
                raise
            raise argparse.ArgumentError(
                action, f"{exc.message} (did you mean {close}?)") from None

    def _command_parser(self, parsed: argparse.Namespace) -> OneLineParser:
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                chosen = action.choices.get(getattr(parsed, action.dest, None) or "")
                if isinstance(chosen, OneLineParser):
                    return chosen._command_parser(parsed)
        return self

    def _suggestion(self, message: str) -> str:
        if not message.startswith("unrecognized arguments: "):
            return ""
        known = [flag for action in self._actions for flag in action.option_strings]
        for word in message.removeprefix("unrecognized arguments: ").split():
            name = word.split("=", 1)[0]
            close = closest(name, known) if name.startswith("--") else None
            if close:
                return f" (did you mean {close}?)"
        return ""


#: ``kclpy-worker --help`` in the sections a reader looks for, each option (by its dest) in
#: exactly one; what each option is, its default and its choices come from the option itself
HELP_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("Application & stream", (
        "processor", "properties", "processes", "stream_name", "stream_arn",
        "application_name", "worker_id", "region", "kinesis_endpoint", "dynamodb_endpoint",
        "initial_position", "initial_timestamp", "stop_when_caught_up",
        "max_initialization_attempts", "initialization_backoff_ms",
        "former_streams_lease_deletion_delay_ms")),
    ("Leases", (
        "table_name", "failover_time_ms", "shard_sync_interval_ms", "max_leases_for_worker",
        "max_leases_to_steal_at_one_time", "parent_shard_poll_interval_ms",
        "cleanup_leases_upon_shard_completion", "is_graceful_lease_handoff_enabled",
        "graceful_lease_handoff_timeout_ms", "list_shards_backoff_base_ms",
        "list_shards_backoff_cap_ms", "max_list_shards_retry_attempts", "lease_assignment",
        "lease_assigner", "rebalance_threshold_percentage", "dampening_percentage",
        "allow_throughput_overshoot", "max_throughput_per_host_kbps",
        "variance_balancing_frequency", "worker_metrics_ema_alpha",
        "worker_metrics_reporter_freq_ms")),
    ("Retrieval", (
        "retrieval_mode", "max_records", "idle_time_between_reads_ms", "prefetch_queue_size",
        "max_pool_connections", "get_records_backoff_base_ms", "get_records_backoff_cap_ms",
        "kpl_hash_range_filter", "consumer_name", "consumer_arn", "fanout_http_version",
        "register_stream_consumer_retries", "max_describe_stream_consumer_retries",
        "retry_backoff_ms")),
    ("Processing & checkpoints", (
        "call_process_records_even_for_empty_record_list", "processor_error_policy",
        "processor_error_attempts", "task_backoff_time_ms", "max_task_backoff_time_ms",
        "fail_on_data_loss", "shutdown_grace_ms", "timeout_in_seconds", "stray_stdout")),
    ("Lag & recovery", (
        "max_lag_ms", "recovery_max_rate", "lag_window_s", "lag_interval_s", "lag_webhook")),
    ("State store", ("state_store", "transaction_max_records", "transaction_max_time_ms")),
    ("Metrics & operations", (
        "metrics_port", "metrics_host", "ops_allowed_hosts", "progress_interval", "metrics_level",
        "metrics_enabled_dimensions", "metrics_buffer_time_ms", "metrics_max_queue_size",
        "metrics_namespace", "cloudwatch_region", "cloudwatch_endpoint")),
    ("Spark", ("spark_batch", "spark_decode")),
    ("Logging", ("log_level",)),
    ("Local/dev", ("local",)),
)


#: what a value of each kind of option looks like, in the usage and help lines
_METAVARS = {"int": "N", "int0": "N", "port": "PORT", "url": "URL", "timestamp": "TIME",
             "fraction": "NUMBER"}


def _help(text: str, default: Any = None, choices: Sequence[str] = ()) -> str:
    """``text`` with the choices and default argparse would not show by itself: a config
    option's argparse default stays None (an unset flag must not hide the environment or
    the properties file), so its default is ``KCLConfig``'s, stated here."""
    notes = []
    if choices:
        notes.append(f"choices: {', '.join(choices)}")
    if default is not None:
        shown = str(default).lower() if isinstance(default, bool) else str(default)
        notes.append(f"default: {shown}")
    suffix = f" ({'; '.join(notes)})" if notes else ""
    return (text + suffix).replace("%", "%%")


def worker_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="kclpy-worker", usage="%(prog)s [options] (--processor SPEC | --properties FILE "
                                   "| --spark-batch SPEC)",
        description="Consume a Kinesis stream with a kclpy record processor. Each option "
                    "can also be set in a --properties file or a KCLPY_* environment "
                    "variable (docs/configuration.md); flags win.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    groups = {}
    for title, dests in HELP_GROUPS:
        group = parser.add_argument_group(title)
        groups.update(dict.fromkeys(dests, group))
    groups["processor"].add_argument(
        "--processor", metavar="SPEC",
        help="pkg.module:Class or path/to/file.py:Class (an IRecordProcessor)")
    groups["properties"].add_argument(
        "--properties", metavar="FILE",
        help="MultiLangDaemon .properties file (flags win over it)")
    groups["local"].add_argument(
        "--local", action="store_true",
        help="start the embedded local AWS endpoint (demo stream included; with "
             "--retrieval-mode fanout, kinesis-mock serves Kinesis)")
    groups["processes"].add_argument(
        "--processes", metavar="N", default="1",
        help=_help("run N worker processes sharing the lease table (all cores)", "1"))
    groups["spark_batch"].add_argument(
        "--spark-batch", metavar="SPEC",
        help="hand micro-batches to foreach_batch(df, batch_id) at SPEC (pkg.module:function) "
             "instead of running a processor")
    groups["spark_decode"].add_argument(
        "--spark-decode", metavar="SPEC",
        help="with --spark-batch: decode(data: pyarrow.BinaryArray) -> pyarrow.Table of extra "
             "columns, one row per record")
    groups["log_level"].add_argument(
        "--log-level", default="INFO", type=str.upper, metavar="LEVEL", choices=LOG_LEVELS,
        help=_help("kclpy's log level (any case)", "INFO", LOG_LEVELS))
    groups["progress_interval"].add_argument(
        "--progress-interval", metavar="SECONDS", default="30",
        help=_help("log a progress line (records, bytes, shards held, largest "
                   "MillisBehindLatest) this often; 0 turns it off", "30"))
    for option in OPTIONS:
        if option.name in ("executable_name",):
            continue
        group = groups[option.name]
        text = _help(option.help, option.default, option.listed_choices)
        metavar = _METAVARS.get(option.kind, "TEXT")
        if option.name in _REPEATABLE:
            group.add_argument(option.flag, dest=option.name, action="append", metavar="NAME"
                               if option.name == "stream_name" else "ARN",
                               help=text + " Repeat it to consume several streams.")
        elif option.kind == "bool":
            group.add_argument(option.flag, dest=option.name, nargs="?", const="true",
                               metavar="BOOL", help=text)
        else:
            group.add_argument(option.flag, dest=option.name,
                               metavar="NAME" if option.listed_choices else metavar, help=text)
    return parser


def secrets_out_of_argv(argv: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """``argv`` without its secret options' flags, and those values as the environment
    variables (``SECRET_FLAG_ENV``) that carry them to a child instead."""
    flags = {option.flag: option for option in OPTIONS if option.secret}
    rest: list[str] = []
    secrets: dict[str, str] = {}
    args = iter(argv)
    for arg in args:
        flag, equals, value = arg.partition("=")
        if flag in flags:
            option = flags[flag]
            secrets[SECRET_FLAG_ENV + option.name.upper()] = (
                value if equals else next(args, ""))
        else:
            rest.append(arg)
    return rest, secrets


def early_log_level(argv: Sequence[str]) -> str:
    """The ``--log-level`` of ``argv`` (INFO when absent or invalid), known before the rest
    is parsed: reading a .properties file already logs what it changes."""
    level = str(_early(argv).log_level)
    return level if level in LOG_LEVELS else "INFO"


def early_worker_id(argv: Sequence[str]) -> str | None:
    """The last ``--worker-id`` of ``argv``: the one a supervisor gives each of its
    children, known before logging is set up, so every line of the child names it."""
    worker_id = _early(argv).worker_id
    return str(worker_id) if worker_id else None


def _early(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--log-level", default="INFO", type=str.upper)
    parser.add_argument("--worker-id")
    known, _ = parser.parse_known_args(list(argv))
    return known


def parse_worker_args(argv: Sequence[str] | None) -> tuple[KCLConfig, argparse.Namespace]:
    """Merge properties file, environment and flags (flags win) into a validated config.

    ``args.labels`` maps each option given to the name the user gave it under (flag,
    properties key or environment variable), for errors raised after parsing."""
    args = worker_parser().parse_args(argv)
    values: dict[str, Any] = {}
    labels: dict[str, str] = {}
    env_values, env_labels = from_environment()
    values.update(env_values)
    labels.update(env_labels)
    if args.properties:
        path = Path(args.properties)
        prop_values, prop_labels = from_properties(
            read_properties(path), base_dir=path.resolve().parent,
            retrieval_mode_set=args.retrieval_mode is not None or "retrieval_mode" in env_values)
        values.update(prop_values)
        labels.update(prop_labels)
    names, arns = args.stream_name or [], args.stream_arn or []
    if len(names) > 1 or len(arns) > 1:
        values["streams"] = tuple(StreamConfig(name=n) for n in names) + tuple(
            StreamConfig(arn=a) for a in arns)
        labels["streams"] = "--stream-name"
        for field_name in _REPEATABLE:
            values.pop(field_name, None)
            labels.pop(field_name, None)
        args.stream_name = args.stream_arn = None
    else:
        args.stream_name = names[0] if names else None
        args.stream_arn = arns[0] if arns else None
    for option in OPTIONS:
        raw = getattr(args, option.name, None)
        if raw is not None:
            values[option.name] = convert_cli_value(option.name, raw)
            labels[option.name] = option.flag
    for option in OPTIONS:
        handed = os.environ.get(SECRET_FLAG_ENV + option.name.upper())
        if option.secret and handed is not None and getattr(args, option.name) is None:
            values[option.name] = convert_cli_value(option.name, handed)
            labels[option.name] = option.flag
    if args.local:
        _check_local(values, labels)
        values.setdefault("stream_name", LOCAL_DEMO_NAME)
        values.setdefault("application_name", LOCAL_DEMO_NAME)
        values.setdefault("initial_position", TRIM_HORIZON)
        values.setdefault("region", "us-east-1")
    config = build_config(values, labels)
    if not args.processes.isdigit() or int(args.processes) < 1:
        raise ConfigError("--processes", f"{args.processes!r} is not a whole number >= 1")
    args.processes = int(args.processes)
    try:
        args.progress_interval = float(args.progress_interval)
    except ValueError:
        args.progress_interval = -1.0
    if not args.progress_interval >= 0:
        raise ConfigError("--progress-interval", "must be a number of seconds >= 0 (0: off)")
    args.labels = labels
    if args.spark_decode and not args.spark_batch:
        raise ConfigError("--spark-decode", "needs --spark-batch")
    if args.spark_batch and (args.processor or args.local):
        raise ConfigError("--spark-batch", "cannot be combined with --processor or --local")
    if not args.processor and not config.executable_name and not args.spark_batch:
        raise ConfigError("--processor", "is required (or executableName in --properties, "
                          "or --spark-batch)")
    return config, args


#: what ``--local`` runs on, and cannot be pointed elsewhere
_LOCAL_ENDPOINTS = ("kinesis_endpoint", "dynamodb_endpoint", "cloudwatch_endpoint")


def _check_local(values: dict[str, Any], labels: dict[str, str]) -> None:
    """Refuse, in one line each, what ``--local``'s embedded endpoint cannot serve; every
    request it makes must stay on this machine."""
    for field_name in _LOCAL_ENDPOINTS:
        if values.get(field_name):
            raise ConfigError(labels.get(field_name, field_name), "cannot be combined with "
                              "--local, which serves every AWS API itself on 127.0.0.1")
    if values.get("consumer_arn"):
        raise ConfigError(labels.get("consumer_arn", "--consumer-arn"),
                          "cannot be combined with --local, whose streams and consumers live "
                          "only on this machine (--retrieval-mode fanout registers one)")
    try:
        import moto  # noqa: F401
        import werkzeug  # noqa: F401
    except ImportError:
        raise ConfigError("--local", "needs the embedded endpoint, which is an extra: "
                          "pip install 'kinesis-kclpy[local]'") from None
    if retrieval_mode(str(values.get("retrieval_mode", "polling")),
                      labels.get("retrieval_mode", "--retrieval-mode")).needs_consumer:
        from kclpy.local.endpoints import LocalEndpointError
        from kclpy.local.kinesis_mock import require_node

        try:
            require_node()
        except LocalEndpointError as exc:
            raise ConfigError(labels.get("retrieval_mode", "--retrieval-mode"),
                              f"fanout on --local runs kinesis-mock: {exc}") from None
