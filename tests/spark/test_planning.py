"""The source's batch planning on values alone (kclpy.spark.planning): no Java, no Spark
session, no emulator. Each test is one situation the driver meets (new shards, a split, a
merge, a closed shard at an AvailableNow target, budgets, nothing new, a shard gone) given
as the facts the driver would have gathered: the previous offset, the listed shards, the
resolved budgeted ends and what the probes found."""

from __future__ import annotations

import ast
from collections.abc import Mapping
from pathlib import Path

from kclpy.position import Position
from kclpy.spark import planning
from kclpy.spark.offsets import Budget, OffsetEntry, UptoEnd, decode_offset, encode_offset
from kclpy.spark.planning import (
    BatchPlan,
    Limits,
    ShardNode,
    Target,
    live_entries,
    plan_batch,
    probe_keys,
    share_budgets,
    starts,
)
from kclpy.spark.reading import Probe

NOW = 1_700_000_010_000
SETTLE = 1_000
#: where a batch planned at NOW ends
UNTIL = NOW - SETTLE
FRESH = Probe(first_arrival_ms=UNTIL - 500)


def at(ms: int) -> Position:
    return Position.at_timestamp(ms)


def listed(*nodes: ShardNode) -> dict[str, ShardNode]:
    return {node.key: node for node in nodes}


def plan(previous: Mapping[str, OffsetEntry], shards: Mapping[str, ShardNode],
         found: Mapping[str, Probe], *, resolved: Mapping[str, Position] | None = None,
         target: Target | None = None, limits: Limits | None = None,
         turn: int = 0) -> tuple[BatchPlan, list[str]]:
    """One planning step as the driver takes it: the plan and the shards it probed (a probe
    the driver would not have made is never consulted, so ``found`` may name any shard)."""
    given, _ = live_entries(previous, shards)
    reached: dict[str, Position] = {}
    for key, entry in given.items():
        if isinstance(entry, UptoEnd):
            assert resolved is not None, f"{key}: where its UPTO end stopped is a given"
            reached[key] = resolved[key]
        else:
            reached[key] = entry
    positions = starts(reached, shards)
    probed = probe_keys(given, positions, shards, target)
    result = plan_batch(given, positions, shards, {k: found[k] for k in probed if k in found},
                        now_ms=NOW, settle_ms=SETTLE, target=target, limits=limits, turn=turn,
                        plan_id="p1")
    return result, probed


def test_nothing_new_gives_back_the_same_offset() -> None:
    shards = listed(ShardNode("s0"), ShardNode("s1"))
    previous: dict[str, OffsetEntry] = {"s0": Position("100", 0), "s1": at(UNTIL - 5_000)}
    result, probed = plan(previous, shards, {"s0": Probe(), "s1": Probe()})
    assert probed == ["s0", "s1"]
    assert result.moving == () and result.offset == previous
    assert encode_offset(result.offset) == encode_offset(previous)


def test_records_younger_than_the_settle_time_wait_for_a_later_batch() -> None:
    shards = listed(ShardNode("s0"), ShardNode("s1"))
    previous: dict[str, OffsetEntry] = {"s0": Position("100", 0), "s1": Position("200", 0)}
    young = Probe(first_arrival_ms=UNTIL)
    result, _ = plan(previous, shards, {"s0": FRESH, "s1": young})
    assert result.moving == ("s0",)
    assert result.offset == {"s0": at(UNTIL), "s1": Position("200", 0)}


def test_a_shard_listed_for_the_first_time_is_read_from_its_beginning() -> None:
    shards = listed(ShardNode("s0"), ShardNode("s1"))
    result, probed = plan({"s0": Position("100", 0)}, shards, {"s0": Probe(), "s1": FRESH})
    assert probed == ["s0", "s1"]
    assert result.moving == ("s1",)
    assert result.offset == {"s0": Position("100", 0), "s1": at(UNTIL)}


def test_a_new_shard_with_nothing_yet_is_listed_at_trim_horizon() -> None:
    shards = listed(ShardNode("s0"), ShardNode("s1"))
    result, _ = plan({"s0": Position("100", 0)}, shards, {"s0": Probe(), "s1": Probe()})
    assert result.offset["s1"] == Position.trim_horizon()


