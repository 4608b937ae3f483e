"""A PATH without some programs: what a machine that lacks them looks like to a child.

Programs such as ``java`` or ``node`` sit in /usr/bin beside everything else, so no PATH of
real folders can leave them out; this builds one folder that links every other program.
"""

from __future__ import annotations

import os
from collections.abc import Collection
from pathlib import Path


def path_without(folder: Path, path: str, programs: Collection[str]) -> str:
    """A PATH (one folder, made in ``folder``) with every program on ``path`` but
    ``programs``; the first of two programs of one name wins, as on ``path``."""
    folder.mkdir(parents=True, exist_ok=True)
    for directory in path.split(os.pathsep):
        if not directory or not os.path.isdir(directory):
            continue
        for entry in sorted(os.listdir(directory)):
            link = folder / entry
            target = Path(directory) / entry
            if entry in programs or link.exists() or link.is_symlink():
                continue
            if target.is_file() and os.access(target, os.X_OK):
                link.symlink_to(target)
    return str(folder)
