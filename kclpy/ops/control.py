"""Operator controls on the lease table: ``kclpy checkpoint set``, ``kclpy shard park`` /
``resume`` and ``kclpy recovery add`` / ``list`` / ``cancel``.

Each one is what an on-call engineer would otherwise do by hand in the DynamoDB console,
done the way the workers themselves write: every change is an UpdateItem conditional on the
``leaseCounter`` the command read, and bumps it. So a change never lands on a lease that
moved meanwhile (the command says so and exits 1), and a worker holding the lease sees its
next renewal or checkpoint refused, which ends its tenure with ``lease_lost`` exactly as a
steal would: nothing it does afterwards can overwrite the operator's change.

A lease a worker holds is never changed from under it unless the operator says ``--force``
(checkpoint set) - then the owner is removed with the change, and a worker (the same or
another) takes the lease again within the failover time and starts from the new checkpoint.
Parking always takes the lease from its holder: that is its purpose.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO, Any

from botocore.exceptions import ClientError

from kclpy.leases import park as parking
from kclpy.leases import serializer as ser
from kclpy.leases.dynamo import CONDITION_FAILED, error_code
from kclpy.leases.lease import SHARD_END, Lease
from kclpy.leases.serializer import UpdateBuilder, n, s
from kclpy.leases.shard_sync import Shard, ShardSyncer
from kclpy.leases.table import LeaseTable, checkpoint_changes
from kclpy.ops.position import (
    Position,
    PositionError,
    ShardReader,
    Target,
    parse_position,
    resolve,
)
from kclpy.ops.text import print_table
from kclpy.streams import StreamIdentifier

#: exit code when the command refused to act or the lease moved under it
EXIT_REFUSED = 1


class UsageError(Exception):
    """A bad argument found after parsing: exit 2, naming ``option``."""

    def __init__(self, option: str, message: str) -> None:
        super().__init__(f"{option}: {message}")
        self.option = option


class Refused(Exception):
    """The command would not act (a held lease without ``--force``, a lease that changed
    since it was read): exit 1 with the message."""


# -- arguments -------------------------------------------------------------------------------


def _position(text: str) -> Position:
    try:
        return parse_position(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _stream_options(parser: argparse.ArgumentParser, *, required: bool) -> None:
    where = parser.add_mutually_exclusive_group(required=required)
    where.add_argument("--stream-name", help="the stream (picks one stream's leases in a "
                       "multi-stream table)")
    where.add_argument("--stream-arn", help="the stream's ARN (instead of its name)")


def add_commands(commands: Any, common: argparse.ArgumentParser) -> None:
    """The control subcommands, beside the inspector's (``commands`` is its subparsers)."""
    checkpoint = commands.add_parser(
        "checkpoint", help="move a shard's checkpoint",
        description="Move checkpoints (replay from a time, skip a poison record).")
    actions = checkpoint.add_subparsers(dest="action", required=True,
                                        parser_class=type(checkpoint))
    move = actions.add_parser(
        "set", parents=[common], help="set the checkpoint of one shard or all shards",
        description="Set where workers resume: right after POSITION. The write is "
                    "conditional on the lease counter read; a lease a worker holds is "
                    "refused unless --force.")
    which = move.add_mutually_exclusive_group(required=True)
    which.add_argument("--shard-id", help="the shard whose checkpoint moves")
    which.add_argument("--all-shards", action="store_true",
                       help="every shard of the stream (a finished shard with nothing "
                            "after POSITION is left alone)")
    _stream_options(move, required=True)
    move.add_argument("--to", required=True, type=_position, metavar="POSITION",
                      help="TRIM_HORIZON, LATEST (now), a sequence number of the shard, or "
                           "an ISO-8601 time (naive = UTC): the next record processed is "
                           "the first after the sequence number / at or after the time")
    move.add_argument("--force", action="store_true",
                      help="also move a lease a worker holds: it is taken from the holder "
                           "(lease_lost) and taken again from the new checkpoint")
    move.add_argument("--dry-run", action="store_true", help="print what would change, "
                      "write nothing")

    shard = commands.add_parser("shard", help="park or resume a shard",
                                description="Park a shard so that no worker takes it, or "
                                            "resume it.")
    shard_actions = shard.add_subparsers(dest="action", required=True,
                                         parser_class=type(shard))
    park = shard_actions.add_parser(
        "park", parents=[common], help="release the shard's lease and keep every worker "
        "off it", description="Take the lease from its holder (lease_lost) and mark it "
        "parked: no kclpy worker takes it until 'kclpy shard resume'.")
    park.add_argument("--shard-id", required=True, help="the shard to park")
    park.add_argument("--reason", default="parked by an operator",
                      help="why (shown by 'kclpy leases' and the workers' /status)")
    _stream_options(park, required=False)
    resume = shard_actions.add_parser(
        "resume", parents=[common], help="let workers take a parked shard again",
        description="Clear the park mark; a worker takes the lease within the failover "
                    "time and starts at its last checkpoint.")
    resume.add_argument("--shard-id", required=True, help="the shard to resume")
    _stream_options(resume, required=False)


