"""The process table, read from ``/proc``: which processes are still alive, found by pid or
by a string in their command line (a test's own temporary path, so nothing of anyone else's
matches). A zombie counts as gone: it runs nothing and holds nothing but its table entry."""

from __future__ import annotations

from pathlib import Path

_PROC = Path("/proc")


def alive(pid: int) -> bool:
    """``pid`` exists and is not a zombie."""
    try:
        stat = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return False
    # "pid (comm) state ...": comm may hold spaces and parentheses, the state follows the last ")"
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def pids_running(marker: str) -> list[int]:
    """Live processes whose command line contains ``marker``."""
    found = []
    for entry in _PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if marker.encode() in cmdline and alive(int(entry.name)):
            found.append(int(entry.name))
    return sorted(found)
