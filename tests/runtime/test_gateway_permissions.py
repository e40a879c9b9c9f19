"""Who may use the admin endpoints: the start-up refusal to serve them open beyond loopback."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from basin_runtime.gateway.cli import OPEN_ENDPOINTS, check_admin_exposure, is_loopback, main
from basin_runtime.gateway.config import ConfigError, build_parser, load_config

TOKEN = "s3cret"


# --- start-up: no open admin endpoints beyond loopback -------------------------------------------


BASE = ["--upstream", "http://127.0.0.1:9", "--budget-tokens", "10"]


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "gpu-box.example"])
def test_binding_beyond_loopback_without_an_admin_token_stops_start_up(
        host: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status = main([*BASE, "--model", str(tmp_path / "never-loaded.onnx"), "--host", host])
    lines = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(lines) == 1
    line = lines[0]
    assert line.startswith(f"basin-gateway: error: host {host}: ") and "never-loaded" not in line
    for endpoint in ("/basin/state", "/basin/sessions", "/basin/budget", "/basin/reload", "/basin/shadow",
                     "/basin/sessions/{id}/end"):
        assert endpoint in line
    assert "--admin-token" in line and "admin_token:" in line and "--insecure-admin" in line


@pytest.mark.parametrize(("host", "is_loop"), [
    ("127.0.0.1", True), ("127.8.9.10", True), ("::1", True), ("[::1]", True), ("localhost", True),
    ("LocalHost", True), ("0.0.0.0", False), ("::", False), ("192.168.1.5", False), ("fe80::1", False),
    ("128.0.0.1", False), ("localhost.example", False),
])
def test_loopback_is_127_slash_8_ipv6_one_and_localhost(host: str, is_loop: bool) -> None:
    assert is_loopback(host) is is_loop


def test_an_admin_token_or_a_loopback_host_passes_the_check() -> None:
    check_admin_exposure(load_config(vars(build_parser().parse_args(
        [*BASE, "--model", "m.onnx", "--host", "0.0.0.0", "--admin-token", TOKEN]))))
    check_admin_exposure(load_config(vars(build_parser().parse_args([*BASE, "--model", "m.onnx",
                                                                     "--host", "127.0.0.2"]))))


def test_insecure_admin_starts_open_with_a_warning_naming_every_endpoint(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    config_file = tmp_path / "gw.yaml"
    config_file.write_text("host: 0.0.0.0\ninsecure_admin: true\n", encoding="utf-8")
    config = load_config(vars(build_parser().parse_args([*BASE, "--model", "m.onnx", "--config", str(config_file)])))
    with caplog.at_level(logging.WARNING, logger="basin_runtime.gateway.cli"):
        check_admin_exposure(config)
    [record] = caplog.records
    assert record.levelno == logging.WARNING and "0.0.0.0" in record.getMessage()
    for endpoint in OPEN_ENDPOINTS:
        assert endpoint in record.getMessage()
    with pytest.raises(ConfigError, match="insecure_admin: expected true or false"):
        config_file.write_text("insecure_admin: sure\n", encoding="utf-8")
        load_config(vars(build_parser().parse_args([*BASE, "--model", "m.onnx", "--config", str(config_file)])))


def test_insecure_admin_on_the_command_line_gets_past_the_check(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> None:
    status = main([*BASE, "--model", str(tmp_path / "missing.onnx"), "--host", "0.0.0.0", "--insecure-admin"])
    assert status == 2  # it went on to load the model, which is missing
    assert "missing.onnx" in capsys.readouterr().err.strip().splitlines()[-1]
    assert any("--insecure-admin: binding 0.0.0.0" in r.getMessage() for r in caplog.records)
