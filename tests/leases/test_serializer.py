"""Lease <-> item mapping in the Java KCL schema, and the update-expression builder."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kclpy.leases.lease import Lease
from kclpy.leases.serializer import UpdateBuilder, lease_from_item, lease_to_new_item, n, s, ss
from kclpy.position import AT_TIMESTAMP, LATEST, SHARD_END, TRIM_HORIZON, Position

JAVA_ITEM: dict[str, Any] = {
    "leaseKey": {"S": "shardId-000000000007"},
    "leaseOwner": {"S": "ip-10-0-0-1.ec2.internal:4f9c0e2a"},
    "leaseCounter": {"N": "1234"},
    "checkpoint": {"S": "49590338271490256608559692538361571095921575989136588898"},
    "checkpointSubSequenceNumber": {"N": "7"},
    "pendingCheckpoint": {"S": "49590338271490256608559692538361571095921575989136589000"},
    "pendingCheckpointSubSequenceNumber": {"N": "2"},
    "pendingCheckpointState": {"B": b"\x00\x01state"},
    "ownerSwitchesSinceCheckpoint": {"N": "3"},
    "parentShardId": {"SS": ["shardId-000000000001", "shardId-000000000002"]},
    "childShardIds": {"SS": ["shardId-000000000009"]},
    "startingHashKey": {"S": "0"},
    "endingHashKey": {"S": "170141183460469231731687303715884105727"},
    "checkpointOwner": {"S": "old-worker"},
    "throughputKBps": {"N": "12.5"},
    "someFutureAttribute": {"M": {"x": {"S": "y"}}},
}


def test_reads_every_java_attribute() -> None:
    lease = lease_from_item(JAVA_ITEM)
    assert lease == Lease(
        lease_key="shardId-000000000007",
        lease_owner="ip-10-0-0-1.ec2.internal:4f9c0e2a",
        lease_counter=1234,
        checkpoint=Position("49590338271490256608559692538361571095921575989136588898", 7),
        pending_checkpoint=Position("49590338271490256608559692538361571095921575989136589000", 2),
        pending_checkpoint_state=b"\x00\x01state",
        owner_switches_since_checkpoint=3,
        parent_shard_ids=frozenset({"shardId-000000000001", "shardId-000000000002"}),
        child_shard_ids=frozenset({"shardId-000000000009"}),
        starting_hash_key="0",
        ending_hash_key="170141183460469231731687303715884105727",
        checkpoint_owner="old-worker",
    )
    assert lease.concurrency_token is None


def test_a_java_item_is_written_back_as_java_wrote_it() -> None:
    """The checkpoint and the pending checkpoint are one value each in the lease and two
    attributes each in the item: the same two, with the same values, both ways."""
    item = lease_to_new_item(lease_from_item(JAVA_ITEM))
    assert item == {name: value for name, value in JAVA_ITEM.items()
                    if name not in ("throughputKBps", "someFutureAttribute")}


@pytest.mark.parametrize("sentinel", [TRIM_HORIZON, LATEST, AT_TIMESTAMP, SHARD_END])
def test_reads_sentinel_checkpoints(sentinel: str) -> None:
    lease = lease_from_item(
        {
            "leaseKey": {"S": "shardId-0"},
            "leaseCounter": {"N": "0"},
            "checkpoint": {"S": sentinel},
            "checkpointSubSequenceNumber": {"N": "0"},
        }
    )
    assert lease.checkpoint.sequence_number == sentinel
    assert lease.is_shard_end == (sentinel == SHARD_END)


def test_minimal_unowned_item_gets_defaults() -> None:
    lease = lease_from_item({"leaseKey": {"S": "shardId-0"}, "leaseCounter": {"N": "5"}})
    assert lease.lease_owner is None
    assert lease.lease_counter == 5
    assert lease.checkpoint == Position.trim_horizon()
    assert lease.parent_shard_ids == frozenset()
    assert lease.pending_checkpoint is None


def test_pending_sub_sequence_without_pending_checkpoint_is_ignored() -> None:
    lease = lease_from_item(
        {"leaseKey": {"S": "k"}, "pendingCheckpointSubSequenceNumber": {"N": "4"}}
    )
    assert lease.pending_checkpoint is None


def test_item_without_string_lease_key_is_rejected() -> None:
    with pytest.raises(ValueError, match="leaseKey"):
        lease_from_item({"leaseKey": {"N": "1"}})


@pytest.mark.parametrize(("attribute", "value"), [
    ("checkpoint", "12ab"), ("pendingCheckpoint", "-5"), ("checkpoint", "\u0661\u0662")])
def test_an_item_with_a_checkpoint_no_kcl_writes_is_rejected_naming_lease_and_attribute(
    attribute: str, value: str
) -> None:
    item = {"leaseKey": s("shardId-7"), "checkpoint": s("42"), attribute: s(value)}
    with pytest.raises(ValueError, match=f"lease shardId-7: {attribute} '{value}'"):
        lease_from_item(item)


def test_new_item_has_java_attribute_names_and_omits_unset_optionals() -> None:
    item = lease_to_new_item(Lease("shardId-1", checkpoint=Position.latest()))
    assert item == {
        "leaseKey": {"S": "shardId-1"},
        "leaseCounter": {"N": "0"},
        "checkpoint": {"S": "LATEST"},
        "checkpointSubSequenceNumber": {"N": "0"},
        "ownerSwitchesSinceCheckpoint": {"N": "0"},
    }


def test_concurrency_token_is_never_written() -> None:
    lease = Lease("k", lease_owner="w", concurrency_token="secret")
    assert "secret" not in repr(lease_to_new_item(lease))


_ids = st.text(alphabet="abcdef0123456789-", min_size=1, max_size=20)
_optional_numbers = st.one_of(st.none(), st.integers(min_value=0, max_value=2**64))


@st.composite
def leases(draw: st.DrawFn) -> Lease:
    pending = draw(st.one_of(st.none(), st.integers(min_value=0).map(str)))
    pending_sub = draw(st.integers(min_value=0, max_value=2**31))
    hash_keys = draw(st.one_of(st.none(), st.tuples(_ids, _ids)))
    return Lease(
        lease_key=draw(_ids),
        lease_owner=draw(st.one_of(st.none(), _ids)),
        lease_counter=draw(st.integers(min_value=0, max_value=2**63)),
        checkpoint=Position(
            draw(st.one_of(
                st.sampled_from([TRIM_HORIZON, LATEST, AT_TIMESTAMP, SHARD_END]),
                st.integers(min_value=0, max_value=10**60).map(str),
            )),
            draw(st.integers(min_value=0, max_value=2**31)),
        ),
        pending_checkpoint=None if pending is None else Position(pending, pending_sub),
        pending_checkpoint_state=draw(st.one_of(st.none(), st.binary(max_size=16))),
        owner_switches_since_checkpoint=draw(st.integers(min_value=0, max_value=1000)),
        parent_shard_ids=draw(st.frozensets(_ids, max_size=2)),
        child_shard_ids=draw(st.frozensets(_ids, max_size=3)),
        starting_hash_key=None if hash_keys is None else hash_keys[0],
        ending_hash_key=None if hash_keys is None else hash_keys[1],
        checkpoint_owner=draw(st.one_of(st.none(), _ids)),
    )


@given(leases())
def test_new_item_round_trips(lease: Lease) -> None:
    assert lease_from_item(lease_to_new_item(lease)) == lease


def test_string_set_is_sorted_and_never_empty() -> None:
    assert ss(["b", "a", "b"]) == {"SS": ["a", "b"]}
    with pytest.raises(ValueError, match="empty"):
        ss([])


def test_update_builder_uses_placeholders_for_every_name_and_value() -> None:
    request = (
        UpdateBuilder()
        .set("leaseCounter", n(8))
        .set("leaseOwner", s("w"))
        .add("ownerSwitchesSinceCheckpoint", n(1))
        .remove("checkpointOwner")
        .expect_equal("leaseCounter", n(7))
        .expect_owner(None)
        .request()
    )
    names = request["ExpressionAttributeNames"]
    by_name = {name: placeholder for placeholder, name in names.items()}
    counter, owner = by_name["leaseCounter"], by_name["leaseOwner"]
    assert request["UpdateExpression"] == (
        f"SET {counter} = :v0, {owner} = :v1 "
        f"ADD {by_name['ownerSwitchesSinceCheckpoint']} :v2 "
        f"REMOVE {by_name['checkpointOwner']}"
    )
    assert request["ConditionExpression"] == (f"{counter} = :v3 AND attribute_not_exists({owner})")
    assert request["ExpressionAttributeValues"] == {
        ":v0": {"N": "8"},
        ":v1": {"S": "w"},
        ":v2": {"N": "1"},
        ":v3": {"N": "7"},
    }
    assert len(names) == 4


def test_update_builder_without_values_or_conditions_omits_them() -> None:
    request = UpdateBuilder().remove("leaseOwner").request()
    assert "ExpressionAttributeValues" not in request
    assert "ConditionExpression" not in request


def test_update_builder_refuses_an_empty_update() -> None:
    with pytest.raises(ValueError, match="at least one"):
        UpdateBuilder().expect_present("leaseKey").request()


# -- Lease.copy: dataclasses.replace made cheap, the same lease field for field --------------

def _lease_with_every_field() -> Lease:
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
    lease = _lease_with_every_field()
    for changes in ({}, {"lease_counter": 8, "lease_owner": None},
                    {"concurrency_token": "other", "checkpoint": Position.trim_horizon()}):
        copied, replaced = lease.copy(**changes), dataclasses.replace(lease, **changes)
        assert copied is not lease
        # compare=False fields too: equality alone would not see them
        assert {f.name: getattr(copied, f.name) for f in dataclasses.fields(Lease)} == {
            f.name: getattr(replaced, f.name) for f in dataclasses.fields(Lease)}
        assert vars(copied) == vars(replaced)


def test_a_copy_is_independent_of_the_original() -> None:
    lease = _lease_with_every_field()
    copied = lease.copy()
    copied.lease_counter = 99
    assert lease.lease_counter == 7


def test_a_copy_refuses_a_field_a_lease_does_not_have() -> None:
    with pytest.raises(TypeError, match="lease_countr"):
        _lease_with_every_field().copy(lease_countr=1)
