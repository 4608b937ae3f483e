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

``checkpoint set --all-shards`` is a replay of the whole stream, never a skip: a shard whose
checkpoint is already before the position (a lagging one) keeps it and is only taken from its
holder, so what it delivered past its checkpoint is delivered again (``_kept``). It also
creates the lease of a closed parent that lease cleanup deleted, when the parent still holds
records after the position, so that its children wait for it again (``_lost_ancestors``). Its
writes go parents first; one that fails does not stop the others (a DynamoDB table cannot
move every lease in one step), and every shard's outcome is printed (``_write_moves``).

The recovery queue is the exception: a backfill must not cost the holder its lease. A held
lease gets the change as a request beside the queue (``kclpy.recovery.requests``), which
leaves the counter alone; the holder folds it into its queue within one renewal. A lease
nobody holds has its queue written directly, conditional on the counter as above.

The commands' flags and help are their entries in ``kclpy.ops.commands``'s table, which
hands each handler here its arguments, the Kinesis client and the lease table.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import IO, Any

from botocore.exceptions import ClientError

from kclpy.errors import ConfigError, KCLError
from kclpy.leases import park as parking
from kclpy.leases import serializer as ser
from kclpy.leases.dynamo import CONDITION_FAILED
from kclpy.leases.lease import (
    Lease,
    new_incarnation,
    new_write_id,
    same_stream,
)
from kclpy.leases.serializer import UpdateBuilder, n, s, ss
from kclpy.leases.shard_sync import Shard, ShardSyncer, SyncedStream
from kclpy.leases.shard_sync import _depths as shard_depths
from kclpy.leases.table import LeaseTable, checkpoint_changes, expect_counter
from kclpy.ops.position import (
    Destination,
    PositionError,
    ShardReader,
    Target,
    last_before,
    last_sub_sequence,
    record_at,
    resolve,
)
from kclpy.ops.text import print_table
from kclpy.position import SHARD_END, TRIM_HORIZON, Position
from kclpy.recovery import queue as gaps
from kclpy.recovery import requests as asked
from kclpy.retry import error_code, is_not_found
from kclpy.state import open_store
from kclpy.state.store import PositionKeepingStore, keeps_own_position
from kclpy.streams import StreamIdentifier

#: exit code when the command refused to act or the lease moved under it
EXIT_REFUSED = 1


class Refused(KCLError):
    """The command would not act (a held lease without ``--force``, a lease that changed
    since it was read): exit 1 with the message."""


# -- finding leases --------------------------------------------------------------------------


def table_name(args: argparse.Namespace) -> str:
    return str(args.table_name or args.application_name)


def stream_label(args: argparse.Namespace) -> str | None:
    """The stream's name as given (the last part of an ARN); the inspector's commands and
    these filter a multi-stream table by it."""
    if getattr(args, "stream_arn", None):
        return str(args.stream_arn).rsplit("/", 1)[-1]
    name = getattr(args, "stream_name", None)
    return str(name) if name else None


def stream_name(lease: Lease) -> str | None:
    """The name in a multi-stream lease's stream identifier; None for a single-stream one."""
    if lease.stream is None:
        return None
    try:
        return StreamIdentifier.parse(lease.stream).name
    except ValueError:
        return lease.stream


def read_leases(args: argparse.Namespace, table: LeaseTable, kinesis: Any) -> list[Lease]:
    """The leases of the stream named by the arguments (all of a single-stream table); in a
    multi-stream table, those of the stream's current incarnation only (``_current``)."""
    try:
        leases = table.list_leases()
    except ClientError as exc:
        if is_not_found(exc):
            option = "--table-name" if args.table_name else "--application-name"
            raise ConfigError(option, f"lease table {table_name(args)!r} does not "
                             "exist") from None
        raise
    wanted = stream_label(args)
    if wanted is None:
        if any(lease.stream for lease in leases):
            raise ConfigError("--stream-name", "the table holds several streams' leases; "
                             "name the stream")
        return sorted(leases, key=lambda lease: lease.lease_key)
    named = [lease for lease in leases
             if lease.stream is None or stream_name(lease) == wanted]
    return sorted(_current(args, named, kinesis), key=lambda lease: lease.lease_key)


