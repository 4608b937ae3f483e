"""Shared by the v1/v2/v3 test applications: the event log the tests read, and what a
record's payload tells the application to do.

A payload is plain text; its first word is a command:

- ``crash``: exit at once with code 3, mid-batch, without acknowledging it
- ``crash-once``: the same, unless this application crashed on it before (the event log
  next to the output file remembers), so the redelivered batch goes through
- ``hang``: stop responding (sleep for an hour)
- ``garbage``: print a line that is not a protocol message to stdout
- ``stderr <text>``: write ``<text>`` to stderr
- ``checkpoint [<sequence number>]``: checkpoint at this record (or at the number given)
  and log the outcome
- ``checkpoint-last``: checkpoint without arguments (the last record delivered) and log
  the outcome
- anything else: just logged

Events are JSON lines appended to the file named by ``KCLPY_TEST_OUTPUT``, each with the
shard id once the application knows it (``SHARD``, set by its initialize).
"""

import json
import os
import sys
import time

from amazon_kclpy.kcl import CheckpointError

SHARD = None


def emit(event):
    if SHARD is not None:
        event.setdefault("shard_id", SHARD)
    with open(os.environ["KCLPY_TEST_OUTPUT"], "a", encoding="utf-8") as out:
        out.write(json.dumps(event) + "\n")


def _crash():
    sys.stderr.write("crashing on purpose\n")
    sys.stderr.flush()
    os._exit(3)


def record(version, data, partition_key, sequence_number, sub_sequence_number, timestamp):
    emit({"event": "record", "version": version, "data": data.decode("utf-8"),
          "partition_key": partition_key, "sequence_number": sequence_number,
          "sub_sequence_number": sub_sequence_number,
          "approximate_arrival_timestamp": timestamp})


def checkpoint(checkpointer, sequence_number=None, sub_sequence_number=None):
    """Checkpoint and log the outcome: the error is the Java exception name the daemon sent."""
    try:
        checkpointer.checkpoint(sequence_number, sub_sequence_number)
    except CheckpointError as exc:
        emit({"event": "checkpoint", "sequence_number": sequence_number, "error": exc.value})
    else:
        emit({"event": "checkpoint", "sequence_number": sequence_number, "error": None})


def act(data, checkpointer, sequence_number, sub_sequence_number):
    command, _, argument = data.decode("utf-8").partition(" ")
    if command == "crash":
        _crash()
    elif command == "crash-once":
        marker = os.environ["KCLPY_TEST_OUTPUT"] + ".crashed"
        if not os.path.exists(marker):
            open(marker, "w").close()
            _crash()
    elif command == "hang":
        time.sleep(3600)
    elif command == "garbage":
        sys.stdout.write("this is not a protocol message\n")
        sys.stdout.flush()
    elif command == "stderr":
        sys.stderr.write(argument + "\n")
        sys.stderr.flush()
    elif command == "checkpoint-last":
        checkpoint(checkpointer)
    elif command == "checkpoint":
        if argument:
            checkpoint(checkpointer, argument, 0)
        else:
            checkpoint(checkpointer, sequence_number, sub_sequence_number)
