"""Which dependency releases this run has: the committed lock's, or others (the newest).

The README's test command installs through ``.ci/constraints.txt`` so that an upstream release
cannot turn a newcomer's run red; a run without it tries the newest releases. The run's header
says which of the two it is, so a failure report tells by itself what was installed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from packaging.requirements import Requirement

LOCK = Path(__file__).resolve().parents[2] / ".ci" / "constraints.txt"


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(lock: Path = LOCK) -> dict[str, str]:
    """Distribution (canonical name) -> locked version, for pins that apply to this Python."""
    found: dict[str, str] = {}
    for line in lock.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        requirement = Requirement(line)
        if requirement.marker is not None and not requirement.marker.evaluate():
            continue
        (specifier,) = requirement.specifier
        found[canonical(requirement.name)] = specifier.version
    return found


@dataclass(frozen=True)
class LockStatus:
    locked: int
    differ: list[tuple[str, str, str | None]]

    def header(self) -> str:
        if not self.differ:
            return (f"dependencies: the committed lock ({LOCK.parent.name}/{LOCK.name}), "
                    f"all {self.locked} pins as locked")
        shown = ", ".join(f"{name} {have or 'absent'} (lock {want})"
                          for name, want, have in self.differ[:6])
        more = f", and {len(self.differ) - 6} more" if len(self.differ) > 6 else ""
        return (f"dependencies: NOT the committed lock ({LOCK.parent.name}/{LOCK.name}): "
                f"{len(self.differ)} of {self.locked} pins differ: {shown}{more}")


def status(lock: Path = LOCK) -> LockStatus:
    differ: list[tuple[str, str, str | None]] = []
    locked = pins(lock)
    for name, want in sorted(locked.items()):
        try:
            have: str | None = version(name)
        except PackageNotFoundError:
            have = None
        if have != want:
            differ.append((name, want, have))
    return LockStatus(len(locked), differ)

