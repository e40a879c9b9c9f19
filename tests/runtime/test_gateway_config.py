"""Gateway start-up: options, config file, calibration, model loading, and clean one-line failures."""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from basin_runtime.calibration import CalibrationError, load_calibration
from basin_runtime.clock import ManualClock
from basin_runtime.gateway.app import build_gateway, create_app
from basin_runtime.gateway.cli import main
from basin_runtime.gateway.config import CONFIG_KEYS, ConfigError, GatewayConfig, build_parser, load_config
from basin_runtime.gateway.config import gateway_policy_config as policy_config
from basin_runtime.gateway.limits import Limits

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "models"
DEFAULT_MODEL = MODELS / "peak_predictor.onnx"
EXAMPLE = ROOT / "deploy" / "gateway.yaml"


def parse(*argv: str) -> GatewayConfig:
    """The config `basin-gateway argv...` would start with."""
    return load_config(vars(build_parser().parse_args(list(argv))))


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def calibration_file(tmp_path: Path, **values: Any) -> Path:
    return write(tmp_path / "cal.json", json.dumps(values))


# --- options and the config file -----------------------------------------------------------------


def test_every_option_is_a_config_key_and_every_config_key_an_option() -> None:
    dests = {action.dest for action in build_parser()._actions if action.dest not in ("help", "config")}
    assert dests == CONFIG_KEYS - {"policy"}  # a mapping lives in the file only


def test_the_command_line_wins_over_the_file_and_the_file_over_the_defaults(tmp_path: Path) -> None:
    config_file = write(tmp_path / "gw.yaml", f"upstream: http://127.0.0.1:8000/\nport: 9000\nidle-timeout-s: 30\n"
                                              f"model: {DEFAULT_MODEL}\nbudget_tokens: 5000\n")
    config = parse("--config", str(config_file), "--port", "9100", "--budget-tokens", "7000")

    assert (config.upstream, config.port, config.idle_timeout_s) == ("http://127.0.0.1:8000", 9100, 30.0)
    assert (config.budget_tokens, config.host, config.session_header) == (7000, "127.0.0.1", "X-Session-ID")
    assert config.default_model == DEFAULT_MODEL


def test_paths_in_the_file_are_relative_to_the_file_and_on_the_command_line_to_the_working_dir(
        tmp_path: Path) -> None:
    config_file = write(tmp_path / "conf" / "gw.yaml",
                        "upstream: http://r:1\nmodel: [m.onnx, swe=sub/w.onnx]\ncalibration: cal.json\n")
    config = parse("--config", str(config_file))
    assert config.default_model == tmp_path / "conf" / "m.onnx"
    assert dict(config.workload_models) == {"swe": tmp_path / "conf" / "sub" / "w.onnx"}
    assert config.calibration == tmp_path / "conf" / "cal.json"
    assert parse("--upstream", "http://r:1", "--model", "here.onnx").default_model == Path("here.onnx")


def test_models_are_one_default_and_any_number_of_workloads() -> None:
    config = parse("--upstream", "http://r:1", "--model", "a=x.onnx", "--model", "d.onnx", "--model", "b=y.onnx")
    assert (config.default_model, dict(config.workload_models)) == (Path("d.onnx"),
                                                                    {"a": Path("x.onnx"), "b": Path("y.onnx")})


