"""An amazon_kclpy v1 processor (``amazon_kclpy.kcl.RecordProcessorBase``): records are read as
dicts with camelCase keys and shutdown gets a reason string."""

import base64

import _behaviour
from amazon_kclpy import kcl


class V1Processor(kcl.RecordProcessorBase):
    def initialize(self, shard_id):
        _behaviour.SHARD = shard_id
        _behaviour.emit({"event": "initialize", "version": 1, "shard_id": shard_id})

    def process_records(self, records, checkpointer):
        _behaviour.emit({"event": "batch", "version": 1, "count": len(records)})
        for rec in records:
            data = base64.b64decode(rec["data"])
            _behaviour.record(1, data, rec["partitionKey"], rec["sequenceNumber"],
                              rec["subSequenceNumber"], rec["approximateArrivalTimestamp"])
            _behaviour.act(data, checkpointer, rec["sequenceNumber"], rec["subSequenceNumber"])

    def shutdown(self, checkpointer, reason):
        _behaviour.emit({"event": "shutdown", "version": 1, "reason": reason})
        if reason == "TERMINATE":
            _behaviour.checkpoint(checkpointer)

    def shutdown_requested(self, checkpointer):
        _behaviour.emit({"event": "shutdown_requested", "version": 1})
        _behaviour.checkpoint(checkpointer)


if __name__ == "__main__":
    kcl.KCLProcess(V1Processor()).run()
