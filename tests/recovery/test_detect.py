"""The first look recovery takes at a shard (kclpy/recovery/detect.py): the first record a
probe delivers, read past empty pages, and None once the probe is caught up, at the shard's
end, or out of pages - never a wait for records that are not there."""

from __future__ import annotations

from dataclasses import dataclass, field

from kclpy.records import Record, Records
from kclpy.recovery.detect import PROBE_PAGES, first_record
from kclpy.retrieval.page import Page


def page(*sequences: int, caught_up: bool = False) -> Page[Records]:
    records = [Record(str(n), "pk", None, 0, str(n).encode()) for n in sequences]
    return Page(Records([records]), None, False, (), caught_up)


@dataclass
class ScriptedProbe:
    """Answers its pages in order (None: the pipeline had nothing this time), then empty
    pages; ``caught_up`` and ``finished`` come true after the given number of fetches."""

    pages: list[Page[Records] | None]
    caught_up_after: int | None = None
    finished_after: int | None = None
    fetches: int = field(default=0, init=False)

    def fetch_once(self) -> Page[Records] | None:
        self.fetches += 1
        return self.pages.pop(0) if self.pages else page()

    @property
    def caught_up(self) -> bool:
        return self.caught_up_after is not None and self.fetches >= self.caught_up_after

    @property
    def finished(self) -> bool:
        return self.finished_after is not None and self.fetches >= self.finished_after


def test_the_first_record_is_found_past_empty_pages_and_nothing_is_read_after_it() -> None:
    probe = ScriptedProbe([page(), None, page(), page(7, 8), page(9)])
    first = first_record(probe)
    assert first is not None and first.sequence_number == "7"
    assert probe.fetches == 4


def test_a_caught_up_or_finished_shard_has_no_first_record() -> None:
    caught_up = ScriptedProbe([page(), page(5)], caught_up_after=1)
    assert first_record(caught_up) is None and caught_up.fetches == 1
    ended = ScriptedProbe([page(), page(), page(5)], finished_after=2)
    assert first_record(ended) is None and ended.fetches == 2


def test_a_record_on_the_page_that_catches_up_is_still_the_first() -> None:
    probe = ScriptedProbe([page(3, caught_up=True)], caught_up_after=1)
    first = first_record(probe)
    assert first is not None and first.sequence_number == "3"


def test_the_probe_gives_up_after_its_pages() -> None:
    endless = ScriptedProbe([])
    assert first_record(endless) is None
    assert endless.fetches == PROBE_PAGES
    late = ScriptedProbe([page(), page(), page(1)])
    assert first_record(late, pages=2) is None and late.fetches == 2
