"""Timing helpers shared by the benchmarks.

The machine these run on is shared and noisy. So the clock is this process's CPU time
(time spent descheduled while other processes run is not ours to count), every figure is a
median of several repetitions, and each kclpy repetition runs right next to a baseline
repetition, so what noise remains (caches, frequency) hits both sides of a ratio.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# `python bench/x.py` from a checkout puts bench/ on sys.path, not the repository root; the
# benchmarks measure the working tree's kclpy, installed or not.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

Setup = Callable[[], Any]
Run = Callable[[Any], object]


@dataclass(frozen=True)
class Figure:
    name: str
    items: int
    kclpy_s: float
    baseline_s: float

    @property
    def ratio(self) -> float:
        return self.baseline_s / self.kclpy_s

    def line(self, unit: str, baseline_name: str) -> str:
        return (
            f"{self.name}: kclpy {self.items / self.kclpy_s:,.0f} {unit}/s "
            f"({self.kclpy_s * 1000:.1f} ms), {baseline_name} "
            f"{self.items / self.baseline_s:,.0f} {unit}/s ({self.baseline_s * 1000:.1f} ms), "
            f"ratio {self.ratio:.1f}x"
        )


def _once(setup: Setup, run: Run) -> float:
    arg = setup()
    gc.collect()
    started = time.process_time()
    run(arg)
    return time.process_time() - started


def compare(name: str, items: int, kclpy: tuple[Setup, Run], baseline: tuple[Setup, Run],
            repetitions: int) -> Figure:
    """Median seconds per run of each side; setup (fresh inputs) is not timed."""
    # Warm-up, untimed: the first runs pay for growing the process's heap.
    for _ in range(3):
        _once(*kclpy)
        _once(*baseline)
    ours: list[float] = []
    theirs: list[float] = []
    for _ in range(repetitions):
        ours.append(_once(*kclpy))
        theirs.append(_once(*baseline))
    return Figure(name, items, statistics.median(ours), statistics.median(theirs))
