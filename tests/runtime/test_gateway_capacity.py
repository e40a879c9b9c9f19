"""Start-up's capacity check (basin_runtime/gateway/capacity.py, cli.check_engine_capacity), over httpx.MockTransport.

Rules:
- The upstream is smg (`GET /workers` lists prefill and decode workers) or one SGLang server (no /workers); each
  engine answers `max_total_num_tokens` at /server_info, or only at the older /get_server_info.
- Issue 45: the 1P3D H200 calibration (cache 3.39M tokens) in front of a 1.3M-token engine must be refused,
  naming both numbers; within 25% it starts; an override starts anyway; engines that cannot tell warn.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest

from basin_runtime.calibration import Calibration
from basin_runtime.gateway.capacity import (
    Capacity,
    CapacityMismatch,
    CapacityUnknown,
    check_capacity,
    read_capacity,
)
from basin_runtime.gateway.cli import check_engine_capacity, startup_summary
from basin_runtime.gateway.config import ConfigError, GatewayConfig
from basin_runtime.policy import PolicyConfig

ROUTER = "http://router:8000"


def client(routes: Mapping[str, Any]) -> httpx.Client:
    """A client whose GETs answer `routes[url]` as JSON (404 for any other URL; an exception is raised)."""
    def handle(request: httpx.Request) -> httpx.Response:
        answer = routes.get(str(request.url))
        if isinstance(answer, Exception):
            raise answer
        return httpx.Response(404) if answer is None else httpx.Response(200, json=answer)
    return httpx.Client(transport=httpx.MockTransport(handle))


def smg(prefill: Mapping[str, int], decode: Mapping[str, int]) -> dict[str, Any]:
    workers = [{"url": url, "worker_type": "prefill"} for url in prefill]
    workers += [{"url": url, "worker_type": "decode"} for url in decode]
    routes: dict[str, Any] = {f"{ROUTER}/workers": {"workers": workers}}
    for url, tokens in {**prefill, **decode}.items():
        routes[f"{url}/server_info"] = {"max_total_num_tokens": tokens, "disaggregation_mode": "x"}
    return routes


def test_the_capacity_is_the_sum_over_the_prefill_engines_smg_lists() -> None:
    routes = smg({"http://p0:30000": 1_300_000, "http://p1:30000": 1_200_000}, {"http://d0:30001": 9_999_999})
    capacity = read_capacity(client(routes), ROUTER)
    assert capacity == Capacity((("http://p0:30000", 1_300_000), ("http://p1:30000", 1_200_000)),
                                f"listed by {ROUTER}/workers")
    assert capacity.total_tokens == 2_500_000


def test_an_upstream_without_a_worker_list_is_the_engine_and_the_older_path_is_read() -> None:
    routes = {f"{ROUTER}/get_server_info": {"max_total_num_tokens": 800_000}}
    capacity = read_capacity(client(routes), ROUTER + "/")
    assert capacity.engines == ((ROUTER, 800_000),) and "no smg /workers list" in capacity.found_by


@pytest.mark.parametrize(("routes", "why"), [
    ({f"{ROUTER}{path}": httpx.ConnectError("refused") for path in ("/workers", "/server_info", "/get_server_info")},
     "GET http://router:8000/server_info: refused; GET http://router:8000/get_server_info: refused"),
    ({f"{ROUTER}/server_info": {"max_total_num_tokens": None}}, "no positive max_total_num_tokens (got None)"),
    ({f"{ROUTER}/workers": {"workers": []}}, "lists no worker"),
])
def test_engines_that_cannot_tell_are_named_with_why(routes: dict[str, Any], why: str) -> None:
    with pytest.raises(CapacityUnknown, match=re.escape(why)):
        read_capacity(client(routes), ROUTER)


def test_a_calibration_for_another_deployment_is_refused_naming_both_numbers() -> None:
    capacity = Capacity((("http://p0:30000", 1_300_000),), "listed")
    with pytest.raises(CapacityMismatch) as caught:
        check_capacity(3_390_000, capacity, "h200.json", allow_mismatch=False)
    message = str(caught.value)
    assert "3,390,000" in message and "1,300,000" in message and "h200.json" in message and "161% apart" in message
    assert "basin-sim knee" in message and "basin-live-ramp" in message and "--allow-calibration-mismatch" in message
    assert "used anyway" in check_capacity(3_390_000, capacity, "h200.json", allow_mismatch=True)
    assert "within 25%" in check_capacity(1_600_000, capacity, "near.json", allow_mismatch=False)  # 23% apart
    with pytest.raises(CapacityMismatch):
        check_capacity(1_700_000, capacity, "far.json", allow_mismatch=False)  # 31% apart
    with pytest.raises(CapacityMismatch):
        check_capacity(900_000, capacity, "small.json", allow_mismatch=False)  # 31% under


def config(**changes: Any) -> GatewayConfig:
    return GatewayConfig(upstream=ROUTER, default_model=Path("m.onnx"), **{"calibration": Path("cal.json"), **changes})


CALIBRATION = Calibration(knee_tokens=4_690_000.0, cache_capacity_tokens=3_390_000.0)


def test_start_up_refuses_the_mismatch_as_a_bad_option_unless_allowed(caplog: pytest.LogCaptureFixture) -> None:
    routes = smg({"http://p0:30000": 1_300_000}, {"http://d0:30001": 1_300_000})
    with pytest.raises(ConfigError, match=r"3,390,000 tokens; the engines hold 1,300,000 tokens"):
        check_engine_capacity(config(), CALIBRATION, client(routes))
    with caplog.at_level(logging.INFO, logger="basin_runtime.gateway.cli"):
        check_engine_capacity(config(allow_calibration_mismatch=True), CALIBRATION, client(routes))
        check_engine_capacity(config(), CALIBRATION, client({}))  # nothing answers: warned, not refused
        check_engine_capacity(config(), None, client({}))  # no calibration: nothing to check
    assert [r.levelname for r in caplog.records] == ["INFO", "WARNING"]
    assert "used anyway" in caplog.records[0].getMessage()
    assert "is not checked" in caplog.records[1].getMessage() and "3,390,000" in caplog.records[1].getMessage()


def test_the_start_up_line_names_the_budget_its_source_the_model_and_the_calibration() -> None:
    line = startup_summary(config(), CALIBRATION, PolicyConfig(budget_tokens=3_390_000))
    assert line.startswith("budget 3,390,000 tokens (from the calibration: knee 4,690,000, cache 3,390,000 tokens)")
    assert "model m.onnx" in line and "calibration cal.json" in line
    line = startup_summary(config(budget_tokens=1000, calibration=None), None, PolicyConfig(budget_tokens=1000))
    assert line.startswith("budget 1,000 tokens (--budget-tokens)") and "calibration none" in line
