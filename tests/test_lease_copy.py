"""``Lease.copy`` is ``dataclasses.replace`` made cheap: the same lease, field for field."""

from __future__ import annotations

import dataclasses

import pytest

from kclpy.leases.lease import Lease
from kclpy.position import Position


def _every_field_set() -> Lease:
    return Lease("shardId-000000000001", lease_owner="w1", lease_counter=7,
                 checkpoint=Position.of("123", 2), pending_checkpoint=Position.of("124"),
                 pending_checkpoint_state=b"state", owner_switches_since_checkpoint=3,
                 parent_shard_ids=frozenset({"shardId-000000000000"}),
                 child_shard_ids=frozenset({"shardId-000000000002"}), starting_hash_key="0",
                 ending_hash_key="9", checkpoint_owner="w0", recovery="[]",
                 recovery_requests=frozenset({"r"}), start_at_ms=5, parked="{}", stream=None,
                 incarnation="1:2:3", stream_name="s", kclpy_holder="w1",
                 assignment_notice="n", last_write="lw", write_id="wi",
                 concurrency_token="tok")


def test_a_copy_has_every_field_of_the_original_and_the_changes() -> None:
    lease = _every_field_set()
    for changes in ({}, {"lease_counter": 8, "lease_owner": None},
                    {"concurrency_token": "other", "checkpoint": Position.trim_horizon()}):
        copied, replaced = lease.copy(**changes), dataclasses.replace(lease, **changes)
        assert copied is not lease
        # compare=False fields too: equality alone would not see them
        assert {f.name: getattr(copied, f.name) for f in dataclasses.fields(Lease)} == {
            f.name: getattr(replaced, f.name) for f in dataclasses.fields(Lease)}
        assert vars(copied) == vars(replaced)


def test_a_copy_is_independent_of_the_original() -> None:
    lease = _every_field_set()
    copied = lease.copy()
    copied.lease_counter = 99
    assert lease.lease_counter == 7


def test_a_copy_refuses_a_field_a_lease_does_not_have() -> None:
    with pytest.raises(TypeError, match="lease_countr"):
        _every_field_set().copy(lease_countr=1)
