"""The ``kclpy`` operator CLI run in the test's own process, so that a test reads its exit
code and output without a subprocess, against endpoints the test started."""

from __future__ import annotations

import pytest

from kclpy.local import LocalEndpoint
from kclpy.ops.commands import operator_main


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``kclpy ARGV`` in this process: (exit code, stdout, stderr)."""
    try:
        code = operator_main(list(argv))
    except SystemExit as exc:  # argparse usage errors
        code = int(exc.code or 0)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def endpoints(kinesis: LocalEndpoint, dynamodb: LocalEndpoint) -> list[str]:
    return ["--region", "us-east-1", "--kinesis-endpoint", kinesis.url,
            "--dynamodb-endpoint", dynamodb.url]
