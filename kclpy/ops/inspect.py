"""``kclpy leases`` and ``kclpy status``: an application's leases and lag, looked at from any
machine with read access.

No worker needs to run: everything comes from the lease table (Scan) and the stream
(ListShards, and GetShardIterator + GetRecords at each checkpoint to measure lag).

- ``kclpy leases``: who owns which shard, where each checkpoint is, the shard lineage.
- ``kclpy status``: per-shard lag status with Burrow's rules (``kclpy.ops.lag``). A status
  needs movement, so one run samples ``--samples`` times spread over ``--window-seconds``
  and evaluates that window; ``--watch`` keeps sampling and prints an evaluation of the
  sliding window after every sample. ``--worker URL`` adds what running workers report on
  their ops endpoint (``/status``): each shard's retrieval mode, subscription age and lag
  recovery queue.

In a multi-stream table (Java ``MultiStreamLease`` keys, ``kclpy.streams``) ``leases`` shows
each lease's stream and ``--stream-name`` / ``--stream-arn`` pick one stream's leases.

Their flags, and every other ``kclpy`` command, are in ``kclpy.ops.commands``'s table.
``status`` exits 0 for OK, 1 for WARN, 2 for ERROR, 3 when the status could not be
determined (AWS unreachable, access denied).
"""

from __future__ import annotations

import argparse
import base64
import json
import logging
import sys
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

import botocore.config
from botocore.exceptions import ClientError, NoRegionError

from kclpy.errors import ConfigError
from kclpy.leases import park as parking
from kclpy.leases import serializer as ser
from kclpy.leases.lease import Lease
from kclpy.leases.shard_sync import ShardSyncer, SyncedStream
from kclpy.leases.table import LeaseTable
from kclpy.ops.control import stream_label, stream_name, table_name
from kclpy.ops.lag import (
    LagProbe,
    LagTracker,
    Observation,
    ShardEvaluation,
    application_status,
    report_to_json,
)
from kclpy.ops.text import print_table, printable
from kclpy.retry import NOT_FOUND, error_code, is_not_found
from kclpy.sessions import aws_session
from kclpy.streams import StreamIdentifier

log = logging.getLogger("kclpy.inspect")

#: ``kclpy status`` when the status could not be determined (Nagios' UNKNOWN)
EXIT_UNKNOWN = 3


# -- AWS -------------------------------------------------------------------------------------


def clients(args: argparse.Namespace) -> tuple[Any, Any]:
    """``(kinesis, dynamodb)`` as the common flags say, retrying less than the workers do:
    an operator waiting at a terminal wants an answer, or the error, within seconds."""
    session = aws_session(args.region)
    config = botocore.config.Config(retries={"mode": "standard", "total_max_attempts": 3},
                                    connect_timeout=5, read_timeout=30)
    try:
        kinesis = session.client("kinesis", endpoint_url=args.kinesis_endpoint, config=config)
        dynamodb = session.client("dynamodb", endpoint_url=args.dynamodb_endpoint,
                                  config=config)
    except NoRegionError:
        raise ConfigError("--region", "no region configured (set --region or "
                         "AWS_DEFAULT_REGION)") from None
    return kinesis, dynamodb


def _missing_table(args: argparse.Namespace) -> ConfigError:
    option = "--table-name" if args.table_name else "--application-name"
    return ConfigError(option, f"lease table {table_name(args)!r} does not exist")


def _scan(dynamodb: Any, table: str) -> list[dict[str, Any]]:
    """Every item, strongly consistent: the same view the workers' lease takers have."""
    items: list[dict[str, Any]] = []
    request: dict[str, Any] = {"TableName": table, "ConsistentRead": True}
    while True:
        page = dynamodb.scan(**request)
        items.extend(page.get("Items", []))
        if not page.get("LastEvaluatedKey"):
            return items
        request["ExclusiveStartKey"] = page["LastEvaluatedKey"]


# -- leases ----------------------------------------------------------------------------------

def _number(text: str) -> int | float:
    try:
        return int(text)
    except ValueError:
        return float(text)


def _plain(value: Mapping[str, Any]) -> Any:
    """One DynamoDB attribute value as plain JSON: numbers as numbers, sets as sorted
    lists, binary as base64 text."""
    (kind, raw), = value.items()
    if kind == "N":
        return _number(raw)
    if kind == "NS":
        return sorted(_number(v) for v in raw)
    if kind == "SS":
        return sorted(raw)
    if kind == "B":
        return base64.b64encode(raw).decode()
    if kind == "BS":
        return sorted(base64.b64encode(v).decode() for v in raw)
    if kind == "L":
        return [_plain(v) for v in raw]
    if kind == "M":
        return {k: _plain(v) for k, v in raw.items()}
    if kind == "NULL":
        return None
    return raw  # S and BOOL are JSON already


