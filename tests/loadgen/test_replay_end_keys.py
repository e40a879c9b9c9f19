"""The replayer against the real gateway (in-process, on loopback, in front of the fake OpenAI server) with an
admin token: it ends every session it opened holding only the sessions' own end keys."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from basin_loadgen.replay import ConversationBuilder
from basin_loadgen.replay_client import ClientSettings, Replayer
from basin_runtime.gateway.app import build_app
from basin_runtime.gateway.config import GatewayConfig
from tests.loadgen.fake_openai import running_fake, serving
from tests.loadgen.test_replay import TOKENIZER, planned, pool_of

MODEL_FILE = Path(__file__).resolve().parents[2] / "models" / "peak_predictor.onnx"
ADMIN_TOKEN = "operator-only"


@pytest.mark.asyncio
async def test_the_replayer_ends_its_sessions_at_a_gateway_with_an_admin_token_by_their_keys_alone() -> None:
    pool = pool_of()
    plan = planned(pool, tag="keys")[:4]
    with running_fake() as fake:
        config = GatewayConfig(upstream=fake.url, default_model=MODEL_FILE, budget_tokens=10**9,
                               admin_token=ADMIN_TOKEN)
        with serving(build_app(config), lifespan="on") as gateway:
            settings = ClientSettings(f"{gateway}/v1", time_scale=50.0, sample_s=1.0)  # no admin token
            records = await Replayer(settings, ConversationBuilder(pool, TOKENIZER, "keys")).run(plan)
            admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
            async with httpx.AsyncClient(base_url=gateway, headers=admin) as http:
                policy = (await http.get("/basin/state")).json()["policy"]
                metrics = (await http.get("/metrics")).text

    assert [r.status for r in records] == ["finished"] * 4
    assert len(fake.engine.requests) == sum(p.session.n_calls for p in plan)  # every call went through the gateway
    assert (policy["live"], policy["queued"]) == ([], [])
    assert 'basin_sessions_ended_total{reason="ended"} 4.0' in metrics  # ended by the client, not idled out
