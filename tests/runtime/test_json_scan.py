"""`json_scan`: reading JSON bytes without parsing them, against the parser itself (Hypothesis).

- `count_values` is the exact number of values the parser builds, `values_bound` never below it;
- `top_level_members` and `array_items` find the spans the parser reads; a body cut into `object_pieces` and
  joined parses as the body less the dropped members, plus the extra ones;
- a large body read member by member and item by item (`calls._read_in_pieces`) is the whole parse, or None when
  the whole parse would refuse it (so the whole parse names the error).
"""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from basin_runtime.gateway import calls
from basin_runtime.gateway.json_scan import (
    array_items,
    count_values,
    object_pieces,
    top_level_members,
    values_bound,
)

EXAMPLES = settings(max_examples=300, deadline=None)
texts = st.text(alphabet=st.characters(codec="utf-8"), max_size=8) | st.sampled_from(['a,b', '{[', '"', '\\', ',,,'])
scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False)
values = st.recursive(scalars | texts, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner,
                                                                                                    max_size=4),
                      max_leaves=20)
objects = st.dictionaries(texts, values, max_size=5)
spacing = st.sampled_from([None, 0, 2])  # json.dumps indent: compact, newlines, or indented


def dumped(value: Any, indent: int | None) -> bytes:
    return json.dumps(value, indent=indent, ensure_ascii=False).encode("utf-8")


def num_values(value: Any) -> int:
    """What the parser builds: every value, containers included (not the keys)."""
    if isinstance(value, dict):
        return 1 + sum(num_values(v) for v in value.values())
    if isinstance(value, list):
        return 1 + sum(num_values(v) for v in value)
    return 1


@EXAMPLES
@given(value=values, indent=spacing)
def test_count_values_is_exact_and_the_bound_never_below_it(value: Any, indent: int | None) -> None:
    raw = dumped(value, indent)
    exact = num_values(value)
    assert count_values(raw, 10**9) == exact
    assert values_bound(raw) >= exact
    limit = max(0, exact - 1)
    assert count_values(raw, limit) > limit  # stops as soon as it passes the limit, past it


@EXAMPLES
@given(body=objects, indent=spacing)
def test_members_and_items_are_the_spans_the_parser_reads(body: dict[str, Any], indent: int | None) -> None:
    raw = dumped(body, indent)
    members = top_level_members(raw)
    assert members is not None and [m[0] for m in members] == list(body)
    for key, start, value_start, end in members:
        assert raw[start:value_start].rstrip(b" \t\r\n:").decode() == json.dumps(key, ensure_ascii=False)
        assert json.loads(raw[value_start:end]) == body[key]
        items = array_items(raw, value_start, end)
        if isinstance(body[key], list):
            assert items is not None and [json.loads(raw[i:j]) for i, j in items] == body[key]
        else:
            assert items is None


@EXAMPLES
@given(body=objects, indent=spacing, data=st.data())
def test_object_pieces_drop_members_and_add_the_extra_ones(body: dict[str, Any], indent: int | None,
                                                           data: st.DataObject) -> None:
    raw = dumped(body, indent)
    members = top_level_members(raw)
    assert members is not None
    dropped = data.draw(st.sets(st.sampled_from(list(body))) if body else st.just(set()), label="dropped")
    extra = {"priority": 3, "rid": "r_t0"}
    joined = b"".join(object_pieces(raw, [m for m in members if m[0] not in dropped],
                                    b",".join(orjson.dumps(k) + b":" + orjson.dumps(v) for k, v in extra.items())))
    assert json.loads(joined) == {**{k: v for k, v in body.items() if k not in dropped}, **extra}


@pytest.mark.parametrize("raw", [b'{"a": 1} x', b'{"a": 1', b'[1, 2]', b'{"a" 1}', b'{"a": [1, 2}', b'{"a": 1,}'])
def test_what_is_not_one_object_scans_as_none(raw: bytes) -> None:
    assert top_level_members(raw) is None


@EXAMPLES
@given(body=objects, indent=spacing, data=st.data())
def test_a_body_read_in_pieces_is_the_whole_parse_or_none(body: dict[str, Any], indent: int | None,
                                                         data: st.DataObject) -> None:
    raw = dumped(body, indent)
    if data.draw(st.booleans(), label="broken"):  # a byte changed, cut or added: the whole parse must decide
        k = data.draw(st.integers(0, len(raw)), label="at")
        raw = raw[:k] + data.draw(st.sampled_from([b"", b"x", b",", b"]", b"\xff", b"NaN", b" 1"]), label="with") + \
            raw[k + data.draw(st.integers(0, 2), label="cut"):]
    try:
        whole = json.loads(raw.decode("utf-8"), parse_constant=calls._no_constant, parse_float=calls._finite_float)
    except ValueError:
        whole = ValueError
    threshold, calls.PIECEWISE_PARSE_BYTES = calls.PIECEWISE_PARSE_BYTES, 0  # every array read item by item
    try:
        pieces = calls._read_in_pieces(raw)
    finally:
        calls.PIECEWISE_PARSE_BYTES = threshold
    assert pieces is None or pieces == whole
    if not isinstance(whole, dict):
        assert pieces is None
