"""``metadataPath``'s stores: a directory, an S3 prefix and a DynamoDB table, each over the
same contract (first write wins, a retried write finds its own record, clean-up keeps what a
later batch can still need), the remote ones over real HTTP against moto's server and the
embedded endpoint; then a budgeted query whose executors record their ends in S3 or DynamoDB
fetches each record once, as with a shared directory.
"""

from __future__ import annotations

import io
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import boto3
import botocore.session
import pytest
from botocore.exceptions import ClientError
from botocore.response import StreamingBody
from botocore.stub import Stubber

from kclpy.errors import ConfigError
from kclpy.local import LocalEndpoint
from kclpy.position import Position
from kclpy.spark.metadata import (
    ConflictingEndError,
    Location,
    MetadataStore,
    ObjectStore,
    PositionStore,
    TableStore,
    open_store,
    parse_location,
)
from kclpy.spark.offsets import Budget, UptoEnd
from kclpy.spark.options import SourceOptions
from tests.support.counting import CountingProxy
from tests.support.faultproxy import Call
from tests.support.iam import Names, denied, needless, role_statements
from tests.support.source_driving import available_now, make_reader
from tests.support.streams import create_stream, kinesis_client, put_plain, unique_name

DRIVER, EXECUTOR = "kclpy-spark-driver", "kclpy-spark-executor"
SHARD = "shardId-000000000000"


def upto(start: Position, plan: str = "p1") -> UptoEnd:
    return UptoEnd(start, 1_700_000_000_000, Budget(rows=100), plan)


def s3_client(url: str) -> Any:
    return boto3.client("s3", endpoint_url=url, region_name="us-east-1")


def dynamodb(url: str) -> Any:
    return boto3.client("dynamodb", endpoint_url=url, region_name="us-east-1")


def new_bucket(url: str) -> str:
    bucket = unique_name("ends").lower()
    s3_client(url).create_bucket(Bucket=bucket)
    return bucket


def store_options(where: str, endpoint: str | None = None) -> SourceOptions:
    given = {"streamName": "s", "region": "us-east-1", "metadataPath": where}
    if endpoint is not None:
        given["metadataEndpointUrl"] = endpoint
    return SourceOptions.parse(given)


