"""Expressions: gen/select argument checks and regex trimming (no model needed)."""

from __future__ import annotations

import pytest

from treadle.lang import RegexMismatchError, gen, select
from treadle.lang.ir import Concat, Gen, Text, trim_to_regex


def test_trim_to_regex_prefers_the_longest_matching_prefix():
    assert trim_to_regex("42 apples", r"\d+") == "42"
    assert trim_to_regex("2024-01-05 and more", r"\d{4}-\d{2}-\d{2}") == "2024-01-05"


def test_trim_to_regex_falls_back_to_the_first_match_inside():
    assert trim_to_regex("The answer is 7.", r"\d+") == "7"


def test_trim_to_regex_raises_when_nothing_matches():
    with pytest.raises(RegexMismatchError, match="does not constrain decoding"):
        trim_to_regex("no digits here", r"\d+")


def test_plus_concatenates_text_and_calls():
    expr = "Q: " + gen("a", max_tokens=3) + "!"
    assert isinstance(expr, Concat)
    assert [type(p) for p in expr.parts] == [Text, Gen, Text]


def test_bad_arguments_are_rejected_early():
    with pytest.raises(ValueError, match="invalid regex"):
        gen("x", regex="(")
    with pytest.raises(ValueError, match="at least one choice"):
        select("x", [])
    with pytest.raises(ValueError, match="non-empty string"):
        select("x", ["a", ""])
