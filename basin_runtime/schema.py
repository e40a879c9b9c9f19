"""Declared keys: what a mapping read from a file (or a command line) may hold, and the one reader of it.

Rules:
- A key is declared once, as a `Key`: its `Check` (what it accepts, in words and in code), its unit and
  its help. A dataclass declares its keys on its fields (`field(metadata=key(...))`); a field that
  declares nothing gets the check its type annotation implies (`check_for`: `bool`, `int`, `float`, `str`,
  `Literal[...]`, `X | None`, `tuple[X, ...]`, `tuple[X, X]`, a nested dataclass; anything else must
  declare one).
- `read_keys(raw, keys, required, where)` checks a mapping whole: not a mapping, or a required key
  missing, or a key not declared, is an error; every such mapping of one reading, at every nesting
  level and list item, is named in one `BadKeys` (an unknown key with its closest known one: "did you
  mean"); each value passes its
  check, which may convert it (a whole number given for a float is a float, a list is a tuple, a nested
  mapping is its dataclass). `read_fields(cls, raw, where)` is the same over a dataclass's fields, each
  field without a default required.
- With `null_is_absent`, an optional key given as null is left out (its default applies).
- Errors are `SchemaError`s naming the key's path from the top (`bursts[0].kill_at_s`, `workload.timing`)
  and the value: `BadValue` ("KEY must be EXPECTED, got VALUE") and `BadKeys` (each mapping's missing
  and unknown keys). Callers put the file in front.
- The standard library only: the gateway's options, the calibration file, the simulator's catalog and the
  pipeline's params sections are all read through it.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass
from typing import Any, get_args, get_origin, get_type_hints

KEY = "basin.key"  # the dataclass field metadata entry holding the field's `Key`


class SchemaError(ValueError):
    """A mapping that does not hold what its keys declare; the message names the key and the value."""


class BadValue(SchemaError):
    """A value that its key's check refuses."""

    def __init__(self, key: str, expected: str, value: object) -> None:
        super().__init__(f"{key} must be {expected}, got {value!r}")
        self.key = key
        self.expected = expected
        self.value = value


@dataclass(frozen=True)
class KeyProblem:
    """One mapping's required keys missing and undeclared keys, at `where` (its key path; "" at the top)."""

    where: str
    missing: tuple[str, ...]
    unknown: tuple[str, ...]
    known: tuple[str, ...]

    def __str__(self) -> str:
        at = f"{self.where}: " if self.where else ""
        parts = [f"missing key{'s' if len(self.missing) > 1 else ''} {', '.join(map(repr, self.missing))}"] \
            if self.missing else []
        for name in self.unknown:
            close = difflib.get_close_matches(name, self.known, n=1, cutoff=0.6)
            parts.append(f"unknown key {name!r} (did you mean {close[0]!r}?)" if close else
                         f"unknown key {name!r} (known: {', '.join(self.known)})")
        return at + "; ".join(parts)


class BadKeys(SchemaError):
    """Mappings with required keys missing or keys nobody declared: every such mapping of one reading, at
    every nesting level, in one error (`problems`; `where`, `missing`, `unknown` and `known` are the first's)."""

    def __init__(self, problems: Sequence[KeyProblem], also: Sequence[SchemaError] = ()) -> None:
        super().__init__("; ".join([*map(str, problems), *map(str, also)]))
        self.problems = list(problems)
        first = problems[0]
        self.where = first.where
        self.missing = list(first.missing)
        self.unknown = list(first.unknown)
        self.known = list(first.known)


def _read_all(items: Sequence[tuple[str, Check, str, object]], problems: list[KeyProblem]) -> dict[str, Any]:
    """Each (name, check, key path, value) read; every `BadKeys` gathered with `problems` into one (a `BadValue`
    is raised at once, unless there are key problems too: then it joins their message)."""
    values: dict[str, Any] = {}
    also: list[SchemaError] = []
    for name, check, path, value in items:
        try:
            values[name] = check.read(path, value)
        except BadKeys as exc:
            problems.extend(exc.problems)
        except SchemaError as exc:
            if not problems:
                raise
            also.append(exc)
    if problems:
        raise BadKeys(problems, also)
    return values


# --- checks --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Check:
    """What a key accepts: `expected` says it in words (`says` overrides the words), `read` converts a value
    or raises `BadValue`, `from_text` reads it from a command-line word."""

    _: KW_ONLY
    says: str | None = None

    @property
    def expected(self) -> str:
        """What the key accepts, as the error messages and the option reference say it."""
        return self.says or self.describe()

    def describe(self) -> str:
        """The words for `expected` when the declaration gives none."""
        raise NotImplementedError

    def read(self, key: str, value: object) -> Any:
        """`value` as kept, or `BadValue` naming `key`."""
        raise NotImplementedError

    @property
    def from_text(self) -> Callable[[str], Any]:
        """How a command-line word becomes a value for `read` (argparse's `type`)."""
        return str

    def refused(self, key: str, value: object) -> BadValue:
        return BadValue(key, self.expected, value)


