"""The ``kclpy`` operator command line: every command in one table, ``COMMANDS``.

An entry maps the words that name a command (``("leases",)``, ``("shard", "park")``) to its
help, the function that adds its flags and its handler. The parser is built from the table
and the dispatch is a lookup in it, so a command can be run exactly when it has an entry:
a word with none is a usage error naming it (exit 2, with the closest command), never some
other command's handler.

To add an operator command: write its handler beside the code it drives, its flags here,
and one ``Command`` entry (a two-word command whose first word is new also needs its
``GROUPS`` entry). ``tests/ops/test_commands.py`` then runs it from the command line, with its
handler replaced, and its ``--help``.

The commands: ``leases`` and ``status`` (``kclpy.ops.inspect``); ``monitor``
(``kclpy.ops.monitor``); ``consumers``,
``register-consumer`` and ``deregister-consumer`` (``kclpy.ops.consumers``);
``checkpoint set``, ``shard park`` / ``resume`` and ``recovery add`` / ``list`` / ``cancel``
(``kclpy.ops.control``); ``local`` (``kclpy.local.server``).

Exit codes: ``status`` exits 0 for OK, 1 for WARN, 2 for ERROR, 3 when the status could not
be determined (AWS unreachable, access denied); the other commands exit 0, or 1 on such
failures (``deregister-consumer`` also when there was no such consumer; the control
commands also when they refused to act). ``kclpy local`` exits 0 once stopped by Ctrl-C or
SIGTERM, 1 when a server failed, 2 for a busy port or without the ``local`` extra (moto, or
the Node.js kinesis-mock runs on); ``kclpy monitor`` exits 0 once stopped, 2 for a port it
cannot listen on. Bad arguments, a lease table or stream that does not
exist, or no region exit 2 with one line naming the option (``status``: 3, so that a typo
is never read as the application's ERROR).
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import IO, Any

from botocore.exceptions import BotoCoreError, ClientError

from kclpy import __version__
from kclpy.arguments import LOG_LEVELS, OneLineParser
from kclpy.errors import ConfigError, KCLError, closest
from kclpy.leases.table import LeaseTable
from kclpy.ops import consumers, control, inspect
from kclpy.ops.control import Refused
from kclpy.ops.monitor import command as monitor
from kclpy.ops.position import Destination, parse_position
from kclpy.ops.text import TerminalText, printable
from kclpy.recovery import requests as asked
from kclpy.redaction import configure_logging, redact

PROG = "kclpy"


class Clients:
    """The Kinesis and DynamoDB clients a command talks to: made from the common flags when
    the handler first asks (``kclpy local`` asks for none), or handed in by a caller that
    brings its own."""

    def __init__(self, args: argparse.Namespace, made: tuple[Any, Any] | None = None) -> None:
        self._args = args
        self._made = made

    def both(self) -> tuple[Any, Any]:
        if self._made is None:
            self._made = inspect.clients(self._args)
        return self._made

    @property
    def kinesis(self) -> Any:
        return self.both()[0]

    @property
    def dynamodb(self) -> Any:
        return self.both()[1]


#: a command's handler: its exit code; a usage error, a refusal or an AWS error it raises is
#: printed by ``operator_main`` in one line
Handler = Callable[[argparse.Namespace, Clients, IO[str]], int]


@dataclass(frozen=True)
class Command:
    """Everything about one ``kclpy`` command, in one place: the parser is built from these
    and the dispatch looks them up, so the two cannot disagree about which commands exist."""

    words: tuple[str, ...]
    help: str
    description: str
    #: adds the command's own flags to the parser made for it
    flags: Callable[[OneLineParser], None]
    run: Handler
    #: whether it takes the flags every AWS command shares (``_common_flags``)
    aws: bool = True
    #: exit code of a bad argument, and of a failure to reach or use AWS
    usage_exit: int = 2
    failure_exit: int = 1
    #: a rule between flags that argparse cannot state: the error when it is broken
    check: Callable[[argparse.Namespace], str | None] | None = None


@dataclass(frozen=True)
class Group:
    """The first word of two-word commands (``kclpy shard park``): a parser of its own
    that lists its actions."""

    help: str
    description: str


# -- argument types --------------------------------------------------------------------------


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _whole(least: int, most: int | None = None) -> Callable[[str], int]:
    def convert(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"must be at least {least}, got {text}")
        if most is not None and value > most:
            raise argparse.ArgumentTypeError(f"must be at most {most}, got {text}")
        return value
    return convert


def _url(text: str) -> str:
    if not re.match(r"^https?://[^\s/]+", text):
        raise argparse.ArgumentTypeError(f"{text!r} is not an http(s) URL")
    return text


def _position(text: str) -> Destination:
    try:
        return parse_position(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _sequence(text: str) -> str:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a sequence number")
    return str(int(text))


def _gap_number(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a gap number (1, 2, ...)")
    return int(text)


def _gap_end(text: str) -> str:
    """``--ends``: a gap's end as ``recovery list``'s ``ENDS`` shows it, with or without its
    first word; a naive time is UTC. Returned as that column's text, to compare with it."""
    word, _, rest = text.strip().partition(" ")
    value = rest.strip() if word in ("through", "before") else text.strip()
    if value.isdigit():
        return asked.end_text(0, str(int(value)))
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a gap's end: a sequence number or "
                                         "an ISO-8601 time, as 'kclpy recovery list' shows "
                                         "it under ENDS") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return asked.end_text(round(moment.timestamp() * 1000), None)


