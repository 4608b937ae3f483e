"""Lease cleanup upon shard completion: which finished leases go, who deletes them, and
that shard sync never brings one back. The split test in tests/system/test_fleet.py does it
end to end with worker processes over real HTTP."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import boto3
import pytest
from moto import mock_aws

from kclpy.leases.cleanup import deletable, has_progressed
from kclpy.leases.coordinator import CoordinatorSettings, LeaseCoordinator
from kclpy.leases.lease import Lease
from kclpy.leases.shard_sync import Shard, ShardSyncer, SyncedStream, plan_new_leases
from kclpy.leases.table import LeaseTable
from kclpy.ops import control
from kclpy.position import AT_TIMESTAMP, LATEST, SHARD_END, TRIM_HORIZON, Position
from kclpy.recovery import requests as asked
from kclpy.recovery.queue import RecoveryRequest
from tests.support.determinism import Clock
from tests.support.leases import coordinator


def lease(key: str, checkpoint: str = TRIM_HORIZON, **fields: Any) -> Lease:
    for name in ("parent_shard_ids", "child_shard_ids"):
        if name in fields:
            fields[name] = frozenset(fields[name])
    return Lease(key, checkpoint=Position(checkpoint), **fields)


def keys(leases: list[Lease]) -> list[str]:
    return [item.lease_key for item in leases]


def split(parent_checkpoint: str, *children: str, **child_fields: Any) -> list[Lease]:
    """A finished parent ``p`` and its children ``c1``, ``c2`` at the given checkpoints."""
    parent = lease("p", parent_checkpoint)
    kids = [
        lease(f"c{i}", checkpoint, parent_shard_ids={"p"}, **child_fields)
        for i, checkpoint in enumerate(children, 1)
    ]
    return [parent, *kids]


def test_progress_means_a_sequence_number_or_shard_end() -> None:
    assert has_progressed(lease("c", "4959"))
    assert has_progressed(lease("c", SHARD_END))
    for start in (TRIM_HORIZON, LATEST, AT_TIMESTAMP):
        assert not has_progressed(lease("c", start))


def test_a_finished_parent_goes_once_every_child_has_progressed() -> None:
    assert keys(deletable(split(SHARD_END, "100", "200"), "w")) == ["p"]
    assert keys(deletable(split(SHARD_END, "100", SHARD_END), "w")) == ["p"]
    assert deletable(split(SHARD_END, "100", TRIM_HORIZON), "w") == []


def test_a_parent_still_being_read_stays() -> None:
    assert deletable(split("999", "100", "200"), "w") == []


def test_a_parent_without_known_children_stays() -> None:
    assert deletable([lease("p", SHARD_END)], "w") == []


def test_a_child_named_by_the_parent_but_without_a_lease_yet_keeps_it() -> None:
    leases = split(SHARD_END, "100")
    leases[0] = leases[0].copy(child_shard_ids=frozenset({"c1", "c2"}))
    assert deletable(leases, "w") == []
    leases.append(lease("c2", "5", parent_shard_ids={"p"}))
    assert keys(deletable(leases, "w")) == ["p"]


def test_a_merged_child_lets_both_parents_go() -> None:
    leases = [
        lease("p1", SHARD_END),
        lease("p2", SHARD_END),
        lease("m", "77", parent_shard_ids={"p1", "p2"}),
    ]
    assert keys(deletable(leases, "w")) == ["p1", "p2"]


def test_deletion_runs_from_the_top_of_the_tree_down() -> None:
    leases = [
        lease("g", SHARD_END),
        lease("p", SHARD_END, parent_shard_ids={"g"}),
        lease("c", "5", parent_shard_ids={"p"}),
    ]
    assert keys(deletable(leases, "w")) == ["g"], "p waits until its own parent is gone"
    assert keys(deletable(leases[1:], "w")) == ["p"]


def test_the_owner_of_the_first_owned_child_deletes() -> None:
    leases = split(SHARD_END, "100", "200")
    leases[1] = leases[1].copy(lease_owner="B")
    leases[2] = leases[2].copy(lease_owner="A")
    assert keys(deletable(leases, "B")) == ["p"]
    assert deletable(leases, "A") == []
    unowned = split(SHARD_END, SHARD_END, SHARD_END)
    assert keys(deletable(unowned, "anyone")) == ["p"]


# -- the coordinator deletes on its scans; shard sync never recreates -------------------------


@pytest.fixture
def aws() -> Iterator[tuple[Any, LeaseTable]]:
    with mock_aws():
        dynamodb = boto3.client("dynamodb", region_name="us-east-1")
        kinesis = boto3.client("kinesis", region_name="us-east-1")
        table = LeaseTable(dynamodb, "app", sleep=lambda _: None)
        table.create_if_missing()
        yield kinesis, table


def test_the_child_holder_deletes_the_parent_on_its_next_scan(
    aws: tuple[Any, LeaseTable],
) -> None:
    _, table = aws
    for item in split(SHARD_END, TRIM_HORIZON, TRIM_HORIZON):
        assert table.create(item)
    worker = LeaseCoordinator(table, "A",
                              CoordinatorSettings(failover_time_s=10, renewal_threads=1))
    worker.run_taker_once()
    assert table.get("p") is not None, "children not started yet"
    for key in ("c1", "c2"):
        held = worker.get_held(key)
        assert held is not None and held.concurrency_token is not None
        worker.fence.update_checkpoint(key, held.concurrency_token, Position("123"))
    worker.run_taker_once()
    assert table.get("p") is None
    assert {item.lease_key for item in table.list_leases()} == {"c1", "c2"}


def test_cleanup_can_be_turned_off(aws: tuple[Any, LeaseTable]) -> None:
    _, table = aws
    for item in split(SHARD_END, "1", "2"):
        assert table.create(item)
    worker = LeaseCoordinator(table, "A",
                              CoordinatorSettings(cleanup_leases=False, renewal_threads=1))
    worker.run_taker_once()
    worker.run_taker_once()
    assert table.get("p") is not None


def test_a_parent_changed_since_the_scan_is_not_deleted(aws: tuple[Any, LeaseTable]) -> None:
    _, table = aws
    for item in split(SHARD_END, "1", "2"):
        assert table.create(item)
    stale = table.get("p")
    assert stale is not None
    table.update_child_shard_ids("p", ["c3"])
    table.renew(table.take(stale, "someone"))
    assert table.delete(stale) is False
    assert table.get("p") is not None


def test_child_leases_from_get_records_are_recorded_on_their_parents(
    aws: tuple[Any, LeaseTable],
) -> None:
    kinesis, table = aws
    assert table.create(lease("p", SHARD_END))
    syncer = ShardSyncer(kinesis, table, SyncedStream("s"))

    class Child:
        def __init__(self, shard_id: str, parents: list[str]) -> None:
            self.shard_id = shard_id
            self.parent_shards = parents
            self.starting_hash_key = "0"
            self.ending_hash_key = "1"

    syncer.create_child_leases([Child("c1", ["p"]), Child("c2", ["p", "never-leased"])])
    parent = table.get("p")
    assert parent is not None and parent.child_shard_ids == {"c1", "c2"}
    assert table.get("never-leased") is None


def _shard(shard_id: str, parent: str | None = None, *, closed: bool = False) -> Shard:
    return Shard(shard_id, parent, None, "0", "9", "1", "2" if closed else None)


def test_shard_sync_never_recreates_a_deleted_parent() -> None:
    shards = [_shard("p", closed=True), _shard("c1", "p"), _shard("c2", "p")]
    for position in (TRIM_HORIZON, LATEST, AT_TIMESTAMP):
        assert plan_new_leases(shards, {"c1", "c2"}, position) == []


class _ScanBeforeTheRequest(LeaseTable):
    """A table whose scans answer as of ``freeze()``: the taker cycle scanned, then the
    operator's request landed, then the cycle's cleanup acted on its scan."""

    frozen: list[Lease] | None = None

    def freeze(self) -> None:
        self.frozen = super().list_leases()

    def list_leases(self, *, consistent: bool = True) -> list[Lease]:
        return list(self.frozen) if self.frozen is not None else super().list_leases()


@pytest.mark.parametrize("renewed", [False, True], ids=["before-a-renewal", "after-a-renewal"])
def test_a_backfill_queued_on_a_finished_lease_after_the_cleanups_scan_is_kept(
    renewed: bool,
) -> None:
    """An operator's ``recovery add`` on a held finished parent leaves the counter alone, so a
    cleanup acting on a scan from before it passed the counter condition and deleted the
    request the command had reported queued."""
    with mock_aws():
        dynamodb = boto3.client("dynamodb", region_name="us-east-1")
        table = _ScanBeforeTheRequest(dynamodb, "app", sleep=lambda _: None)
        table.create_if_missing()
        for item in split("99", TRIM_HORIZON):
            assert table.create(item)
        worker, _ = coordinator(table, "A", Clock())
        worker.run_taker_once()
        for key, position in (("p", Position.shard_end()), ("c1", Position("123"))):
            held = worker.get_held(key)
            assert held is not None and held.concurrency_token is not None
            worker.fence.update_checkpoint(key, held.concurrency_token, position)
        table.freeze()
        parent = table.get("p")
        assert parent is not None and parent.is_finished and parent.lease_owner == "A"
        gap = RecoveryRequest.gap(TRIM_HORIZON, 0, 1_000, None, "1", last_sequence="99")
        holder, queue, _ = control._request(table, parent, asked.adding(gap, 2_000))
        assert (holder, len(queue)) == ("A", 1)
        if renewed:
            worker.run_renewer_once()
        worker.run_taker_once()
        kept = table.get("p")
        assert kept is not None and len(kept.recovery_requests) == 1
        assert worker.get_held("p") is not None, "kept held, for the consumer that reads it"
