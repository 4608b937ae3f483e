"""Operating a consumer: the worker's HTTP endpoint, lag status, and the ``kclpy`` inspector.

See docs/operations.md for the metrics, the status rules and alerting suggestions.
"""

from kclpy.ops.server import RunningServer, serve_worker

__all__ = ["RunningServer", "serve_worker"]