def item_to_json(item: Mapping[str, Any]) -> dict[str, Any]:
    """A lease item keyed by its attribute names, every attribute included (also those
    kclpy does not model, such as newer Java KCL versions' ``throughputKBps``)."""
    return {name: _plain(value) for name, value in sorted(item.items())}


def leases_command(args: argparse.Namespace, dynamodb: Any, out: IO[str]) -> int:
    try:
        items = _scan(dynamodb, table_name(args))
    except ClientError as exc:
        if is_not_found(exc):
            raise _missing_table(args) from None
        raise
    leases: list[tuple[Lease, dict[str, Any]]] = []
    for item in items:
        try:
            leases.append((ser.lease_from_item(item), item))
        except ValueError:
            log.warning("skipping an item that is not a lease: %s", sorted(item))
    leases.sort(key=lambda pair: pair[0].lease_key)
    wanted = stream_label(args)
    if wanted is not None:
        leases = [(lease, item) for lease, item in leases
                  if lease.stream is None or stream_name(lease) == wanted]
    if args.json:
        json.dump([{**item_to_json(item), "state": lease_state(lease)}
                   for lease, item in leases], out, indent=2)
        out.write("\n")
        return 0
    rows = [["STREAM", "SHARD", "STATE", "OWNER", "COUNTER", "CHECKPOINT", "SUB", "SWITCHES",
             "PARENTS", "CHILDREN"]]
    parked: list[str] = []
    for lease, _ in leases:
        owner = lease.lease_owner or "-"
        if lease.checkpoint_owner:
            owner += f" (handoff from {lease.checkpoint_owner})"
        marker = parking.describe(lease.parked)
        if marker is not None:
            parked.append(printable(f"{lease.shard_id}: {marker.get('reason')}")
                          + (printable(f" ({marker['error']})") if marker.get("error") else ""))
        rows.append([stream_name(lease) or "-", lease.shard_id, lease_state(lease), owner,
                     str(lease.lease_counter), lease.checkpoint.sequence_number,
                     str(lease.checkpoint.sub_sequence_number),
                     str(lease.owner_switches_since_checkpoint),
                     ",".join(sorted(lease.parent_shard_ids)) or "-",
                     ",".join(sorted(lease.child_shard_ids)) or "-"])
    print_table(rows, out)
    for line in parked:
        out.write(f"parked {line}\n")
    out.write(f"{len(leases)} lease(s) in {table_name(args)}\n")
    return 0


def lease_state(lease: Lease) -> str:
    """PARKED (no worker takes it), FINISHED (at SHARD_END, nothing queued), HELD or FREE."""
    if lease.parked is not None:
        return "PARKED"
    if lease.is_finished:
        return "FINISHED"
    return "HELD" if lease.lease_owner else "FREE"


# -- status ----------------------------------------------------------------------------------


@dataclass
class Sample:
    """What one look at the table and the stream found besides the observations."""

    time: float
    #: open shards nobody has a lease for yet (no worker ran, or shard sync is pending)
    unleased_shards: list[str]
    #: leases whose shard the stream no longer lists (expired beyond retention)
    unlisted_leases: list[str]
    #: parked leases (``kclpy shard park``, the park policy): shard id -> the park mark
    parked: dict[str, dict[str, Any]] = field(default_factory=dict)


class TableSampler:
    """Observes every leased shard of one stream from the lease table and the stream."""

    def __init__(self, table: LeaseTable, syncer: ShardSyncer, probe: LagProbe,
                 tracker: LagTracker, clock: Callable[[], float],
                 identify: Callable[[], str] | None = None) -> None:
        self._table = table
        self._syncer = syncer
        self._probe = probe
        self._tracker = tracker
        self._clock = clock
        #: the stream's serialised identifier, looked up once a multi-stream lease is seen
        self._identify = identify
        self._stream_id: str | None = None
        #: shard id -> lease key, as the workers' ``/status`` names the shards
        self.lease_keys: dict[str, str] = {}

    def _leases(self) -> dict[str, Lease]:
        """The stream's leases by shard id: all of a single-stream table, or those of the
        stream in a multi-stream one."""
        every = self._table.list_leases()
        if not any(lease.stream for lease in every) or self._identify is None:
            return {lease.lease_key: lease for lease in every}
        if self._stream_id is None:
            self._stream_id = self._identify()
        return {lease.shard_id: lease for lease in every if lease.stream == self._stream_id}

    def sample(self) -> Sample:
        now = self._clock()
        leases = self._leases()
        self.lease_keys = {shard_id: lease.lease_key for shard_id, lease in leases.items()}
        shards = {shard.shard_id: shard for shard in self._syncer.list_shards()}
        sample = Sample(now,
                        unleased_shards=sorted(s for s, shard in shards.items()
                                               if s not in leases and shard.is_open),
                        unlisted_leases=sorted(set(leases) - set(shards)),
                        parked={shard_id: parking.describe(lease.parked) or {}
                                for shard_id, lease in leases.items() if lease.parked})
        observed = sorted(set(leases) & set(shards))
        for shard_id in observed:
            lease = leases[shard_id]
            # A parent whose lease is gone was finished and cleaned up, as the consumer
            # itself concludes before it starts a child.
            waiting = any(p in leases and not leases[p].is_shard_end
                          for p in lease.parent_shard_ids)
            checkpoint = lease.checkpoint
            lag = self._probe.measure(shard_id, checkpoint.sequence_number,
                                      checkpoint.sub_sequence_number)
            self._tracker.record(shard_id, Observation(
                time=now, checkpoint=checkpoint.sequence_number,
                sub_sequence_number=checkpoint.sub_sequence_number, lag=lag,
                lease_counter=lease.lease_counter, owner=lease.lease_owner,
                owner_switches=lease.owner_switches_since_checkpoint,
                waiting_on_parents=waiting))
        self._tracker.retain(observed)
        return sample


