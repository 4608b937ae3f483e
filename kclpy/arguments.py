"""The ``kclpy-worker`` command line: flags, ``.properties`` file and environment merged
into one validated ``KCLConfig``.

It lives apart from ``cli.py`` because two entry points need it: the CLI that runs one
worker, and the supervisor that checks the configuration once before starting N of them.
"""

from __future__ import annotations

import argparse
import difflib
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
from kclpy.errors import ConfigError
from kclpy.position import TRIM_HORIZON
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
            if name.startswith("--"):
                close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
                if close:
                    return f" (did you mean {close[0]}?)"
        return ""


def worker_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="kclpy-worker",
        description="Consume a Kinesis stream with a kclpy record processor.")
    parser.add_argument("--processor", metavar="SPEC",
                        help="pkg.module:Class or path/to/file.py:Class (an IRecordProcessor)")
    parser.add_argument("--properties", metavar="FILE",
                        help="MultiLangDaemon .properties file (flags win over it)")
    parser.add_argument("--local", action="store_true",
                        help="start the embedded local AWS endpoint (demo stream included; "
                             "with --retrieval-mode fanout, kinesis-mock serves Kinesis)")
    parser.add_argument("--processes", metavar="N", default="1",
                        help="run N worker processes sharing the lease table (all cores)")
    parser.add_argument("--spark-batch", metavar="SPEC",
                        help="hand micro-batches to foreach_batch(df, batch_id) at SPEC "
                             "(pkg.module:function) instead of running a processor")
    parser.add_argument("--spark-decode", metavar="SPEC",
                        help="with --spark-batch: decode(data: pyarrow.BinaryArray) -> "
                             "pyarrow.Table of extra columns, one row per record")
    parser.add_argument("--log-level", default="INFO", type=str.upper, metavar="LEVEL",
                        choices=LOG_LEVELS, help="DEBUG, INFO, WARNING or ERROR (any case)")
    parser.add_argument("--progress-interval", metavar="SECONDS", default="30",
                        help="log a progress line (records, bytes, shards held, largest "
                             "MillisBehindLatest) this often; 0 turns it off")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    for option in OPTIONS:
        if option.name in ("executable_name",):
            continue
        if option.name in _REPEATABLE:
            parser.add_argument(option.flag, dest=option.name, action="append",
                                metavar=option.kind.upper(),
                                help=option.help + " Repeat it to consume several streams.")
        elif option.kind == "bool":
            parser.add_argument(option.flag, dest=option.name, nargs="?", const="true",
                                metavar="BOOL", help=option.help)
        else:
            parser.add_argument(option.flag, dest=option.name, metavar=option.kind.upper(),
                                help=option.help)
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
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--log-level", default="INFO", type=str.upper)
    known, _ = parser.parse_known_args(list(argv))
    level = str(known.log_level)
    return level if level in LOG_LEVELS else "INFO"


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
    if str(values.get("retrieval_mode", "polling")).lower() == "fanout":
        from kclpy.local.endpoints import LocalEndpointError
        from kclpy.local.kinesis_mock import require_node

        try:
            require_node()
        except LocalEndpointError as exc:
            raise ConfigError(labels.get("retrieval_mode", "--retrieval-mode"),
                              f"fanout on --local runs kinesis-mock: {exc}") from None