# -- flags -----------------------------------------------------------------------------------


def _common_flags() -> OneLineParser:
    common = OneLineParser(add_help=False)
    common.add_argument("--application-name", required=True,
                        help="application name (the lease table's default name)")
    common.add_argument("--table-name", help="lease table (default: the application name)")
    common.add_argument("--region", help="AWS region (default: the boto3 chain)")
    common.add_argument("--kinesis-endpoint", type=_url, metavar="URL",
                        help="Kinesis endpoint URL (default: the boto3 chain)")
    common.add_argument("--dynamodb-endpoint", type=_url, metavar="URL",
                        help="DynamoDB endpoint URL (default: the boto3 chain)")
    common.add_argument("--json", action="store_true", help="print JSON")
    common.add_argument("--log-level", default="WARNING", choices=LOG_LEVELS)
    return common


def _leases_flags(parser: OneLineParser) -> None:
    only = parser.add_mutually_exclusive_group()
    only.add_argument("--stream-name", help="only this stream's leases (multi-stream tables)")
    only.add_argument("--stream-arn", help="only this stream's leases, by ARN")


def _status_flags(parser: OneLineParser) -> None:
    stream = parser.add_mutually_exclusive_group(required=True)
    stream.add_argument("--stream-name", help="the stream the application consumes")
    stream.add_argument("--stream-arn", help="the stream's ARN (instead of its name)")
    parser.add_argument("--window-seconds", type=_positive_seconds, default=30.0,
                        metavar="S", help="length of the evaluation window (default 30)")
    parser.add_argument("--samples", type=_whole(2), default=4, metavar="N",
                        help="observations per window, at least 2 (default 4)")
    parser.add_argument("--watch", action="store_true",
                        help="keep sampling; print the sliding window's status after each")
    parser.add_argument("--count", type=_whole(1), metavar="N",
                        help="with --watch: stop after N evaluations")
    parser.add_argument("--worker", type=_url, action="append", default=[], metavar="URL",
                        help="a worker's ops endpoint (repeatable): adds each shard's "
                             "retrieval mode, subscription age and recovery queue")
    parser.add_argument("--records-limit", type=_whole(1, 10000), default=1000,
                        metavar="N", help="GetRecords Limit when counting records behind; "
                        "more are shown as N+ (default 1000)")


def _status_check(args: argparse.Namespace) -> str | None:
    if args.count is not None and not args.watch:
        return "argument --count: only with --watch"
    return None


