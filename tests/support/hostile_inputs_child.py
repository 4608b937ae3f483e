"""The child of tests/system/test_fuzz_hostile_inputs.py: hostile MultiLang lines and hostile lease
items through the worker's own paths under a cap on its address space, and a one-line JSON
account per case.

Run as ``python -m tests.support.hostile_inputs_child multilang|leases <case>[,<case>...]
<cap bytes>``. The cap is set before the first input is built, so a path that copies or
parses without bound dies here with MemoryError (exit code 1 and a traceback) instead of
passing because the machine is large. The case ``control`` asks for more than the cap, to
show that the cap bites.

``python -m tests.support.hostile_inputs_child app <case>`` is the MultiLang application:
it acknowledges ``initialize``, answers ``processRecords`` with the case's hostile bytes and
then with a proper acknowledgement, so a line the worker tolerates ends the exchange well.
"""

from __future__ import annotations

import json
import logging
import resource
import sys
from collections.abc import Callable
from typing import Any

MB = 2**20
ACK = b'{"action":"status","responseFor":"processRecords"}\n'


def checkpoint(sequence_number: str) -> bytes:
    return b'{"action":"checkpoint","sequenceNumber":' + sequence_number.encode() + b"}\n"


#: what the application writes while it handles processRecords, before its acknowledgement
MULTILANG: dict[str, Callable[[], bytes]] = {
    # one line far beyond the reader's 64 KiB pieces: a status with a 20 MiB field
    "huge_line": lambda: ACK[:-2] + b',"x":"' + b"a" * (20 * MB) + b'"}\n',
    # as much without any newline, then the acknowledgement on a line of its own
    "no_newline": lambda: b"z" * (20 * MB) + b"\n" + ACK,
    "deep_array": lambda: b"[" * 100_000 + b"]" * 100_000 + b"\n",
    "deep_object": lambda: b'{"a":' * 100_000 + b"1" + b"}" * 100_000 + b"\n",
    # nested as deep as fits one 64 KiB piece, whole: valid JSON too deep to parse
    "deep_whole": lambda: b"[" * 30_000 + b"]" * 30_000 + b"\n",
    "array": lambda: b'["action","status"]\n',
    "number": lambda: b"12345\n",
    "string": lambda: b'"status"\n',
    "null": lambda: b"null\n",
    "no_action": lambda: b'{"responseFor":"processRecords"}\n',
    "action_not_string": lambda: b'{"action":["status"],"responseFor":"processRecords"}\n',
    "unknown_action": lambda: b'{"action":"reboot"}\n',
    "status_for_nothing": lambda: b'{"action":"status","responseFor":7}\n',
    "status_for_other": lambda: b'{"action":"status","responseFor":"initialize"}\n',
    # a 5,000-digit number is past Python's int digits limit: json.loads refuses it
    "checkpoint_5000_digits": lambda: checkpoint("9" * 5_000),
    "checkpoint_huge_int": lambda: checkpoint(str(10**400)),
    "checkpoint_negative": lambda: checkpoint("-5"),
    "checkpoint_float": lambda: checkpoint("1.5e308"),
    "checkpoint_overflow": lambda: checkpoint("1e309"),
    "checkpoint_nan": lambda: checkpoint("NaN"),
    "checkpoint_object": lambda: checkpoint('{"n":1}'),
    "checkpoint_bool": lambda: checkpoint("true"),
    "checkpoint_60k_string": lambda: checkpoint('"' + "7" * 60_000 + '"'),
    "checkpoint_10m_string": lambda: checkpoint('"' + "7" * (10 * MB) + '"'),
    "checkpoint_huge_sub": lambda: (b'{"action":"checkpoint","sequenceNumber":null,'
                                    b'"subSequenceNumber":' + str(10**400).encode() + b"}\n"),
    "invalid_utf8": lambda: b"\xff\xfe\xc3" + ACK,
    "invalid_utf8_in_value": lambda: ACK[:-2] + b',"x":"\xff\xc3("}\n',
    "nul_after": lambda: ACK[:-1] + b"\x00\n",
    "nul_in_string": lambda: ACK[:-2] + b',"x":"\x00"}\n',
    "blank_lines": lambda: b"\n" * 100_000,
    "stray_lines": lambda: b"x\n" * 100_000,
}
#: cases run with ``stray_stdout="skip"``: stray output is skipped, not a restart
SKIP_STRAY = {"huge_line", "no_newline", "stray_lines", "invalid_utf8"}