@pytest.mark.parametrize(
    ("models", "fragment"),
    [
        ([], "exactly one default model"),
        (["a.onnx", "b.onnx"], "exactly one default model"),
        (["d.onnx", "w=x.onnx", "w=y.onnx"], "workload 'w' is given twice"),
        (["d.onnx", "=x.onnx"], "is not PATH or WORKLOAD=PATH"),
    ],
)
def test_bad_model_lists_are_refused(models: list[str], fragment: str) -> None:
    argv = ["--upstream", "http://r:1"] + [arg for m in models for arg in ("--model", m)]
    with pytest.raises(ConfigError, match=fragment):
        parse(*argv)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("upstream: http://r:1\nbudget: 5\n", "unknown option 'budget'"),
        ("upstream: http://r:1\nport: eighty\n", "port: expected a whole number >= 0, got 'eighty'"),
        ("upstream: http://r:1\nidle_timeout_s: 0\n", "idle_timeout_s: expected a number of seconds > 0"),
        ("upstream: http://r:1\nalways_engaged: yes please\n", "always_engaged: expected true or false"),
        ("upstream: ftp://r\n", "upstream: expected an http(s):// URL"),
        ("upstream: http://r:1\nlog_level: loud\n", "log_level: expected one of debug"),
        ("upstream: http://r:1\npolicy: {tokens_per_sec: 3}\n", "policy: unknown field(s) ['tokens_per_sec']"),
        ("- just\n- a list\n", "must hold a mapping of options"),
        ("upstream: [unclosed\n", "cannot read the config file"),
    ],
)
def test_a_bad_config_file_names_the_file_the_key_and_the_value(tmp_path: Path, text: str, fragment: str) -> None:
    config_file = write(tmp_path / "gw.yaml", text)
    with pytest.raises(ConfigError) as caught:
        parse("--config", str(config_file), "--model", "m.onnx")
    assert str(caught.value).startswith(str(config_file))
    assert fragment in str(caught.value)


def test_a_bad_command_line_value_names_the_option() -> None:
    with pytest.raises(ConfigError, match="command line: tick_interval_s: expected a number of seconds > 0"):
        parse("--upstream", "http://r:1", "--model", "m.onnx", "--tick-interval-s", "-1")


def test_the_limits_are_options_on_the_command_line_and_in_the_file(tmp_path: Path) -> None:
    config_file = tmp_path / "gw.yaml"
    config_file.write_text("upstream: http://r:1\nmodel: m.onnx\nmax-json-depth: 64\nmax_session_id_chars: 80\n")
    argv = ["--config", str(config_file), "--max-body-bytes", "1048576"]
    config = load_config(vars(build_parser().parse_args(argv)))
    assert config.limits == Limits(max_body_bytes=1 << 20, max_json_depth=64, max_session_id_chars=80)
    assert GatewayConfig(upstream="http://r", default_model=Path("m")).limits == Limits(64 << 20, 128, 256)


