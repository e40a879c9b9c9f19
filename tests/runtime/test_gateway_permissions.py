"""Who may use the admin endpoints: the operator's token, a session's own end key, and the start-up refusal
to serve them open beyond loopback."""

from __future__ import annotations

import hashlib
import hmac
import logging
from pathlib import Path

import httpx
import pytest

from basin_runtime.gateway.cli import OPEN_ENDPOINTS, check_admin_exposure, is_loopback, main
from basin_runtime.gateway.config import ConfigError, build_parser, load_config
from tests.runtime.test_gateway_app import Rig, rig_for

TOKEN = "s3cret"
KEY_HEADER = "X-Basin-Session-Key"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}


def expected_key(rig: Rig, secret: str, session_id: str) -> str:
    """The documented derivation, computed here independently of the gateway's code: the run's nonce and the
    session's incarnation (its policy record's sequence number and arrival time) before its id."""
    record = rig.policy.record_of(session_id)
    run = rig.gateway.settings.session_keys.run
    message = f"basin-session-end:{run}/{record.seq}/{record.arrival_s!r}:{session_id}"
    return hmac.new(secret.encode(), message.encode(), hashlib.sha256).hexdigest()[:32]


async def live_ids(rig: Rig) -> set[str]:
    return set(rig.policy.snapshot().live)


# --- the session end key -------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_sessions_first_answer_carries_its_end_key_and_later_answers_do_not() -> None:
    async with rig_for(admin_token=TOKEN) as rig:
        first = await rig.chat("s1", "task")
        later = await rig.chat("s1", "task", "more")
    assert first.status_code == later.status_code == 200
    assert first.headers[KEY_HEADER] == expected_key(rig, TOKEN, "s1")
    assert KEY_HEADER.lower() not in later.headers


@pytest.mark.asyncio
async def test_an_agent_ends_its_own_session_with_its_key_alone() -> None:
    async with rig_for(admin_token=TOKEN) as rig:
        key = (await rig.chat("s1", "task")).headers[KEY_HEADER]
        await rig.chat("s2", "task two")
        ended = await rig.client.post("/basin/sessions/s1/end", headers={KEY_HEADER: key})
        assert (ended.status_code, ended.json()["session_id"]) == (200, "s1")
        assert await live_ids(rig) == {"s2"}


@pytest.mark.asyncio
async def test_a_session_key_opens_nothing_else() -> None:
    async with rig_for(admin_token=TOKEN) as rig:
        key_a = (await rig.chat("a", "task a")).headers[KEY_HEADER]
        await rig.chat("b", "task b")
        as_key = {KEY_HEADER: key_a}
        as_bearer = {"Authorization": f"Bearer {key_a}"}
        for method, path in [("GET", "/basin/state"), ("GET", "/basin/sessions"), ("PUT", "/basin/budget"),
                             ("POST", "/basin/reload"), ("PUT", "/basin/shadow")]:
            for headers in (as_key, as_bearer):
                response = await rig.client.request(method, path, json={}, headers=headers)
                assert response.status_code == 401, (method, path, headers)
        for headers in (as_key, as_bearer, {KEY_HEADER: expected_key(rig, TOKEN, "a")[:-1] + "0"}, {}):
            response = await rig.client.post("/basin/sessions/b/end", headers=headers)
            assert response.status_code == 401, headers
            assert response.json()["error"]["type"] == "unauthorized"
        assert await live_ids(rig) == {"a", "b"}  # nothing ended
        assert (await rig.client.get("/basin/state", headers=ADMIN)).status_code == 200


@pytest.mark.asyncio
async def test_the_401s_name_the_credential_each_route_takes() -> None:
    async with rig_for(admin_token=TOKEN) as rig:
        state = (await rig.client.get("/basin/state")).json()["error"]["message"]
        end = (await rig.client.post("/basin/sessions/x/end")).json()["error"]["message"]
    assert "Authorization: Bearer <admin token>" in state and KEY_HEADER in state and "opens only" in state
    assert "Authorization: Bearer <admin token>" in end and f"{KEY_HEADER}: <its key>" in end


@pytest.mark.asyncio
async def test_the_admin_token_still_ends_any_session() -> None:
    async with rig_for(admin_token=TOKEN) as rig:
        await rig.chat("s1", "task")
        response = await rig.client.post("/basin/sessions/s1/end", headers={**ADMIN, KEY_HEADER: "wrong"})
        assert response.status_code == 200 and await live_ids(rig) == set()


