"""Import what a ``module:name`` or ``path/to/file.py:name`` spec names.

Processors (``--processor``), Spark hooks (``--spark-batch``, ``--spark-decode``) are given
this way; a spec that does not load is a configuration error naming the option.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

from kclpy.errors import ConfigError


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
                raise ConfigError(option, f"no such file {str(path)!r}")
            module = importlib.util.module_from_spec(module_spec)
            sys.modules.setdefault(path.stem, module)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(option, f"cannot import {module_name!r}: {exc}") from None
    target = getattr(module, name, None)
    if target is None:
        raise ConfigError(option, f"{module_name!r} has no attribute {name!r}")
    return target