@pytest.mark.parametrize(("argv", "fragment"), [
    (["--max-body-bytes", "0"], "max_body_bytes: expected a whole number > 0"),
    (["--max-json-depth", "2"], "max_json_depth: expected a whole number from 3 to 512"),
    (["--max-json-depth", "900"], "max_json_depth: expected a whole number from 3 to 512"),
    (["--max-session-id-chars", "0"], "max_session_id_chars: expected a whole number > 0"),
])
def test_a_bad_limit_is_refused_naming_it(argv: list[str], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        load_config(vars(build_parser().parse_args(["--upstream", "http://r:1", "--model", "m.onnx", *argv])))


def test_without_an_upstream_nothing_starts() -> None:
    with pytest.raises(ConfigError, match="no upstream"):
        parse("--model", "m.onnx")


def test_the_example_config_file_loads(tmp_path: Path) -> None:
    config = parse("--config", str(EXAMPLE))
    assert config.default_model.resolve() == DEFAULT_MODEL
    assert set(config.workload_models) == {"swebench-verified", "terminal-bench", "tau-bench-airline"}
    assert policy_config(config, None).budget_tokens == 400_000


# --- calibration and the policy configuration ----------------------------------------------------


@pytest.mark.parametrize(("knee", "capacity", "budget"), [(100_000, 1_000_000, 90_000), (100_000, 50_000, 50_000)])
def test_the_budget_is_the_smaller_of_0_9_knee_and_the_capacity(tmp_path: Path, knee: int, capacity: int,
                                                                 budget: int) -> None:
    calibration = load_calibration(calibration_file(tmp_path, knee_tokens=knee, cache_capacity_tokens=capacity))
    config = parse("--upstream", "http://r:1", "--model", "m.onnx")
    assert policy_config(config, calibration).budget_tokens == budget


def test_the_reservation_ratio_scales_the_budget_into_reservation_tokens_except_in_prototype_mode(
        tmp_path: Path) -> None:
    calibration = load_calibration(calibration_file(tmp_path, knee_tokens=100_000, cache_capacity_tokens=10**6,
                                                    reservation_ratio=1.5))
    basin = parse("--upstream", "http://r:1", "--model", "m.onnx")
    served = policy_config(basin, calibration)
    assert (served.budget_tokens, served.reservation_ratio) == (135_000, 1.5)  # 1.5 x 0.9 x 100k; engages at 90k
    config_file = write(tmp_path / "proto.yaml", "upstream: http://r:1\nmodel: m.onnx\npolicy: {mode: prototype}\n")
    proto = policy_config(parse("--config", str(config_file)), calibration)
    assert (proto.budget_tokens, proto.reservation_ratio) == (90_000, 1.0)


def test_the_latency_gate_is_off_unless_asked_for_and_then_set_by_the_plateau_latency_and_call_cycle(
        tmp_path: Path) -> None:
    calibration = load_calibration(calibration_file(tmp_path, knee_tokens=100_000, cache_capacity_tokens=10**6,
                                                    ttft_plateau_s=0.25, call_cycle_plateau_s=10.0))
    assert (calibration.ttft_plateau_s, calibration.call_cycle_plateau_s) == (0.25, 10.0)
    paper = policy_config(parse("--upstream", "http://r:1", "--model", "m.onnx"), calibration)
    assert paper.latency_gate_s is None  # the paper's Basin: the working set alone engages admission
    gated = parse("--upstream", "http://r:1", "--model", "m.onnx", "--latency-gate")
    # a session is good within 4x its unloaded time: calls 3 x 10 s slower each and the median one misses it
    assert policy_config(gated, calibration).latency_gate_s == pytest.approx(30.25)
    from_file = write(tmp_path / "gate.yaml", "upstream: http://r:1\nmodel: m.onnx\nlatency_gate: true\n")
    assert policy_config(parse("--config", str(from_file)), calibration).latency_gate_s == pytest.approx(30.25)
    half = load_calibration(calibration_file(tmp_path, knee_tokens=100_000, cache_capacity_tokens=10**6,
                                             ttft_plateau_s=0.25))
    assert policy_config(gated, half).latency_gate_s is None  # not measured: no gate to serve
    config_file = write(tmp_path / "proto.yaml", "upstream: http://r:1\nmodel: m.onnx\nlatency_gate: true\n"
                                                 "policy: {mode: prototype}\n")
    assert policy_config(parse("--config", str(config_file)), calibration).latency_gate_s is None  # the prototype's
    off = write(tmp_path / "off.yaml", "upstream: http://r:1\nmodel: m.onnx\nlatency_gate: true\n"
                                       "policy: {latency_gate_s: null}\n")
    assert policy_config(parse("--config", str(off)), calibration).latency_gate_s is None  # the operator's word
    with pytest.raises(CalibrationError, match="ttft_plateau_s must be a finite number > 0, got -1"):
        load_calibration(calibration_file(tmp_path, knee_tokens=100_000, cache_capacity_tokens=10**6,
                                          ttft_plateau_s=-1))


def test_budget_tokens_overrides_the_calibration_and_the_policy_section_its_measurements(tmp_path: Path) -> None:
    calibration = load_calibration(calibration_file(tmp_path, knee_tokens=100_000, cache_capacity_tokens=10**6,
                                                    hit_rate_plateau=0.8, peak_completion_rate_per_s=0.4,
                                                    notes="measured on 2 x H100"))
    config_file = write(tmp_path / "gw.yaml", "upstream: http://r:1\nmodel: m.onnx\nbudget_tokens: 1234\n"
                                              "always_engaged: true\npolicy: {peak_completion_rate_per_s: 0.2}\n")
    policy = policy_config(parse("--config", str(config_file)), calibration)
    assert (policy.budget_tokens, policy.always_engaged) == (1234, True)
    assert (policy.hit_rate_plateau, policy.peak_completion_rate_per_s) == (0.8, 0.2)


def test_without_a_budget_or_a_calibration_nothing_starts() -> None:
    with pytest.raises(ConfigError, match="no budget: give --budget-tokens N or --calibration FILE"):
        policy_config(parse("--upstream", "http://r:1", "--model", "m.onnx"), None)


def test_a_policy_value_the_policy_refuses_is_a_config_error() -> None:
    config = parse("--upstream", "http://r:1", "--model", "m.onnx", "--budget-tokens", "0")
    with pytest.raises(ConfigError, match=r"policy configuration: PolicyConfig\.budget_tokens must be > 0"):
        policy_config(config, None)


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        (None, "cannot read the calibration file"),
        ("{oops", "cannot read the calibration file"),
        ("[1]", "must hold a JSON object"),
        ('{"knee_tokens": 5}', "missing ['cache_capacity_tokens']"),
        ('{"knee_tokens": 5, "cache_capacity_tokens": 9, "knee": 3}', "unknown key(s) ['knee']"),
        ('{"knee_tokens": -5, "cache_capacity_tokens": 9}', "knee_tokens must be a finite number > 0"),
        ('{"knee_tokens": 5, "cache_capacity_tokens": "big"}', "cache_capacity_tokens must be a finite number"),
        ('{"knee_tokens": 5, "cache_capacity_tokens": 9, "hit_rate_plateau": 1.5}', "hit_rate_plateau must be in"),
        ('{"knee_tokens": 1, "cache_capacity_tokens": 0.5}', "rounds down to 0 tokens"),
        ('{"knee_tokens": 5, "cache_capacity_tokens": 9, "reservation_ratio": 0.5}', "reservation_ratio must be >= 1"),
    ],
)
def test_a_bad_calibration_file_is_refused_naming_it(tmp_path: Path, content: str | None, fragment: str) -> None:
    path = tmp_path / "cal.json"
    if content is not None:
        path.write_text(content, encoding="utf-8")
    with pytest.raises(CalibrationError) as caught:
        load_calibration(path)
    assert str(caught.value).startswith(str(path)) and fragment in str(caught.value)