def _current(args: argparse.Namespace, leases: list[Lease], kinesis: Any) -> list[Lease]:
    """The leases of the stream's current incarnation, when the table holds leases of
    several streams of that name (deleted and created again: Java's stream identifier,
    hence the lease key, names the creation second, and the former stream's leases stay
    until someone deletes them). Which one is current is the stream's creation time, as
    DescribeStreamSummary gives it, compared as ``same_stream`` does; asked only when
    there is a choice, so park / resume of an unambiguous shard need no Kinesis call."""
    identifiers = {lease.stream for lease in leases if lease.stream is not None}
    if len(identifiers) <= 1:
        return leases
    option = "--stream-name" if args.stream_name else "--stream-arn"
    try:
        summary = kinesis.describe_stream_summary(**_stream_params(args))[
            "StreamDescriptionSummary"]
    except ClientError as exc:
        if is_not_found(exc):
            raise ConfigError(option, f"stream {stream_label(args)!r} does not exist, and the "
                             f"table holds leases of {len(identifiers)} former streams of "
                             f"that name ({', '.join(sorted(identifiers))})") from None
        raise
    created = summary["StreamCreationTimestamp"]
    created_s = created.timestamp() if isinstance(created, datetime) else float(created)

    def is_current(identifier: str) -> bool:
        try:
            epoch = StreamIdentifier.parse(identifier).creation_epoch
        except ValueError:
            return False
        return same_stream(float(epoch), created_s)

    kept = [lease for lease in leases if lease.stream is None or is_current(lease.stream)]
    if not any(lease.stream for lease in kept):
        raise ConfigError(option, f"the table holds leases of {len(identifiers)} streams named "
                         f"{stream_label(args)!r} ({', '.join(sorted(identifiers))}), none "
                         f"of the stream that exists now (created at {created_s:.0f})")
    return kept


def one_lease(args: argparse.Namespace, table: LeaseTable, kinesis: Any) -> Lease:
    """The lease of ``--shard-id``, of the stream's current incarnation."""
    for lease in read_leases(args, table, kinesis):
        if lease.shard_id == args.shard_id:
            return lease
    raise ConfigError("--shard-id", f"no lease for shard {args.shard_id!r} in "
                     f"{table_name(args)}")


def _stream_params(args: argparse.Namespace) -> dict[str, str]:
    if args.stream_arn:
        return {"StreamARN": str(args.stream_arn)}
    return {"StreamName": str(args.stream_name)}


def _shards(args: argparse.Namespace, kinesis: Any, table: LeaseTable) -> dict[str, Shard]:
    syncer = ShardSyncer(kinesis, table, SyncedStream(args.stream_name, args.stream_arn))
    try:
        return {shard.shard_id: shard for shard in syncer.list_shards()}
    except ClientError as exc:
        if is_not_found(exc):
            option = "--stream-name" if args.stream_name else "--stream-arn"
            raise ConfigError(option, f"stream {stream_label(args)!r} does not "
                             "exist") from None
        raise


def _write(table: LeaseTable, lease: Lease, update: UpdateBuilder) -> Lease:
    """``update`` on ``lease`` if its counter is still the one read, bumping it: the same
    fence the workers' own writes have, so a worker that held the lease in between can no
    longer write it. Stamped with a write id of its own, as the workers' writes are: a write
    that landed and lost its answer (botocore's retry is then refused by the counter it
    bumped) is recognised in the item and reported as written, not as "nothing written"
    (simulator seeds 21 and 706) - at any counter: the id is this request's alone, and a
    worker may have taken the lease since (a resume's purpose). When another writer's id
    replaced it, a refused retry says the write may have landed instead of "nothing
    written" (seed 458: a park landed between a resume and its retry). And a worker never
    takes the operator's change for one of its own writes
    (``kclpy.leases.fence.own_write``)."""
    write_id = new_write_id()
    update.set(ser.LEASE_COUNTER, n(lease.lease_counter + 1)).set(ser.WRITE_ID, s(write_id))
    expect_counter(update, lease)
    try:
        response = table.call("UpdateItem", table.client.update_item,
                              TableName=table.table_name, Key=ser.key_of(lease.lease_key),
                              ReturnValues="ALL_NEW", **update.request())
    except ClientError as exc:
        if error_code(exc) == CONDITION_FAILED:
            current = table.get(lease.lease_key)
            if current is not None and current.last_write == write_id:
                return current  # landed; a take since leaves the id (takes stamp none)
            if exc.response.get("ResponseMetadata", {}).get("RetryAttempts", 0):
                raise Refused(
                    f"lease {lease.lease_key}: an attempt of this write got no answer and the "
                    f"retry found the lease changed since it was read (counter "
                    f"{lease.lease_counter}): the write may have landed before another "
                    "writer changed the lease; see `kclpy leases` and run the command again "
                    "if it is still needed") from None
            raise Refused(f"lease {lease.lease_key} changed since it was read (counter "
                          f"{lease.lease_counter}); nothing written to it, run again") from None
        raise
    return ser.lease_from_item(response["Attributes"])


#: fresh reads and writes of one lease before giving up (a holder renews a few times per
#: failover time, each renewal bumping the counter)
WRITE_ATTEMPTS = 5


