"""The shared check of an optional typed field: what passes, and the exact error otherwise."""

from __future__ import annotations

import pytest

from pddgw.api.errors import ApiError, optional


def test_absent_or_null_is_none_and_a_value_of_the_kind_is_returned():
    assert optional({}, "stream", bool) is None
    assert optional({"stream": None}, "stream", bool) is None
    assert optional({"stream": False}, "stream", bool) is False
    assert optional({"model": "m"}, "model", str) == "m"
    assert optional({"format": {"type": "text"}}, "format", dict) == {"type": "text"}
    assert optional({"stream_id": "x" * 8}, "stream_id", str, max_len=8) == "x" * 8


@pytest.mark.parametrize("d, key, kind, kw, message, param", [
    ({"stream": 1}, "stream", bool, {}, "'stream' must be a boolean", "stream"),
    ({"model": 3}, "model", str, {}, "'model' must be a string", "model"),
    ({"format": []}, "format", dict, {"name": "text.format"}, "'text.format' must be an object", "text.format"),
    ({"stream_id": "x" * 9}, "stream_id", str, {"max_len": 8},
     "'stream_id' must be a string of at most 8 characters", "stream_id"),
    ({"stream_id": 5}, "stream_id", str, {"max_len": 8},
     "'stream_id' must be a string of at most 8 characters", "stream_id"),
])
def test_anything_else_is_an_api_error_naming_the_field(d, key, kind, kw, message, param):
    with pytest.raises(ApiError) as e:
        optional(d, key, kind, **kw)
    assert (str(e.value), e.value.param) == (message, param)
