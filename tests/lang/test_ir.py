"""Expressions: gen/select argument checks (no model needed)."""

from __future__ import annotations

import pytest

from treadle.lang import gen, select
from treadle.lang.ir import Concat, Gen, Text


def test_plus_concatenates_text_and_calls():
    expr = "Q: " + gen("a", max_tokens=3) + "!"
    assert isinstance(expr, Concat)
    assert [type(p) for p in expr.parts] == [Text, Gen, Text]


def test_bad_arguments_are_rejected_early():
    with pytest.raises(ValueError, match="invalid regex"):
        gen("x", regex="(")
    with pytest.raises(ValueError, match="not both"):
        gen("x", regex="a", json_schema={"type": "object"})
    with pytest.raises(ValueError, match="at least one choice"):
        select("x", [])
    with pytest.raises(ValueError, match="non-empty string"):
        select("x", ["a", ""])


def test_constraints_travel_as_sampling_parameters():
    assert gen("x", regex="[0-9]+").sampling_overrides() == {"regex": "[0-9]+"}
    assert gen("x", json_schema={"type": "object"}).sampling_overrides() == {"json_schema": '{"type": "object"}'}
