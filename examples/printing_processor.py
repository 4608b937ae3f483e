"""The example processor: prints every record and checkpoints after each batch.

Run it on the embedded local endpoint (no AWS account needed):

    kclpy-worker --local --processor examples/printing_processor.py:PrintingProcessor \
        --stop-when-caught-up

or against a real stream:

    kclpy-worker --stream-name my-stream --application-name my-app \
        --processor examples/printing_processor.py:PrintingProcessor
"""

from __future__ import annotations

import sys

import kclpy


def say(line: str) -> None:
    """One write per line: processors of different shards print from different threads, and
    print() writes the text and the newline separately, so lines could interleave."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


class PrintingProcessor(kclpy.IRecordProcessor):
    def initialize(self, initialize_input: kclpy.InitializeInput) -> None:
        self.shard_id = initialize_input.shard_id
        say(f"[{self.shard_id}] starting after checkpoint {initialize_input.sequence_number}")

    def process_records(self, process_records_input: kclpy.ProcessRecordsInput) -> None:
        for record in process_records_input.records:
            payload = record.binary_data.decode("utf-8", errors="replace")
            say(f"[{self.shard_id}] {record.sequence_number}/{record.sub_sequence_number} "
                f"key={record.partition_key} data={payload}")
        # At-least-once: checkpoint only after the whole batch was handled.
        process_records_input.checkpointer.checkpoint()

    def lease_lost(self, lease_lost_input: kclpy.LeaseLostInput) -> None:
        say(f"[{self.shard_id}] lease lost; another worker continues")

    def shard_ended(self, shard_ended_input: kclpy.ShardEndedInput) -> None:
        say(f"[{self.shard_id}] shard ended")
        shard_ended_input.checkpointer.checkpoint()

    def shutdown_requested(self, shutdown_requested_input: kclpy.ShutdownRequestedInput) -> None:
        say(f"[{self.shard_id}] shutting down")
        shutdown_requested_input.checkpointer.checkpoint()