def status_report(args: argparse.Namespace, sample: Sample,
                  evaluations: Mapping[str, ShardEvaluation],
                  workers: Sequence[WorkerView] = (),
                  lease_keys: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The ``--json`` document: ``report_to_json``'s shape plus what was not evaluated, and
    with ``--worker`` what the workers say of each shard (``retrieval``, ``recovery``)."""
    report = {
        "application": args.application_name,
        "stream": args.stream_name or args.stream_arn,
        "table": table_name(args),
        **report_to_json(evaluations, args.window_seconds),
        "samples": args.samples,
        "unleased_shards": sample.unleased_shards,
        "unlisted_leases": sample.unlisted_leases,
        "parked": sample.parked,
    }
    if workers:
        report["workers"] = [view.summary() for view in workers]
        keys = lease_keys or {}
        for shard in report["shards"]:
            key = keys.get(shard["shard_id"], shard["shard_id"])
            for view in workers:
                reported = view.shards.get(key)
                if reported is not None:
                    shard["worker"] = view.worker_id or view.url
                    shard["retrieval"] = reported.get("retrieval") or {}
                    shard["recovery"] = reported.get("recovery") or []
                    if reported.get("failure"):
                        shard["state"] = "FAILED"
                        shard["failure"] = reported["failure"]
                    break
    return report


@dataclass
class WorkerView:
    """What one worker's ``/status`` said, or why it could not be read."""

    url: str
    worker_id: str | None = None
    shards: Mapping[str, Any] = field(default_factory=dict)
    error: str | None = None

    def summary(self) -> dict[str, Any]:
        return {"url": self.url, "worker_id": self.worker_id, "reachable": self.error is None,
                "error": self.error, "shards": sorted(self.shards)}


def read_worker(url: str, timeout_s: float = 5.0) -> WorkerView:
    """GET ``url``/status; a worker that does not answer is reported, not fatal."""
    target = url.rstrip("/") + "/status"
    try:
        with urllib.request.urlopen(target, timeout=timeout_s) as response:  # noqa: S310
            document = json.load(response)
    except (OSError, ValueError) as exc:
        return WorkerView(url, error=str(exc))
    if not isinstance(document, dict) or not isinstance(document.get("shards"), dict):
        return WorkerView(url, error="not a kclpy worker's /status document")
    return WorkerView(url, document.get("worker_id"), document["shards"])


def _retrieval_text(shard: Mapping[str, Any]) -> tuple[str, str, str]:
    """MODE, SUB AGE and RECOVERY columns of a shard a worker reported on."""
    if "retrieval" not in shard:
        return "-", "-", "-"
    retrieval = shard["retrieval"]
    age = retrieval.get("subscription_age_s")
    queue = shard.get("recovery") or []
    remaining = sum(int(gap.get("remaining_ms") or 0) for gap in queue)
    recovery = f"{len(queue)} gap(s), {remaining / 1000:.0f}s left" if queue else "-"
    return (str(retrieval.get("mode") or "-"), "-" if age is None else f"{age:.0f}s",
            recovery)


def _print_status(report: Mapping[str, Any], out: IO[str], *, as_json: bool,
                  watching: bool) -> None:
    if as_json:
        json.dump(report, out, indent=None if watching else 2)
        out.write("\n")
        out.flush()
        return
    out.write(f"{report['application']} on {report['stream']}: {report['status']} "
              f"(window {report['window_seconds']:g}s, {report['samples']} samples)\n")
    workers = report.get("workers")
    rows = [["SHARD", "STATUS", "OWNER", "CHECKPOINT", "BEHIND", "AGE", "REASON"]
            + (["MODE", "SUB AGE", "RECOVERY"] if workers else [])]
    for shard in report["shards"]:
        behind = "-"
        if "records_behind" in shard:
            behind = str(shard["records_behind"]) + ("" if shard["records_behind_exact"]
                                                     else "+")
        age = f"{shard['millis_behind'] / 1000:.1f}s" if "millis_behind" in shard else "-"
        rows.append([shard["shard_id"], shard["status"], shard.get("owner") or "-",
                     shard.get("checkpoint") or "-", behind, age, shard["reason"]]
                    + (list(_retrieval_text(shard)) if workers else []))
    print_table(rows, out)
    for worker in workers or []:
        if not worker["reachable"]:
            out.write(printable(f"worker {worker['url']} unreachable: {worker['error']}")
                      + "\n")
    for shard in report["shards"]:
        failure = shard.get("failure")
        if failure:
            since = time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                  time.gmtime(int(failure.get("since_ms") or 0) / 1000))
            out.write(printable(f"shard {shard['shard_id']} FAILED: "
                                f"{failure.get('error_type')}: {failure.get('message')} "
                                f"({failure.get('attempts')} attempt(s) since {since})")
                      + "\n")
    for shard_id, mark in sorted(report.get("parked", {}).items()):
        why = mark.get("reason") or "-"
        error = f" ({mark['error']})" if mark.get("error") else ""
        out.write(printable(f"shard {shard_id} PARKED by {mark.get('by') or '-'}: {why}{error}")
                  + "\n")
    if report["unleased_shards"]:
        out.write(printable(f"open shards without a lease: "
                            f"{', '.join(report['unleased_shards'])}") + "\n")
    if report["unlisted_leases"]:
        out.write(printable("leases of shards the stream no longer lists: "
                            f"{', '.join(report['unlisted_leases'])}") + "\n")
    out.flush()