def test_a_split_reads_the_parent_to_its_end_before_either_child() -> None:
    shards = listed(ShardNode("p", closed=True), ShardNode("c1", ("p",)),
                    ShardNode("c2", ("p",)))
    everything_new = {"p": FRESH, "c1": FRESH, "c2": FRESH}

    first, probed = plan({"p": Position("100", 0)}, shards, everything_new)
    assert probed == ["p"], "children are not even probed while their parent has records"
    assert first.moving == ("p",)
    assert first.offset == {"p": at(UNTIL), "c1": Position.trim_horizon(),
                            "c2": Position.trim_horizon()}

    ended, _ = plan(first.offset, shards, {**everything_new, "p": Probe(shard_end=True)})
    assert ended.moving == ()
    assert ended.offset["p"] == Position.shard_end()
    assert ended.offset["c1"] == ended.offset["c2"] == Position.trim_horizon()

    children, probed = plan(ended.offset, shards, everything_new)
    assert probed == ["c1", "c2"]
    assert children.moving == ("c1", "c2")
    assert children.offset == {"p": Position.shard_end(), "c1": at(UNTIL), "c2": at(UNTIL)}


def test_a_merge_reads_its_child_only_after_both_parents_ended() -> None:
    shards = listed(ShardNode("a", closed=True), ShardNode("b", closed=True),
                    ShardNode("ab", ("a", "b")))
    previous: dict[str, OffsetEntry] = {"a": Position.shard_end(), "b": Position("300", 0)}
    one_left, probed = plan(previous, shards, {"b": FRESH, "ab": FRESH})
    assert probed == ["b"] and one_left.moving == ("b",)
    assert one_left.offset["ab"] == Position.trim_horizon()

    both, _ = plan(one_left.offset, shards, {"b": Probe(shard_end=True), "ab": FRESH})
    assert both.offset["b"] == Position.shard_end() and both.moving == ()

    child, probed = plan(both.offset, shards, {"ab": FRESH})
    assert probed == ["ab"] and child.moving == ("ab",)
    assert child.offset["ab"] == at(UNTIL)


def test_a_parent_no_longer_listed_holds_no_child_back() -> None:
    shards = listed(ShardNode("c", ("expired-parent",)))
    result, probed = plan({}, shards, {"c": FRESH})
    assert probed == ["c"] and result.offset == {"c": at(UNTIL)}


def test_a_shard_at_its_end_is_never_probed_again() -> None:
    shards = listed(ShardNode("done", closed=True))
    result, probed = plan({"done": Position.shard_end()}, shards, {"done": FRESH})
    assert probed == [] and result.offset == {"done": Position.shard_end()}


def test_at_the_available_now_target_only_a_closed_shard_is_probed_for_its_end() -> None:
    target = Target(UNTIL - 2_000, frozenset({"open", "closed", "child"}))
    shards = listed(ShardNode("open"), ShardNode("closed", closed=True),
                    ShardNode("child", ("closed",)), ShardNode("later"))
    previous: dict[str, OffsetEntry] = {"open": at(target.until_ms),
                                        "closed": at(target.until_ms)}
    found = {"closed": Probe(shard_end=True), "open": FRESH, "later": FRESH, "child": FRESH}
    result, probed = plan(previous, shards, found, target=target)
    assert probed == ["closed"], "a shard listed after the target's shards belongs to no batch"
    assert result.offset == {"open": at(target.until_ms), "closed": Position.shard_end(),
                             "child": Position.trim_horizon(),
                             "later": Position.trim_horizon()}


def test_a_batch_never_ends_after_the_available_now_target() -> None:
    target = Target(UNTIL - 2_000, frozenset({"s0"}))
    result, _ = plan({"s0": Position("100", 0)}, listed(ShardNode("s0")),
                     {"s0": Probe(first_arrival_ms=target.until_ms - 1)}, target=target)
    assert result.offset == {"s0": at(target.until_ms)}


def test_a_probe_that_could_not_decide_counts_as_something_new() -> None:
    result, _ = plan({"s0": Position("100", 0)}, listed(ShardNode("s0")),
                     {"s0": Probe(undecided=True)})
    assert result.moving == ("s0",)