def _write_fresh(table: LeaseTable, lease: Lease,
                 build: Callable[[Lease], UpdateBuilder], *, take: bool) -> Lease:
    """Read the lease again and write ``build(lease)`` conditional on the counter just read,
    taking the lease from its holder (owner removed) when it has one. Resolving a position
    can take seconds, in which a holder renews; a renewal between this read and the write
    only costs another attempt. Without ``take``, a lease that has a holder now is
    refused."""
    for _ in range(WRITE_ATTEMPTS):
        fresh = table.get(lease.lease_key)
        if fresh is None:
            raise Refused(f"lease {lease.lease_key} was deleted meanwhile")
        if fresh.lease_owner is not None and not take:
            raise Refused(f"nothing written to {lease.lease_key}: held by "
                          f"{fresh.lease_owner} now (use --force to take it)")
        update = build(fresh)
        if fresh.lease_owner is not None:
            update.remove(ser.LEASE_OWNER).remove(ser.CHECKPOINT_OWNER)
        try:
            return _write(table, fresh, update)
        except Refused:
            continue
    raise Refused(f"lease {lease.lease_key} kept changing; nothing written to it, run again")


# -- checkpoint set --------------------------------------------------------------------------


@dataclass
class Move:
    """One shard's planned checkpoint change, and what became of it."""

    lease: Lease
    target: Target | None
    note: str = ""
    written: bool = False
    #: the shard has no lease (cleaned up after it ended, or never leased): the move
    #: creates one at the target, so its records after the position are read again
    create: bool = False
    #: generation in the shard tree (0: no listed parent): writes go parents first
    depth: int = 0
    #: ``--all-shards`` on a shard already before the position: its own checkpoint is
    #: written again (the holder loses the lease), never moved forward
    kept: bool = False
    #: why the write was not made (the lease moved or was taken meanwhile, a parent was
    #: not moved, the endpoint failed); None while nothing went wrong
    failed: str | None = None

    def outcome(self, dry_run: bool) -> str:
        if self.target is None:
            return "unchanged"
        if self.failed is not None:
            return "refused"
        if self.written:
            return "created" if self.create else "kept" if self.kept else "moved"
        # not tried: a dry run, or the whole plan refused (a held lease without --force)
        return "planned" if dry_run else "not written"

    def to_json(self, dry_run: bool = False) -> dict[str, Any]:
        lease = self.lease
        moved = self.target is not None
        return {
            "shard_id": lease.shard_id, "lease_key": lease.lease_key,
            "owner": lease.lease_owner, "lease_counter": lease.lease_counter,
            "from": None if self.create else {
                "checkpoint": lease.checkpoint.sequence_number,
                "sub_sequence_number": lease.checkpoint.sub_sequence_number},
            "to": None if not moved else {
                "checkpoint": self.target.checkpoint if self.target else None,
                "sub_sequence_number": self.target.sub_sequence_number if self.target else 0},
            "meaning": self.target.meaning if self.target else None,
            "create": self.create, "note": self.note or None, "written": self.written,
            "outcome": self.outcome(dry_run), "error": self.failed,
        }


def _plan_moves(args: argparse.Namespace, kinesis: Any, table: LeaseTable) -> list[Move]:
    """Every shard's move, parents before children. With ``--all-shards`` that includes the
    listed shards that hold records after the position but have no lease: ancestors of
    leased shards whose lease cleanup deleted (``_lost_ancestors``)."""
    position: Destination = args.to
    if args.all_shards and position.names_one_shard:
        raise ConfigError("--to", "a sequence number is one shard's: use --shard-id")
    leases = ([one_lease(args, table, kinesis)] if args.shard_id
              else read_leases(args, table, kinesis))
    shards = _shards(args, kinesis, table)
    if args.shard_id and args.shard_id not in shards:
        raise ConfigError("--shard-id", f"stream {stream_label(args)!r} has no shard "
                         f"{args.shard_id!r} (expired beyond retention?)")
    depth = shard_depths(shards)
    moves: list[Move] = []
    for lease in leases:
        if lease.shard_id not in shards:
            moves.append(Move(lease, None, "the stream no longer lists the shard"))
            continue
        target = _resolve(args, kinesis, lease.shard_id, position,
                          lease.checkpoint.sequence_number)
        if args.all_shards and target is not None and _behind(lease.checkpoint,
                                                              target.position):
            moves.append(_kept(lease, depth[lease.shard_id]))
            continue
        moves.append(Move(lease, target, "" if target else "finished, nothing after the "
                          "position", depth=depth[lease.shard_id]))
    if args.all_shards and leases:
        for shard in _lost_ancestors(leases, shards):
            target = _resolve(args, kinesis, shard.shard_id, position, SHARD_END)
            if target is None:
                continue  # nothing after the position: nothing to read again
            moves.append(Move(_recreated(shard, shards, leases[0]), target,
                              "no lease (cleaned up after the shard ended): created, so its "
                              "children wait for it again", create=True,
                              depth=depth[shard.shard_id]))
    return sorted(moves, key=lambda m: (m.depth, m.lease.lease_key))