@pytest.mark.asyncio
async def test_whoever_else_sends_a_call_under_a_live_sessions_id_gets_no_key() -> None:
    async with rig_for(admin_token=TOKEN) as rig:
        owner = await rig.chat("victim", "task")
        intruder = await rig.chat("victim", "task", "let me in")
        assert KEY_HEADER in owner.headers and KEY_HEADER.lower() not in intruder.headers
        refused = await rig.client.post("/basin/sessions/victim/end")
        assert refused.status_code == 401 and await live_ids(rig) == {"victim"}


@pytest.mark.asyncio
async def test_the_key_goes_out_on_the_first_answer_forwarded_not_on_a_failed_call() -> None:
    async with rig_for(admin_token=TOKEN) as rig:
        async def broken(request: httpx.Request) -> httpx.Response:
            return httpx.Response(500, text="engine down")

        rig.upstream.handler = broken
        failed = await rig.chat("s1", "task")
        rig.upstream.handler = None
        served = await rig.chat("s1", "task")
    assert failed.status_code == 502 and KEY_HEADER.lower() not in failed.headers
    assert served.status_code == 200 and served.headers[KEY_HEADER] == expected_key(rig, TOKEN, "s1")


@pytest.mark.asyncio
async def test_a_key_ends_only_the_incarnation_it_was_given_to() -> None:
    # Issue 36 item 3: the key of an ended session used to end every later session with its id.
    async with rig_for(admin_token=TOKEN) as rig:
        old_key = (await rig.chat("s1", "task")).headers[KEY_HEADER]
        assert (await rig.client.post("/basin/sessions/s1/end", headers={KEY_HEADER: old_key})).status_code == 200
        new_key = (await rig.chat("s1", "task")).headers[KEY_HEADER]
        assert new_key != old_key and new_key == expected_key(rig, TOKEN, "s1")
        refused = await rig.client.post("/basin/sessions/s1/end", headers={KEY_HEADER: old_key})
        assert refused.status_code == 401 and "s1" in await live_ids(rig)
        assert (await rig.client.post("/basin/sessions/s1/end", headers={KEY_HEADER: new_key})).status_code == 200
        gone = await rig.client.post("/basin/sessions/s1/end", headers={KEY_HEADER: new_key})
        assert gone.status_code == 401  # nothing held under the id: the key is checked first (issue 46 item 4)
        admin = await rig.client.post("/basin/sessions/s1/end", headers={"Authorization": f"Bearer {TOKEN}"})
        assert admin.status_code == 404  # the admin token alone learns that nothing is held


@pytest.mark.asyncio
async def test_keys_rotate_when_the_gateway_restarts() -> None:
    # Two runs of one gateway (the same admin token): a key from before the restart opens nothing after it, and the
    # session's first answer in the new run carries its new key.
    async with rig_for(admin_token=TOKEN) as before:
        old_key = (await before.chat("s1", "task")).headers[KEY_HEADER]
    async with rig_for(admin_token=TOKEN) as after:
        new_key = (await after.chat("s1", "task")).headers[KEY_HEADER]
        runs = before.gateway.settings.session_keys.run, after.gateway.settings.session_keys.run
        assert new_key != old_key and runs[0] != runs[1]
        refused = await after.client.post("/basin/sessions/s1/end", headers={KEY_HEADER: old_key})
        assert refused.status_code == 401 and "s1" in await live_ids(after)
        assert (await after.client.post("/basin/sessions/s1/end", headers={KEY_HEADER: new_key})).status_code == 200


@pytest.mark.asyncio
async def test_without_an_admin_token_keys_still_go_out_and_ending_stays_open() -> None:
    async with rig_for() as rig:
        key = (await rig.chat("s1", "task")).headers[KEY_HEADER]
        await rig.chat("s2", "task two")
        assert len(key) == 32 and int(key, 16) >= 0  # from a per-process random secret
        assert (await rig.client.post("/basin/sessions/s1/end")).status_code == 200
        assert (await rig.client.post("/basin/sessions/s2/end", headers={KEY_HEADER: "anything"})).status_code == 200


@pytest.mark.asyncio
async def test_a_single_call_session_gets_no_key() -> None:
    async with rig_for(admin_token=TOKEN) as rig:
        response = await rig.client.post("/v1/completions", json={"model": "m", "prompt": "hello"})
    assert response.status_code == 200 and KEY_HEADER.lower() not in response.headers


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