def run_status(args: argparse.Namespace, out: IO[str], *,
               aws: tuple[Any, Any] | None = None,
               clock: Callable[[], float] = time.monotonic,
               sleep: Callable[[float], None] = time.sleep,
               wall_clock: Callable[[], float] = time.time) -> int:
    """Sample and evaluate; returns the exit code of the last evaluation. ``aws`` is
    ``(kinesis, dynamodb)``, made from the flags when not given."""
    kinesis, dynamodb = aws or clients(args)
    table = LeaseTable(dynamodb, table_name(args), max_attempts=5)
    syncer = ShardSyncer(kinesis, table, SyncedStream(args.stream_name, args.stream_arn))
    probe = LagProbe(kinesis, stream_name=args.stream_name, stream_arn=args.stream_arn,
                     records_limit=args.records_limit, wall_clock=wall_clock)
    tracker = LagTracker(args.window_seconds)

    def identify() -> str:
        params = {"StreamARN": args.stream_arn} if args.stream_arn else {
            "StreamName": args.stream_name}
        summary = kinesis.describe_stream_summary(**params)["StreamDescriptionSummary"]
        return StreamIdentifier.from_summary(summary).serialize()

    sampler = TableSampler(table, syncer, probe, tracker, clock, identify)
    interval = args.window_seconds / (args.samples - 1)
    if not args.json and sys.stderr.isatty():
        # the first verdict needs the whole window: tell a person, rather than sit silent
        # for it (a monitoring check's stderr stays one line, its error)
        print(f"sampling {args.samples} times over {args.window_seconds:g} s "
              f"(--window-seconds, --samples) before the first status ...", file=sys.stderr)
    evaluations = args.count if args.watch else 1
    code = EXIT_UNKNOWN
    start = clock()
    taken = 0
    try:
        while evaluations is None or evaluations > 0:
            target = start + taken * interval
            while (delay := target - clock()) > 0:
                sleep(delay)
            sample = _sample(sampler, args)
            taken += 1
            if not args.watch and taken < args.samples:
                continue
            evaluated = tracker.evaluate(sample.time)
            workers = [read_worker(url) for url in args.worker]
            _print_status(status_report(args, sample, evaluated, workers, sampler.lease_keys),
                          out, as_json=args.json, watching=args.watch)
            code = application_status(e.status for e in evaluated.values()).exit_code
            if evaluations is not None:
                evaluations -= 1
    except KeyboardInterrupt:
        pass
    return code


def _sample(sampler: TableSampler, args: argparse.Namespace) -> Sample:
    try:
        return sampler.sample()
    except ClientError as exc:
        code = error_code(exc)
        if code == NOT_FOUND and exc.operation_name == "Scan":
            raise _missing_table(args) from None
        if code == NOT_FOUND:
            option = "--stream-name" if args.stream_name else "--stream-arn"
            raise ConfigError(option, f"stream {args.stream_name or args.stream_arn!r} "
                             "does not exist") from None
        raise