def _behind(checkpoint: Position, target: Position) -> bool:
    """Whether a shard at ``checkpoint`` has records before ``target`` it never processed
    (``TRIM_HORIZON`` or a record checkpoint before it): moving it to ``target`` would skip
    them (simulator seed 244: a replay of the stream skipped a lagging shard's record)."""
    return (checkpoint.is_record or checkpoint.sequence_number == TRIM_HORIZON) and (
        checkpoint < target)


def _kept(lease: Lease, depth: int) -> Move:
    return Move(lease, Target(lease.checkpoint, "its own checkpoint, before the position"),
                "already before the position: kept, not moved forward over records never "
                "processed", depth=depth, kept=True)


def _resolve(args: argparse.Namespace, kinesis: Any, shard_id: str, position: Destination,
             checkpoint: str) -> Target | None:
    reader = ShardReader(kinesis, _stream_params(args), shard_id)
    try:
        if position.kind == TRIM_HORIZON and checkpoint == SHARD_END and (
                reader.first(Position.trim_horizon()) is None):
            return None  # a finished shard retention emptied: nothing to read again
        return resolve(reader, position, checkpoint=checkpoint)
    except PositionError as exc:
        raise ConfigError("--to", f"shard {shard_id}: {exc}") from None


def _lost_ancestors(leases: Sequence[Lease], shards: Mapping[str, Shard]) -> list[Shard]:
    """The listed ancestors of leased shards that have no lease themselves. Lease cleanup
    deletes a parent's lease once its children progressed (``kclpy.leases.cleanup``), and
    shard sync never creates a lease for an ancestor of a leased shard, so no worker would
    ever read such a shard again - yet while retention keeps it, it holds records after an
    earlier position, which a replay from there must deliver (before its children's)."""
    leased = {lease.shard_id for lease in leases}
    found: dict[str, Shard] = {}
    stack = [shard_id for shard_id in leased if shard_id in shards]
    while stack:
        for parent in shards[stack.pop()].parent_ids:
            if parent in shards and parent not in leased and parent not in found:
                found[parent] = shards[parent]
                stack.append(parent)
    return [found[key] for key in sorted(found)]


def _recreated(shard: Shard, shards: Mapping[str, Shard], sibling: Lease) -> Lease:
    """The lease shard sync would have made for ``shard`` (parents, children, hash range,
    the stream's identifier and creation time taken from a lease of the same stream), at
    SHARD_END until the move sets its checkpoint."""
    if sibling.incarnation:
        epoch: float | None = sibling.stream_epoch or None
    elif sibling.stream is not None:
        epoch = float(StreamIdentifier.parse(sibling.stream).creation_epoch)
    else:
        epoch = None
    children = frozenset(other.shard_id for other in shards.values()
                         if shard.shard_id in other.parent_ids)
    return Lease(lease_key=sibling.key_of(shard.shard_id), checkpoint=Position.shard_end(),
                 parent_shard_ids=frozenset(shard.parent_ids), child_shard_ids=children,
                 starting_hash_key=shard.starting_hash_key,
                 ending_hash_key=shard.ending_hash_key, stream=sibling.stream,
                 incarnation=new_incarnation(epoch), stream_name=sibling.stream_name)


def set_checkpoint(args: argparse.Namespace, kinesis: Any, table: LeaseTable,
                   out: IO[str]) -> int:
    """Plan every shard's move, then write them parents first. A held lease without
    ``--force`` refuses the whole command before anything is written. Past that point one
    shard's write can still fail (a worker took the lease, shard sync created it, the
    endpoint gave up): the other shards are still written - except that shard's
    descendants, which would otherwise be read before the records it was to read again -
    every shard's outcome is printed, and the command exits 1."""
    moves = _plan_moves(args, kinesis, table)
    held = [m for m in moves if m.target is not None and m.lease.lease_owner is not None]
    refused = bool(held) and not args.force
    for move in held:
        holder = move.lease.lease_owner
        move.note = (f"taken from {holder}" if args.force
                     else f"refused: held by {holder} (use --force to take it)")
    store = _position_keeping_store(args.state_store) if args.state_store else None
    if not refused and not args.dry_run:
        _write_moves(table, store, moves, force=args.force)
    _print_moves(args, moves, out)
    if refused:
        holders = ", ".join(f"{m.lease.shard_id} by {m.lease.lease_owner}" for m in held)
        raise Refused(f"nothing written: lease(s) held ({holders}); stop the worker, or "
                      "use --force to take the lease(s) from the holder")
    failed = [m for m in moves if m.failed is not None]
    if failed:
        moved = sum(m.written for m in moves)
        names = ", ".join(m.lease.shard_id for m in failed)
        raise Refused(f"{len(failed)} shard(s) not moved ({names}), {moved} moved: see the "
                      "table above; run the command again")
    return 0


