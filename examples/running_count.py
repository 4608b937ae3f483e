"""A running count per partition key, exactly once through failover (kclpy.StatefulProcessor).

With the state in a DynamoDB table (created when missing), on the embedded local endpoint:

    kclpy-worker --local --processor examples/running_count.py:RunningCount \
        --state-store running-counts --stop-when-caught-up

or in a SQL database - SQLite on one host, PostgreSQL for a fleet
(pip install 'kinesis-kclpy[sql]'):

    kclpy-worker --local --processor examples/running_count.py:RunningCount \
        --state-store sqlite:///running-counts.db --stop-when-caught-up
    python examples/running_count.py sqlite:///running-counts.db    # print the counts

Against a real stream, add --stream-name and --application-name instead of --local.
"""

from __future__ import annotations

import json
import sys

import kclpy


class RunningCount(kclpy.StatefulProcessor):
    """Counts records and their bytes per partition key. No checkpointing: kclpy commits the
    counts together with the checkpoint, so a record is never counted twice."""

    def apply(self, record: kclpy.Record, txn: kclpy.StateTransaction) -> None:
        txn.update(f"count/{record.partition_key}", lambda n: n + 1, 0)
        txn.update(f"bytes/{record.partition_key}", lambda n: n + len(record.binary_data), 0)


def stored_counts(url: str) -> dict[str, int]:
    """What a SQL store holds, key by key."""
    import sqlalchemy as sa

    store = kclpy.SQLStateStore(url)
    with store.engine.connect() as conn:
        rows = conn.execute(sa.select(store.state.c.state_key, store.state.c.state_value))
        return {key: json.loads(value) for key, value in rows}


if __name__ == "__main__":
    for key, value in sorted(stored_counts(sys.argv[1]).items()):
        print(f"{key} {value}")
