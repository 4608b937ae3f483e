"""An empty ``AWS_DEFAULT_REGION`` is a configuration error named as such by every entry
point, not a request to ``https://kinesis..amazonaws.com`` failing later."""

from __future__ import annotations

import pytest

from kclpy.cli import worker_main
from kclpy.errors import ConfigError
from kclpy.ops.commands import operator_main
from kclpy.ops.inspect import EXIT_UNKNOWN
from kclpy.sessions import aws_session


@pytest.fixture
def empty_region(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_DEFAULT_REGION", "")
    monkeypatch.delenv("AWS_REGION", raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")


@pytest.mark.usefixtures("empty_region")
def test_an_empty_region_variable_is_refused_naming_it() -> None:
    with pytest.raises(ConfigError) as raised:
        aws_session(None)
    assert raised.value.option == "AWS_DEFAULT_REGION"


@pytest.mark.usefixtures("empty_region")
def test_a_region_given_in_the_options_wins_over_the_empty_variable() -> None:
    assert aws_session("eu-west-1").region_name == "eu-west-1"


@pytest.mark.usefixtures("empty_region")
def test_the_worker_exits_2_naming_the_variable(capsys: pytest.CaptureFixture[str]) -> None:
    code = worker_main(["--stream-name", "s", "--application-name", "a", "--processor",
                        "examples/printing_processor.py:PrintingProcessor"])
    err = capsys.readouterr().err
    assert code == 2
    assert "AWS_DEFAULT_REGION: is set but empty" in err
    assert "Invalid endpoint" not in err


@pytest.mark.usefixtures("empty_region")
def test_the_operator_tool_reports_a_usage_error_naming_the_variable(
        capsys: pytest.CaptureFixture[str]) -> None:
    code = operator_main(["status", "--application-name", "a", "--stream-name", "s"])
    err = capsys.readouterr().err
    assert code == EXIT_UNKNOWN
    assert "AWS_DEFAULT_REGION: is set but empty" in err