def command_names() -> frozenset[str]:
    return frozenset({"checkpoint", "shard"})


def run(args: argparse.Namespace, kinesis: Any, dynamodb: Any, out: IO[str]) -> int:
    """Carry out one control command; raises UsageError / Refused for the caller to print."""
    table = LeaseTable(dynamodb, _table_name(args), max_attempts=5)
    if args.command == "checkpoint":
        return set_checkpoint(args, kinesis, table, out)
    if args.action == "park":
        return park(args, table, out)
    return resume_shard(args, table, out)


# -- finding leases --------------------------------------------------------------------------


def _table_name(args: argparse.Namespace) -> str:
    return str(args.table_name or args.application_name)


def _stream_label(args: argparse.Namespace) -> str | None:
    if getattr(args, "stream_arn", None):
        return str(args.stream_arn).rsplit("/", 1)[-1]
    name = getattr(args, "stream_name", None)
    return str(name) if name else None


def _stream_of(lease: Lease) -> str | None:
    if lease.stream is None:
        return None
    try:
        return StreamIdentifier.parse(lease.stream).name
    except ValueError:
        return lease.stream


def read_leases(args: argparse.Namespace, table: LeaseTable) -> list[Lease]:
    """The leases of the stream named by the arguments (all of a single-stream table)."""
    try:
        leases = table.list_leases()
    except ClientError as exc:
        if error_code(exc) == "ResourceNotFoundException":
            option = "--table-name" if args.table_name else "--application-name"
            raise UsageError(option, f"lease table {_table_name(args)!r} does not "
                             "exist") from None
        raise
    wanted = _stream_label(args)
    if wanted is None:
        if any(lease.stream for lease in leases):
            raise UsageError("--stream-name", "the table holds several streams' leases; "
                             "name the stream")
        return sorted(leases, key=lambda lease: lease.lease_key)
    return sorted((lease for lease in leases
                   if lease.stream is None or _stream_of(lease) == wanted),
                  key=lambda lease: lease.lease_key)


def one_lease(args: argparse.Namespace, table: LeaseTable) -> Lease:
    for lease in read_leases(args, table):
        if lease.shard_id == args.shard_id:
            return lease
    raise UsageError("--shard-id", f"no lease for shard {args.shard_id!r} in "
                     f"{_table_name(args)}")


def _stream_params(args: argparse.Namespace) -> dict[str, str]:
    if args.stream_arn:
        return {"StreamARN": str(args.stream_arn)}
    return {"StreamName": str(args.stream_name)}


def _shards(args: argparse.Namespace, kinesis: Any, table: LeaseTable) -> dict[str, Shard]:
    syncer = ShardSyncer(kinesis, table, stream_name=args.stream_name,
                         stream_arn=args.stream_arn)
    try:
        return {shard.shard_id: shard for shard in syncer.list_shards()}
    except ClientError as exc:
        if error_code(exc) == "ResourceNotFoundException":
            option = "--stream-name" if args.stream_name else "--stream-arn"
            raise UsageError(option, f"stream {_stream_label(args)!r} does not "
                             "exist") from None
        raise


def _write(table: LeaseTable, lease: Lease, update: UpdateBuilder) -> Lease:
    """``update`` on ``lease`` if its counter is still the one read, bumping it: the same
    fence the workers' own writes have, so a worker that held the lease in between can no
    longer write it."""
    update.set(ser.LEASE_COUNTER, n(lease.lease_counter + 1))
    update.expect_equal(ser.LEASE_COUNTER, n(lease.lease_counter))
    try:
        response = table.call("UpdateItem", table.client.update_item,
                              TableName=table.table_name, Key=ser.key_of(lease.lease_key),
                              ReturnValues="ALL_NEW", **update.request())
    except ClientError as exc:
        if error_code(exc) == CONDITION_FAILED:
            raise Refused(f"lease {lease.lease_key} changed since it was read (counter "
                          f"{lease.lease_counter}); nothing written to it, run again") from None
        raise
    return ser.lease_from_item(response["Attributes"])


# -- checkpoint set --------------------------------------------------------------------------


@dataclass
class Move:
    """One lease's planned checkpoint change."""

    lease: Lease
    target: Target | None
    note: str = ""
    written: bool = False

    def to_json(self) -> dict[str, Any]:
        lease = self.lease
        moved = self.target is not None
        return {
            "shard_id": lease.shard_id, "lease_key": lease.lease_key,
            "owner": lease.lease_owner, "lease_counter": lease.lease_counter,
            "from": {"checkpoint": lease.checkpoint,
                     "sub_sequence_number": lease.checkpoint_sub_sequence_number},
            "to": None if not moved else {
                "checkpoint": self.target.checkpoint if self.target else None,
                "sub_sequence_number": self.target.sub_sequence_number if self.target else 0},
            "meaning": self.target.meaning if self.target else None,
            "note": self.note or None, "written": self.written,
        }