def _write_moves(table: LeaseTable, store: PositionKeepingStore | None, moves: Sequence[Move], *,
                 force: bool) -> None:
    """Write ``moves`` (parents first), noting each one's outcome on it."""
    not_moved: set[str] = set()
    for move in moves:
        if move.target is None:
            continue
        blocked = sorted(move.lease.parent_lease_keys & not_moved)
        if blocked:
            move.failed = (f"not written: its parent {', '.join(blocked)} was not moved, and "
                           "its records must be read again before this shard's")
            not_moved.add(move.lease.lease_key)
            continue
        try:
            if store is not None and not move.kept:  # a kept shard's store row stays put
                _move_with_store(table, store, move.lease, move.target, force=force,
                                 create=move.create)
            elif move.create:
                _create(table, move.lease, move.target)
            else:
                _write_fresh(table, move.lease, _moving_to(move.target), take=force)
        except Refused as exc:
            move.failed = str(exc)
        except Exception as exc:  # reported with every other shard's outcome
            move.failed = f"failed: {exc!r}"
        if move.failed is None:
            move.written = True
        else:
            not_moved.add(move.lease.lease_key)


def _create(table: LeaseTable, lease: Lease, target: Target, parked: str | None = None
            ) -> Lease:
    """Put ``lease`` at ``target`` unless a lease of its key exists meanwhile (shard sync
    never creates one for an ancestor of a leased shard, so one that exists was made by
    another operator command: refused, the operator runs again)."""
    created = lease.copy(checkpoint=target.position, parked=parked)
    item = ser.lease_to_new_item(created)
    if parked is not None:
        item[ser.PARKED] = s(parked)
    try:
        table.call("PutItem", table.client.put_item, TableName=table.table_name, Item=item,
                   ConditionExpression="attribute_not_exists(#k)",
                   ExpressionAttributeNames={"#k": ser.LEASE_KEY})
    except ClientError as exc:
        if error_code(exc) == CONDITION_FAILED:
            raise Refused(f"nothing written to {lease.lease_key}: a lease was created for it "
                          "since it was read; run again") from None
        raise
    return created


def _position_keeping_store(spec: str) -> PositionKeepingStore | None:
    """The state store ``spec`` names when it keeps positions of its own
    (``keeps_own_position``), opened; None for one whose position is the lease
    item's checkpoint, which moves with it."""
    try:
        store = open_store(spec)
    except ConfigError as exc:
        raise ConfigError("--state-store", exc.message) from None
    if not keeps_own_position(store):
        return None
    store.open(None)
    return store


def _move_with_store(table: LeaseTable, store: PositionKeepingStore, lease: Lease,
                     target: Target, *, force: bool, create: bool = False) -> None:
    """Move the lease's checkpoint and the store's own position for it together.

    A stateful processor resumes after the later of the two, so the store must move too.
    The lease is first moved and parked in one write (so no worker starts a tenure that
    would read the store's old position), then the store's row is moved and its tenure
    raised to the lease's new counter (so a commit of the previous holder's tenure is
    refused from then on), then the lease is unparked. Interrupted half-way, the shard
    stays parked, visibly, until ``kclpy shard resume``. A lease ``create``d again (a
    cleaned-up parent) is created parked; the store's row, if it kept one, is moved and
    given the new lease's incarnation, since the store would otherwise resume after its
    own, later, position (``SQLStateStore._take_over``)."""

    holding = parking.marker("kclpy checkpoint set in progress", "operator")

    def move_and_park(fresh: Lease) -> UpdateBuilder:
        return _replay_changes(fresh, target.position).set(ser.PARKED, s(holding))

    moved = (_create(table, lease, target, holding) if create
             else _write_fresh(table, lease, move_and_park, take=force))
    store.move_position(lease.lease_key, target.position, tenure=moved.lease_counter,
                        incarnation=moved.incarnation if create else None,
                        gaps=[r.start_position for r in _queued(moved)])
    _write(table, moved, UpdateBuilder().remove(ser.PARKED))


def _moving_to(target: Target) -> Callable[[Lease], UpdateBuilder]:
    return lambda fresh: _replay_changes(fresh, target.position)


def _replay_changes(fresh: Lease, position: Position) -> UpdateBuilder:
    """The checkpoint moved to ``position``, and the shard's recovery queue cut to what
    reading right after it still needs (``queue.replayed_from``); requests a holder has not
    folded in yet are folded in here, so that none of them outlives the cut."""
    changes = checkpoint_changes(position)
    folded = asked.read(fresh.recovery_requests)[0]
    stored = _queued(fresh)
    kept = gaps.replayed_from(_effective(fresh), position)
    if kept == stored and not folded:
        return changes
    value = gaps.dumps(kept)
    if value is None:
        changes.remove(ser.RECOVERY)
    else:
        changes.set(ser.RECOVERY, s(value))
    if folded:
        changes.delete(ser.RECOVERY_REQUESTS, ss(text for text, _ in folded))
    return changes


