"""Run a worker whose shards feed Spark micro-batches: from Python, or from ``kclpy-worker``.

The worker blocks the calling thread (it owns the signal handlers when that is the main
thread); the batcher runs on its own thread. Order matters on the way out: the worker's
shutdown asks every shard to drain its records through the batcher, so the batcher must
outlive the worker and is stopped only after ``Worker.run`` returned.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, cast

import pyarrow as pa

from kclpy.config import KCLConfig
from kclpy.errors import ConfigError
from kclpy.loading import load_object
from kclpy.metrics import Metrics
from kclpy.progress import reporting_progress, totals
from kclpy.spark.arrow import Decoder
from kclpy.spark.batcher import BatchOptions, ForeachBatch, MicroBatcher
from kclpy.spark.java import ensure_java

__all__ = ["load_callable", "run_spark_batch_worker", "run_worker"]

log = logging.getLogger(__name__)


def run_worker(
    config: KCLConfig,
    foreach_batch: ForeachBatch,
    *,
    spark: Any = None,
    options: BatchOptions | None = None,
    decode: Decoder | None = None,
    metrics: Metrics | None = None,
    on_started: Callable[[Any], None] | None = None,
    progress_interval_s: float = 0,
) -> None:
    """Consume ``config``'s stream, handing micro-batches to ``foreach_batch(df, batch_id)``.

    Blocks until the worker shuts down (SIGTERM/SIGINT on the main thread, or
    ``worker.shutdown()`` from ``on_started``'s argument). ``spark`` defaults to
    ``SparkSession.builder.getOrCreate()``. Raises ``WorkerFatalError`` when the worker or
    the batch loop stopped on an error. ``config.metrics_port`` serves /metrics, /healthz and
    /status as for any worker; ``progress_interval_s`` logs a progress line that often.
    """
    from kclpy.worker import Worker, WorkerFatalError

    if spark is None:
        from pyspark.sql import SparkSession

        ensure_java()
        spark = SparkSession.builder.appName(f"kclpy-{config.application_name}").getOrCreate()
    metrics = metrics or Metrics()
    metrics.register_spark()
    batcher = MicroBatcher(spark, foreach_batch, stream=config.stream_label, options=options,
                           decode=_checked(decode) if decode is not None else None,
                           metrics=metrics)
    worker = Worker(config, batcher.processor_factory, metrics=metrics)
    batcher.on_fatal = lambda exc: worker.shutdown()
    batcher.start()
    try:
        with _serving(worker), reporting_progress(metrics, worker.status, progress_interval_s):
            if on_started is not None:
                on_started(worker)
            worker.run()
    finally:
        batcher.stop()
    if batcher.error is not None:
        raise WorkerFatalError(f"spark batch loop failed: {batcher.error!r}") from batcher.error
    left = totals(metrics).records - batcher.stats.records
    if config.stop_when_caught_up and left > 0:
        # "drain and exit" that did not drain is not a success
        raise WorkerFatalError(
            f"stopped with {left:.0f} record(s) not committed to Spark (foreach_batch or "
            f"the decoder kept failing; see the log): they were not checkpointed and are "
            f"read again at the next start")


def _checked(decode: Decoder) -> Decoder:
    """``decode`` whose result is checked: a decoder written to return a dict per record (an
    easy mistake) fails with what it must return, not with an attribute error deep in the
    batch."""

    def checked(data: pa.BinaryArray) -> pa.Table | pa.RecordBatch:
        result = decode(data)
        if not isinstance(result, (pa.Table, pa.RecordBatch)):
            raise TypeError(f"the decoder (--spark-decode) returned a "
                            f"{type(result).__name__}; it must return a pyarrow.Table with "
                            f"one row per record of the pyarrow.BinaryArray it is given "
                            f"(docs/spark.md, Decoded columns)")
        return result

    return checked


def _serving(worker: Any) -> AbstractContextManager[Any]:
    port = worker.config.metrics_port
    if port is None:
        return nullcontext()
    from kclpy.ops.server import serve_worker

    log.info("serving /metrics, /healthz and /status on %s:%s", worker.config.metrics_host,
             port)
    return serve_worker(worker, worker.config.metrics_host, port,
                        allowed_hosts=(worker.config.ops_allowed_hosts or "").split(","))


def load_callable(spec: str, option: str) -> Callable[..., Any]:
    """Import ``pkg.module:name`` or ``path/to/file.py:name``; ConfigError naming ``option``
    when that fails or the name is not callable."""
    target = load_object(spec, option)
    if not callable(target):
        raise ConfigError(option, f"{spec!r} is not callable")
    return cast("Callable[..., Any]", target)


def run_spark_batch_worker(
    config: KCLConfig,
    foreach_batch_spec: str,
    *,
    decode_spec: str | None = None,
    options: BatchOptions | None = None,
    spark: Any = None,
    progress_interval_s: float = 0,
) -> int:
    """``kclpy-worker --spark-batch pkg.module:function``: the exit code (0 after a clean
    shutdown, 1 after a fatal error).

    Raises ConfigError (naming ``--spark-batch`` or ``--spark-decode``) before anything
    starts when a spec does not import, so the CLI can report it with exit code 2.
    """
    from kclpy.worker import WorkerFatalError

    foreach_batch = load_callable(foreach_batch_spec, "--spark-batch")
    decode = load_callable(decode_spec, "--spark-decode") if decode_spec else None
    try:
        run_worker(config, foreach_batch, spark=spark, options=options, decode=decode,
                   progress_interval_s=progress_interval_s)
    except WorkerFatalError as exc:
        log.error("kclpy spark worker stopped: %s", exc)
        return 1
    return 0