@dataclass(frozen=True)
class Anything(Check):
    """Any value, kept as it is (free text, notes)."""

    def describe(self) -> str:
        return "anything"

    def read(self, key: str, value: object) -> Any:
        return value


@dataclass(frozen=True)
class Flag(Check):
    """true or false."""

    def describe(self) -> str:
        return "true or false"

    def read(self, key: str, value: object) -> bool:
        if not isinstance(value, bool):
            raise self.refused(key, value)
        return value


@dataclass(frozen=True)
class Whole(Check):
    """A whole number (never a bool), within `min` and `max` when given."""

    min: int | None = None
    max: int | None = None

    def describe(self) -> str:
        if self.max is not None:
            return f"a whole number from {self.min} to {self.max}" if self.min is not None else \
                f"a whole number <= {self.max}"
        if self.min is None:
            return "a whole number"
        return "a whole number > 0" if self.min == 1 else f"a whole number >= {self.min}"

    def read(self, key: str, value: object) -> int:
        if not isinstance(value, int) or isinstance(value, bool) or (self.min is not None and value < self.min) \
                or (self.max is not None and value > self.max):
            raise self.refused(key, value)
        return value

    @property
    def from_text(self) -> Callable[[str], Any]:
        return int


@dataclass(frozen=True)
class Number(Check):
    """A finite number (a whole one too, kept as a float), within the bounds given."""

    gt: float | None = None
    ge: float | None = None
    lt: float | None = None
    le: float | None = None
    noun: str = "a number"

    def describe(self) -> str:
        low = f"({self.gt:g}" if self.gt is not None else f"[{self.ge:g}" if self.ge is not None else None
        high = f"{self.lt:g})" if self.lt is not None else f"{self.le:g}]" if self.le is not None else None
        if low is not None and high is not None:
            return f"{self.noun} in {low}, {high}"
        bounds = [f"> {self.gt:g}" if self.gt is not None else f">= {self.ge:g}" if self.ge is not None else "",
                  f"< {self.lt:g}" if self.lt is not None else f"<= {self.le:g}" if self.le is not None else ""]
        return " ".join([self.noun, *(b for b in bounds if b)])

    def read(self, key: str, value: object) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
                or not self._within(value):
            raise self.refused(key, value)
        return float(value)

    def _within(self, x: float) -> bool:
        return ((self.gt is None or x > self.gt) and (self.ge is None or x >= self.ge)
                and (self.lt is None or x < self.lt) and (self.le is None or x <= self.le))

    @property
    def from_text(self) -> Callable[[str], Any]:
        return float


@dataclass(frozen=True)
class Text(Check):
    """A non-empty string, matching `pattern` whole when given; `rstrip` characters are cut from its end."""

    pattern: str | None = None
    rstrip: str = ""

    def describe(self) -> str:
        return "a non-empty string" if self.pattern is None else f"a string matching {self.pattern}"

    def read(self, key: str, value: object) -> str:
        if not isinstance(value, str) or not value or (
                self.pattern is not None and re.fullmatch(self.pattern, value) is None):
            raise self.refused(key, value)
        return value.rstrip(self.rstrip) if self.rstrip else value


@dataclass(frozen=True)
class OneOf(Check):
    """One of `choices`, kept as it is."""

    choices: tuple[Any, ...]

    def describe(self) -> str:
        return f"one of {list(self.choices)}"

    def read(self, key: str, value: object) -> Any:
        if not any(value == choice and type(value) is type(choice) for choice in self.choices):
            raise self.refused(key, value)
        return value


@dataclass(frozen=True)
class Maybe(Check):
    """null (None), or what `inner` accepts."""

    inner: Check

    def describe(self) -> str:
        return self.inner.expected

    def read(self, key: str, value: object) -> Any:
        return None if value is None else self.inner.read(key, value)

    @property
    def from_text(self) -> Callable[[str], Any]:
        return self.inner.from_text


