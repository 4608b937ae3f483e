"""The default seeds (0-999) that break an invariant on fd986fc, the code before the fixes of
the holes the grown world found (issue 36): seed -> the invariants it breaks. Generated from
``python -m tests.simulation --histories 1000 --seed 0``; ``tests/test_simulation.py`` keeps
the soak green while they are open, and fails when a seed breaks anything else or no longer
breaks (then take it out: its hole was fixed). Regenerate it after a fix is merged.
"""

from __future__ import annotations

OPEN_36: dict[int, frozenset[str]] = {
}
