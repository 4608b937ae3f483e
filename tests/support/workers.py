"""Run a real Worker on a thread for the length of a ``with`` block."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from kclpy import Worker


@contextmanager
def running(worker: Worker) -> Iterator[Worker]:
    """Run ``worker``; on exit shut it down, and fail the test if it did not stop or if
    ``run()`` raised."""
    errors: list[BaseException] = []

    def target() -> None:
        try:
            worker.run(install_signal_handlers=False)
        except BaseException as exc:  # surfaced to the test below
            errors.append(exc)

    thread = threading.Thread(target=target, name="test-worker", daemon=True)
    thread.start()
    try:
        yield worker
    finally:
        worker.shutdown()
        thread.join(60)
        assert not thread.is_alive(), "worker did not stop"
    assert not errors, errors