def _consumer_flags(parser: OneLineParser) -> None:
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--stream-name", help="the stream")
    where.add_argument("--stream-arn", help="the stream's ARN (instead of its name)")
    parser.add_argument("--consumer-name",
                        help="the consumer (default: the application name, as workers)")
    parser.add_argument("--register-retries", type=_whole(1), default=10, metavar="N",
                        help="registerStreamConsumerRetries (default 10)")
    parser.add_argument("--describe-retries", type=_whole(1), default=10, metavar="N",
                        help="maxDescribeStreamConsumerRetries (default 10)")
    parser.add_argument("--retry-backoff-ms", type=_whole(0), default=1000, metavar="MS",
                        help="retryBackoffMillis (default 1000)")


def _stream_flags(parser: OneLineParser, *, required: bool) -> None:
    where = parser.add_mutually_exclusive_group(required=required)
    where.add_argument("--stream-name", help="the stream (picks one stream's leases in a "
                       "multi-stream table)")
    where.add_argument("--stream-arn", help="the stream's ARN (instead of its name)")


def _checkpoint_set_flags(parser: OneLineParser) -> None:
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--shard-id", help="the shard whose checkpoint moves")
    which.add_argument("--all-shards", action="store_true",
                       help="every shard of the stream (a finished shard with nothing "
                            "after POSITION is left alone; a closed parent whose lease was "
                            "cleaned up gets a lease again when it holds records after "
                            "POSITION)")
    _stream_flags(parser, required=True)
    parser.add_argument("--to", required=True, type=_position, metavar="POSITION",
                        help="TRIM_HORIZON, LATEST (now), a sequence number of the shard, or "
                             "an ISO-8601 time (naive = UTC): the next record processed is "
                             "the first after the sequence number / at or after the time")
    parser.add_argument("--force", action="store_true",
                        help="also move a lease a worker holds: it is taken from the holder "
                             "(lease_lost) and taken again from the new checkpoint")
    parser.add_argument("--dry-run", action="store_true", help="print what would change, "
                        "write nothing")
    parser.add_argument("--state-store", metavar="SPEC",
                        help="the exactly-once application's state store (the workers' "
                             "--state-store): a SQL store's position is moved too")


def _shard_park_flags(parser: OneLineParser) -> None:
    parser.add_argument("--shard-id", required=True, help="the shard to park")
    parser.add_argument("--reason", default="parked by an operator",
                        help="why (shown by 'kclpy leases' and the workers' /status)")
    _stream_flags(parser, required=False)


def _shard_resume_flags(parser: OneLineParser) -> None:
    parser.add_argument("--shard-id", required=True, help="the shard to resume")
    _stream_flags(parser, required=False)


def _recovery_add_flags(parser: OneLineParser) -> None:
    parser.add_argument("--shard-id", required=True, help="the shard")
    parser.add_argument("--from", dest="first", required=True, type=_sequence, metavar="SEQ",
                        help="sequence number of the first record to read again")
    parser.add_argument("--to", dest="last", required=True, type=_sequence, metavar="SEQ",
                        help="sequence number of the last record to read again")
    parser.add_argument("--dry-run", action="store_true", help="print the gap, write nothing")
    _stream_flags(parser, required=True)


def _recovery_list_flags(parser: OneLineParser) -> None:
    parser.add_argument("--shard-id", help="only this shard's gaps")
    _stream_flags(parser, required=False)


def _recovery_cancel_flags(parser: OneLineParser) -> None:
    parser.add_argument("--shard-id", required=True, help="the shard")
    which_gap = parser.add_mutually_exclusive_group(required=True)
    which_gap.add_argument("--gap", type=_gap_number, metavar="N",
                           help="the gap's number (1 = first) in 'kclpy recovery list'")
    which_gap.add_argument("--all", action="store_true",
                           help="every gap of the shard, as this command reads them")
    parser.add_argument("--ends", type=_gap_end, metavar="END",
                        help="with --gap: the gap's end as 'kclpy recovery list' showed it "
                             "(ENDS: a sequence number or a time); a gap that ends "
                             "elsewhere now is not dropped")
    _stream_flags(parser, required=False)
    parser.add_argument("--state-store", metavar="SPEC",
                        help="the exactly-once application's state store (the workers' "
                             "--state-store): a SQL store forgets the gap too, when no "
                             "worker holds the lease")


