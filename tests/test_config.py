"""Configuration: loaders, precedence, and errors that name the option as the user wrote it."""

from __future__ import annotations

import threading
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest

from kclpy.config import (
    OPTIONS,
    KCLConfig,
    Option,
    build_config,
    from_environment,
    from_properties,
    read_properties,
)
from kclpy.errors import ConfigError
from kclpy.worker import Worker
from tests.support.recording import Ledger, RecordingProcessor


def test_defaults_follow_the_java_kcl() -> None:
    config = KCLConfig(application_name="app", stream_name="s")
    assert config.lease_table_name == "app"
    assert config.failover_time_ms == 10_000
    assert config.max_records == 10_000
    assert config.idle_time_between_reads_ms == 1_000
    assert config.initial_position == "LATEST"
    assert config.max_leases_to_steal_at_one_time == 1
    assert config.cleanup_leases_upon_shard_completion is True
    assert config.processor_error_policy == "retry"


def test_worker_ids_are_unique() -> None:
    a = KCLConfig(application_name="app", stream_name="s")
    b = KCLConfig(application_name="app", stream_name="s")
    assert a.worker_id != b.worker_id


def test_properties_file_parsing(tmp_path: Path) -> None:
    path = tmp_path / "app.properties"
    path.write_text(
        "# comment\n! other comment\n"
        "executableName = python sample.py\n"
        "streamName: my-stream\n"
        "applicationName my-app\n"
        "failoverTimeMillis = 20000\n"
        "callProcessRecordsEvenForEmptyRecordList = true\n"
        "initialPositionInStream = TRIM_HORIZON\n"
        "regionName = \\\n    eu-west-1\n"
        "AWSCredentialsProvider = DefaultCredentialsProvider\n"
    )
    properties = read_properties(path)
    warnings: list[str] = []
    values, labels = from_properties(properties, base_dir=tmp_path, warn=warnings.append)
    config = build_config(values, labels)
    assert config.executable_name == "python sample.py"
    assert config.stream_name == "my-stream"
    assert config.application_name == "my-app"
    assert config.failover_time_ms == 20000
    assert config.call_process_records_even_for_empty_record_list is True
    assert config.initial_position == "TRIM_HORIZON"
    assert config.region == "eu-west-1"
    assert config.properties_dir == tmp_path
    assert warnings == []


def test_unknown_properties_keys_are_warned_about() -> None:
    warnings: list[str] = []
    from_properties({"streamName": "s", "noSuchKey": "1"}, warn=warnings.append)
    assert len(warnings) == 1 and "noSuchKey" in warnings[0]


def test_at_timestamp_from_properties_epoch_seconds() -> None:
    values, labels = from_properties({
        "streamName": "s", "applicationName": "a", "initialPositionInStream": "AT_TIMESTAMP",
        "timestampAtInitialPositionInStream": "1700000000"})
    config = build_config(values, labels)
    assert config.initial_timestamp == datetime.fromtimestamp(1700000000, tz=timezone.utc)


@pytest.mark.parametrize(
    ("properties", "named"),
    [
        ({"failoverTimeMillis": "ten"}, "failoverTimeMillis"),
        ({"failoverTimeMillis": "-5"}, "failoverTimeMillis"),
        ({"maxRecords": "20000"}, "maxRecords"),
        ({"initialPositionInStream": "SOMEWHERE"}, "initialPositionInStream"),
        ({"cleanupLeasesUponShardCompletion": "perhaps"}, "cleanupLeasesUponShardCompletion"),
        ({"kinesisEndpoint": "localhost:4566"}, "kinesisEndpoint"),
        ({"initialPositionInStream": "AT_TIMESTAMP"}, "--initial-timestamp"),
        ({"timestampAtInitialPositionInStream": "yesterday"},
         "timestampAtInitialPositionInStream"),
    ],
)
def test_bad_properties_name_the_key(properties: dict[str, str], named: str) -> None:
    base = {"streamName": "s", "applicationName": "a"}
    with pytest.raises(ConfigError) as info:
        values, labels = from_properties({**base, **properties})
        build_config(values, labels)
    assert info.value.option == named


