"""The gateway's options come from one declaration each: the parser, the config file's checks and the
committed reference page (`docs/gateway/options.md`) are all derived from `GatewayConfig`'s fields."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from basin_runtime.gateway import options_doc
from basin_runtime.gateway.config import OPTIONS, ConfigError, GatewayConfig, build_parser, load_config

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "docs" / "gateway" / "options.md"


def test_the_committed_option_reference_is_the_generators_output() -> None:
    assert REFERENCE.read_text(encoding="utf-8") == options_doc.render(), (
        f"{REFERENCE.relative_to(ROOT)} is stale: regenerate it with `{options_doc.REGENERATE}`")


def test_every_option_is_in_the_reference_with_its_flag_check_and_default() -> None:
    page = options_doc.render()
    for name, declared in OPTIONS.items():
        line = next(line for line in page.splitlines() if line.startswith(f"| `{name}` |"))
        assert declared.option.help and declared.option.help.replace("<", "&lt;") in line.replace("\\|", "|")
        assert declared.option.check.expected.replace("<", "&lt;") in line.replace("\\|", "|")
        if declared.flag is not None:
            assert f"`{declared.flag}" in line
    assert "| `keep_alive_s` | `--keep-alive-s S` | a number of seconds > 0 | 90 | s |" in page


def test_every_config_field_but_the_models_of_workloads_is_declared_as_an_option() -> None:
    fields = {f.name for f in dataclasses.fields(GatewayConfig)}
    options = {declared.field.name for declared in OPTIONS.values()}
    assert fields - options == {"workload_models"}  # filled from `model`'s WORKLOAD=PATH entries


def test_a_parsers_defaults_are_the_declared_ones() -> None:
    config = load_config(vars(build_parser().parse_args(["--upstream", "http://r:1", "--model", "m.onnx"])))
    for name, declared in OPTIONS.items():
        if declared.default is not dataclasses.MISSING:
            assert getattr(config, declared.field.name) == declared.default, name


@pytest.mark.parametrize(("flag", "word", "message"), [
    ("--port", "-1", "command line: port: expected a whole number >= 0, got -1"),
    ("--engine-priority-levels", "65", "command line: engine_priority_levels: expected a whole number from 1 to 64"),
    ("--state-lease-s", "0.1", "command line: state_lease_s: expected a lease of at least 0.5 s, got 0.1"),
    ("--routing-key-header", "a b", "command line: routing_key_header: expected an HTTP header name, got 'a b'"),
    ("--engine-metrics", "ftp://e", "command line: engine_metrics_urls[0]: expected an http(s):// URL"),
    ("--state", "http://r", "command line: state: expected redis://HOST:PORT/DB"),
    ("--max-header-bytes", "512", "expected a whole number of bytes >= 1024"),
])
def test_a_value_the_declaration_refuses_names_the_option_and_the_value(flag: str, word: str, message: str) -> None:
    argv = ["--upstream", "http://r:1", "--model", "m.onnx", flag, word]
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(vars(build_parser().parse_args(argv)))


def test_the_same_check_reads_the_file(tmp_path: Path) -> None:
    path = tmp_path / "gw.yaml"
    path.write_text("upstream: http://r:1/\nmodel: m.onnx\nrevise-at-calls: [5, 3, 5]\nengine_metrics_urls: "
                    "http://e:1/metrics\n")
    config = load_config({"config": path})
    assert (config.upstream, config.revise_at_calls, tuple(config.engine_metrics_urls)) == (
        "http://r:1", (3, 5), ("http://e:1/metrics",))
    for text, calls in (("[]", ()), ("null", None)):  # never; the online model's own slots (the default)
        path.write_text(f"upstream: http://r:1\nmodel: m.onnx\nrevise_at_calls: {text}\n")
        assert load_config({"config": path}).revise_at_calls == calls
    argv = ["--upstream", "http://r:1", "--model", "m.onnx"]
    assert load_config(vars(build_parser().parse_args(argv))).revise_at_calls is None
    assert load_config(vars(build_parser().parse_args([*argv, "--revise-at-calls"]))).revise_at_calls == ()
    assert load_config(vars(build_parser().parse_args([*argv, "--revise-at-calls", "5", "3"]))).revise_at_calls == (
        3, 5)
    path.write_text("upstream: http://r:1\nmodel: m.onnx\nrevise_at_calls: [1, 3]\n")
    with pytest.raises(ConfigError, match=rf"{path}: revise_at_calls\[0\]: expected a call number >= 2"):
        load_config({"config": path})
