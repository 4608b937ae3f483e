"""tests/support/waiting.py: the one wait of the suite returns what it waited for, and a
timeout says what was awaited and what was seen last."""

from __future__ import annotations

import itertools

import pytest

from tests.support.waiting import wait_for


def test_returns_the_first_truthy_value_the_predicate_gave() -> None:
    counter = itertools.count()
    assert wait_for(lambda: [n] if (n := next(counter)) >= 3 else [], 10, interval=0) == [3]


def test_a_timeout_names_what_was_awaited_and_the_last_value_seen() -> None:
    seen = iter(range(1_000_000))
    with pytest.raises(AssertionError, match=r"waiting for the answer; last seen: \[\]") as error:
        wait_for(lambda: [] if next(seen) >= 0 else [1], 0.05, "the answer", interval=0.01)
    assert "timed out after 0.05 s" in str(error.value)


def test_without_a_message_the_predicates_name_is_shown_and_long_values_are_cut() -> None:
    def nothing_yet() -> str:
        return ""

    with pytest.raises(AssertionError, match=r"waiting for nothing_yet; last seen: ''$"):
        wait_for(nothing_yet, 0)
    with pytest.raises(AssertionError, match=r"last seen: Empty\(x+\.\.\. \(1007 characters\)$"):
        wait_for(lambda: Empty("x" * 1000), 0)


class Empty:
    """A falsy value with a long repr, as a big status document that is not there yet."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"Empty({self.text})"


def test_an_exception_in_the_predicate_is_raised_at_once() -> None:
    def broken() -> bool:
        raise KeyError("probe")

    with pytest.raises(KeyError, match="probe"):
        wait_for(broken, 3600)


def test_a_predicate_keeping_its_state_elsewhere_shows_that_state_at_the_timeout() -> None:
    polls: list[int] = []

    def settled() -> None:
        polls.append(len(polls))

    with pytest.raises(AssertionError, match=r"waiting for quiet; last seen: 'polled [1-9]\d* x'"):
        wait_for(settled, 0.05, "quiet", interval=0.01, seen=lambda: f"polled {len(polls)} x")