def _deep(kind: str) -> str:
    """JSON nested 100,000 deep: past any recursion limit a decoder has."""
    return {"array": "[" * 100_000 + "]" * 100_000,
            "object": '{"a":' * 100_000 + "1" + "}" * 100_000,
            "in_requests": '{"requests":' + "[" * 100_000 + "]" * 100_000 + "}"}[kind]


def _recovery(requests: int, number: str = "1") -> str:
    one = ('{"start":"100","startSub":' + number + ',"endMs":1,"firstMs":null,'
           '"firstSequence":null,"done":"100","doneSub":0,"doneMs":null}')
    return '{"v":1,"requests":[' + ",".join([one] * requests) + "]}"


def _s(value: str) -> dict[str, Any]:
    return {"S": value}


def _n(value: str) -> dict[str, Any]:
    return {"N": value}


#: lease items: the key and the hostile attributes (attribute -> value as DynamoDB returns it)
LEASES: dict[str, Callable[[], dict[str, Any]]] = {
    "counter_400_digits": lambda: {"leaseCounter": _n(str(10**400))},
    "counter_5000_digits": lambda: {"leaseCounter": _n("9" * 5_000)},
    "counter_1m_digits": lambda: {"leaseCounter": _n("9" * 1_000_000)},
    "counter_negative": lambda: {"leaseCounter": _n("-7")},
    "counter_1e309": lambda: {"leaseCounter": _n("1e309")},
    "counter_nan": lambda: {"leaseCounter": _n("NaN")},
    "counter_as_s": lambda: {"leaseCounter": _s("5")},
    "counter_as_m": lambda: {"leaseCounter": {"M": {"a": _n("1")}}},
    "counter_as_l": lambda: {"leaseCounter": {"L": [_n("1")]}},
    "counter_as_b": lambda: {"leaseCounter": {"B": b"\x01"}},
    "checkpoint_400k_digits": lambda: {"checkpoint": _s("1" * 400_000)},
    # past what int() reads (4,300 digits): a position no comparison can order
    "checkpoint_5000_digits": lambda: {"checkpoint": _s("1" * 5_000)},
    "checkpoint_not_digits": lambda: {"checkpoint": _s("12a")},
    "checkpoint_other_digits": lambda: {"checkpoint": _s("\u0661\u0662")},
    "checkpoint_as_n": lambda: {"checkpoint": _n("12")},
    "sub_400_digits": lambda: {"checkpoint": _s("12"),
                               "checkpointSubSequenceNumber": _n(str(10**400))},
    "sub_negative": lambda: {"checkpoint": _s("12"), "checkpointSubSequenceNumber": _n("-1")},
    "pending_not_digits": lambda: {"pendingCheckpoint": _s("x" * 400_000)},
    "switches_400_digits": lambda: {"ownerSwitchesSinceCheckpoint": _n(str(10**400))},
    "parents_100k": lambda: {"parentShardId": {"SS": [f"shardId-{i:012d}"
                                                      for i in range(100_000)]}},
    "parents_as_l": lambda: {"parentShardId": {"L": [_s("a")]}},
    "parents_as_b": lambda: {"parentShardId": {"B": b"x"}},
    "owner_as_m": lambda: {"leaseOwner": {"M": {"a": _s("b")}}},
    "start_at_1e309": lambda: {"kclpyStartAt": _n("1e309")},
    "incarnation_infinite": lambda: {"kclpyIncarnation": _s("1e999:1:x")},
    "incarnation_nan": lambda: {"kclpyIncarnation": _s("nan:1:x")},
    "recovery_1m_requests": lambda: {"kclpyRecovery": _s(_recovery(1_000_000))},
    "recovery_infinite": lambda: {"kclpyRecovery": _s(_recovery(1, "1e309"))},
    "recovery_400_digits": lambda: {"kclpyRecovery": _s(_recovery(1, str(10**400)))},
    "recovery_5000_digits": lambda: {"kclpyRecovery": _s(_recovery(1, "9" * 5_000))},
    "recovery_deep": lambda: {"kclpyRecovery": _s(_deep("in_requests"))},
    "recovery_not_object": lambda: {"kclpyRecovery": _s("[1]")},
    "requests_deep": lambda: {"kclpyRecoveryRequests": {"SS": [_deep("array"),
                                                                _deep("object")]}},
    "requests_absurd": lambda: {"kclpyRecoveryRequests": {"SS": [
        '{"id":"a","at":1e309,"cancel":[["1",0]]}', '{"id":"b","at":NaN,"cancel":[["1",0]]}',
        '{"id":"c","at":' + "9" * 5_000 + ',"cancel":[["1",0]]}', "x" * 400_000]}},
    "parked_400k": lambda: {"kclpyParked": _s("x" * 400_000)},
    "parked_deep": lambda: {"kclpyParked": _s(_deep("object"))},
    "no_key": lambda: {"leaseKey": None},
    "key_as_n": lambda: {"leaseKey": _n("1")},
    "key_400k": lambda: {"leaseKey": _s("k" * 400_000)},
}