def _recovery_cancel_check(args: argparse.Namespace) -> str | None:
    """A gap's number alone may name more than was listed: the gap merges with any found
    again that overlaps it, or another takes its number once an earlier one finishes."""
    if args.gap is not None and args.ends is None:
        return "argument --ends: required with --gap (the gap's ENDS in 'kclpy recovery list')"
    if args.all and args.ends is not None:
        return "argument --ends: only with --gap"
    return None


def _monitor_flags(parser: OneLineParser) -> None:
    monitor.add_flags(parser, url=_url, seconds=_positive_seconds, whole=_whole)


def _local_flags(parser: OneLineParser) -> None:
    """Here rather than in ``kclpy.local.server``: that module needs the ``local`` extra,
    and ``kclpy local --help`` must work without it."""
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1: the endpoints accept "
                             "any credentials)")
    parser.add_argument("--port", type=_whole(0, 65535), default=0, metavar="N",
                        help="moto's port: DynamoDB and CloudWatch (default 0: a free port)")
    parser.add_argument("--kinesis-port", type=_whole(0, 65535), default=0, metavar="N",
                        help="kinesis-mock's port (default 0: a free port)")
    parser.add_argument("--region", default="us-east-1",
                        help="the region printed for clients (default us-east-1)")
    parser.add_argument("--no-kinesis-mock", action="store_true",
                        help="serve Kinesis from moto instead: no Node.js, polling only "
                             "(no SubscribeToShard)")
    parser.add_argument("--demo-stream", metavar="NAME",
                        help="create stream NAME holding the demo records of kclpy-worker "
                             "--local")
    parser.add_argument("--log-level", default="WARNING", choices=LOG_LEVELS)


# -- handlers --------------------------------------------------------------------------------


def _leases(args: argparse.Namespace, aws: Clients, out: IO[str]) -> int:
    return inspect.leases_command(args, aws.dynamodb, out)


def _status(args: argparse.Namespace, aws: Clients, out: IO[str]) -> int:
    return inspect.run_status(args, out, aws=aws.both())


def _on_kinesis(run: Callable[[argparse.Namespace, Any, IO[str]], int]) -> Handler:
    def handler(args: argparse.Namespace, aws: Clients, out: IO[str]) -> int:
        return run(args, aws.kinesis, out)
    return handler


def _on_lease_table(run: Callable[[argparse.Namespace, Any, LeaseTable, IO[str]], int]
                    ) -> Handler:
    def handler(args: argparse.Namespace, aws: Clients, out: IO[str]) -> int:
        table = LeaseTable(aws.dynamodb, control.table_name(args), max_attempts=5)
        return run(args, aws.kinesis, table, out)
    return handler


def _monitor(args: argparse.Namespace, aws: Clients, out: IO[str]) -> int:
    return monitor.run(args, out)


def _local(args: argparse.Namespace, aws: Clients, out: IO[str]) -> int:
    try:
        from kclpy.local.server import local_command
    except ImportError as exc:
        print(f"{PROG} local: error: needs the local extra: pip install "
              f"'kinesis-kclpy[local]' ({exc})", file=sys.stderr)
        return 2
    return local_command(args, out)


# -- the table -------------------------------------------------------------------------------

GROUPS: dict[str, Group] = {
    "checkpoint": Group("move a shard's checkpoint",
                        "Move checkpoints (replay from a time, skip a poison record)."),
    "shard": Group("park or resume a shard",
                   "Park a shard so that no worker takes it, or resume it."),
    "recovery": Group("queue, show or drop backfills of a shard",
                      "The shard's recovery queue: gaps read again beside live reading, "
                      "their records flagged is_recovery."),
}

