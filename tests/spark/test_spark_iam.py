"""The Spark source's driver and executors keep to the ``spark-source`` policy of docs/iam.md
(with ``spark-fan-out`` when reading through a consumer): every request a query makes goes
through a recording proxy, whichever JVM-started Python process makes it (tests/system/test_iam.py
holds the other roles)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kclpy.local import LocalEndpoint
from tests.support.faultproxy import FaultProxy
from tests.support.iam import Names, denied, needless, role_statements
from tests.support.streams import create_stream, kinesis_client, put_plain, unique_name


def read_to_the_end(spark: Any, url: str, stream: str, checkpoint: Path,
                    **options: str) -> int:
    """An availableNow query over the stream; the rows it read."""
    reader = (spark.readStream.format("kinesis").option("streamName", stream)
              .option("endpointUrl", url).option("region", "us-east-1")
              .option("startingPosition", "TRIM_HORIZON"))
    for key, value in options.items():
        reader = reader.option(key, value)
    counted: list[int] = []
    query = (reader.load().writeStream
             .foreachBatch(lambda df, _: counted.append(df.count()))
             .option("checkpointLocation", str(checkpoint))
             .trigger(availableNow=True).start())
    assert query.awaitTermination(240), "availableNow query did not finish"
    assert query.exception() is None
    return sum(counted)


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize(("role", "options"), [
    ("spark source", {}),
    ("spark fan-out source", {"consumerName": "iam-spark"}),
])
def test_a_spark_querys_calls_are_allowed_by_the_spark_policies(
        spark: Any, kinesis_mock: LocalEndpoint, tmp_path: Path, role: str,
        options: dict[str, str]) -> None:
    kinesis = kinesis_client(kinesis_mock.url)
    stream = unique_name("spark-iam")
    create_stream(kinesis, stream, 2)
    put_plain(kinesis, stream, [f"r{i}".encode() for i in range(40)])
    with FaultProxy(kinesis_mock.url, record_calls=True) as proxy:
        assert read_to_the_end(spark, proxy.url, stream, tmp_path / "checkpoint",
                               **options) == 40
        calls = proxy.calls()
    arn = kinesis.describe_stream_summary(StreamName=stream)["StreamDescriptionSummary"][
        "StreamARN"]
    _, _, _, region, account, _ = arn.split(":", 5)
    names = Names(region=region, account=account, stream=stream,
                  consumer=options.get("consumerName", "none"))
    operations = {call.operation for call in calls}
    assert {"ListShards"} <= operations
    assert ({"SubscribeToShard", "RegisterStreamConsumer"} if options else {"GetRecords"}
            ) <= operations
    assert denied(role_statements(role, names), calls, names) == [], \
        f"the {role}'s policies in docs/iam.md lack these"
    assert needless(role_statements(role, names), calls, names) == [], \
        f"the {role}'s policies in docs/iam.md allow these, which it did not need"
    if options:
        assert denied(role_statements("spark source", names), calls, names), \
            "reading through a consumer needs more than the polling source's policy"