def app(case: str) -> None:
    """The hostile MultiLang application (see the module's docstring)."""
    out = sys.stdout.buffer
    sys.stdin.buffer.readline()
    out.write(b'\n{"action":"status","responseFor":"initialize"}\n')
    out.flush()
    sys.stdin.buffer.readline()
    out.write(MULTILANG[case]() + ACK)
    out.flush()
    sys.stdin.buffer.read()


def run_multilang(case: str) -> dict[str, Any]:
    from pathlib import Path

    from kclpy.checkpoint import Checkpointer
    from kclpy.metrics import Metrics
    from kclpy.multilang import MultiLangChildError, MultiLangRecordProcessor
    from kclpy.position import Position
    from kclpy.processor import InitializeInput, ProcessRecordsInput
    from kclpy.records import Record
    from tests.support.checkpoints import CheckpointWriterBase

    class Writer(CheckpointWriterBase):
        def __init__(self) -> None:
            self.writes: list[str] = []

        def update_checkpoint(self, lease_key: str, concurrency_token: str,
                              position: Position) -> None:
            self.writes.append(position.checkpoint)

    shard = "shardId-000000000001"
    metrics = Metrics()
    writer = Writer()
    processor = MultiLangRecordProcessor(
        [sys.executable, "-m", "tests.support.hostile_inputs_child", "app", case],
        cwd=Path.cwd(), metrics=metrics, response_timeout_s=60,
        stray_stdout="skip" if case in SKIP_STRAY else "restart")
    checkpointer = Checkpointer(shard, writer, "token", Position.trim_horizon())
    record = Record(sequence_number="49600000000000000000000000000000000000000000000000000001",
                    partition_key="pk", timestamp_millis=1_700_000_000_000, data=b"x")
    outcome = "ok"
    processor.initialize(InitializeInput(shard, "TRIM_HORIZON", 0))
    try:
        checkpointer.mark_delivered(record)
        processor.process_records(ProcessRecordsInput(shard, [record], checkpointer, 0))
    except MultiLangChildError as exc:
        outcome = exc.reason
    finally:
        processor.close()
    return {"case": case, "outcome": outcome, "checkpoints": writer.writes,
            "stray": int(metrics.registry.get_sample_value(
                "kclpy_multilang_stray_stdout_lines_total", {"shard_id": shard}) or 0)}


def run_leases(case: str) -> dict[str, Any]:
    """The item as the lease table's reads parse it, then what a holder or the taker reads
    out of the lease (its recovery queue and requests, its park mark, its incarnation)."""
    from kclpy.leases import park
    from kclpy.leases.lease import incarnation_epoch
    from kclpy.leases.serializer import lease_from_item
    from kclpy.recovery import queue, requests

    item = {"leaseKey": _s("shardId-000000000001"), **LEASES[case]()}
    item = {name: value for name, value in item.items() if value is not None}
    try:
        lease = lease_from_item(item)
    except ValueError:
        return {"case": case, "outcome": "unreadable"}
    try:
        recovery: str | int = len(queue.loads(lease.recovery))
    except ValueError:
        recovery = "unreadable"
    readable, unreadable = requests.read(lease.recovery_requests)
    described = park.describe(lease.parked)
    return {"case": case, "outcome": "lease", "counter": str(lease.lease_counter)[:12],
            "checkpoint_digits": len(lease.checkpoint.sequence_number),
            "parents": len(lease.parent_shard_ids), "recovery": recovery,
            "requests": [len(readable), len(unreadable)],
            "parked": None if described is None else len(json.dumps(described)),
            "incarnation_epoch": incarnation_epoch(lease.incarnation or "")}


def main(mode: str, cases: list[str], cap: int) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    # every skipped line is logged: 100,000 warnings say nothing the account does not
    logging.disable(logging.CRITICAL)
    run = {"multilang": run_multilang, "leases": run_leases}[mode]
    for case in cases:
        if case == "control":
            print(len(bytearray(cap)))
        print(json.dumps(run(case)), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "app":
        app(sys.argv[2])
    else:
        main(sys.argv[1], sys.argv[2].split(","), int(sys.argv[3]))
