"""Configuration: loaders, precedence, and errors that name the option as the user wrote it."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

import pytest

from kclpy.config import (
    OPTIONS,
    KCLConfig,
    build_config,
    from_environment,
    from_properties,
    read_properties,
)
from kclpy.errors import ConfigError


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