#: every command, in the order ``kclpy --help`` lists them
COMMANDS: dict[tuple[str, ...], Command] = {command.words: command for command in (
    Command(("leases",), "every lease: owner, counter, checkpoint, lineage",
            "Print every lease of the application's lease table.", _leases_flags, _leases),
    Command(("status",), "per-shard lag status (exit 0 OK, 1 WARN, 2 ERROR, 3 UNKNOWN)",
            "Evaluate each shard's lag with Burrow's rules over a sampled window.",
            _status_flags, _status, usage_exit=inspect.EXIT_UNKNOWN,
            failure_exit=inspect.EXIT_UNKNOWN, check=_status_check),
    Command(("monitor",), "serve every application's lag status: page, JSON API, metrics",
            "Watch one or many applications from outside (every shard, held or not), "
            "evaluate their lag with the rules of 'kclpy status' over a sliding window, "
            "serve the result at / (page), /v1/applications (JSON) and /metrics, and POST "
            "every status change to --lag-webhook. Reads only; runs until Ctrl-C or "
            "SIGTERM.", _monitor_flags, _monitor, aws=False, check=monitor.check),
    Command(("consumers",), "the stream's enhanced fan-out consumers",
            "List every consumer registered on the stream.", _consumer_flags,
            _on_kinesis(consumers.list_command)),
    Command(("register-consumer",), "register the application's consumer, wait until ACTIVE",
            "Register the consumer (if missing) and wait until it is ACTIVE; print its ARN.",
            _consumer_flags, _on_kinesis(consumers.register_command)),
    Command(("deregister-consumer",), "deregister the application's consumer",
            "Deregister the consumer (exit 1 when there is none); kclpy never does it "
            "by itself.", _consumer_flags, _on_kinesis(consumers.deregister_command)),
    Command(("checkpoint", "set"), "set the checkpoint of one shard or all shards",
            "Set where workers resume: right after POSITION. The write is conditional on "
            "the lease counter read; a lease a worker holds is refused unless --force.",
            _checkpoint_set_flags, _on_lease_table(control.set_checkpoint)),
    Command(("shard", "park"), "release the shard's lease and keep every worker off it",
            "Take the lease from its holder (lease_lost) and mark it parked: no kclpy worker "
            "takes it until 'kclpy shard resume'.",
            _shard_park_flags, _on_lease_table(control.park)),
    Command(("shard", "resume"), "let workers take a parked shard again",
            "Clear the park mark; a worker takes the lease within the failover time and "
            "starts at its last checkpoint.",
            _shard_resume_flags, _on_lease_table(control.resume_shard)),
    Command(("recovery", "add"), "queue a backfill of a range of records",
            "Queue the records FROM..TO (both included) of one shard for recovery. A worker "
            "holding the lease keeps it and starts reading the gap within one renewal (half "
            "the failover time).",
            _recovery_add_flags, _on_lease_table(control.recovery_add)),
    Command(("recovery", "list"), "every queued gap",
            "Print every shard's queued recovery gaps.",
            _recovery_list_flags, _on_lease_table(control.recovery_list)),
    Command(("recovery", "cancel"), "drop a queued gap",
            "Drop one queued gap (by its number and end in 'kclpy recovery list') or all of "
            "a shard's. Only what was seen is dropped: a gap that grew since (a lag found "
            "again merges into it) stays queued, and the command or the holder says so. A "
            "worker holding the lease keeps it and stops reading the gap within one "
            "renewal (half the failover time).",
            _recovery_cancel_flags, _on_lease_table(control.recovery_cancel),
            check=_recovery_cancel_check),
    Command(("local",),
            "serve Kinesis, DynamoDB and CloudWatch locally (no Docker) until Ctrl-C",
            "Serve Kinesis (kinesis-mock, with SubscribeToShard), DynamoDB and CloudWatch "
            "(moto) on this machine and print the environment variables that point kclpy, "
            "boto3 and the AWS CLI at them. Runs until Ctrl-C or SIGTERM. Needs the local "
            "extra: pip install 'kinesis-kclpy[local]'.",
            _local_flags, _local, aws=False),
)}


