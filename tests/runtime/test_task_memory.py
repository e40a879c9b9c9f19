"""The task fingerprint and the memory of finished tasks (basin_runtime.task_fingerprint, basin_runtime.task_memory)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from basin_runtime.task_fingerprint import normalise_task_text, task_fingerprint
from basin_runtime.task_memory import (
    FORMAT,
    VERSION,
    TaskMemory,
    TaskMemoryError,
    load_shrinkage,
    shrinkage_weight,
    shrunk_peak,
)


def test_the_fingerprint_ignores_case_whitespace_and_unicode_forms_only() -> None:
    base = task_fingerprint("Fix the Parser\nin src/x.py")
    assert base == task_fingerprint("  fix the parser\r\n\tin   SRC/X.PY ")
    assert base == task_fingerprint("Fix the Parser\u00a0in src/x.py")  # NFKC: no-break space is a space
    assert base == task_fingerprint("Fix the Parser in src/x.py")
    assert base != task_fingerprint("Fix the Parser in src/y.py")  # ids and paths are content
    assert base != task_fingerprint("Fix the Parser in src/x.py.")
    assert normalise_task_text(" A\u2163  b\n") == "aiv b"  # NFKC then casefold: Roman numeral IV -> "iv"
    assert task_fingerprint(" \n\t") is None
    assert base is not None and len(base) == 32 and int(base, 16) >= 0


def test_shrinkage_weight_and_combination_in_log_space() -> None:
    assert shrinkage_weight(0, 1.0) == 0.0
    assert shrinkage_weight(3, None) == 0.0
    assert shrinkage_weight(3, 1.0) == 0.75
    assert shrinkage_weight(2, 0.0) == 1.0
    assert shrunk_peak(1000.0, [], 0.5) == 1000.0
    assert shrunk_peak(1000.0, [4000.0, 16000.0], None) == 1000.0
    # w = 2/3: exp(1/3 log 1000 + 2/3 log 8000) = 1000^(1/3) x 8000^(2/3) = 10 x 400
    assert math.isclose(shrunk_peak(1000.0, [4000.0, 16000.0], 1.0), 4000.0)
    with pytest.raises(TaskMemoryError):
        shrinkage_weight(1, -1.0)


def test_only_sessions_ended_before_the_arrival_count() -> None:
    memory = TaskMemory()
    memory.record("t", "a", 100.0, ended_s=10.0)
    memory.record("t", "b", 200.0, ended_s=20.0)
    assert memory.peaks("t", now=10.0) == []
    assert memory.peaks("t", now=10.5) == [100.0]
    assert memory.peaks("t", now=20.0) == [100.0]
    assert memory.peaks("t", now=21.0) == [100.0, 200.0]
    assert memory.peaks("other", now=99.0) == []
    assert memory.peaks(None, now=99.0) == []


def test_a_replayed_trajectory_never_finds_its_own_peak() -> None:
    memory = TaskMemory()
    memory.record("t", "traj-1", 100.0, ended_s=1.0)
    memory.record("t", "traj-2", 300.0, ended_s=2.0)
    memory.record("t", "traj-1", 100.0, ended_s=3.0)  # the same trajectory replayed again
    assert memory.peaks("t", now=9.0, exclude="traj-1") == [300.0]
    assert memory.peaks("t", now=9.0, exclude="traj-2") == [100.0, 100.0]


def test_the_memory_is_bounded_per_task_and_in_tasks() -> None:
    memory = TaskMemory(max_peaks_per_task=2, max_tasks=2)
    for k, peak in enumerate((10.0, 20.0, 30.0)):
        memory.record("t1", f"s{k}", peak, ended_s=float(k))
    assert memory.peaks("t1", now=9.0) == [20.0, 30.0]  # the newest kept
    memory.record("t2", "x", 5.0, ended_s=0.0)
    memory.record("t1", "s3", 40.0, ended_s=4.0)  # t1 recorded last: t2 is the least recent
    memory.record("t3", "y", 7.0, ended_s=0.0)
    assert len(memory) == 2
    assert memory.peaks("t2", now=9.0) == []
    assert memory.peaks("t1", now=9.0) == [30.0, 40.0]


def test_a_bad_record_raises_and_changes_nothing() -> None:
    memory = TaskMemory()
    memory.record("t", "a", 100.0, ended_s=1.0)
    for peak in (0.0, math.nan, math.inf):
        with pytest.raises(TaskMemoryError, match="session 'b'"):
            memory.record("t", "b", peak, ended_s=2.0)
    assert memory.peaks("t", now=9.0) == [100.0]
    assert len(memory) == 1


def test_load_shrinkage_reads_k_and_names_a_bad_file(tmp_path: Path) -> None:
    path = tmp_path / "task_memory.json"
    path.write_text(json.dumps({"format": FORMAT, "version": VERSION, "k": 0.79}))
    assert load_shrinkage(path).k == 0.79
    path.write_text(json.dumps({"format": FORMAT, "version": VERSION, "k": None}))
    assert load_shrinkage(path).k is None
    path.write_text(json.dumps({"format": FORMAT, "version": VERSION, "k": -1}))
    with pytest.raises(TaskMemoryError, match="'k'"):
        load_shrinkage(path)
    with pytest.raises(TaskMemoryError, match="stage task_memory"):
        load_shrinkage(tmp_path / "absent.json")


def test_the_committed_task_memory_file_loads() -> None:
    k = load_shrinkage(Path(__file__).resolve().parents[2] / "metrics" / "task_memory.json").k
    assert k is None or k >= 0
