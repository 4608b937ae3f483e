"""An amazon_kclpy v2 processor (``amazon_kclpy.v2.processor.RecordProcessorBase``): input
objects, Record objects, and one ``shutdown`` with a reason."""

import _behaviour
from amazon_kclpy import kcl
from amazon_kclpy.v2 import processor


class V2Processor(processor.RecordProcessorBase):
    def initialize(self, initialize_input):
        _behaviour.SHARD = initialize_input.shard_id
        _behaviour.emit({"event": "initialize", "version": 2,
                         "shard_id": initialize_input.shard_id,
                         "sequence_number": initialize_input.sequence_number,
                         "sub_sequence_number": initialize_input.sub_sequence_number})

    def process_records(self, process_records_input):
        records = process_records_input.records
        _behaviour.emit({"event": "batch", "version": 2, "count": len(records),
                         "millis_behind_latest": process_records_input.millis_behind_latest})
        for rec in records:
            _behaviour.record(2, rec.binary_data, rec.partition_key, rec.sequence_number,
                              rec.sub_sequence_number, rec.timestamp_millis)
            _behaviour.act(rec.binary_data, process_records_input.checkpointer,
                           rec.sequence_number, rec.sub_sequence_number)

    def shutdown(self, shutdown_input):
        _behaviour.emit({"event": "shutdown", "version": 2, "reason": shutdown_input.reason})
        if shutdown_input.reason == "TERMINATE":
            _behaviour.checkpoint(shutdown_input.checkpointer)

    def shutdown_requested(self, shutdown_requested_input):
        _behaviour.emit({"event": "shutdown_requested", "version": 2})
        _behaviour.checkpoint(shutdown_requested_input.checkpointer)


if __name__ == "__main__":
    kcl.KCLProcess(V2Processor()).run()