# --- start-up as a whole -------------------------------------------------------------------------


def run_main(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, list[str]]:
    status = main(list(argv))
    return status, capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize("problem", ["missing model", "garbage model", "missing calibration", "bad workload model"])
def test_a_file_that_cannot_be_loaded_stops_start_up_with_one_line_naming_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], problem: str) -> None:
    garbage = write(tmp_path / "garbage.onnx", "not an onnx model")
    argv = {
        "missing model": ["--model", str(tmp_path / "nope.onnx"), "--budget-tokens", "10"],
        "garbage model": ["--model", str(garbage), "--budget-tokens", "10"],
        "missing calibration": ["--model", str(DEFAULT_MODEL), "--calibration", str(tmp_path / "cal.json")],
        "bad workload model": ["--model", str(DEFAULT_MODEL), "--model", f"w={garbage}", "--budget-tokens", "10"],
    }[problem]
    status, lines = run_main(capsys, "--upstream", "http://127.0.0.1:9", *argv)

    named = str(tmp_path / ("cal.json" if "calibration" in problem else
                            "nope.onnx" if problem == "missing model" else "garbage.onnx"))
    assert status == 2
    assert len(lines) == 1 and lines[0].startswith("basin-gateway: error: ") and named in lines[0]


def test_a_calibration_measured_for_another_predictor_or_quantile_is_refused_naming_both(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The reservation ratio holds only for the predictor file and quantile it was measured with."""
    served = hashlib.sha256(DEFAULT_MODEL.read_bytes()).hexdigest()
    base = {"knee_tokens": 100_000, "cache_capacity_tokens": 10**6, "reservation_ratio": 3.0}
    argv = ["--upstream", "http://127.0.0.1:9", "--model", str(DEFAULT_MODEL)]
    for said, problem in (({"predictor_sha256": "ab" * 32, "reservation_quantile": 0.9}, "predictor SHA-256 abababab"),
                          ({"predictor_sha256": served, "reservation_quantile": 0.5},
                           "reservation quantile 0.5 (served: 0.9)")):
        path = calibration_file(tmp_path, **base, **said)
        status, lines = run_main(capsys, *argv, "--calibration", str(path))
        assert status == 2 and len(lines) == 1 and str(path) in lines[0] and problem in lines[0]
        assert "re-measure with `basin-sim knee --model FILE --reservation-quantile Q" in lines[0]
    matching = calibration_file(tmp_path, **base, predictor_sha256=served, reservation_quantile=0.9, lending="none")
    gateway = build_gateway(parse(*argv, "--calibration", str(matching)), clock=ManualClock())
    try:  # measured for what is served (or not saying, as a hand-written file): accepted
        assert gateway.room.policy.config.budget_tokens == 270_000
    finally:
        asyncio.run(gateway.upstream.client.aclose())
    for bad, fragment in (({"predictor_sha256": "XYZ"}, "predictor_sha256 must be 64 lowercase hex digits"),
                          ({"reservation_quantile": 1.0}, "reservation_quantile must be a number in (0, 1)"),
                          ({"lending": "storage"},
                           "lending must be one of ['none', 'decode-memory', 'storage-offload']")):
        with pytest.raises(CalibrationError, match=re.escape(fragment)):
            load_calibration(calibration_file(tmp_path, **base, **bad))


def test_a_model_trained_on_another_tokenizer_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    status, lines = run_main(capsys, "--upstream", "http://127.0.0.1:9", "--model", str(DEFAULT_MODEL),
                             "--budget-tokens", "10", "--tokenizer", "qwen2.5")
    assert status == 2 and len(lines) == 1 and "trained on 'qwen3.6' token counts" in lines[0]


def test_an_unknown_tokenizer_or_bad_task_text_pattern_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--upstream", "http://127.0.0.1:9", "--model", str(DEFAULT_MODEL), "--budget-tokens", "10"]
    assert run_main(capsys, *base, "--tokenizer", "gpt-9")[0] == 2
    status, lines = run_main(capsys, *base, "--task-text-pattern", "(unclosed")
    assert status == 2 and len(lines) == 1 and "not a valid regex" in lines[0]


def test_the_shipped_models_load_per_workload_and_predict() -> None:
    config = parse("--config", str(EXAMPLE))
    gateway = build_gateway(config, clock=ManualClock())
    try:
        swe = gateway.predictors.for_workload("swebench-verified")
        assert swe is not gateway.predictors.default
        assert gateway.predictors.for_workload("no-such-bench") is gateway.predictors.default
        assert swe.predict("Fix the failing test in the parser", 1500) >= 1500
    finally:
        asyncio.run(gateway.upstream.client.aclose())


def test_sessions_reserve_the_files_multiplier_times_the_prediction_at_the_configured_quantile() -> None:
    from basin_runtime.predictor import PeakPredictor

    swe_file = PeakPredictor.load(MODELS / "peak_predictor-swebench-verified.onnx")
    pooled = PeakPredictor.load(DEFAULT_MODEL)
    for argv, q in (((), 0.9), (("--reservation-quantile", "0.95"), 0.95)):
        gateway = build_gateway(parse("--config", str(EXAMPLE), *argv), clock=ManualClock())
        try:
            predictors = gateway.predictors
            assert predictors.reservation_quantile == q
            assert predictors.multiplier("swebench-verified") == swe_file.multiplier(q) > 1
            assert predictors.multiplier(None) == predictors.multiplier("my-agent") == pooled.multiplier(q)
        finally:
            asyncio.run(gateway.upstream.client.aclose())
    only_default = build_gateway(parse("--upstream", "http://127.0.0.1:9", "--model", str(DEFAULT_MODEL),
                                       "--budget-tokens", "10"), clock=ManualClock())
    try:  # the default file answers with the workload's own row when it is one of its benchmarks
        assert only_default.predictors.multiplier("swebench-verified") == pooled.multiplier(0.9, "swebench-verified")
        assert pooled.multiplier(0.9, "swebench-verified") != pooled.multiplier(0.9)
    finally:
        asyncio.run(only_default.upstream.client.aclose())
    bare = build_gateway(parse("--config", str(EXAMPLE), "--reservation-quantile", "none"), clock=ManualClock())
    try:
        assert bare.predictors.multiplier("swebench-verified") == 1.0
    finally:
        asyncio.run(bare.upstream.client.aclose())


@pytest.mark.parametrize(("argv", "named"), [
    (("--reservation-quantile", "0.999"), "outside the multipliers' grid [0.5, 0.99]"),
    (("--reservation-quantile", "1.5"), "expected a quantile in (0, 1) or 'none', got '1.5'"),
    (("--reservation-quantile", "most"), "expected a quantile in (0, 1) or 'none'"),
])
def test_a_reservation_quantile_the_files_cannot_serve_stops_start_up_in_one_line(
        capsys: pytest.CaptureFixture[str], argv: tuple[str, ...], named: str) -> None:
    try:
        status, lines = run_main(capsys, "--upstream", "http://127.0.0.1:9", "--model", str(DEFAULT_MODEL),
                                 "--budget-tokens", "10", *argv)
    except SystemExit as exc:  # argparse's own type error
        status, lines = int(exc.code or 0), capsys.readouterr().err.strip().splitlines()
    assert status == 2 and named in lines[-1]


def test_a_file_without_multipliers_needs_the_bare_prediction_asked_for(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import onnx

    proto = onnx.load(DEFAULT_MODEL)
    kept = [(e.key, e.value) for e in proto.metadata_props if e.key != "basin.reservation_multipliers"]
    del proto.metadata_props[:]
    for key, value in kept:
        proto.metadata_props.add(key=key, value=value)
    old = tmp_path / "old.onnx"
    onnx.save(proto, old)
    base = ["--upstream", "http://127.0.0.1:9", "--model", str(old), "--budget-tokens", "10"]
    status, lines = run_main(capsys, *base)
    assert status == 2 and len(lines) == 1 and f"{old}: carries no reservation multipliers" in lines[0]
    gateway = build_gateway(parse(*base, "--reservation-quantile", "none"), clock=ManualClock())
    try:
        assert gateway.predictors.multiplier(None) == 1.0
    finally:
        asyncio.run(gateway.upstream.client.aclose())


def test_the_app_lifespan_starts_the_timers_and_closes_what_it_owns() -> None:
    gateway = build_gateway(parse("--config", str(EXAMPLE)), clock=ManualClock())
    client = gateway.upstream.client
    app = create_app(gateway, on_shutdown=client.aclose)
    with TestClient(app) as http:
        assert http.get("/health").json() == {"status": "ok"}
    assert client.is_closed


def test_the_keep_alive_comes_from_the_command_line_or_the_file_and_reaches_uvicorn(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base = ["--upstream", "http://127.0.0.1:9", "--model", str(DEFAULT_MODEL), "--budget-tokens", "10"]
    assert parse(*base).keep_alive_s == 90.0  # above the client pools' 5 s (httpx, openai) and 15 s (aiohttp)
    assert parse(*base, "--config", str(write(tmp_path / "a.yaml", "keep-alive-s: 30\n"))).keep_alive_s == 30.0
    for bad in ("0", "-1", "soon"):
        with pytest.raises(ConfigError, match="keep_alive_s: expected a number of seconds > 0"):
            parse(*base, "--config", str(write(tmp_path / "b.yaml", f"keep_alive_s: {bad}\n")))
    served: list[float] = []
    monkeypatch.setattr("basin_runtime.gateway.cli.DrainingServer.run",
                        lambda server: served.append(server.config.timeout_keep_alive))

    assert main([*base, "--keep-alive-s", "75.5", "--log-level", "warning"]) == 0
    assert served == [75.5]
