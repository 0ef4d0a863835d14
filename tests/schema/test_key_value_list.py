"""The shared `key=value,...` tokeniser: entries trimmed then percent-decoded, blanks left out, positions kept."""
from __future__ import annotations

import pytest

from traceml.schema.key_value_list import KeyValueEntry, key_value_entries


def test_entries_are_trimmed_then_percent_decoded_in_order():
    assert list(key_value_entries(" a = 1 ,b=x%3Dy%2Cz, c%20d =%20e")) == [
        KeyValueEntry(1, "a", "1"), KeyValueEntry(2, "b", "x=y,z"), KeyValueEntry(3, "c d", " e")]


@pytest.mark.parametrize("raw", [None, "", " ", ",,"])
def test_nothing_given_is_no_entries(raw):
    assert list(key_value_entries(raw)) == []


def test_positions_count_blank_entries_which_are_left_out():
    assert [e.position for e in key_value_entries("a=1,,b=2,")] == [1, 3]


def test_an_entry_without_equals_has_no_value_and_an_empty_value_is_kept():
    assert list(key_value_entries("orphan,k=")) == [KeyValueEntry(1, "orphan", None), KeyValueEntry(2, "k", "")]


def test_only_the_first_equals_separates_key_from_value():
    assert list(key_value_entries("k=a=b")) == [KeyValueEntry(1, "k", "a=b")]