def _print_moves(args: argparse.Namespace, moves: Sequence[Move], out: IO[str]) -> None:
    if args.json:
        json.dump({"dry_run": args.dry_run, "position": str(args.to),
                   "shards": [m.to_json(args.dry_run) for m in moves]}, out, indent=2)
        out.write("\n")
        return
    rows = [["SHARD", "OWNER", "COUNTER", "FROM", "TO", "MEANING", "OUTCOME", "NOTE"]]
    for move in moves:
        lease = move.lease
        target = move.target
        rows.append([lease.shard_id, lease.lease_owner or "-", str(lease.lease_counter),
                     "(no lease)" if move.create else _checkpoint_text(
                         lease.checkpoint.sequence_number,
                         lease.checkpoint.sub_sequence_number),
                     "-" if target is None else _checkpoint_text(
                         target.checkpoint, target.sub_sequence_number),
                     "-" if target is None else target.meaning, move.outcome(args.dry_run),
                     "; ".join(n for n in (move.note, move.failed) if n) or "-"])
    print_table(rows, out)
    written = sum(m.written for m in moves)
    verb = "would move" if args.dry_run else "moved"
    count = sum(m.target is not None for m in moves) if args.dry_run else written
    out.write(f"{verb} {count} checkpoint(s) in {table_name(args)}\n")


def _checkpoint_text(checkpoint: str, sub: int) -> str:
    return checkpoint if sub == 0 else f"{checkpoint}/{sub}"


# -- park / resume ---------------------------------------------------------------------------


def park(args: argparse.Namespace, kinesis: Any, table: LeaseTable, out: IO[str]) -> int:
    lease = one_lease(args, table, kinesis)
    if lease.is_shard_end and not lease.recovery:
        raise Refused(f"shard {lease.shard_id} is finished (SHARD_END): nothing to park")
    value = parking.marker(args.reason, "operator")
    _write_fresh(table, lease, lambda _: UpdateBuilder().set(ser.PARKED, s(value)), take=True)
    taken = f", taken from {lease.lease_owner}" if lease.lease_owner else ""
    _report(args, out, {"shard_id": lease.shard_id, "parked": True,
                        "previous_owner": lease.lease_owner},
            f"parked {lease.shard_id}{taken}; checkpoint stays {lease.checkpoint.sequence_number}")
    return 0


def resume_shard(args: argparse.Namespace, kinesis: Any, table: LeaseTable,
                 out: IO[str]) -> int:
    lease = one_lease(args, table, kinesis)
    if lease.parked is None:
        raise Refused(f"shard {lease.shard_id} is not parked")
    _write(table, lease, UpdateBuilder().remove(ser.PARKED))
    _report(args, out, {"shard_id": lease.shard_id, "parked": False},
            f"resumed {lease.shard_id}: a worker takes it within the failover time, from "
            f"checkpoint {lease.checkpoint.sequence_number}")
    return 0


def _report(args: argparse.Namespace, out: IO[str], document: dict[str, Any],
            text: str) -> None:
    if args.json:
        json.dump(document, out, indent=2)
        out.write("\n")
    else:
        out.write(text + "\n")


# -- recovery add / list / cancel --------------------------------------------------------------


def _request(table: LeaseTable, lease: Lease, request: asked.QueueRequest, *,
             park: str | None = None
             ) -> tuple[str | None, tuple[gaps.RecoveryRequest, ...], Lease | None]:
    """Make ``request`` of the shard's queue: ``(holder, queue as it will be, the lease as
    written directly)``.

    A held lease gets it as an element of its requests set, conditional only on the lease
    still naming the owner read (the counter is left alone, so the holder keeps its lease
    and folds the request in within one renewal); ``holder`` is that owner, and no lease is
    returned. A lease nobody holds has its queue written directly, with any requests a
    holder left unfolded, conditional on the counter read; ``holder`` is None. ``park``: the
    same write parks such a lease with this mark, unless it is parked already (the caller
    then changes a state store before it unparks it). A lease that moved in between is
    read again.

    A cancel that the queue as read refuses (``asked.applied``: a gap grew since the command
    read it) is refused here, nothing written: the holder would refuse it as well."""
    element = request.to_text()
    for _ in range(WRITE_ATTEMPTS):
        fresh = table.get(lease.lease_key)
        if fresh is None:
            raise Refused(f"lease {lease.lease_key} was deleted meanwhile")
        pending = [r for _, r in asked.read(fresh.recovery_requests)[0]]
        queue, refused = asked.applied(asked.apply(_queued(fresh), pending), [request])
        if refused:
            raise Refused(f"shard {fresh.shard_id}: " + "; ".join(refused))
        if fresh.lease_owner is None:
            update = UpdateBuilder().expect_owner(None)
            if park is not None and fresh.parked is None:
                update.set(ser.PARKED, s(park))
            value = gaps.dumps(queue)
            if value is None:
                update.remove(ser.RECOVERY)
            else:
                update.set(ser.RECOVERY, s(value))
            folded = asked.read(fresh.recovery_requests)[0]
            if folded:
                update.delete(ser.RECOVERY_REQUESTS, ss(text for text, _ in folded))
            try:
                written = _write(table, fresh, update)
            except Refused:
                continue
            return None, queue, written
        update = UpdateBuilder().add(ser.RECOVERY_REQUESTS, ss([element])).expect_owner(
            fresh.lease_owner)
        try:
            table.call("UpdateItem", table.client.update_item, TableName=table.table_name,
                       Key=ser.key_of(fresh.lease_key), **update.request())
        except ClientError as exc:
            if error_code(exc) == CONDITION_FAILED:
                continue
            raise
        return fresh.lease_owner, queue, None
    raise Refused(f"lease {lease.lease_key} kept changing; nothing written to it, run again")