def test_missing_stream_and_application() -> None:
    with pytest.raises(ConfigError) as info:
        build_config({"application_name": "a"}, {})
    assert info.value.option == "--stream-name"
    with pytest.raises(ConfigError) as info:
        build_config({"stream_name": "s"}, {})
    assert info.value.option == "--application-name"


def test_environment_loader() -> None:
    values, labels = from_environment({"KCLPY_STREAM_NAME": "s", "KCLPY_MAX_RECORDS": "50",
                                       "UNRELATED": "x"})
    assert values == {"stream_name": "s", "max_records": 50}
    assert labels["max_records"] == "KCLPY_MAX_RECORDS"


def test_every_option_has_a_flag_and_a_properties_key() -> None:
    for option in OPTIONS:
        assert option.flag.startswith("--")
        assert option.properties_keys, option.name
        assert option.help


#: for every option that has a rule of its own, a value (with what else it needs) that breaks
#: it; the option named by the error is the key
BREAKING: dict[str, dict[str, Any]] = {
    "stream_name": {"stream_name": None},
    "stream_arn": {"stream_arn": "arn:aws:s3:::bucket"},
    "application_name": {"application_name": " "},
    "region": {"region": "us east 1"},
    "kinesis_endpoint": {"kinesis_endpoint": "localhost:4566"},
    "dynamodb_endpoint": {"dynamodb_endpoint": "ftp://x"},
    "cloudwatch_endpoint": {"cloudwatch_endpoint": "monitoring"},
    "initial_position": {"initial_position": "latest"},
    "initial_timestamp": {"initial_position": "AT_TIMESTAMP"},
    "max_records": {"max_records": 10_001},
    "max_pool_connections": {"max_pool_connections": 65_536},
    "max_task_backoff_time_ms": {"task_backoff_time_ms": 1000, "max_task_backoff_time_ms": 999},
    "processor_error_policy": {"processor_error_policy": "ignore"},
    "lease_assignment": {"lease_assignment": "random"},
    "lease_assigner": {"lease_assigner": "everyone"},
    "dampening_percentage": {"dampening_percentage": 101},
    "metrics_port": {"metrics_port": 65536},
    "lag_webhook": {"lag_webhook": "https://hooks.example/x"},
    "stray_stdout": {"stray_stdout": "print"},
    "state_store": {"state_store": "sqlite:/state.db"},
    "retrieval_mode": {"retrieval_mode": "DEFAULT"},
    "consumer_arn": {"consumer_arn": "arn:aws:kinesis:us-east-1:1:stream/s"},
    "fanout_http_version": {"fanout_http_version": "3"},
    "get_records_backoff_cap_ms": {"get_records_backoff_cap_ms": 50},
    "list_shards_backoff_cap_ms": {"list_shards_backoff_base_ms": 300,
                                   "list_shards_backoff_cap_ms": 299},
    "metrics_level": {"metrics_level": "loud"},
    "metrics_enabled_dimensions": {"metrics_enabled_dimensions": "Planet"},
}


def _has_own_rule(option: Option) -> bool:
    return bool(option.rule or option.choices or option.kind in ("url", "port")
                or option.most is not None)


def test_every_option_with_a_rule_is_refused_by_its_own_name() -> None:
    """The rules live with the options: each option's bad value is named by that option,
    whichever loader it came through - here a KCLConfig built in Python."""
    assert {o.name for o in OPTIONS if _has_own_rule(o)} == set(BREAKING)
    for field_name, changes in BREAKING.items():
        with pytest.raises(ConfigError) as info:
            KCLConfig(**{"application_name": "a", "stream_name": "s", **changes})
        assert info.value.option == field_name, (field_name, info.value)


@pytest.mark.parametrize("option", [o for o in OPTIONS if o.kind in ("int", "int0", "port")],
                         ids=lambda o: o.name)
def test_every_whole_number_option_has_a_range(option: Option) -> None:
    assert option.least is not None
    with pytest.raises(ConfigError) as info:
        KCLConfig(application_name="a", stream_name="s",
                  **{option.name: option.least - 1})  # type: ignore[arg-type]
    assert info.value.option == option.name
    with pytest.raises(ConfigError) as info:
        KCLConfig(application_name="a", stream_name="s",
                  **{option.name: "7"})  # type: ignore[arg-type]
    assert info.value.option == option.name and "whole number" in info.value.message
    with pytest.raises(ConfigError) as info:
        KCLConfig(application_name="a", stream_name="s",
                  **{option.name: option.ceiling + 1})  # type: ignore[arg-type]
    assert info.value.option == option.name
    assert ("not a port" if option.kind == "port" else f"at most {option.ceiling},"
            ) in info.value.message


