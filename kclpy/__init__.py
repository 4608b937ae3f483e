"""kclpy: a pure-Python Kinesis Client Library.

The public API is what ``__all__`` lists; every other module may change between releases.
"""

from typing import TYPE_CHECKING

from kclpy.checkpoint import Checkpointer
from kclpy.config import KCLConfig
from kclpy.errors import (
    CheckpointError,
    ConfigError,
    InvalidStateException,
    KCLError,
    KinesisClientLibDependencyException,
    ProcessorRestartRequired,
    ShutdownException,
    ThrottlingException,
    TransactionRejected,
)
from kclpy.metrics import Metrics
from kclpy.processor import (
    InitializeInput,
    IRecordProcessor,
    LeaseLostInput,
    ProcessRecordsInput,
    RecordProcessor,
    RecordProcessorBase,
    ShardEndedInput,
    ShutdownReason,
    ShutdownRequestedInput,
)
from kclpy.records import Record
from kclpy.streams import StreamConfig, StreamTracker
from kclpy.telemetry import Backend as MetricsBackend

if TYPE_CHECKING:
    from kclpy.state import register_store
    from kclpy.state.dynamodb import DynamoDBStateStore
    from kclpy.state.processor import StatefulProcessor
    from kclpy.state.sql import SQLStateStore, StateStoreUnavailable
    from kclpy.state.store import StateStore
    from kclpy.state.transaction import StateTransaction, TransactionTooLarge
    from kclpy.worker import Worker, WorkerFatalError

__version__ = "0.1.0"


#: exactly-once state, imported on first use like the worker
_STATE = {
    "DynamoDBStateStore": "kclpy.state.dynamodb",
    "StatefulProcessor": "kclpy.state.processor",
    "SQLStateStore": "kclpy.state.sql",
    "StateStoreUnavailable": "kclpy.state.sql",
    "StateStore": "kclpy.state.store",
    "register_store": "kclpy.state",
    "StateTransaction": "kclpy.state.transaction",
    "TransactionTooLarge": "kclpy.state.transaction",
}


def __getattr__(name: str) -> object:
    # The worker pulls in boto3 clients, leases and retrieval; a Spark executor or a tool
    # that only needs Record and the processor API should not pay for importing them.
    if name in ("Worker", "WorkerFatalError"):
        from kclpy import worker

        return getattr(worker, name)
    if name in _STATE:
        import importlib

        return getattr(importlib.import_module(_STATE[name]), name)
    raise AttributeError(f"module 'kclpy' has no attribute {name!r}")

__all__ = [
    "CheckpointError",
    "Checkpointer",
    "ConfigError",
    "DynamoDBStateStore",
    "IRecordProcessor",
    "InitializeInput",
    "InvalidStateException",
    "KCLConfig",
    "KCLError",
    "KinesisClientLibDependencyException",
    "LeaseLostInput",
    "Metrics",
    "MetricsBackend",
    "ProcessRecordsInput",
    "ProcessorRestartRequired",
    "Record",
    "RecordProcessor",
    "RecordProcessorBase",
    "SQLStateStore",
    "ShardEndedInput",
    "ShutdownException",
    "ShutdownReason",
    "ShutdownRequestedInput",
    "StateStore",
    "StateStoreUnavailable",
    "StateTransaction",
    "StatefulProcessor",
    "StreamConfig",
    "StreamTracker",
    "ThrottlingException",
    "TransactionRejected",
    "TransactionTooLarge",
    "Worker",
    "WorkerFatalError",
    "__version__",
    "register_store",
]