def test_a_row_limit_is_shared_among_the_moving_shards_taking_turns_at_the_remainder() -> None:
    shards = listed(ShardNode("s0"), ShardNode("s1"), ShardNode("idle"))
    previous: dict[str, OffsetEntry] = {"s0": Position("100", 0), "s1": Position("200", 0),
                                        "idle": Position("300", 0)}
    found = {"s0": FRESH, "s1": FRESH, "idle": Probe()}
    first, _ = plan(previous, shards, found, limits=Limits(rows=5))
    assert first.moving == ("s0", "s1") and first.turn == 1
    assert first.offset == {
        "s0": UptoEnd(Position("100", 0), UNTIL, Budget(rows=3), "p1"),
        "s1": UptoEnd(Position("200", 0), UNTIL, Budget(rows=2), "p1"),
        "idle": Position("300", 0)}
    second, _ = plan(previous, shards, found, limits=Limits(rows=5), turn=first.turn)
    assert {k: e.budget.rows for k, e in second.offset.items() if isinstance(e, UptoEnd)} == {
        "s0": 2, "s1": 3}, "the other shard takes the remainder next time"


def test_fewer_rows_than_moving_shards_leave_the_others_for_a_later_batch() -> None:
    budgets = [share_budgets(["a", "b", "c"], Limits(rows=1), turn) for turn in range(3)]
    assert budgets == [{"a": Budget(rows=1)}, {"b": Budget(rows=1)}, {"c": Budget(rows=1)}]


def test_per_shard_rows_bytes_and_time_limits_make_each_shards_budget() -> None:
    limits = Limits(rows=10, per_shard_rows=4, bytes=1001, duration_ms=2_000)
    assert share_budgets(["a", "b"], limits) == {
        "a": Budget(rows=4, bytes=501, duration_ms=2_000),
        "b": Budget(rows=4, bytes=501, duration_ms=2_000)}
    assert share_budgets(["a", "b"], Limits(per_shard_rows=7)) == {
        "a": Budget(rows=7), "b": Budget(rows=7)}


def test_limits_with_no_shard_moving_give_the_same_offset_and_keep_the_turn() -> None:
    previous: dict[str, OffsetEntry] = {"s0": Position("100", 0)}
    result, _ = plan(previous, listed(ShardNode("s0")), {"s0": Probe()},
                     limits=Limits(rows=5), turn=3)
    assert result.offset == previous and result.turn == 3


def test_a_budget_that_cut_a_part_short_moves_again_without_a_probe() -> None:
    shards = listed(ShardNode("cut"), ShardNode("quiet"))
    cut = UptoEnd(Position("100", 0), UNTIL - 9_000, Budget(rows=3), "old")
    quiet = UptoEnd(Position("200", 0), UNTIL - 9_000, Budget(rows=3), "old")
    previous: dict[str, OffsetEntry] = {"cut": cut, "quiet": quiet}
    # a budget stopped "cut" at a record; "quiet" read to its time (the tip or the bound)
    resolved = {"cut": Position("130", 2), "quiet": at(UNTIL - 9_000)}
    result, probed = plan(previous, shards, {"quiet": Probe(), "cut": Probe()},
                          resolved=resolved, limits=Limits(rows=4))
    assert probed == ["quiet"]
    assert result.moving == ("cut",)
    assert result.offset == {"cut": UptoEnd(Position("130", 2), UNTIL, Budget(rows=4), "p1"),
                             "quiet": quiet}, "a shard with nothing new keeps its UPTO end"


def test_a_shard_gone_before_its_end_loses_its_records_and_one_gone_at_its_end_nothing() -> None:
    previous = decode_offset({"shards": {"s0": "AFTER/100/0", "expired": "AFTER/50/1",
                                         "finished": "SHARD_END"}})
    kept, lost = live_entries(previous, listed(ShardNode("s0")))
    assert kept == {"s0": Position("100", 0)}
    assert lost == {"expired": Position("50", 1)}
    result, _ = plan(previous, listed(ShardNode("s0")), {"s0": FRESH})
    assert result.offset == {"s0": at(UNTIL)}, "a gone shard leaves the offset"


#: what would make planning depend on more than its arguments
IMPURE = {"time", "random", "datetime", "threading", "boto3", "botocore", "pyspark", "os"}


def imported_modules(source: str) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            names.add(node.module.split(".")[0])
    return names


def test_the_planning_module_imports_no_clock_client_or_randomness() -> None:
    """What keeps every planning decision a unit test on values (docs/design.md's guide):
    the driver's clock, AWS and Spark reach planning only as arguments."""
    source = Path(planning.__file__).read_text()
    assert imported_modules(source) & IMPURE == set()
    assert imported_modules("import time\nfrom botocore.client import Config\n") & IMPURE == {
        "time", "botocore"}