# -- parsing and dispatch --------------------------------------------------------------------


def _build() -> tuple[OneLineParser, dict[tuple[str, ...], OneLineParser]]:
    """The parser, and each command's own parser by its words, from the table alone."""
    parser = OneLineParser(prog=PROG, description="Inspect a kclpy (or Java KCL) application.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    top = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    common = _common_flags()
    actions: dict[str, Any] = {}
    made: dict[tuple[str, ...], OneLineParser] = {}
    for words, command in COMMANDS.items():
        commands = top
        if len(words) == 2:
            group = words[0]
            if group not in actions:
                listed = top.add_parser(group, help=GROUPS[group].help,
                                        description=GROUPS[group].description)
                actions[group] = listed.add_subparsers(dest="action", required=True,
                                                       parser_class=OneLineParser)
            commands = actions[group]
        own = commands.add_parser(words[-1], parents=[common] if command.aws else [],
                                  help=command.help, description=command.description,
                                  usage_exit_code=command.usage_exit)
        command.flags(own)
        made[words] = own
    return parser, made


def build_parser() -> OneLineParser:
    """The whole ``kclpy`` parser (documentation tests parse each documented line with it)."""
    return _build()[0]


def command_words(args: argparse.Namespace) -> tuple[str, ...]:
    """The words of the command ``args`` were parsed for: the table's key."""
    return tuple(word for word in (args.command, getattr(args, "action", None))
                 if word is not None)


def lookup(words: tuple[str, ...]) -> Command:
    """The table's entry for ``words``. The parser offers only the table's words, so on the
    command line a miss is already argparse's usage error; a caller that builds its own
    arguments gets one too, never another command's handler."""
    command = COMMANDS.get(words)
    if command is None:
        said = " ".join(words)
        close = closest(said, [" ".join(known) for known in COMMANDS])
        raise ConfigError("command", f"{said!r} is not a kclpy command"
                         + (f" (did you mean {close}?)" if close else ""))
    return command


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line; a usage error exits 2 with one line naming the option. Bare
    ``kclpy`` prints the help, which lists the commands, and exits 2 as a command group
    without its command does in click."""
    parser, made = _build()
    if not (sys.argv[1:] if argv is None else argv):
        parser.print_help()
        raise SystemExit(2)
    args = parser.parse_args(argv)
    command = lookup(command_words(args))
    problem = command.check(args) if command.check is not None else None
    if problem is not None:
        made[command.words].error(problem)
    return args


def execute(args: argparse.Namespace, aws: Clients, out: IO[str]) -> int:
    """Run the command ``args`` were parsed for; what it raises is the caller's to report."""
    return lookup(command_words(args)).run(args, aws, out)


def operator_main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    command = lookup(command_words(args))
    configure_logging(args.log_level, "%(asctime)s %(levelname)s %(name)s: %(message)s")
    prog = " ".join((PROG, *command.words))
    # every command's output, and the errors below, may quote what producers wrote
    stdout: Any = TerminalText(sys.stdout)
    try:
        return execute(args, Clients(args), stdout)
    except ConfigError as exc:
        print(f"{prog}: error: {printable(redact(str(exc)))}", file=sys.stderr)
        return command.usage_exit
    except Refused as exc:
        print(f"{prog}: {printable(redact(str(exc)))}", file=sys.stderr)
        return control.EXIT_REFUSED
    except (ClientError, BotoCoreError, KCLError) as exc:
        print(f"{prog}: error: {printable(redact(str(exc)))}", file=sys.stderr)
        return command.failure_exit


def main() -> None:
    sys.exit(operator_main())


if __name__ == "__main__":
    main()