def _plan_moves(args: argparse.Namespace, kinesis: Any, table: LeaseTable) -> list[Move]:
    position: Position = args.to
    if args.all_shards and position.names_one_shard:
        raise UsageError("--to", "a sequence number is one shard's: use --shard-id")
    leases = [one_lease(args, table)] if args.shard_id else read_leases(args, table)
    shards = _shards(args, kinesis, table)
    if args.shard_id and args.shard_id not in shards:
        raise UsageError("--shard-id", f"stream {_stream_label(args)!r} has no shard "
                         f"{args.shard_id!r} (expired beyond retention?)")
    moves: list[Move] = []
    for lease in leases:
        if lease.shard_id not in shards:
            moves.append(Move(lease, None, "the stream no longer lists the shard"))
            continue
        reader = ShardReader(kinesis, _stream_params(args), lease.shard_id)
        try:
            target = resolve(reader, position, checkpoint=lease.checkpoint)
        except PositionError as exc:
            raise UsageError("--to", f"shard {lease.shard_id}: {exc}") from None
        if target is None:
            moves.append(Move(lease, None, "finished, nothing after the position"))
        else:
            moves.append(Move(lease, target))
    return moves


def set_checkpoint(args: argparse.Namespace, kinesis: Any, table: LeaseTable,
                   out: IO[str]) -> int:
    moves = _plan_moves(args, kinesis, table)
    held = [m for m in moves if m.target is not None and m.lease.lease_owner is not None]
    refused = bool(held) and not args.force
    for move in held:
        holder = move.lease.lease_owner
        move.note = (f"taken from {holder}" if args.force
                     else f"refused: held by {holder} (use --force to take it)")
    if not refused and not args.dry_run:
        for move in moves:
            if move.target is None:
                continue
            update = checkpoint_changes(move.target.checkpoint,
                                        move.target.sub_sequence_number)
            if move.lease.lease_owner is not None:
                update.remove(ser.LEASE_OWNER).remove(ser.CHECKPOINT_OWNER)
            _write(table, move.lease, update)
            move.written = True
    _print_moves(args, moves, out)
    if refused:
        holders = ", ".join(f"{m.lease.shard_id} by {m.lease.lease_owner}" for m in held)
        raise Refused(f"nothing written: lease(s) held ({holders}); stop the worker, or "
                      "use --force to take the lease(s) from the holder")
    return 0


def _print_moves(args: argparse.Namespace, moves: Sequence[Move], out: IO[str]) -> None:
    if args.json:
        json.dump({"dry_run": args.dry_run, "position": str(args.to),
                   "shards": [m.to_json() for m in moves]}, out, indent=2)
        out.write("\n")
        return
    rows = [["SHARD", "OWNER", "COUNTER", "FROM", "TO", "MEANING", "NOTE"]]
    for move in moves:
        lease = move.lease
        target = move.target
        rows.append([lease.shard_id, lease.lease_owner or "-", str(lease.lease_counter),
                     _checkpoint_text(lease.checkpoint, lease.checkpoint_sub_sequence_number),
                     "-" if target is None else _checkpoint_text(
                         target.checkpoint, target.sub_sequence_number),
                     "-" if target is None else target.meaning, move.note or "-"])
    print_table(rows, out)
    written = sum(m.written for m in moves)
    verb = "would move" if args.dry_run else "moved"
    count = sum(m.target is not None for m in moves) if args.dry_run else written
    out.write(f"{verb} {count} checkpoint(s) in {_table_name(args)}\n")


def _checkpoint_text(checkpoint: str, sub: int) -> str:
    return checkpoint if sub == 0 else f"{checkpoint}/{sub}"


# -- park / resume ---------------------------------------------------------------------------


def park(args: argparse.Namespace, table: LeaseTable, out: IO[str]) -> int:
    lease = one_lease(args, table)
    if lease.checkpoint == SHARD_END and not lease.recovery:
        raise Refused(f"shard {lease.shard_id} is finished (SHARD_END): nothing to park")
    update = UpdateBuilder().set(ser.PARKED, s(parking.marker(args.reason, "operator")))
    if lease.lease_owner is not None:
        update.remove(ser.LEASE_OWNER).remove(ser.CHECKPOINT_OWNER)
    _write(table, lease, update)
    taken = f", taken from {lease.lease_owner}" if lease.lease_owner else ""
    _report(args, out, {"shard_id": lease.shard_id, "parked": True,
                        "previous_owner": lease.lease_owner},
            f"parked {lease.shard_id}{taken}; checkpoint stays {lease.checkpoint}")
    return 0


def resume_shard(args: argparse.Namespace, table: LeaseTable, out: IO[str]) -> int:
    lease = one_lease(args, table)
    if lease.parked is None:
        raise Refused(f"shard {lease.shard_id} is not parked")
    _write(table, lease, UpdateBuilder().remove(ser.PARKED))
    _report(args, out, {"shard_id": lease.shard_id, "parked": False},
            f"resumed {lease.shard_id}: a worker takes it within the failover time, from "
            f"checkpoint {lease.checkpoint}")
    return 0


def _report(args: argparse.Namespace, out: IO[str], document: dict[str, Any],
            text: str) -> None:
    if args.json:
        json.dump(document, out, indent=2)
        out.write("\n")
    else:
        out.write(text + "\n")
