"""Every AWS operation kclpy's own code makes in a test run, checked against docs/iam.md.

The role runs of ``tests/system/test_iam.py`` record a few representative runs through a proxy; this
records the rest: every test of the suite, unit and integration, that runs kclpy code in the
pytest process. Each botocore call is attributed to the first caller outside botocore and
boto3: a call from ``kclpy`` (not ``kclpy/local``, which only ever talks to an emulator) is
recorded with the module that made it, a call a test makes itself (creating a stream,
producing records, reading a lease table to assert on it) is not, since no role of
kclpy's makes it. At the end of the run ``conftest.py`` fails the run if one of the recorded
operations is allowed by no documented policy.

What runs in child processes (the chaos fleets' workers, Spark executors) is not seen here:
the proxy-recorded role runs and the static scan of the code cover those paths.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterable, Mapping
from types import FrameType
from typing import Any

from botocore.client import BaseClient

from tests.support.iam import Statement, actions_of, not_allowed_anywhere

#: (service, operation) -> the kclpy module that made it first
Recorded = dict[tuple[str, str], str]

_seen: Recorded = {}
_lock = threading.Lock()
_FOREIGN = ("botocore", "boto3", __name__)


def kclpy_caller(frame: FrameType | None) -> str | None:
    """The module of the first frame outside botocore, boto3 and this recorder, when it is
    kclpy's own (``kclpy/local`` excepted); None for a call a test or a library makes."""
    while frame is not None:
        module = str(frame.f_globals.get("__name__", ""))
        if not module.startswith(_FOREIGN):
            if module == "kclpy" or module.startswith("kclpy."):
                return None if module.startswith("kclpy.local") else module
            return None
        frame = frame.f_back
    return None


def install() -> None:
    """Record from now on, in this process (idempotent: each xdist worker installs once)."""
    original = BaseClient._make_api_call  # type: ignore[attr-defined]
    if getattr(original, "kclpy_records", False):
        return

    def recording(client: BaseClient, operation_name: str, api_params: Mapping[str, Any]) -> Any:
        caller = kclpy_caller(sys._getframe(1))
        if caller is not None:
            key = (client.meta.service_model.service_name, operation_name)
            with _lock:
                _seen.setdefault(key, caller)
        return original(client, operation_name, api_params)

    recording.kclpy_records = True  # type: ignore[attr-defined]
    BaseClient._make_api_call = recording  # type: ignore[attr-defined]


def recorded() -> Recorded:
    with _lock:
        return dict(_seen)


def dump() -> list[list[str]]:
    """The recorded calls as plain lists, for a worker's ``workeroutput``."""
    return [[service, operation, caller]
            for (service, operation), caller in sorted(recorded().items())]


def merge(rows: Iterable[Iterable[str]]) -> None:
    """Add what an xdist worker recorded to this (the controller's) record."""
    with _lock:
        for service, operation, caller in rows:
            _seen.setdefault((service, operation), caller)


#: actions kclpy may call that no policy of docs/iam.md grants, each named in the page with
#: the reason: a call whose refusal changes nothing but a hint, or one the caller's own
#: principal needs outside kclpy's policies
GRANTED_ELSEWHERE = {
    "kinesis:ListStreams": "optional: a stream name that does not exist gets a 'did you "
                           "mean'; refused, the error has no suggestion",
    "sts:AssumeRole": "the Spark source's roleArn: the cluster's own principal is allowed to "
                      "assume the role that has spark-source",
}


def not_allowed(calls: Recorded, policies: Mapping[str, tuple[Statement, ...]]) -> list[str]:
    """One line per recorded call that needs an action no policy allows (and that
    ``GRANTED_ELSEWHERE`` does not name), naming the module that made it."""
    lines = []
    for (service, operation), caller in sorted(calls.items()):
        missing = [action for action in not_allowed_anywhere(
            policies, actions_of(service, operation)) if action not in GRANTED_ELSEWHERE]
        if missing:
            lines.append(f"{service}:{operation} (made by {caller}) needs "
                         f"{', '.join(missing)}, which no policy in docs/iam.md allows")
    return lines
