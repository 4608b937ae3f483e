"""The example processor: prints every record and checkpoints after each batch.

Run it on the embedded local endpoint (no AWS account needed):

    kclpy-worker --local --processor examples/printing_processor.py:PrintingProcessor \
        --stop-when-caught-up

or against a real stream:

    kclpy-worker --stream-name my-stream --application-name my-app \
        --processor examples/printing_processor.py:PrintingProcessor
"""

from __future__ import annotations

import kclpy


class PrintingProcessor(kclpy.IRecordProcessor):
    def initialize(self, initialize_input: kclpy.InitializeInput) -> None:
        self.shard_id = initialize_input.shard_id
        print(f"[{self.shard_id}] starting after checkpoint {initialize_input.sequence_number}",
              flush=True)

    def process_records(self, process_records_input: kclpy.ProcessRecordsInput) -> None:
        for record in process_records_input.records:
            payload = record.binary_data.decode("utf-8", errors="replace")
            print(f"[{self.shard_id}] {record.sequence_number}/{record.sub_sequence_number} "
                  f"key={record.partition_key} data={payload}", flush=True)
        # At-least-once: checkpoint only after the whole batch was handled.
        process_records_input.checkpointer.checkpoint()

    def lease_lost(self, lease_lost_input: kclpy.LeaseLostInput) -> None:
        print(f"[{self.shard_id}] lease lost; another worker continues", flush=True)

    def shard_ended(self, shard_ended_input: kclpy.ShardEndedInput) -> None:
        print(f"[{self.shard_id}] shard ended", flush=True)
        shard_ended_input.checkpointer.checkpoint()

    def shutdown_requested(self, shutdown_requested_input: kclpy.ShutdownRequestedInput) -> None:
        print(f"[{self.shard_id}] shutting down", flush=True)
        shutdown_requested_input.checkpointer.checkpoint()
