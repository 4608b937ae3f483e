"""An amazon_kclpy v3 processor (``amazon_kclpy.v3.processor.RecordProcessorBase``): one
callback per way a shard's processing ends."""

import _behaviour
from amazon_kclpy import kcl
from amazon_kclpy.v3 import processor


class V3Processor(processor.RecordProcessorBase):
    def initialize(self, initialize_input):
        _behaviour.SHARD = initialize_input.shard_id
        _behaviour.emit({"event": "initialize", "version": 3,
                         "shard_id": initialize_input.shard_id,
                         "sequence_number": initialize_input.sequence_number,
                         "sub_sequence_number": initialize_input.sub_sequence_number})

    def process_records(self, process_records_input):
        records = process_records_input.records
        _behaviour.emit({"event": "batch", "version": 3, "count": len(records),
                         "millis_behind_latest": process_records_input.millis_behind_latest})
        for rec in records:
            _behaviour.record(3, rec.binary_data, rec.partition_key, rec.sequence_number,
                              rec.sub_sequence_number, rec.timestamp_millis)
            _behaviour.act(rec.binary_data, process_records_input.checkpointer,
                           rec.sequence_number, rec.sub_sequence_number)

    def lease_lost(self, lease_lost_input):
        _behaviour.emit({"event": "lease_lost", "version": 3})

    def shard_ended(self, shard_ended_input):
        _behaviour.emit({"event": "shard_ended", "version": 3})
        _behaviour.checkpoint(shard_ended_input.checkpointer)

    def shutdown_requested(self, shutdown_requested_input):
        _behaviour.emit({"event": "shutdown_requested", "version": 3})
        _behaviour.checkpoint(shutdown_requested_input.checkpointer)


if __name__ == "__main__":
    kcl.KCLProcess(V3Processor()).run()