def _queued(lease: Lease) -> tuple[gaps.RecoveryRequest, ...]:
    try:
        return gaps.loads(lease.recovery)
    except ValueError as exc:
        raise Refused(f"shard {lease.shard_id}: {exc}; fix or remove the {ser.RECOVERY} "
                      "attribute by hand") from None


def _effective(lease: Lease) -> tuple[gaps.RecoveryRequest, ...]:
    """The queue as it is once the holder has folded in the requests it has not yet."""
    return asked.apply(_queued(lease), [r for _, r in asked.read(lease.recovery_requests)[0]])


def _now_ms() -> int:
    return round(datetime.now(timezone.utc).timestamp() * 1000)


def _handed_to(holder: str | None) -> str:
    if holder is None:
        return ""
    return f"; {holder} holds the lease and takes it in within one renewal"


def recovery_add(args: argparse.Namespace, kinesis: Any, table: LeaseTable,
                 out: IO[str]) -> int:
    lease = one_lease(args, table, kinesis)
    if args.shard_id not in _shards(args, kinesis, table):
        raise ConfigError("--shard-id", f"stream {stream_label(args)!r} has no shard "
                         f"{args.shard_id!r}")
    if int(args.first) > int(args.last):
        raise ConfigError("--to", f"{args.last} comes before --from {args.first}")
    reader = ShardReader(kinesis, _stream_params(args), lease.shard_id)
    try:
        first = record_at(reader, args.first)
    except PositionError as exc:
        raise ConfigError("--from", str(exc)) from None
    try:
        last = record_at(reader, args.last)
    except PositionError as exc:
        raise ConfigError("--to", str(exc)) from None
    first_ms = first.timestamp_millis or 0
    before, _ = last_before(reader, datetime.fromtimestamp(first_ms / 1000, timezone.utc),
                            lambda record: int(record.sequence_number) >= int(args.first))
    start, start_sub = ((before.sequence_number, last_sub_sequence(before))
                        if before is not None else (TRIM_HORIZON, 0))
    # The gap ends at the last record asked for: records after it that arrived in the same
    # millisecond are not replayed. Its reading still ends before the millisecond after
    # that record arrived, where every gap's reading ends.
    end_ms = (last.timestamp_millis or 0) + 1
    request = gaps.RecoveryRequest.gap(start, start_sub, end_ms, first_ms,
                                       first.sequence_number,
                                       last_sequence=last.sequence_number)
    queue = gaps.add(_effective(lease), request)
    holder = lease.lease_owner
    if not args.dry_run:
        holder, queue, _ = _request(table, lease, asked.adding(request, _now_ms()))
    verb = "would queue" if args.dry_run else "queued"
    _report(args, out, {"shard_id": lease.shard_id, "dry_run": args.dry_run,
                        "gap": _gap_json(request), "queue": [_gap_json(r) for r in queue],
                        "holder": holder},
            f"{verb} {lease.shard_id}: records after {start}"
            f"{'/' + str(start_sub) if start_sub else ''} through {last.sequence_number} "
            f"({args.first} .. {args.last}); {len(queue)} gap(s) "
            f"queued{'' if args.dry_run else _handed_to(holder)}")
    return 0


