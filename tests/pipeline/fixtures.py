"""Small trajectory files written by the tests themselves, in each supported format."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

SYSTEM = "You are a helpful assistant that can run shell commands."
TASK = ("<pr_description>\nConsider the following PR description:\n"
        "Fix the off-by-one in utils.slice()\n</pr_description>")


def _assistant(content: str, prompt_tokens: int, cached: int, created: int) -> dict[str, Any]:
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": 9,
             "prompt_tokens_details": {"cached_tokens": cached}}
    return {"role": "assistant", "content": content,
            "extra": {"response": {"model": "test/model-x", "created": created, "usage": usage}}}


def mini_swe_trajectory(instance_id: str = "proj__proj-1") -> dict[str, Any]:
    return {
        "trajectory_format": "mini-swe-agent-1",
        "instance_id": instance_id,
        "info": {"mini_version": "1.15.0", "exit_status": "Submitted"},
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": TASK},
            _assistant("THOUGHT: look\n```bash\nls\n```", 100, 0, 1000),
            {"role": "user", "content": "<returncode>0</returncode>\n<output>utils.py</output>"},
            _assistant("THOUGHT: read\n```bash\ncat utils.py\n```", 140, 90, 1004),
            {"role": "user", "content": "<output>def slice(x): return x[1:]</output>"},
            _assistant("Done", 180, 130, 1003),  # one second back: clock jitter, not an error
        ],
    }


def write_mini_swe(folder: Path, n: int = 2, gz: bool = True) -> list[str]:
    trajs = folder / "trajs"
    trajs.mkdir(parents=True)
    ids = [f"proj__proj-{i}" for i in range(n)]
    for instance_id in ids:
        data = json.dumps(mini_swe_trajectory(instance_id)).encode()
        name = trajs / f"{instance_id}.traj.json"
        if gz:
            name.with_name(name.name + ".gz").write_bytes(gzip.compress(data))
        else:
            name.write_bytes(data)
    (folder / "resolved.json").write_text(json.dumps({ids[0]: True}))
    return ids


TOOLS = [{"type": "function", "function": {"name": "get_user", "description": "Look a user up.",
                                            "parameters": {"type": "object", "properties": {
                                                "user_id": {"type": "string"}}}}}]


def messages_session(session_id: str, with_times: bool = True, tools: bool = True) -> dict[str, Any]:
    messages = [
        {"role": "system", "content": "Airline policy."},
        {"role": "user", "content": "I want to change my flight."},
        {"role": "assistant", "content": '{"name": "get_user", "arguments": {"user_id": "u1"}}'},
        {"role": "tool", "name": "get_user", "content": '{"user_id": "u1", "reservations": ["R1"]}'},
        {"role": "assistant", "content": "Which reservation?"},
        {"role": "user", "content": "R1 please."},
        {"role": "assistant", "content": "Done."},
    ]
    if with_times:
        for t, m in zip([0.0, 0.1, 2.0, 2.5, 4.0, 9.0, 11.0], messages, strict=True):
            m["t"] = t
    body: dict[str, Any] = {"session_id": session_id, "benchmark": "toy-airline", "task_id": "t1",
                            "task_description": "hidden instruction", "agent": "toy", "model": "toy-4o",
                            "resolved": "True", "messages": messages, "extra_field": {"ignored": 1}}
    if tools:
        body["tools"] = TOOLS
    return body


def write_jsonl(path: Path, lines: list[str], gz: bool = False) -> Path:
    text = "".join(line + "\n" for line in lines)
    if gz:
        path = path.with_name(path.name + ".gz")
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)
    return path
