"""``kclpy monitor``: every application's lag judged from outside, served and alerted on.

A worker judges only the shards it holds (``/status``, ``--lag-webhook``) and ``kclpy
status`` judges once, by hand. A shard nobody holds - parked, or of a fleet that is down -
is in neither: the monitor samples each application's lease table and streams every
interval (``watch``), keeps a sliding window per shard and applies the rules of
``kclpy.ops.lag`` (``service``), and serves the result as a page, a Burrow-style JSON API
and Prometheus metrics (``web``, ``page``), POSTing every status change to the lag webhook.
It only reads: no lease is ever taken or written. docs/operations.md says what it costs.
"""

from kclpy.ops.monitor.service import Monitor, exported_names
from kclpy.ops.monitor.watch import ApplicationWatch, AppView, ShardView
from kclpy.ops.monitor.web import serve_monitor

__all__ = ["AppView", "ApplicationWatch", "Monitor", "ShardView", "exported_names",
           "serve_monitor"]