@dataclass(frozen=True)
class ListOf(Check):
    """A list (kept as a tuple) of what `item` accepts, `length` long or at least `min_items`; with
    `one_ok` a single item stands for a list of one. An item is named `key[i]` in errors."""

    item: Check
    length: int | None = None
    min_items: int = 0
    one_ok: bool = False

    def describe(self) -> str:
        size = f"{self.length} " if self.length is not None else "non-empty " if self.min_items else ""
        return f"a {size}list ({self.item.expected} each)"

    def read(self, key: str, value: object) -> tuple[Any, ...]:
        items = [value] if self.one_ok and not isinstance(value, list | tuple) else value
        if not isinstance(items, list | tuple) or len(items) < self.min_items or (
                self.length is not None and len(items) != self.length):
            raise self.refused(key, value)
        values = _read_all([(str(k), self.item, f"{key}[{k}]", item) for k, item in enumerate(items)], [])
        return tuple(values[str(k)] for k in range(len(items)))

    @property
    def from_text(self) -> Callable[[str], Any]:
        return self.item.from_text


@dataclass(frozen=True)
class Section(Check):
    """A mapping holding the declared `keys` (`read_keys`), `required` ones among them; kept as a dict."""

    keys: Mapping[str, Key]
    required: tuple[str, ...] = ()
    null_is_absent: bool = False

    def describe(self) -> str:
        return "a mapping"

    def read(self, key: str, value: object) -> dict[str, Any]:
        return read_keys(value, self.keys, self.required, key, null_is_absent=self.null_is_absent)


@dataclass(frozen=True)
class Record(Check):
    """A mapping holding the fields of the dataclass `cls` (`read_fields`), built into one."""

    cls: type[Any]
    null_is_absent: bool = False

    def describe(self) -> str:
        return "a mapping"

    def read(self, key: str, value: object) -> Any:
        return self.cls(**read_fields(self.cls, value, key, null_is_absent=self.null_is_absent))


# --- declarations --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Key:
    """One declared key: its check, its unit (`s`, `bytes`, `tokens`, ...) and what it means."""

    check: Check
    help: str = ""
    unit: str = ""


def key(check: Check, help: str = "", unit: str = "") -> dict[str, Key]:
    """Field metadata declaring a dataclass field's key: `field(default=..., metadata=key(...))`."""
    return {KEY: Key(check, help, unit)}


def check_for(hint: object) -> Check:
    """The check a type annotation implies (see the rules); `TypeError` for one it does not cover."""
    origin, args = get_origin(hint), get_args(hint)
    if hint is bool:
        return Flag()
    if hint is int:
        return Whole()
    if hint is float:
        return Number(noun="a float")  # named as the annotation is
    if hint is str:
        return Text()
    if origin is typing.Literal:
        return OneOf(args)
    if origin in (types.UnionType, typing.Union) and type(None) in args and len(args) == 2:
        return Maybe(check_for(next(a for a in args if a is not type(None))))
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return ListOf(check_for(args[0]))
    if origin is tuple and args and all(a == args[0] for a in args):
        return ListOf(check_for(args[0]), length=len(args))
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return Record(hint)
    raise TypeError(f"no check is implied by the annotation {hint!r}: declare one (schema.key)")


def declared(cls: type[Any]) -> dict[str, Key]:
    """Each field of the dataclass `cls` and its `Key`: declared in its metadata, or implied by its type."""
    hints = get_type_hints(cls)
    found: dict[str, Key] = {}
    for f in dataclasses.fields(cls):
        declared_key = f.metadata.get(KEY)
        found[f.name] = declared_key if isinstance(declared_key, Key) else Key(check_for(hints[f.name]))
    return found


def required_fields(cls: type[Any]) -> list[str]:
    """The fields of the dataclass `cls` without a default."""
    return [f.name for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]


# --- reading -------------------------------------------------------------------------------------


def read_keys(raw: object, keys: Mapping[str, Key], required: Collection[str] = (), where: str = "", *,
              null_is_absent: bool = False) -> dict[str, Any]:
    """The checked values of the mapping `raw` (see the rules); `where` is its own key path ("" at the top)."""
    if not isinstance(raw, Mapping):
        raise BadValue(where or "the top level", "a mapping", raw)
    missing = tuple(sorted(name for name in required if name not in raw))
    unknown = tuple(sorted(str(name) for name in raw if name not in keys))
    problems = [KeyProblem(where, missing, unknown, tuple(sorted(keys)))] if missing or unknown else []
    items = [(str(name), keys[name].check, f"{where}.{name}" if where else str(name), value)
             for name, value in raw.items()
             if name in keys and not (value is None and null_is_absent and name not in required)]
    return _read_all(items, problems)


def read_fields(cls: type[Any], raw: object, where: str = "", *, required: Collection[str] | None = None,
                null_is_absent: bool = False) -> dict[str, Any]:
    """The checked values of `raw` for the dataclass `cls`'s fields (`required`: default, those without a default)."""
    return read_keys(raw, declared(cls), required_fields(cls) if required is None else required, where,
                     null_is_absent=null_is_absent)