@pytest.fixture(params=["directory", "s3", "dynamodb", "dynamodb-embedded"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> MetadataStore:
    """Each store as ``metadataPath`` opens it, the remote ones over HTTP."""
    kind = request.param
    if kind == "directory":
        where, endpoint = str(tmp_path / "ends"), None
    elif kind == "s3":
        endpoint = request.getfixturevalue("moto_server").url
        where = f"s3://{new_bucket(endpoint)}/query-1"
    else:
        fixture = "moto_server" if kind == "dynamodb" else "embedded_endpoint"
        endpoint = request.getfixturevalue(fixture).url
        where = f"dynamodb://{unique_name('ends')}/query-1"
    opened = open_store(store_options(where, endpoint))
    assert opened is not None
    return opened


def test_the_first_write_wins_and_a_retried_write_finds_its_own(store: MetadataStore) -> None:
    end = upto(Position.trim_horizon())
    assert store.get(SHARD, end) is None
    first, later = Position("100", 2), Position("90")
    assert store.put(SHARD, end, first) == first
    assert store.put(SHARD, end, first) == first, "a retried task: the same end, no error"
    assert store.put(SHARD, end, later) == first, "a slower attempt is held to the first"
    assert store.get(SHARD, end) == first
    assert store.get("shardId-000000000001", end) is None, "another shard's end"
    assert store.get(SHARD, upto(Position.trim_horizon(), "p2")) is None, "another plan's"


def test_attempts_racing_to_record_one_end_all_get_the_same_winner(
        store: MetadataStore) -> None:
    end = upto(Position("7"))
    got: list[Position] = []
    lock = threading.Lock()

    def attempt(n: int) -> None:
        recorded = store.put(SHARD, end, Position(str(10 + n)))
        with lock:
            got.append(recorded)

    threads = [threading.Thread(target=attempt, args=(n,)) for n in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(got) == 6 and len(set(got)) == 1, got
    assert store.get(SHARD, end) == got[0]


@pytest.fixture(params=["s3", "dynamodb", "directory"])
def remote(request: pytest.FixtureRequest, moto_server: LocalEndpoint,
           tmp_path: Path) -> Callable[[str], MetadataStore]:
    """A store under a given prefix, two prefixes sharing one bucket, table or folder."""
    if request.param == "directory":
        return lambda prefix: PositionStore(str(tmp_path / prefix))
    if request.param == "s3":
        bucket = new_bucket(moto_server.url)
        return lambda prefix: ObjectStore(s3_client(moto_server.url), bucket, prefix)
    table = unique_name("ends")

    def opened(prefix: str) -> MetadataStore:
        made = TableStore(dynamodb(moto_server.url), table, prefix)
        made.create_if_missing()
        return made

    return opened


def test_a_commit_removes_earlier_batches_records_and_keeps_later_ones(
        remote: Callable[[str], MetadataStore]) -> None:
    """Spark commits batch N after it planned N+1, and a re-run of N+1 after a restart may
    have recorded its ends before N's commit: only records of parts that started before the
    committed one's go. A query under another prefix keeps all of its own."""
    store, neighbour = remote("a/"), remote("b/")
    ends = [upto(Position.trim_horizon(), "p1"), upto(Position("5"), "p2"),
            upto(Position("9", 3), "p3"), upto(Position("12"), "p4")]
    for end, reached in zip(ends, ["5", "9", "12", "20"], strict=True):
        store.put(SHARD, end, Position(reached))
        neighbour.put(SHARD, end, Position(reached))
    store.put("shardId-000000000001", ends[0], Position("3"))

    store.forget_older(SHARD, ends[2])

    assert [store.get(SHARD, end) for end in ends] == [
        None, None, Position("12"), Position("20")]
    assert store.get("shardId-000000000001", ends[0]) == Position("3"), "another shard's"
    assert all(neighbour.get(SHARD, end) is not None for end in ends), "another query's"
    store.forget_older(SHARD, ends[3])
    assert store.get(SHARD, ends[2]) is None


def test_the_table_is_created_on_first_use_pay_per_request(
        moto_server: LocalEndpoint) -> None:
    table = unique_name("ends")
    client = dynamodb(moto_server.url)
    assert table not in client.list_tables()["TableNames"]
    opened = open_store(store_options(f"dynamodb://{table}", moto_server.url))
    assert isinstance(opened, TableStore)
    described = client.describe_table(TableName=table)["Table"]
    assert described["BillingModeSummary"]["BillingMode"] == "PAY_PER_REQUEST"
    assert {k["AttributeName"]: k["KeyType"] for k in described["KeySchema"]} == {
        "shardKey": "HASH", "batchEnd": "RANGE"}
    assert opened.put(SHARD, upto(Position("1")), Position("2")) == Position("2")
    again = TableStore(client, table, "")
    again.create_if_missing()  # an existing table is used as it is
    assert again.get(SHARD, upto(Position("1"))) == Position("2")


def test_a_missing_bucket_is_an_error_naming_it(moto_server: LocalEndpoint) -> None:
    """Buckets are not kclpy's to create (their region, policy and lifecycle are the
    account's): a query pointed at a missing one fails at its first record."""
    store = ObjectStore(s3_client(moto_server.url), "no-such-bucket-here", "")
    with pytest.raises(Exception, match="NoSuchBucket"):
        store.put(SHARD, upto(Position("1")), Position("2"))


def test_a_write_s3_answers_409_is_tried_again_and_finds_the_winner() -> None:
    """409 ConditionalRequestConflict: another attempt's write of the same record is in
    flight, which S3 asks to retry; the retry's 412 means that one landed: its end stands."""
    client = boto3.client("s3", region_name="us-east-1")
    store = ObjectStore(client, "bucket", "q/")
    end = upto(Position("1"))
    winner = json.dumps({"end": end.encode(), "reached": "AFTER/5/0"}).encode()
    with Stubber(client) as stub:
        stub.add_client_error("put_object", "ConditionalRequestConflict", http_status_code=409)
        stub.add_client_error("put_object", "PreconditionFailed", http_status_code=412)
        stub.add_response("get_object", {"Body": StreamingBody(io.BytesIO(winner),
                                                               len(winner))})
        assert store.put(SHARD, end, Position("9")) == Position("5")
        stub.assert_no_pending_responses()


def test_a_write_s3_keeps_answering_409_fails_after_five_tries_naming_the_record(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The conflict retries are counted: five writes, four waits of the one backoff, then an
    error naming the object, caused by the last 409."""
    waits: list[float] = []
    monkeypatch.setattr(time, "sleep", waits.append)
    client = boto3.client("s3", region_name="us-east-1")
    store = ObjectStore(client, "bucket", "q/")
    with Stubber(client) as stub:
        for _ in range(5):
            stub.add_client_error("put_object", "ConditionalRequestConflict",
                                  http_status_code=409)
        with pytest.raises(ConflictingEndError, match=r"^s3://bucket/q/.*after 5 tries") as \
                raised:
            store.put(SHARD, upto(Position("1")), Position("9"))
        stub.assert_no_pending_responses()
    assert len(waits) == 4 and all(0 <= wait <= 1.0 for wait in waits)
    assert isinstance(raised.value.__cause__, ClientError)


def test_a_refused_put_without_the_old_item_reads_the_winner() -> None:
    """A DynamoDB-compatible store that does not return the item a condition failed on: the
    recorded end is read, not assumed."""
    client = boto3.client("dynamodb", region_name="us-east-1")
    store = TableStore(client, "ends", "")
    with Stubber(client) as stub:
        stub.add_client_error("put_item", "ConditionalCheckFailedException")
        stub.add_response("get_item", {"Item": {"reached": {"S": "AFTER/5/0"}}})
        assert store.put(SHARD, upto(Position("1")), Position("9")) == Position("5")
        stub.assert_no_pending_responses()


@pytest.mark.parametrize(("text", "location"), [
    ("/mnt/shared/ends", Location("", "/mnt/shared/ends")),
    ("s3://my-bucket", Location("s3", "my-bucket", "")),
    ("s3://my-bucket/queries/orders", Location("s3", "my-bucket", "queries/orders/")),
    ("S3://my-bucket/q/", Location("s3", "my-bucket", "q/")),
    ("dynamodb://orders_ends", Location("dynamodb", "orders_ends", "")),
    ("dynamodb://orders_ends/q1", Location("dynamodb", "orders_ends", "q1/")),
])
def test_metadata_path_names_a_directory_a_bucket_or_a_table(text: str,
                                                               location: Location) -> None:
    assert parse_location(text) == location


@pytest.mark.parametrize(("options", "option", "words"), [
    ({"metadataPath": "hdfs://namenode/ends"}, "metadataPath", "not hdfs://"),
    ({"metadataPath": "s3://"}, "metadataPath", "not an S3 bucket name"),
    ({"metadataPath": "s3://Bad_Bucket/x"}, "metadataPath", "not an S3 bucket name"),
    ({"metadataPath": "dynamodb://t"}, "metadataPath", "not a DynamoDB table name"),
    ({"metadataPath": "file:/tmp/ends"}, "metadataPath", "scheme://name/prefix"),
    ({"metadataPath": "/tmp/ends", "metadataEndpointUrl": "http://127.0.0.1:1"},
     "metadataEndpointUrl", "s3:// or dynamodb://"),
    ({"metadataPath": "s3://bucket", "metadataEndpointUrl": "127.0.0.1:1"},
     "metadataEndpointUrl", "http(s) URL"),
    ({"kinesis.dynamodb.tableName": "ends"}, "kinesis.dynamodb.tableName",
     "dynamodb://<table>"),
])
def test_a_bad_metadata_option_is_one_line_naming_it(options: dict[str, str], option: str,
                                                      words: str) -> None:
    with pytest.raises(ConfigError) as excinfo:
        SourceOptions.parse({"streamName": "s", **options})
    assert excinfo.value.option == option
    assert words in excinfo.value.message
    assert "\n" not in str(excinfo.value)


def test_a_directory_store_is_the_files_it_always_was(tmp_path: Path) -> None:
    """Records written by an earlier release under a directory are found after upgrading."""
    opened = open_store(store_options(str(tmp_path)))
    assert isinstance(opened, PositionStore)
    end = upto(Position("4"))
    PositionStore(str(tmp_path)).put(SHARD, end, Position("8"))
    assert opened.get(SHARD, end) == Position("8")


# -- a budgeted query, its ends in S3 or DynamoDB ---------------------------------------------


@pytest.fixture
def proxy(kinesis_mock: LocalEndpoint) -> Iterator[CountingProxy]:
    with CountingProxy(kinesis_mock.url) as counting:
        yield counting


def recorded_calls(monkeypatch: pytest.MonkeyPatch) -> list[Call]:
    """Every call of the clients made in this process from now on, with its parameters: the
    recording proxy reads JSON requests only, and S3's are REST. (Through the clients'
    events, so that the suite's own recorder still sees kclpy make them.)"""
    calls: list[Call] = []
    create = botocore.session.Session.create_client

    def creating(session: botocore.session.Session, *args: Any, **kwargs: Any) -> Any:
        client = create(session, *args, **kwargs)
        service = client.meta.service_model.service_name

        def record(params: dict[str, Any], model: Any, **_: Any) -> None:
            calls.append(Call(service, model.name, dict(params)))

        client.meta.events.register("before-parameter-build", record)
        return client

    monkeypatch.setattr(botocore.session.Session, "create_client", creating)
    return calls


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["s3", "dynamodb"])
def test_a_row_limit_with_ends_in_a_bucket_or_table_reads_each_record_once(
        proxy: CountingProxy, kinesis_mock: LocalEndpoint, moto_server: LocalEndpoint,
        monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    """As with a shared directory (tests/spark/test_source_costs.py): the executors
    record where each part stopped, so the driver reads no batch again, about one fetch per
    row in all where the driver reading to find out costs two; and as batches commit, only
    the last committed batch's records remain. Every call the driver and the executors made
    is allowed by the role's policies in docs/iam.md, and each action they allow was
    needed."""
    read_max_rows = pytest.importorskip("pyspark.sql.streaming.datasource").ReadMaxRows
    kinesis = kinesis_client(kinesis_mock.url)
    stream = unique_name("spark-meta")
    create_stream(kinesis, stream, 4)
    payloads = [f"m-{n}".encode() for n in range(800)]
    put_plain(kinesis, stream, payloads)
    if kind == "s3":
        bucket = new_bucket(moto_server.url)
        where = f"s3://{bucket}/{stream}"
    else:
        table = unique_name("ends")
        where = f"dynamodb://{table}/{stream}"
    reader = make_reader(proxy.url, stream, startingPosition="TRIM_HORIZON", settleTime="0",
                         minFetchPeriod="0", metadataPath=where,
                         metadataEndpointUrl=moto_server.url)

    calls = recorded_calls(monkeypatch)
    rows, batches = available_now(reader, read_max_rows(100))
    monkeypatch.undo()

    assert sorted(rows) == sorted(payloads)
    assert batches >= 8
    fetched = proxy.records[DRIVER] + proxy.records[EXECUTOR]
    assert fetched / len(rows) <= 1.1, dict(proxy.records)
    assert proxy.records[DRIVER] / len(rows) <= 0.02, dict(proxy.records)
    if kind == "s3":
        kept = s3_client(moto_server.url).list_objects_v2(Bucket=bucket).get("Contents", [])
    else:
        kept = dynamodb(moto_server.url).scan(TableName=table)["Items"]
    assert 1 <= len(kept) <= 4, f"one record per shard of the last budgeted batch: {kept}"
    names = Names(region="us-east-1", account="000000000000", stream=stream,
                  metadata_table=table if kind == "dynamodb" else "none",
                  bucket=bucket if kind == "s3" else "none", prefix=f"{stream}/")
    role = "spark source, ends in S3" if kind == "s3" else "spark source, ends in DynamoDB"
    assert denied(role_statements(role, names), calls, names) == []
    assert needless(role_statements(role, names), calls, names) == []


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["s3", "dynamodb"])
def test_a_spark_query_with_ends_in_a_bucket_or_table_fetches_each_record_once(
        spark: Any, proxy: CountingProxy, kinesis_mock: LocalEndpoint,
        moto_server: LocalEndpoint, tmp_path: Path, kind: str) -> None:
    """The same through Spark itself: its executors (Python workers the JVM started, with no
    folder in common with the driver's but the bucket or table) record the ends, and the
    driver plans from them without fetching a batch again."""
    if not hasattr(pytest.importorskip("pyspark.sql.datasource").DataSourceStreamReader,
                   "getDefaultReadLimit"):
        pytest.skip("maxRecordsPerBatch is a read limit from Spark 4.2")
    kinesis = kinesis_client(kinesis_mock.url)
    stream = unique_name("spark-meta-q")
    create_stream(kinesis, stream, 2)
    payloads = [f"q-{n}".encode() for n in range(600)]
    put_plain(kinesis, stream, payloads)
    where = (f"s3://{new_bucket(moto_server.url)}/{stream}" if kind == "s3"
             else f"dynamodb://{unique_name('ends')}/{stream}")
    reader = (spark.readStream.format("kinesis").option("streamName", stream)
              .option("endpointUrl", proxy.url).option("region", "us-east-1")
              .option("startingPosition", "TRIM_HORIZON").option("settleTime", "0")
              .option("maxRecordsPerBatch", "100").option("metadataPath", where)
              .option("metadataEndpointUrl", moto_server.url))
    rows: list[bytes] = []
    batches: list[int] = []

    def collect(df: Any, batch_id: int) -> None:
        batches.append(batch_id)
        rows.extend(bytes(r.data) for r in df.collect())

    query = (reader.load().writeStream.foreachBatch(collect)
             .option("checkpointLocation", str(tmp_path / "checkpoint"))
             .trigger(availableNow=True).start())
    assert query.awaitTermination(240), "availableNow query did not finish"
    assert query.exception() is None

    assert sorted(rows) == sorted(payloads)
    assert len(batches) >= 6
    assert proxy.records[EXECUTOR] / len(rows) <= 1.1, dict(proxy.records)
    assert proxy.records[DRIVER] / len(rows) <= 0.05, dict(proxy.records)


def test_a_folders_records_written_by_a_host_whose_clock_is_behind_are_kept(
        tmp_path: Path) -> None:
    """Executors on several hosts write the folder's records, and a shared mount may date a
    file by the writing host's clock: a later batch's record dated before the committed
    one's must still be kept, as the bucket and table stores keep it."""
    store = PositionStore(str(tmp_path))
    ends = [upto(Position.trim_horizon(), "p1"), upto(Position("5"), "p2"),
            upto(Position("9"), "p3")]
    for end, reached in zip(ends, ["5", "9", "20"], strict=True):
        store.put(SHARD, end, Position(reached))
    files = sorted(path for path in tmp_path.rglob("*.json"))
    assert len(files) == 3
    for age, path in enumerate(files):  # every file dated a minute apart, in any order
        os.utime(path, ns=(10**18 - age * 60 * 10**9, 10**18 - age * 60 * 10**9))
    for path in files:
        if json.loads(path.read_text())["end"] == ends[2].encode():
            os.utime(path, ns=(10**17, 10**17))  # the later batch's, by a clock far behind

    store.forget_older(SHARD, ends[1])

    assert [store.get(SHARD, end) for end in ends] == [None, Position("9"), Position("20")]