def recovery_list(args: argparse.Namespace, kinesis: Any, table: LeaseTable,
                  out: IO[str]) -> int:
    leases = ([one_lease(args, table, kinesis)] if args.shard_id
              else read_leases(args, table, kinesis))
    listed = []
    for lease in leases:
        stored = {(r.start, r.start_sub) for r in _queued(lease)}
        readable, unreadable = asked.read(lease.recovery_requests)
        listed.append((lease, _effective(lease), stored, readable, unreadable))
    if args.json:
        json.dump([{"shard_id": lease.shard_id, "owner": lease.lease_owner,
                    "gaps": [{**_gap_json(r), "taken_in": (r.start, r.start_sub) in stored}
                             for r in queue],
                    "requests": [r.describe() for _, r in readable],
                    "unreadable_requests": unreadable}
                   for lease, queue, stored, readable, unreadable in listed], out, indent=2)
        out.write("\n")
        return 0
    rows = [["SHARD", "GAP", "AFTER", "FIRST", "ENDS", "DONE", "REMAINING", "STATE"]]
    waiting = 0
    for lease, queue, stored, readable, unreadable in listed:
        waiting += len(readable)
        for number, request in enumerate(queue, 1):
            rows.append([lease.shard_id, str(number), request.start,
                         request.first_sequence or "-",
                         asked.end_text(request.end_ms, request.last_sequence),
                         request.done if request.started else "-",
                         f"{request.remaining_ms() / 1000:.1f}s",
                         "queued" if (request.start, request.start_sub) in stored
                         else "requested"])
        for text in unreadable:
            out.write(f"{lease.shard_id}: unreadable request in {ser.RECOVERY_REQUESTS} "
                      f"(remove it by hand): {text[:200]}\n")
    print_table(rows, out)
    note = (f"; {waiting} request(s) not yet taken in by the holder (shown applied)"
            if waiting else "")
    out.write(f"{len(rows) - 1} gap(s) in {table_name(args)}{note}\n")
    return 0


def recovery_cancel(args: argparse.Namespace, kinesis: Any, table: LeaseTable,
                    out: IO[str]) -> int:
    lease = one_lease(args, table, kinesis)
    queue = _effective(lease)
    if not queue:
        raise Refused(f"shard {lease.shard_id} has no queued gap")
    if not args.all and args.gap > len(queue):
        raise ConfigError("--gap", f"shard {lease.shard_id} has {len(queue)} gap(s)")
    dropped = queue if args.all else (queue[args.gap - 1],)
    if not args.all:
        ends = asked.end_text(dropped[0].end_ms, dropped[0].last_sequence)
        if ends != args.ends:
            raise Refused(f"gap {args.gap} of {lease.shard_id} ends {ends} now, not "
                          f"{args.ends}: it changed since it was listed; nothing dropped, "
                          "look again (kclpy recovery list)")
    # Each gap as read here, start and end: the holder drops it only while it still ends
    # there, never a part that merged into it since.
    store = _position_keeping_store(args.state_store) if args.state_store else None
    holding = (None if store is None
               else parking.marker("kclpy recovery cancel in progress", "operator"))
    holder, kept, written = _request(table, lease, asked.cancelling(dropped, _now_ms()),
                                     park=holding)
    if store is not None and written is not None:
        _forget_cancelled(table, store, written, dropped, kept, holding)
    named = ", ".join(f"after {r.start} {asked.end_text(r.end_ms, r.last_sequence)}"
                      for r in dropped)
    _report(args, out, {"shard_id": lease.shard_id, "dropped": len(dropped),
                        "gaps": [_gap_json(r) for r in dropped],
                        "queue": [_gap_json(r) for r in kept], "holder": holder},
            f"dropped {len(dropped)} gap(s) of {lease.shard_id} ({named}); {len(kept)} left"
            f"{_handed_to(holder)}"
            f"{'' if holder is None else ' (a gap grown by then stays queued, logged)'}")
    return 0


def _forget_cancelled(table: LeaseTable, store: PositionKeepingStore, written: Lease,
                      dropped: Sequence[gaps.RecoveryRequest],
                      kept: Sequence[gaps.RecoveryRequest], holding: str | None) -> None:
    """The cancelled gaps' rows out of a state store that keeps them, once the queue of a
    lease nobody holds was written without them: the store keeps every queued gap so that
    a lease-table reset loses none, and the next tenure would take such a row for a gap a
    reset lost and queue it again - the cancelled records applied after all. The lease was
    parked by the write (``holding``; a lease parked before stays so), so no tenure writes
    the rows meanwhile; interrupted before the unpark, the shard stays parked, visibly,
    until ``kclpy shard resume``. A held lease's holder drops the rows itself when it
    folds the request in."""
    queued = {r.start_position for r in kept}
    store.forget_gaps(written.lease_key, [r.start_position for r in dropped
                                          if r.start_position not in queued])
    if written.parked == holding:
        _write(table, written, UpdateBuilder().remove(ser.PARKED))


def _gap_json(request: gaps.RecoveryRequest) -> dict[str, Any]:
    return {"after": request.start, "after_sub": request.start_sub,
            "first_sequence": request.first_sequence, "ends_before": _iso(request.end_ms),
            "last_sequence": request.last_sequence,
            "done": request.done if request.started else None,
            "remaining_ms": request.remaining_ms()}


def _iso(epoch_ms: int) -> str:
    return datetime.fromtimestamp(epoch_ms / 1000, timezone.utc).isoformat(
        timespec="milliseconds")

