"""Import what a ``module:name`` or ``path/to/file.py:name`` spec names.

Processors (``--processor``), Spark hooks (``--spark-batch``, ``--spark-decode``) are given
this way; a spec that does not load is a configuration error naming the option.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

from kclpy.errors import ConfigError, closest


def current_folder_last() -> None:
    """Put the current folder on ``sys.path`` after the installed packages.

    ``--processor mypkg.audit:Printer`` run from the folder holding ``mypkg/`` imports it,
    as ``python -m`` and uvicorn do. But a folder is not always the user's own (a shared
    upload folder, a checkout of someone else's branch): first on the path, any ``moto.py``
    or ``json.py`` planted there would run inside the worker in place of the real package.
    Last, it can only add modules, never replace an installed one."""
    cwd = os.getcwd()
    here = {"", ".", cwd, os.path.realpath(cwd)}
    sys.path[:] = [entry for entry in sys.path if entry not in here]
    sys.path.append(cwd)


class _NotFound(Exception):
    """The spec names a file that is not there."""


def _import_failure(module_name: str, exc: BaseException) -> str:
    """Why ``module_name`` did not import. An error raised by the module's own code (a
    Worker run at import time, say) is told apart from the CLI's own configuration errors,
    which it would otherwise look like."""
    if isinstance(exc, ModuleNotFoundError) and exc.name and module_name.startswith(exc.name):
        return (f"cannot import {module_name!r}: no module named {exc.name!r} "
                f"(looked in the current folder and on sys.path)")
    detail = str(exc) if isinstance(exc, ConfigError) else f"{type(exc).__name__}: {exc}"
    hint = ""
    if isinstance(exc, (ConfigError, SystemExit)):
        hint = ("; does the module run a Worker when imported? Keep that under "
                "`if __name__ == \"__main__\":`")
    return f"importing {module_name!r} raised {detail}{hint}"


def load_object(spec: str, option: str, *, base_dir: Path | None = None) -> Any:
    """The object ``spec`` names; ConfigError naming ``option`` when it cannot be loaded."""
    module_name, sep, name = spec.rpartition(":")
    if not sep or not module_name or not name:
        raise ConfigError(option, f"{spec!r} is not of the form module:name")
    try:
        if module_name.endswith(".py") or "/" in module_name:
            path = Path(module_name)
            if not path.is_absolute() and base_dir is not None:
                path = base_dir / path
            module_spec = importlib.util.spec_from_file_location(path.stem, path)
            if module_spec is None or module_spec.loader is None or not path.is_file():
                raise _NotFound(f"no such file {str(path)!r}")
            module = importlib.util.module_from_spec(module_spec)
            sys.modules.setdefault(path.stem, module)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except _NotFound as exc:
        raise ConfigError(option, str(exc)) from None
    except (Exception, SystemExit) as exc:
        raise ConfigError(option, _import_failure(module_name, exc)) from None
    target = getattr(module, name, None)
    if target is None:
        close = closest(name, [attr for attr in vars(module) if not attr.startswith("_")])
        hint = f" (did you mean {module_name}:{close}?)" if close else ""
        raise ConfigError(option, f"{module_name!r} has no attribute {name!r}{hint}")
    return target
