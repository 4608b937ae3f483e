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
from kclpy.leases.assignment import (
    AssignmentStrategy,
    FleetView,
    TakerView,
    assignment_strategy,
    register_assignment_strategy,
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
from kclpy.retrieval.modes import (
    RetrievalContext,
    RetrievalMode,
    register_retrieval_mode,
    retrieval_mode,
)
from kclpy.retrieval.source import PageSource
from kclpy.streams import StreamConfig, StreamTracker
from kclpy.telemetry import Backend as MetricsBackend

if TYPE_CHECKING:
    from kclpy.state import register_store
    from kclpy.state.dynamodb import DynamoDBStateStore
    from kclpy.state.processor import StatefulProcessor
    from kclpy.state.sql import SQLStateStore, StateStoreUnavailable
    from kclpy.state.store import PositionKeepingStore, StateStore
    from kclpy.state.transaction import DELETED as STATE_DELETED
    from kclpy.state.transaction import Limits as StateLimits
    from kclpy.state.transaction import StateTransaction, TransactionTooLarge, Versioned
    from kclpy.worker import Worker, WorkerFatalError

__version__ = "0.1.0"


#: exactly-once state, imported on first use like the worker: a public name -> its module,
#: or ``module:name`` where the module's own name would say too little at the top level
_STATE = {
    "DynamoDBStateStore": "kclpy.state.dynamodb",
    "StatefulProcessor": "kclpy.state.processor",
    "SQLStateStore": "kclpy.state.sql",
    "StateStoreUnavailable": "kclpy.state.sql",
    "StateStore": "kclpy.state.store",
    "PositionKeepingStore": "kclpy.state.store",
    "register_store": "kclpy.state",
    "StateTransaction": "kclpy.state.transaction",
    "TransactionTooLarge": "kclpy.state.transaction",
    "StateLimits": "kclpy.state.transaction:Limits",
    "STATE_DELETED": "kclpy.state.transaction:DELETED",
    "Versioned": "kclpy.state.transaction",
}


def __getattr__(name: str) -> object:
    # The worker pulls in boto3 clients, leases and retrieval; a Spark executor or a tool
    # that only needs Record and the processor API should not pay for importing them.
    if name in ("Worker", "WorkerFatalError"):
        from kclpy import worker

        return getattr(worker, name)
    if name in _STATE:
        import importlib

        module, _, attribute = _STATE[name].partition(":")
        return getattr(importlib.import_module(module), attribute or name)
    raise AttributeError(f"module 'kclpy' has no attribute {name!r}")

__all__ = [
    "STATE_DELETED",
    "AssignmentStrategy",
    "CheckpointError",
    "Checkpointer",
    "ConfigError",
    "DynamoDBStateStore",
    "FleetView",
    "IRecordProcessor",
    "InitializeInput",
    "InvalidStateException",
    "KCLConfig",
    "KCLError",
    "KinesisClientLibDependencyException",
    "LeaseLostInput",
    "Metrics",
    "MetricsBackend",
    "PageSource",
    "PositionKeepingStore",
    "ProcessRecordsInput",
    "ProcessorRestartRequired",
    "Record",
    "RecordProcessor",
    "RecordProcessorBase",
    "RetrievalContext",
    "RetrievalMode",
    "SQLStateStore",
    "ShardEndedInput",
    "ShutdownException",
    "ShutdownReason",
    "ShutdownRequestedInput",
    "StateLimits",
    "StateStore",
    "StateStoreUnavailable",
    "StateTransaction",
    "StatefulProcessor",
    "StreamConfig",
    "StreamTracker",
    "TakerView",
    "ThrottlingException",
    "TransactionRejected",
    "TransactionTooLarge",
    "Versioned",
    "Worker",
    "WorkerFatalError",
    "__version__",
    "assignment_strategy",
    "register_assignment_strategy",
    "register_retrieval_mode",
    "register_store",
    "retrieval_mode",
]
