"""Exceptions a processor or an operator can meet, named as the Java KCL names them.

amazon_kclpy applications catch these names (via the MultiLangDaemon reply strings), so
the class names are part of the public contract and must not change.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any


class KCLError(Exception):
    """Base class of every error kclpy raises on purpose, so that one ``except`` tells them
    from bugs and SDK errors. Control-flow signals that never leave the package raising them
    are not errors and stay outside (docs/errors.md draws the tree and names them)."""


class CheckpointError(KCLError):
    """Base class of the errors a checkpoint call can raise.

    ``name`` is the string the MultiLangDaemon protocol puts in a checkpoint reply.
    """

    name = "CheckpointError"


class ShutdownException(CheckpointError):
    """The lease is no longer held by this worker: the checkpoint was not written."""

    name = "ShutdownException"


class ThrottlingException(CheckpointError):
    """DynamoDB kept throttling after retries; the checkpoint was not written. Retry later."""

    name = "ThrottlingException"


class InvalidStateException(CheckpointError):
    """The requested position is before the last checkpoint or beyond what was delivered."""

    name = "InvalidStateException"


class KinesisClientLibDependencyException(CheckpointError):
    """DynamoDB failed in a way that is neither throttling nor a lost lease."""

    name = "KinesisClientLibDependencyException"


class ConfigError(KCLError):
    """A configuration value is missing or invalid. ``option`` names it as the user wrote it."""

    def __init__(self, option: str, message: str) -> None:
        super().__init__(f"{option}: {message}")
        self.option = option
        self.message = message


class LeaseLostError(KCLError):
    """Internal signal: a conditional write on a lease failed because someone else owns it."""


class LeaseBusy(KCLError):
    """Internal signal: a guard told not to wait (``LeaseFence.guard``'s ``wait``) found the
    lease's lock taken by another write of it, a renewal or a checkpoint on its way. Whoever
    guards several leases at once waits for a lock only while it holds none: a slow answer
    to one lease's write must not hold back the renewals of the others."""


class TransactionRejected(KCLError):
    """A fenced transaction was cancelled by one of the caller's own items (its condition
    failed, or it was invalid); the lease item's condition held, so the lease is still ours.
    ``reasons`` are DynamoDB's ``CancellationReasons``, one per item, the lease item first.
    Here, not with the lease table that raises it, because every state store raises it too
    and a store need not know the lease table."""

    def __init__(self, message: str, reasons: list[dict[str, Any]]) -> None:
        super().__init__(message)
        self.reasons = reasons


class EarlierTransactionLanded(TransactionRejected):
    """The fence wrote nothing of this transaction because an earlier transaction of the
    same tenure, whose answer was lost, was found to have landed: this one was built without
    it. Whoever sent that earlier one may have been replaced since (a processor restarted
    with ``ProcessorRestartRequired``) and its successor never knew it was in doubt, so the
    committer must read back what landed - its position, the values of its keys - before it
    applies anything again; taken for a conflict, records it covered are applied twice."""

    def __init__(self, message: str) -> None:
        super().__init__(message, [])


class ProcessorRestartRequired(KCLError):
    """Raised from a processor callback when the processor cannot go on as it is (e.g. a
    MultiLangDaemon child died). The consumer discards it, makes a new one and resumes from
    the last checkpoint, so the records of the failed batch are delivered again."""


#: AWS error codes that say the caller's identity or permissions are wrong: the same request
#: a second later fails the same way, so start-up stops at once instead of retrying
_UNHEALABLE_CODES = frozenset({
    "UnrecognizedClientException", "InvalidSignatureException", "IncompleteSignature",
    "MissingAuthenticationToken", "InvalidClientTokenId", "SignatureDoesNotMatch",
    "ExpiredTokenException", "ExpiredToken", "AccessDeniedException", "AccessDenied",
})
#: botocore's exceptions of the same kind (by name: kclpy.errors imports no SDK)
_UNHEALABLE_TYPES = frozenset({"NoCredentialsError", "PartialCredentialsError",
                               "CredentialRetrievalError", "ParamValidationError"})


def cannot_heal(exc: BaseException) -> bool:
    """Whether retrying ``exc`` is pointless: missing or rejected credentials, a denied
    permission, a request the SDK refuses to send. Throttling, 5xx and connection errors are
    not of that kind."""
    if type(exc).__name__ in _UNHEALABLE_TYPES:
        return True
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        code = response.get("Error", {}).get("Code")
        return code in _UNHEALABLE_CODES
    return False


def closest(word: str, known: Iterable[str], *, ignore_case: bool = False) -> str | None:
    """The known name ``word`` was most likely meant to be, as it is spelt in ``known``, or
    None when none is close. Every "did you mean" of kclpy (flags, environment variables,
    properties keys, Spark options, stream names, processor classes) asks this one, so they
    all agree on what counts as a near miss."""
    spellings = {(name.lower() if ignore_case else name): name for name in known}
    matches = difflib.get_close_matches(word.lower() if ignore_case else word, list(spellings),
                                        n=1, cutoff=_CLOSE_ENOUGH)
    return spellings[matches[0]] if matches else None


#: difflib's own default: a one- or two-letter slip in a name, not a different word
_CLOSE_ENOUGH = 0.6
