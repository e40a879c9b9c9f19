"""The shared key reader (`basin_runtime/schema.py`): checks, checks implied by annotations, whole-mapping
reads, and errors naming the key path and the value."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import pytest

from basin_runtime.schema import (
    BadKeys,
    BadValue,
    Check,
    Flag,
    Key,
    ListOf,
    Maybe,
    Number,
    OneOf,
    Record,
    Text,
    Whole,
    check_for,
    key,
    read_fields,
    read_keys,
)


@pytest.mark.parametrize(("check", "good", "kept", "bad", "expected"), [
    (Whole(), 3, 3, True, "a whole number"),
    (Whole(min=0), 0, 0, -1, "a whole number >= 0"),
    (Whole(min=1), 1, 1, 0, "a whole number > 0"),
    (Whole(min=3, max=5), 5, 5, 6, "a whole number from 3 to 5"),
    (Number(gt=0), 2, 2.0, 0, "a number > 0"),
    (Number(ge=0, le=1, noun="a finite number"), 1, 1.0, float("nan"), "a finite number in [0, 1]"),
    (Number(gt=0, lt=1), 0.5, 0.5, float("inf"), "a number in (0, 1)"),
    (Flag(), False, False, 0, "true or false"),
    (Text(), "x", "x", "", "a non-empty string"),
    (Text(r"a+", rstrip="/"), "aa", "aa", "ab", "a string matching a+"),
    (OneOf(("gpu", "host")), "gpu", "gpu", "ssd", "one of ['gpu', 'host']"),
    (Maybe(Whole(min=1)), None, None, 0, "a whole number > 0"),
    (ListOf(Whole(), length=2), [1, 2], (1, 2), [1], "a 2 list (a whole number each)"),
    (ListOf(Text(), min_items=1, one_ok=True), "a", ("a",), [], "a non-empty list (a non-empty string each)"),
    (Number(ge=0.5, says="a lease of at least 0.5 s"), 0.5, 0.5, 0.4, "a lease of at least 0.5 s"),
])
def test_a_check_keeps_a_good_value_and_names_what_it_expected_of_a_bad_one(
        check: Check, good: object, kept: object, bad: object, expected: str) -> None:
    assert check.read("k", good) == kept
    assert type(check.read("k", good)) is type(kept)
    with pytest.raises(BadValue) as caught:
        check.read("k", bad)
    assert str(caught.value) == f"k must be {expected}, got {bad!r}"


def test_a_list_names_the_item_it_refuses() -> None:
    with pytest.raises(BadValue, match=r"^calls\[1\] must be a whole number >= 2, got 1$"):
        ListOf(Whole(min=2)).read("calls", [3, 1])


@dataclass(frozen=True)
class Burst:
    from_s: float
    kill_at_s: float | None = None


@dataclass(frozen=True)
class Plan:
    name: str
    seeds: tuple[int, ...]
    window: tuple[float, float]
    cache: Literal["gpu", "host"]
    bursts: tuple[Burst, ...] = ()
    is_on: bool = False
    workers: int = field(default=1, metadata=key(Whole(min=1), "worker processes"))


def test_annotations_imply_checks_and_a_declared_one_wins() -> None:
    assert check_for(int) == Whole() and check_for(bool) == Flag() and check_for(str) == Text()
    assert check_for(float | None) == Maybe(Number(noun="a float"))
    assert check_for(tuple[int, int]) == ListOf(Whole(), length=2)
    assert check_for(Burst) == Record(Burst)
    with pytest.raises(TypeError, match="declare one"):
        check_for(dict[str, int])
    raw = {"name": "p", "seeds": [1, 2], "window": [0, 1.5], "cache": "host", "bursts": [{"from_s": 3}],
           "workers": 2}
    assert Plan(**read_fields(Plan, raw)) == Plan("p", (1, 2), (0.0, 1.5), "host", (Burst(3.0),), False, 2)
    with pytest.raises(BadValue, match=r"^workers must be a whole number > 0, got 0$"):
        read_fields(Plan, {**raw, "workers": 0})


@pytest.mark.parametrize(("change", "message"), [
    ({"bursts": [{"from_s": "soon"}]}, r"^plan\.bursts\[0\]\.from_s must be a float, got 'soon'$"),
    ({"bursts": [{"kill": 1}]}, r"^plan\.bursts\[0\]: missing key 'from_s'; unknown key 'kill' \(did you mean "
                                r"'kill_at_s'\?\)$"),
    ({"cache": "ssd"}, r"^plan\.cache must be one of \['gpu', 'host'\], got 'ssd'$"),
    ({"seeds": "1"}, r"^plan\.seeds must be a list \(a whole number each\), got '1'$"),
    ({"name": None}, r"^plan\.name must be a non-empty string, got None$"),
])
def test_an_error_names_the_key_path_and_the_value(change: dict[str, object], message: str) -> None:
    raw = {"name": "p", "seeds": [1], "window": [0, 1], "cache": "gpu", **change}
    with pytest.raises(BadValue if "must be" in message else BadKeys, match=message):
        read_fields(Plan, raw, "plan")


def test_keys_are_checked_whole_before_any_value() -> None:
    keys = {"a": Key(Whole()), "b": Key(Whole())}
    with pytest.raises(BadKeys) as caught:
        read_keys({"a": "bad", "c": 1}, keys, required=("b",))
    assert (caught.value.missing, caught.value.unknown, caught.value.known) == (["b"], ["c"], ["a", "b"])
    with pytest.raises(BadValue, match=r"^the top level must be a mapping, got"):
        read_keys([1], keys)


def test_every_unknown_key_at_every_level_is_named_in_one_error_with_the_closest_known_one() -> None:
    # Issue 45: a file's typos were reported one nesting level at a time, with `missing keys []`.
    raw = {"name": "p", "seeds": [1], "window": [0, 1], "cache": "gpu", "workerz": 2,
           "bursts": [{"from_s": 1, "kill_at": 2}, {"from_s": 2}, {"frm_s": 3}]}
    with pytest.raises(BadKeys) as caught:
        read_fields(Plan, raw, "plan")
    assert [(p.where, p.missing, p.unknown) for p in caught.value.problems] == [
        ("plan", (), ("workerz",)), ("plan.bursts[0]", (), ("kill_at",)),
        ("plan.bursts[2]", ("from_s",), ("frm_s",))]
    assert str(caught.value) == (
        "plan: unknown key 'workerz' (did you mean 'workers'?); "
        "plan.bursts[0]: unknown key 'kill_at' (did you mean 'kill_at_s'?); "
        "plan.bursts[2]: missing key 'from_s'; unknown key 'frm_s' (did you mean 'from_s'?)")
    assert "missing keys []" not in str(caught.value)


def test_a_bad_value_beside_unknown_keys_joins_their_message() -> None:
    raw = {"name": "p", "seeds": ["x"], "window": [0, 1], "cache": "gpu", "cash": 1}
    with pytest.raises(BadKeys, match=r"^plan: unknown key 'cash' \(did you mean 'cache'\?\); plan\.seeds\[0\] must "
                                      r"be a whole number, got 'x'$"):
        read_fields(Plan, raw, "plan")


def test_a_null_optional_key_is_absent_only_when_asked() -> None:
    assert read_fields(Burst, {"from_s": 1, "kill_at_s": None}) == {"from_s": 1.0, "kill_at_s": None}
    assert "workers" not in read_fields(Plan, {"name": "p", "seeds": [], "window": [0, 1], "cache": "gpu",
                                               "workers": None}, null_is_absent=True)  # the default applies
    with pytest.raises(BadValue, match="workers must be a whole number > 0, got None"):
        read_fields(Plan, {"name": "p", "seeds": [], "window": [0, 1], "cache": "gpu", "workers": None})
