"""The stop-string scanner the in-process backends share."""

from __future__ import annotations

from pool.backends._text import StopScanner


def test_the_scanner_names_the_stop_string_it_reached() -> None:
    scanner = StopScanner(("World", "lo W"))
    # "l" may start "lo W": it waits.
    assert scanner.feed("Hel") == ("He", False) and scanner.hit is None
    # Both stops are in the text now; the earlier one wins, and nothing of it is sent.
    assert scanner.feed("lo World") == ("l", True)
    assert scanner.hit == "lo W"


def test_text_that_may_start_a_stop_string_waits() -> None:
    scanner = StopScanner(("</s>",))
    assert scanner.feed("a </") == ("a ", False)
    assert scanner.feed("b") == ("</b", False) and scanner.hit is None
    assert scanner.feed(" </s> tail") == (" ", True) and scanner.hit == "</s>"
    assert StopScanner(()).feed("anything") == ("anything", False)
