"""A DynamoDB client whose answer to one chosen write arrives late: the write lands at once,
the caller hears of it only when the test says so. What a throttled retry or a latency spike
looks like to a worker, controlled by the test instead of by a clock."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import boto3

Match = Callable[[str, dict[str, Any]], bool]


class LateAnswers:
    """Wraps a botocore client. ``hold(match)`` arms it: the next call for which
    ``match(operation, params)`` is true is sent at once, and its answer is handed back only
    after ``release()``."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self._lock = threading.Lock()
        self._match: Match | None = None
        #: set once the held call's write has landed (its answer is being held)
        self.landed = threading.Event()
        self._answer = threading.Event()

    def hold(self, match: Match) -> None:
        with self._lock:
            self._match = match
            self.landed.clear()
            self._answer.clear()

    def release(self) -> None:
        self._answer.set()

    def __getattr__(self, name: str) -> Any:
        real = getattr(self._client, name)
        if not callable(real) or name.startswith("_") or name in {"can_paginate",
                                                                  "get_paginator"}:
            return real
        operation = "".join(part.title() for part in name.split("_"))

        def call(**params: Any) -> Any:
            with self._lock:
                held = self._match is not None and self._match(operation, params)
                if held:
                    self._match = None
            result = real(**params)
            if held:
                self.landed.set()
                self._answer.wait(120)
            return result

        return call


def checkpoint_write(operation: str, params: dict[str, Any]) -> bool:
    """The lease item's checkpoint update (not a renewal or a take)."""
    names = params.get("ExpressionAttributeNames", {})
    return operation == "UpdateItem" and "checkpoint" in names.values()


class LateSession(boto3.session.Session):
    """A session whose DynamoDB clients are wrapped in ``LateAnswers`` (``clients``)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.late: list[LateAnswers] = []

    def client(self, service_name: str, *args: Any, **kwargs: Any) -> Any:
        client = super().client(service_name, *args, **kwargs)  # type: ignore[call-overload]
        if service_name != "dynamodb":
            return client
        wrapped = LateAnswers(client)
        self.late.append(wrapped)
        return wrapped
