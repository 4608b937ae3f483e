"""Runs at the start of a chaos worker process whose ``PYTHONPATH`` names this folder: its wall
clock (``time.time``, ``time.time_ns``) runs ``$KCLPY_TEST_CLOCK_SKEW_S`` seconds ahead of the
host's (negative: behind), as a host whose NTP is off would. Monotonic clocks are left alone,
as NTP leaves them; so are ``datetime.now`` and request signing, which kclpy's reading does
not use. Says so on stderr, so the run's log shows which workers were skewed."""

import os
import sys
import time

_SKEW_S = float(os.environ.get("KCLPY_TEST_CLOCK_SKEW_S") or 0.0)

if _SKEW_S:
    _time, _time_ns = time.time, time.time_ns
    time.time = lambda: _time() + _SKEW_S
    time.time_ns = lambda: _time_ns() + round(_SKEW_S * 1e9)
    print(f"kclpy test: this process's wall clock is skewed by {_SKEW_S:+.1f} s",
          file=sys.stderr, flush=True)
