"""Secrets kept out of every log line the kclpy commands write.

Credentials are never logged (docs/security.md), but kclpy does not write every log line:
at DEBUG, botocore prints request headers (the session token travels in
``X-Amz-Security-Token``), hpack prints every header it encodes for enhanced fan-out, and an
exception's message may carry a URL with its password. So the commands do not rely on each
call site being careful: :func:`configure_logging` puts a :class:`RedactingFilter` on the
handlers they log through, which scrubs every record whatever logger it came from, and
keeps the loggers known to print credentials at INFO or above.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable

#: what a secret is replaced by
MASK = "***"

#: loggers that print credentials at DEBUG: request headers and canonical requests (the AWS
#: SDK and its HTTP stack), header blocks of HTTP/2 streams (hpack, h2: enhanced fan-out)
CREDENTIAL_LEAKING_LOGGERS = ("botocore", "boto3", "urllib3", "s3transfer", "hpack", "h2",
                              "httpcore", "httpx")

#: environment variables whose values are secrets wherever they appear
SECRET_ENVIRONMENT = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN",
                      "KCLPY_LAG_WEBHOOK", "KCLPY_STATE_STORE")

#: ``scheme://user:password@host``: the user information of any URL
_USERINFO = re.compile(r"(?P<keep>\b[A-Za-z][A-Za-z0-9+.-]*://)[^/\s@'\"]+@")
#: a header or query parameter that carries a credential, with its value
_CREDENTIAL_FIELD = re.compile(
    r"(?P<keep>(?i:x-amz-security-token|authorization|x-amz-signature|signature)"
    r"['\"]?\s*[:=,]\s*b?['\"]?)[^'\"\s,&}]+")
#: values shorter than this are not taken for secrets (an empty or one-letter value would
#: mask every occurrence of an ordinary character)
_SHORTEST_SECRET = 6

_known: set[str] = set()


def add_secrets(values: Iterable[str | None]) -> None:
    """Mask these values (a resolved credential, a configured URL) in every record from now
    on, and each URL's password on its own too."""
    for value in values:
        if value and len(value) >= _SHORTEST_SECRET:
            _known.add(value)
            password = re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://[^/\s@:]*:([^/\s@]+)@", value)
            if password and len(password.group(1)) >= _SHORTEST_SECRET:
                _known.add(password.group(1))


def redact(text: str) -> str:
    """``text`` without any known secret, URL user information or credential header."""
    for secret in sorted(_known, key=len, reverse=True):
        if secret in text:
            text = text.replace(secret, MASK)
    text = _USERINFO.sub(rf"\g<keep>{MASK}@", text)
    return _CREDENTIAL_FIELD.sub(rf"\g<keep>{MASK}", text)


class RedactingFilter(logging.Filter):
    """Scrubs a record's whole text (message, traceback, stack) before a handler formats it.

    A handler's filter sees every record the handler writes, those propagated from any
    library's logger included, which a logger's filter would not."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg, record.args = redact(record.getMessage()), None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text)
        if record.stack_info:
            record.stack_info = redact(record.stack_info)
        return True


def configure_logging(level: str, fmt: str) -> None:
    """Log at ``level`` in ``fmt`` through redacting handlers; the credential-printing
    libraries stay at INFO or above even at DEBUG: their DEBUG output is mostly headers,
    and redaction is the second line, not the first."""
    logging.basicConfig(level=level, format=fmt)
    add_secrets(os.environ.get(name) for name in SECRET_ENVIRONMENT)
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(RedactingFilter())
    for name in CREDENTIAL_LEAKING_LOGGERS:
        logger = logging.getLogger(name)
        if logger.getEffectiveLevel() < logging.INFO:
            logger.setLevel(logging.INFO)
