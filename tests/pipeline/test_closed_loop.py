"""The closed loop: the gateway's session log becomes training data, and what it trains is served again.

Rules:
- The log is written by the real gateway (in-process, `tests.runtime.test_gateway_app.rig_for`: mock
  upstream, scripted clock) with its real writer; task texts and call shapes come from the synthetic
  corpus, workloads from the `X-Basin-Workload` header. The adapter's edge cases are records given to
  the real `SessionLogWriter`; no log line is written by hand.
- The pipeline is opted in exactly as the README says: the project's params.yaml plus one
  `ingest.corpora` entry `{benchmark: gateway, format: gateway-log, path: data/demo/gateway-log}`,
  in a temporary project folder (the real corpora, relative to it, are then missing and skipped).
- `test_dvc_repro_...` runs the real `dvc repro export evaluate` in a copy of the project (`dvc init
  --no-scm`, `export.publish: false`); marked `slow` (40 s on 2 idle cores, ~95 s under load; each
  stage is a fresh Python) but `make test` runs it. The in-process chain takes ~27 s.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

import httpx
import pandas as pd
import pytest
import yaml

from basin_pipeline import export, featurize, ingest, sources, train
from basin_pipeline.adapters.gateway_log import task_id_of
from basin_pipeline.params import CORPORA_ROOT_ENV
from basin_runtime.gateway.session_log import SessionLogWriter
from basin_runtime.predictor import PeakPredictor, model_file_name
from basin_runtime.session_log import LoggedCall, SessionLogRecord
from basin_runtime.session_table import Session, read_sessions
from basin_sim.workload.synthetic import generate_corpus
from tests.runtime.test_gateway_app import TOKENIZER, rig_for

ROOT = Path(__file__).resolve().parents[2]
LOG_DIR = "data/demo/gateway-log"
GATEWAY_CORPUS = {"benchmark": "gateway", "format": "gateway-log", "path": LOG_DIR}
WORKLOAD_SESSIONS = 10  # per synthetic family, sent with X-Basin-Workload
NO_WORKLOAD_SESSIONS = 2  # per family, sent without: they take the corpus entry's benchmark
RERUNS = 3  # sessions repeating an earlier session's task text (same workload)
MAX_CALLS = 4
GAP_S = 1.5
SYSTEM = "You are an agent with a shell. Answer with one command."


@dataclass(frozen=True)
class Planned:
    """One session the test drives through the gateway."""

    session_id: str
    workload: str | None
    task_text: str
    tool_words: tuple[int, ...]  # words of tool output after each call but the last

    def messages(self, k: int) -> list[dict[str, str]]:
        """The conversation sent at call k (0-based)."""
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": self.task_text}]
        for j in range(k):
            messages.append({"role": "assistant", "content": f"step {j}: run the tests"})
            messages.append({"role": "user", "content": "ok " * self.tool_words[j]})
        return messages


def completion_of(k: int) -> int:
    return 20 + 13 * k


def cached_of(k: int) -> int | None:
    return None if k == 0 else 5 * k


def _plan(synthetic: list[Session]) -> list[Planned]:
    plan = []
    per_family: dict[str, int] = {}
    for s in synthetic:
        n = per_family[s.benchmark] = per_family.get(s.benchmark, 0) + 1
        calls = s.calls[:MAX_CALLS]
        growth = tuple(min(3000, max(1, (b.prompt_tokens - a.prompt_tokens) // 10)) for a, b in pairwise(calls))
        workload = s.benchmark if n <= WORKLOAD_SESSIONS else None
        plan.append(Planned(f"gw-{s.session_id}", workload, s.task_text, growth))
    reruns = [p for p in plan if p.workload is not None][:RERUNS]
    plan += [Planned(f"{p.session_id}-rerun", p.workload, p.task_text, p.tool_words[::-1]) for p in reruns]
    return plan


async def _upstream(request: httpx.Request) -> httpx.Response:
    """An SGLang-like answer whose usage depends on the call's position in its session."""
    k = sum(m["role"] == "assistant" for m in json.loads(request.content)["messages"])
    usage: dict[str, Any] = {"prompt_tokens": 1, "completion_tokens": completion_of(k)}
    if cached_of(k) is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached_of(k)}
    return httpx.Response(200, json={"id": "c", "object": "chat.completion", "usage": usage, "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}]})


async def drive_gateway(plan: list[Planned], log_file: Path, model: Any = None,
                        workload_models: dict[str, Any] | None = None) -> None:
    """Send every planned session through a real gateway that logs to `log_file`, one after another."""
    writer = SessionLogWriter(log_file, keep_text=True)  # the closed loop retrains from the raw text
    async with rig_for(model=model, workload_models=workload_models,
                       gateway_options={"session_log": writer}) as rig:
        rig.upstream.handler = _upstream
        for p in plan:
            headers = {"X-Session-ID": p.session_id} | ({"X-Basin-Workload": p.workload} if p.workload else {})
            for k in range(len(p.tool_words) + 1):
                if k:
                    rig.clock.advance(GAP_S)
                response = await rig.client.post("/v1/chat/completions", headers=headers,
                                                 json={"model": "qwen", "messages": p.messages(k)})
                assert response.status_code == 200, response.text
            assert (await rig.client.post(f"/basin/sessions/{p.session_id}/end")).status_code == 200
    await asyncio.to_thread(writer.close)
    assert writer.num_dropped == 0


def _project(folder: Path, **changes: Any) -> Path:
    """A project folder whose params.yaml is ours plus the gateway corpus (the documented opt-in)."""
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["ingest"]["corpora"].append(dict(GATEWAY_CORPUS))
    params["train"]["n_trials"] = 3
    for key, value in changes.items():
        section, name = key.split("__")
        params[section][name] = value
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    return folder / "params.yaml"


@dataclass(frozen=True)
class Loop:
    plan: list[Planned]
    log_file: Path
    records: list[SessionLogRecord]


@pytest.fixture(scope="module")
def loop(tmp_path_factory: pytest.TempPathFactory) -> Loop:
    """A gateway log of 39 sessions (30 with a workload, 6 without, 3 reruns), written by the gateway."""
    plan = _plan(generate_corpus(11, WORKLOAD_SESSIONS + NO_WORKLOAD_SESSIONS))
    log_file = tmp_path_factory.mktemp("gateway") / "sessions.jsonl"
    asyncio.run(drive_gateway(plan, log_file))
    records = [SessionLogRecord.from_json(line) for line in log_file.read_text().splitlines()]
    return Loop(plan, log_file, records)


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(CORPORA_ROOT_ENV, raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")


def test_the_default_pipeline_reads_no_gateway_log() -> None:
    """Opt-in: replayed or demo sessions would duplicate trajectories already trained on (CV leakage)."""
    corpora = yaml.safe_load((ROOT / "params.yaml").read_text())["ingest"]["corpora"]
    assert all(c["format"] != "gateway-log" for c in corpora)


def test_the_gateway_logs_every_session_with_the_serving_tokenizers_counts(loop: Loop) -> None:
    by_id = {r.session_id: r for r in loop.records}
    assert sorted(by_id) == sorted(p.session_id for p in loop.plan) and len(loop.records) == 39
    for p in loop.plan:
        record = by_id[p.session_id]
        assert (record.workload, record.task_text, record.end_reason) == (p.workload, p.task_text, "ended")
        assert [c.prompt_tokens for c in record.calls] == \
            [TOKENIZER.count_prompt(p.messages(k)) for k in range(len(p.tool_words) + 1)]
        assert [(c.completion_tokens, c.cached_tokens) for c in record.calls] == \
            [(completion_of(k), cached_of(k)) for k in range(len(record.calls))]


def _stage_ingest(project: Path) -> int:
    params = project / "params.yaml"
    assert sources.main(["--params", str(params), "--out", str(project / "data/sources.json")]) == 0
    return ingest.main(["--params", str(params), "--manifest", str(project / "data/sources.json"), "--out",
                        str(project / "data/sessions.parquet"), "--rejects", str(project / "data/ingest/rejects.jsonl"),
                        "--report", str(project / "data/ingest"), "--quiet"])


@pytest.mark.integration
def test_ingest_train_export_and_the_gateway_serves_the_new_models(loop: Loop, tmp_path: Path) -> None:
    project = tmp_path / "project"
    params = _project(project)
    (project / LOG_DIR).mkdir(parents=True)
    shutil.copy(loop.log_file, project / LOG_DIR / "sessions.jsonl")

    assert _stage_ingest(project) == 0
    manifest = json.loads((project / "data/sources.json").read_text())["corpora"]
    real = [c["benchmark"] for c in yaml.safe_load((ROOT / "params.yaml").read_text())["ingest"]["corpora"]]
    assert [(c["benchmark"], c["present"]) for c in manifest] == [(b, False) for b in real] + [("gateway", True)]
    assert (project / "data/ingest/rejects.jsonl").read_text() == ""

    sessions = {s.session_id: s for s in read_sessions(project / "data/sessions.parquet")}
    assert sorted(sessions) == sorted(r.session_id for r in loop.records)
    for record in loop.records:
        s = sessions[record.session_id]
        assert s.benchmark == (record.workload or "gateway")  # the workload wins over the entry's benchmark
        assert s.task_text == record.task_text and s.task_id == task_id_of(s.task_text)
        assert [(c.prompt_tokens, c.completion_tokens, c.cached_tokens) for c in s.calls] == \
            [(c.prompt_tokens, c.completion_tokens, c.cached_tokens) for c in record.calls]
        assert [c.gap_s for c in s.calls] == [GAP_S] * (len(s.calls) - 1) + [None]
    assert sorted(set(s.benchmark for s in sessions.values())) == \
        ["gateway", "synthetic-swebench", "synthetic-tau", "synthetic-terminal"]

    frame_path, summary = project / "data/features/frame.parquet", project / "data/features/summary.json"
    assert featurize.main(["--params", str(params), "--sessions", str(project / "data/sessions.parquet"),
                           "--out", str(frame_path), "--summary", str(summary)]) == 0
    frame = pd.read_parquet(frame_path)
    for p in loop.plan:
        if p.session_id.endswith("-rerun"):  # a rerun shares its task, so it never helps score itself
            folds = frame[frame["session_id"].isin([p.session_id, p.session_id.removesuffix("-rerun")])]
            assert folds["task_id"].nunique() == 1 and folds["fold_unseen"].nunique() == 1
    assert json.loads(summary.read_text())["synthetic"] is False  # a gateway log is real data to the pipeline

    assert train.main(["--params", str(params), "--frame", str(frame_path), "--summary", str(summary),
                       "--out", str(project / "data/train"), "--trials", str(project / "data/plots/trials.csv")]) == 0
    assert export.main(["--params", str(params), "--train-dir", str(project / "data/train"), "--frame",
                        str(frame_path), "--summary", str(summary), "--out", str(project / "data/models"),
                        "--publish-dir", str(project / "models")]) == 0
    workloads = ["synthetic-swebench", "synthetic-tau", "synthetic-terminal"]
    files = {name: project / "data/models" / model_file_name(name) for name in [None, "gateway", *workloads]}
    assert sorted(p.name for p in (project / "models").iterdir()) == sorted(p.name for p in files.values())
    models = {name: PeakPredictor.load(path, expected_tokenizer=TOKENIZER.name) for name, path in files.items()}
    for s in sessions.values():
        for model in (models[None], models[s.benchmark]):
            peak = model.predict(s.task_text, s.first_prompt_tokens)
            assert math.isfinite(peak) and peak > 0
    assert set(models[None].info.benchmarks) == {"gateway", *workloads}

    # Closing the loop: a gateway serving the new files predicts with them and logs what it predicted.
    fresh = [Planned(f"again-{w}", w, f"{w}: fix the failing parser test in utils", (40,)) for w in workloads]
    fresh.append(Planned("again-none", None, "an unknown agent's task", (40,)))
    asyncio.run(drive_gateway(fresh, tmp_path / "second.jsonl", model=models[None],
                              workload_models={w: models[w] for w in workloads}))
    for line in (tmp_path / "second.jsonl").read_text().splitlines():
        record = SessionLogRecord.from_json(line)
        first = TOKENIZER.count_prompt(next(p for p in fresh if p.session_id == record.session_id).messages(0))
        expected = models[record.workload].predict(record.task_text or "", first)
        assert record.predicted_peak_tokens == pytest.approx(expected, rel=1e-9)


def test_workload_names_fallback_and_text_free_records_at_ingest(tmp_path: Path) -> None:
    """The adapter's edge cases, written by the real writer and read by standalone ingest."""
    def record(session_id: str, workload: str | None, text: str | None = "fix the bug") -> SessionLogRecord:
        return SessionLogRecord(session_id=session_id, model="qwen", tokenizer=TOKENIZER.name, task_text=text,
                                task_chars=len("fix the bug"), started_at=1.0, ended_at=5.0, end_reason="ended",
                                calls=(LoggedCall(1.0, 2.0, 300, 10), LoggedCall(4.0, 5.0, 420, 12, 300)),
                                workload=workload)

    writer = SessionLogWriter(tmp_path / "log" / "sessions.jsonl", keep_text=True)
    for r in [record("a", "swe"), record("b", None), record("c", "../../etc/passwd"), record("d", "x" * 101),
              record("e", "swe", text=None), record("f", "swe.v2_beta-1")]:
        writer.append(r)
    writer.close()
    out = tmp_path / "out.parquet"
    assert ingest.main(["--format", "gateway-log", "--benchmark", "prod", "--out", str(out), "--quiet",
                        "--max-reject-fraction", "0.5", str(tmp_path / "log")]) == 0
    sessions = {s.session_id: s for s in read_sessions(out)}
    assert {k: s.benchmark for k, s in sessions.items()} == {"a": "swe", "b": "prod", "f": "swe.v2_beta-1"}
    assert len({s.task_id for s in sessions.values()}) == 1  # same text, same task
    rejects = [json.loads(line) for line in (tmp_path / "out.rejects.jsonl").read_text().splitlines()]
    assert [(r["line"], r["reason"].split(" ")[0]) for r in rejects] == [(3, "workload"), (4, "workload"), (5, "the")]
    assert "cannot name a benchmark" in rejects[0]["reason"] and "text-free" in rejects[2]["reason"]


# --- the real `dvc repro` -------------------------------------------------------------------------

def copy_project(project: Path, names: list[str]) -> None:
    """A fresh folder `project` holding `names` from the repository (no byte-code)."""
    project.mkdir()
    for name in names:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, project / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(source, project / name)


COPIED = ["dvc.yaml", "pipeline", "basin_runtime", "basin_sim", "models", ".dvcignore"]


def _dvc(project: Path, *args: str) -> subprocess.CompletedProcess[str]:
    venv_bin = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": venv_bin + os.pathsep + os.environ.get("PATH", ""), "DVC_NO_ANALYTICS": "1"}
    env.pop(CORPORA_ROOT_ENV, None)
    return subprocess.run([str(Path(venv_bin) / "dvc"), *args], cwd=project, env=env, capture_output=True,
                          text=True, timeout=600, check=False)


@pytest.fixture
def dvc_project(tmp_path: Path, loop: Loop) -> Iterator[Path]:
    """A copy of the project (code, dvc.yaml, shipped models) with the opt-in params and the log in place."""
    project = tmp_path / "repo"
    copy_project(project, COPIED)
    _project(project, export__publish=False)  # the README's advice for demo logs: do not replace models/
    (project / LOG_DIR).mkdir(parents=True)
    shutil.copy(loop.log_file, project / LOG_DIR / "sessions.jsonl")
    for args in (["init", "--no-scm", "-q"], ["config", "--local", "core.site_cache_dir", str(tmp_path / "site")]):
        assert _dvc(project, *args).returncode == 0
    yield project


@pytest.mark.integration
def test_dvc_repro_trains_on_the_gateway_log_and_notices_when_it_grows(dvc_project: Path, loop: Loop) -> None:
    shipped = {p.name: p.read_bytes() for p in (ROOT / "models").iterdir()}
    done = _dvc(dvc_project, "repro", "export", "evaluate")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lock = yaml.safe_load((dvc_project / "dvc.lock").read_text())["stages"]
    assert set(lock) == {"sources", "ingest", "featurize", "train", "online", "export", "evaluate"}
    metrics = json.loads((dvc_project / "metrics/spearman.json").read_text())
    assert set(metrics["unseen_task"]) == {"gateway", "synthetic-swebench", "synthetic-tau", "synthetic-terminal"}
    assert sum(v["sessions"] for v in metrics["unseen_task"].values()) == len(loop.records)
    report = json.loads((dvc_project / "metrics/ingest.json").read_text())
    assert report["synthetic"] is False
    assert {p.name: p.read_bytes() for p in (dvc_project / "models").iterdir()} == shipped  # publish: false

    unchanged = _dvc(dvc_project, "repro", "export", "evaluate")
    assert unchanged.returncode == 0 and "Running stage 'ingest'" not in unchanged.stdout, unchanged.stdout
    with (dvc_project / LOG_DIR / "sessions.jsonl").open("a") as handle:  # the gateway logs one more session
        handle.write(dataclasses.replace(loop.records[0], session_id="one-more").to_json() + "\n")  # as the writer does
    assert _dvc(dvc_project, "repro", "sources").returncode == 0
    status = _dvc(dvc_project, "status", "ingest")
    assert "ingest" in status.stdout and "data/sources.json" in status.stdout, status.stdout
