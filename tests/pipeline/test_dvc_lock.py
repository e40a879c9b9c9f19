"""The committed dvc.lock matches the code and params it records (CI catches a stale lock).

Rules:
- `dvc status --json` in the repository itself; only what CI can see counts: a dependency tracked by
  git (code, params.yaml) recorded with another hash, and a stage whose command changed. Data deps
  (git-ignored `data/`, the corpora) are absent on CI and are not judged.
- A failure names each stale stage and what changed; the fix is `make repro` (or `dvc commit STAGE`
  when only a comment changed) and committing dvc.lock.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def _git_tracked(path: str) -> bool:
    listed = subprocess.run(["git", "ls-files", "--", path], cwd=ROOT, capture_output=True, text=True, check=True)
    return bool(listed.stdout.strip())


def stale_entries(status: dict[str, Any], is_tracked: Any = _git_tracked) -> dict[str, list[str]]:
    """Per stage, what CI can see changed: tracked deps and params.yaml keys, and a changed command."""
    stale: dict[str, list[str]] = {}
    for stage, changes in status.items():
        for change in changes:
            if not isinstance(change, dict):
                if change == "changed command":
                    stale.setdefault(stage, []).append("its command (dvc.yaml)")
                continue  # "always changed" (the sources stage)
            for dep, state in change.get("changed deps", {}).items():
                if isinstance(state, dict):  # params.yaml: {key: "modified" | "new" | "deleted"}
                    stale.setdefault(stage, []).extend(f"{dep}:{k} {v}" for k, v in state.items())
                elif state == "modified" and is_tracked(dep):
                    stale.setdefault(stage, []).append(f"{dep} {state}")
    return stale


def test_stale_entries_name_code_and_params_but_not_absent_data() -> None:
    status = {"sources": ["always changed"],
              "train": [{"changed deps": {"pipeline/basin_pipeline/train.py": "modified",
                                          "data/features/frame.parquet": "deleted",
                                          "params.yaml": {"train.n_trials": "modified"}}},
                        {"changed outs": {"data/train": "deleted"}}],
              "ingest": [{"changed deps": {"data/sources.json": "modified"}}], "evaluate": ["changed command"]}
    assert stale_entries(status, lambda p: not p.startswith("data/")) == {
        "train": ["pipeline/basin_pipeline/train.py modified", "params.yaml:train.n_trials modified"],
        "evaluate": ["its command (dvc.yaml)"]}


def test_the_committed_dvc_lock_matches_the_code_and_params() -> None:
    dvc = Path(sys.executable).parent / "dvc"
    env = {**os.environ, "DVC_NO_ANALYTICS": "1"}
    done = subprocess.run([str(dvc), "status", "--json"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    stale = stale_entries(json.loads(done.stdout or "{}"))
    assert not stale, "dvc.lock is stale (run `make repro` and commit dvc.lock): " + "; ".join(
        f"stage {stage}: {', '.join(changes)}" for stage, changes in sorted(stale.items()))
