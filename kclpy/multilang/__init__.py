"""Run amazon_kclpy applications unchanged: the MultiLangDaemon protocol, without Java.

``multilang_processor_factory(executableName, cwd=<properties folder>, metrics=...)`` gives
the Worker a processor factory; each processor runs the application as a child process for
its shard and talks to it in the JSON-lines protocol of the Java MultiLangDaemon.
"""

from kclpy.errors import ProcessorRestartRequired
from kclpy.multilang.processor import (
    MultiLangChildError,
    MultiLangRecordProcessor,
    StrayStdoutPolicy,
    multilang_processor_factory,
    resolve_command,
)

__all__ = [
    "MultiLangChildError",
    "MultiLangRecordProcessor",
    "ProcessorRestartRequired",
    "StrayStdoutPolicy",
    "multilang_processor_factory",
    "resolve_command",
]
