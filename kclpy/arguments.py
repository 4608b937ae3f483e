"""The ``kclpy-worker`` command line: flags, ``.properties`` file and environment merged
into one validated ``KCLConfig``.

It lives apart from ``cli.py`` because two entry points need it: the CLI that runs one
worker, and the supervisor that checks the configuration once before starting N of them.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

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

LOCAL_DEMO_NAME = "kclpy-demo"


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line naming the option, with exit code 2 (the
    exit code every kclpy command uses for a bad configuration)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def worker_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
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


def parse_worker_args(argv: Sequence[str] | None) -> tuple[KCLConfig, argparse.Namespace]:
    """Merge properties file, environment and flags (flags win) into a validated config."""
    args = worker_parser().parse_args(argv)
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
