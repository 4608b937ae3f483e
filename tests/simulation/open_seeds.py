"""The default seeds (0-999) that still break an invariant on the code with the fixes of the
edge review of 2026-12-06 merged, and with the simulated Kinesis stamping its answers with a
``Date`` header as AWS does: seed -> the invariants it breaks (263 broke on fd986fc, before
the fixes; FOUND.md, "After the fixes were merged"). Generated from
``python -m tests.simulation --histories 1000 --seed 0``; ``tests/test_simulation.py`` keeps
the soak green while they are open, and fails when a seed breaks anything else or no longer
breaks (then take it out: its hole was fixed). Regenerate it after a fix is merged.
"""

from __future__ import annotations

OPEN_36: dict[int, frozenset[str]] = {
    173: frozenset({'exactly-once'}),
    244: frozenset({'liveness'}),
    312: frozenset({'liveness', 'operator-replay'}),
    325: frozenset({'liveness'}),
    341: frozenset({'exactly-once'}),
    368: frozenset({'liveness'}),
    403: frozenset({'exactly-once', 'liveness'}),
    405: frozenset({'liveness'}),
    559: frozenset({'exactly-once'}),
    561: frozenset({'exactly-once'}),
    617: frozenset({'exactly-once'}),
    706: frozenset({'operator-partial'}),
    970: frozenset({'liveness'}),
    971: frozenset({'operator-replay'}),
    994: frozenset({'liveness'}),
}