@pytest.mark.parametrize("option", [o for o in OPTIONS if o.kind in ("int", "int0")
                                    and o.name.endswith(("_ms", "_s", "_seconds"))],
                         ids=lambda o: o.name)
def test_no_time_option_takes_a_wait_a_thread_cannot_make(option: Option) -> None:
    """A wait beyond ``threading.TIMEOUT_MAX`` raises in the thread that waits, after the
    worker started; so the largest time an option takes stays far below it (a wait may be
    a few times an option's value)."""
    seconds = option.ceiling / (1000 if option.name.endswith("_ms") else 1)
    assert seconds * 50 < threading.TIMEOUT_MAX


@pytest.mark.parametrize("option", [o for o in OPTIONS if o.kind == "bool"], ids=lambda o: o.name)
def test_a_boolean_option_takes_no_text_from_python(option: Option) -> None:
    """``stop_when_caught_up="false"`` would be true; only the loaders convert text."""
    with pytest.raises(ConfigError) as info:
        KCLConfig(application_name="a", stream_name="s",
                  **{option.name: "false"})  # type: ignore[arg-type]
    assert info.value.option == option.name


def test_a_backoff_cap_below_its_base_names_both_as_the_user_wrote_them() -> None:
    values, labels = from_properties({"streamName": "s", "applicationName": "a",
                                      "getRecordsBackoffBaseMillis": "200",
                                      "getRecordsBackoffCapMillis": "100"})
    with pytest.raises(ConfigError) as info:
        build_config(values, labels)
    assert info.value.option == "getRecordsBackoffCapMillis"
    assert "getRecordsBackoffBaseMillis (200)" in info.value.message
    with pytest.raises(ConfigError) as info:
        KCLConfig(application_name="a", stream_name="s", get_records_backoff_cap_ms=50)
    assert info.value.option == "get_records_backoff_cap_ms"
    assert "get_records_backoff_base_ms (100)" in info.value.message
    values, labels = from_environment({"KCLPY_STREAM_NAME": "s", "KCLPY_APPLICATION_NAME": "a",
                                       "KCLPY_GET_RECORDS_BACKOFF_CAP_MS": "50"})
    with pytest.raises(ConfigError) as info:
        build_config(values, labels)
    assert info.value.option == "KCLPY_GET_RECORDS_BACKOFF_CAP_MS"


def test_every_valid_backoff_pair_makes_a_backoff() -> None:
    """What validate() lets through makes the read policy every fetcher backs off with
    (``KCLConfig.read_retries``): no consumer thread can fail on it (and have its lease
    released and taken again, for ever), and no wait passes the cap."""
    for base, cap in ((1, 1), (100, 100), (100, 5000), (7, 8)):
        config = KCLConfig(application_name="a", stream_name="s",
                           get_records_backoff_base_ms=base, get_records_backoff_cap_ms=cap)
        backoff = config.read_retries.backoff()
        assert 0 <= backoff.next_delay() <= cap / 1000


def test_the_worker_refuses_a_config_changed_after_it_was_made() -> None:
    config = KCLConfig(application_name="a", stream_name="s")
    config.get_records_backoff_cap_ms = 50
    threads = threading.active_count()
    with pytest.raises(ConfigError) as info:
        Worker(config, lambda: RecordingProcessor(Ledger()))
    assert info.value.option == "get_records_backoff_cap_ms"
    assert threading.active_count() == threads


def test_a_malformed_database_url_is_echoed_without_its_password() -> None:
    from kclpy import KCLConfig

    with pytest.raises(ConfigError) as info:
        KCLConfig(stream_name="s", application_name="a",
                  state_store="postgresql:/kclpy:pw-canary@db.example/state")
    assert "pw-canary" not in str(info.value)
    assert "'postgresql:/***@db.example/state'" in str(info.value)
