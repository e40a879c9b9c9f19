"""How a gateway option is declared, and the command line derived from the declarations.

Rules:
- An option is a dataclass field made by `option(default, check, help, ...)`: its metadata holds an
  `Option`, a `basin_runtime.schema.Key` (check, help, unit) plus how the command line takes it. The
  options themselves are `config.GatewayConfig`'s fields; this module knows none of them.
- `add_options` adds one argparse flag per declared option: the name with dashes (or `flag=`), the type
  from the check (`int` for whole numbers, `float` for numbers, `text=` to override), `choices` for a
  `OneOf`, a switch for a `Flag`, a repeated flag or a list of words (`cli=`), and a help line that
  says a bounded range and the default. Defaults stay unset (`argparse.SUPPRESS`), so a config file can
  supply them.
- The checks every gateway option shares (seconds, counts, URLs, header names) are declared here once.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from basin_runtime.policy import PolicyConfig
from basin_runtime.schema import KEY, Anything, Check, Flag, Key, ListOf, Maybe, Number, OneOf, Text, Whole, read_keys

CliStyle = Literal["value", "switch", "yes-no", "append", "list"]


@dataclass(frozen=True)
class Option(Key):
    """A gateway option: a `Key` plus how the command line takes it and how the reference names it.

    `name`: the config key when it is not the field's name; `flag`: the long option ("": `--` and the
    name with dashes; None: the config file only); `cli`: a value, a switch (store_true), yes|no, a
    repeated flag or a list of words; `default_text`: the default in words, where its value says too
    little; `is_path`: relative to the config file when given there; `text`: reads a command-line word.
    """

    name: str = ""
    flag: str | None = ""
    cli: CliStyle = "value"
    metavar: str | None = None
    default_text: str | None = None
    is_path: bool = False
    text: Callable[[str], Any] | None = None


def option(default: Any = dataclasses.MISSING, check: Check | None = None, help: str = "", *,
           factory: Callable[[], Any] | None = None, **how: Any) -> Any:
    """A `GatewayConfig` field declaring one option (`how`: the `Option` fields past check and help)."""
    assert check is not None
    metadata = {KEY: Option(check, help, **how)}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def _policy_keys() -> dict[str, Key]:
    tuned = sorted({f.name for f in dataclasses.fields(PolicyConfig)} - {"budget_tokens", "always_engaged"})
    return {name: Key(Anything()) for name in tuned}  # the values are PolicyConfig's to check


@dataclass(frozen=True)
class PolicySection(Check):
    """The `policy:` mapping: PolicyConfig fields (their values are checked when the policy is built)."""

    def describe(self) -> str:
        return "a mapping of PolicyConfig fields"

    def read(self, key: str, value: object) -> dict[str, Any]:
        if not isinstance(value, Mapping):
            raise self.refused(key, value)
        return read_keys(value, _policy_keys(), where=key)


@dataclass(frozen=True)
class CallNumbers(ListOf):
    """Call numbers, kept sorted and once each."""

    def read(self, key: str, value: object) -> tuple[int, ...]:
        return tuple(sorted(set(super().read(key, value))))


SECONDS = Number(gt=0, noun="a number of seconds")
COUNT = Whole(min=0)
POSITIVE = Whole(min=1)
HTTP_URL = Text(r"https?://[^/]+.*", rstrip="/", says="an http(s):// URL")
HEADER_NAME = Text(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+", says="an HTTP header name")
STATE_URL = Text(r"(redis|rediss|unix)://.*", says="redis://HOST:PORT/DB (or rediss://, unix://)")
PATH = Maybe(Text())


@dataclass(frozen=True)
class Declared:
    """One option as the parser, the file reader and the reference see it."""

    name: str  # the config key
    field: dataclasses.Field[Any]
    option: Option

    @property
    def flag(self) -> str | None:
        """The long option, or None (the config file only)."""
        if self.option.flag is None:
            return None
        return self.option.flag or "--" + self.name.replace("_", "-")

    @property
    def default(self) -> Any:
        """The default value (dataclasses.MISSING for a required option)."""
        if self.field.default_factory is not dataclasses.MISSING:
            return self.field.default_factory()
        return self.field.default

    @property
    def default_text(self) -> str | None:
        """The default as the help and the reference say it, or None when there is nothing to say."""
        if self.option.default_text is not None:
            return self.option.default_text
        default = self.default
        if default is dataclasses.MISSING or default is None or default is False or default in ((), {}):
            return None
        return f"{default:g}" if isinstance(default, float) else str(default)


def declared_options(cls: type[Any]) -> dict[str, Declared]:
    """Every option declared on the dataclass `cls`'s fields, by config key, in declaration order."""
    found = {}
    for f in dataclasses.fields(cls):
        declared = f.metadata.get(KEY)
        if isinstance(declared, Option):
            name = declared.name or f.name
            found[name] = Declared(name, f, declared)
    return found


def add_options(parser: argparse.ArgumentParser, options: Iterable[Declared]) -> None:
    """One flag per option that has one, derived from its declaration (see the rules)."""
    for declared in options:
        if declared.flag is not None:
            parser.add_argument(declared.flag, dest=declared.name, help=_help(declared), **_how(declared))


def _help(declared: Declared) -> str:
    """The option's help, with its range when bounded and its default when there is one to say."""
    check, said = declared.option.check, []
    if isinstance(check, Whole) and check.min is not None and check.max is not None:
        said.append(f"{check.min}..{check.max}")
    if declared.default_text is not None:
        said.append(f"default {declared.default_text}")
    text = declared.option.help
    if not said:
        return text
    return f"{text[:-1]}; {', '.join(said)})" if text.endswith(")") else f"{text} ({', '.join(said)})"


def _how(declared: Declared) -> dict[str, Any]:
    """The argparse keywords of one option, from its declaration."""
    opt = declared.option
    if opt.cli == "switch" or (isinstance(opt.check, Flag) and opt.cli == "value"):
        return {"action": "store_true"}
    how: dict[str, Any] = {"type": _yes_no if opt.cli == "yes-no" else opt.text or opt.check.from_text}
    if isinstance(opt.check, OneOf):
        how["choices"] = opt.check.choices
    else:
        how["metavar"] = opt.metavar or ("S" if opt.unit == "s" else None)
    if opt.cli == "append":
        how["action"] = "append"
    elif opt.cli == "list":
        how["nargs"] = "*"
    return how


def _yes_no(value: str) -> bool:
    if value.lower() in ("yes", "true", "1"):
        return True
    if value.lower() in ("no", "false", "0"):
        return False
    raise argparse.ArgumentTypeError(f"expected yes or no, got {value!r}")
