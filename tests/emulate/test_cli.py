"""`basin-emulate` options: SGLang's names and defaults, one clear line and exit 2 for anything bad."""

from __future__ import annotations

import pytest

from basin_emulate.cli import main
from basin_emulate.config import parse_config


def test_defaults_are_sglangs() -> None:
    config = parse_config(["--role", "decode"])
    assert (config.host, config.port, config.bootstrap_port) == ("127.0.0.1", 30000, 8998)
    assert not config.enable_priority_scheduling and not config.schedule_low_priority_values_first
    assert not config.enable_metrics and not config.enable_cache_report
    assert config.time_scale == 1.0 and config.profile.name == "h100-qwen3.6-35b-a3b"
    assert config.max_total_tokens == config.profile.kv_pool_tokens == 1_300_000
    assert config.model_name == "h100-qwen3.6-35b-a3b" and config.host_cache_tokens == 0


def test_overrides_reach_the_profile() -> None:
    config = parse_config(["--role", "prefill", "--max-total-tokens", "5000", "--enable-hierarchical-cache",
                           "--hicache-ratio", "3", "--time-scale", "20", "--served-model-name", "m"])
    assert config.max_total_tokens == 5000 and config.host_cache_tokens == 10_000
    assert config.time_scale == 20 and config.model_name == "m"


@pytest.mark.parametrize(("argv", "message"), [
    ([], "the following arguments are required: --role"),
    (["--role", "both"], "invalid choice: 'both'"),
    (["--role", "prefill", "--time-scale", "0"], "--time-scale must be a finite number > 0"),
    (["--role", "prefill", "--time-scale", "nan"], "--time-scale must be a finite number > 0"),
    (["--role", "prefill", "--time-scale", "fast"], "argument --time-scale: invalid float value: 'fast'"),
    (["--role", "prefill", "--max-total-tokens", "0"], "--max-total-tokens: "),
    (["--role", "prefill", "--hicache-ratio", "0.5"], "--hicache-ratio: "),
    (["--role", "prefill", "--port", "70000"], "--port must be a port number"),
    (["--role", "prefill", "--disaggregation-bootstrap-port", "0"],
     "--disaggregation-bootstrap-port must be a port number"),
    (["--role", "prefill", "--profile", "a100-nothing"], "--profile: unknown profile 'a100-nothing'; known"),
    (["--role", "prefill", "--tokenizer", "gpt9"], "--tokenizer 'gpt9' is unknown"),
    (["--role", "prefill", "--bootstrap-timeout", "-1"], "--bootstrap-timeout must be"),
    (["--role", "prefill", "--log-level", "loud"], "invalid choice: 'loud'"),
    (["--role", "prefill", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
])
def test_a_bad_option_is_one_line_and_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("basin-emulate: error: ") and message in err
