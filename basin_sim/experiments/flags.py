"""A set-up dataclass's command line, derived from its fields (as the gateway derives its options from `GatewayConfig`).

Rules:
- A flag is a dataclass field made by `flag(default, help, **how)`: `how` is what `add_argument` takes
  besides the name, default and help (type, choices, nargs, action, metavar). The long option is the
  field's name with dashes; `help` may be a function, called when the parser is built (a list of the
  catalog's names). A field without a default is a required option.
- A field made by `section(cls)` holds a nested set-up whose own flags join the same parser, flat;
  `section(cls, only=names)`: only those of its flags (the rest keep their defaults).
- `add_flags` adds one argparse option per flag (`only`: those named, in declaration order);
  `from_flags` builds the dataclass from the parsed namespace, lists turned into tuples, so the set-up
  stays frozen and hashable. Argparse ends there: the library takes the dataclass.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")
_FLAG = "basin_sim.flag"
_SECTION = "basin_sim.section"
_ONLY = "basin_sim.section_only"


@dataclass(frozen=True)
class Flag:
    """How the command line takes one field: its help and the rest of `add_argument`'s keywords."""

    help: str | Callable[[], str]
    how: dict[str, Any]


def flag(default: Any = dataclasses.MISSING, help: str | Callable[[], str] = "", **how: Any) -> Any:
    """A set-up field with a command-line option (see the rules)."""
    return field(default=default, metadata={_FLAG: Flag(help, how)})


def section(cls: type[Any], only: Collection[str] | None = None) -> Any:
    """A set-up field holding a nested set-up `cls`, its flags (`only`: those named) added flat beside this one's."""
    return field(default_factory=cls, metadata={_SECTION: cls, _ONLY: only})


def add_flags(parser: argparse.ArgumentParser, cls: type[Any], only: Collection[str] | None = None) -> None:
    """One option per flag of `cls` (and of its sections); `only`: just those named."""
    for f in dataclasses.fields(cls):
        if _SECTION in f.metadata:
            add_flags(parser, f.metadata[_SECTION], _narrowed(only, f.metadata[_ONLY]))
            continue
        declared = f.metadata.get(_FLAG)
        if declared is None or (only is not None and f.name not in only):
            continue
        how = dict(declared.how)
        if f.default is dataclasses.MISSING:
            how["required"] = True
        else:
            how["default"] = list(f.default) if isinstance(f.default, tuple) else f.default
        text = declared.help() if callable(declared.help) else declared.help
        parser.add_argument("--" + f.name.replace("_", "-"), dest=f.name, help=text, **how)


def from_flags(cls: type[T], args: argparse.Namespace, **given: Any) -> T:
    """`cls` from the parsed flags (missing ones: the field's default); `given` wins over both."""
    return _from_flags(cls, args, None, given)


def _from_flags(cls: type[T], args: argparse.Namespace, only: Collection[str] | None, given: dict[str, Any]) -> T:
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name in given:
            values[f.name] = given[f.name]
        elif _SECTION in f.metadata:
            values[f.name] = _from_flags(f.metadata[_SECTION], args, _narrowed(only, f.metadata[_ONLY]), {})
        elif _FLAG in f.metadata and hasattr(args, f.name) and (only is None or f.name in only):
            value = getattr(args, f.name)
            values[f.name] = tuple(value) if isinstance(value, list) else value
    return cls(**values)


def _narrowed(only: Collection[str] | None, section_only: Collection[str] | None) -> Collection[str] | None:
    """The flags both selections allow (None: no limit)."""
    if only is None or section_only is None:
        return section_only if only is None else only
    return [name for name in only if name in section_only]
