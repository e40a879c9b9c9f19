"""Write the result tables in README.md and docs/ from the JSON the commands wrote; `--check` only compares.

A generated block sits between `<!-- generated: NAME -->` and `<!-- /generated -->` in any Markdown file;
NAME picks a renderer below, each reading one JSON file the project's commands write:
- `metrics/nested.json`, `metrics/spearman.json`, `metrics/simulate.json` (`make repro`, DVC stages `nested`,
  `evaluate` and `simulate`);
- `docs/results/compare-paper.json` (`basin-sim compare --preset paper --out docs/results/compare-paper.json`);
- `docs/results/compare-field.json` (`basin-sim compare --preset field --out docs/results/compare-field.json`).
Nothing in a block is typed by hand: edit the renderer, re-run this script, commit both. `--check` (run by the
test suite) exits 1 naming every block that differs from what its JSON gives, and 2 on a block it cannot render.

    python -m basin_pipeline.render_results           # rewrite every block
    python -m basin_pipeline.render_results --check   # what CI runs (tests/test_docs.py)
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from basin_runtime.markdown_table import markdown_table

ROOT = Path(__file__).resolve().parents[2]
BLOCK = re.compile(r"(<!-- generated: (?P<name>[a-z0-9-]+) -->\n)(?P<body>.*?)(<!-- /generated -->)", re.DOTALL)
PAPER_JSON = "docs/results/compare-paper.json"
PAPER_COMMAND = "`basin-sim compare --preset paper --plot-dir docs/paper-eval --out docs/results/compare-paper.json`"
# The committed compare JSON's run: the commit it was measured at (issue 47's golden run; the code after the
# restructuring gives the same bytes), named wherever it is shown.
PAPER_MEASURED_AT = "measured at commit 742d4ea (sourced tool time, issue 44; the outgrowth rule, issue 46)"

Runs = dict[tuple[str, str, str, int], float]  # (scenario, lending, label, seed) -> goodput /h


class RenderError(Exception):
    """A block names no renderer, or its JSON is missing or lacks a key."""


@functools.cache  # one read per file and run: several blocks render from the same JSON
def _load(path: str) -> Any:
    file = ROOT / path
    if not file.is_file():
        raise RenderError(f"{path} is missing (the command that writes it is named in "
                          "pipeline/basin_pipeline/render_results.py)")
    return json.loads(file.read_text())


def _mean_sd(values: Sequence[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def _pm(values: Sequence[float], spec: str = ",.0f") -> str:
    mean, sd = _mean_sd(values)
    return f"{mean:{spec}} ± {sd:{spec}}"


# --- the paper's evaluation (basin-sim compare --preset paper) -------------------------------------------


class PaperRuns:
    """The preset's runs, keyed for paired ratios (same scenario and seed: the same arrivals)."""

    def __init__(self, doc: dict[str, Any]) -> None:
        self.rows: list[dict[str, Any]] = doc["runs"]
        self.summary: dict[str, dict[str, Any]] = doc["summary"]
        self.goodput: Runs = {(r["scenario"], r["lending"], r["policy"], r["seed"]): float(r["goodput_per_hour"])
                              for r in self.rows}

    def values(self, scenario: str, lending: str, label: str, key: str = "goodput_per_hour") -> list[float]:
        return [float(r[key]) for r in self.rows
                if (r["scenario"], r["lending"], r["policy"]) == (scenario, lending, label) and r[key] is not None]

    def stuck(self, scenario: str, lending: str, label: str) -> int:
        return sum(bool(r["is_stuck"]) for r in self.rows
                   if (r["scenario"], r["lending"], r["policy"]) == (scenario, lending, label))

    def ratios(self, scenario: str, lending: str, label: str) -> list[float]:
        """`label` over Continuum without lending, seed by seed (a seed whose Continuum made 0 is left out)."""
        seeds = sorted(s for (sc, le, la, s) in self.goodput if (sc, le, la) == (scenario, lending, label))
        return [self.goodput[(scenario, lending, label, s)] / self.goodput[(scenario, "none", "continuum", s)]
                for s in seeds if self.goodput.get((scenario, "none", "continuum", s))]

    def goodput_text(self, scenario: str, lending: str, label: str) -> str:
        text = _pm(self.values(scenario, lending, label))
        cell = next(v for k, v in self.summary.items() if k.startswith(f"{scenario}/") and k.endswith(
            f"/{lending}/{label}"))
        wait = cell["first_call_wait_p50_s"] or 0.0  # over every first call of every seed
        stuck = self.stuck(scenario, lending, label)
        if stuck:
            text += f" ({stuck}/{len(self.values(scenario, lending, label))} stuck)"
        return text + (f", wait {wait:.0f} s" if wait >= 1 else "")

    def ratio_text(self, scenario: str, lending: str, label: str) -> str:
        ratios = self.ratios(scenario, lending, label)
        if not ratios:
            return "-"
        if all(r == 1 for r in ratios):
            return f"1.000 (equal in all {len(ratios)} seeds)"
        ahead = sum(r > 1 for r in ratios)
        return f"{_pm(ratios, '.3f')} ({ahead}/{len(ratios)} seeds ahead)"


PAPER_SCENARIOS = (("Terminal-Bench steady", "paper-timed-steady"),
                   ("Terminal-Bench surge +100%", "paper-timed-surge-100"),
                   ("Terminal-Bench burst killed", "paper-timed-kill-burst"),
                   ("Terminal-Bench burst kept", "paper-timed-kill-burst-keep"),
                   ("SWE-bench-Pro-like steady", "paper-swebench-pro-steady"),
                   ("SWE-bench-Pro-like surge +100%", "paper-swebench-pro-surge-100"))


def paper_table() -> str:
    """Two tables (goodput by policy; the paired ratios), so each fits a 1280-px page."""
    runs = PaperRuns(_load(PAPER_JSON))
    head = ("scenario", "sglang", "continuum", "continuum (lending)", "basin-proto (lending)", "basin (lending)")
    rows = [(name, runs.goodput_text(s, "none", "sglang"), runs.goodput_text(s, "none", "continuum"),
             runs.goodput_text(s, "decode-memory", "continuum"), runs.goodput_text(s, "decode-memory", "basin-proto"),
             runs.goodput_text(s, "decode-memory", "basin")) for name, s in PAPER_SCENARIOS]
    ratios = [(name, runs.ratio_text(s, "decode-memory", "basin"), runs.ratio_text(s, "decode-memory", "basin-proto"))
              for name, s in PAPER_SCENARIOS]
    return (f"Goodput /h, mean ± sd over seeds (the first-call wait p50 over all seeds' first calls where it is 1 s "
            f"or more). From `{PAPER_JSON}`, written by {PAPER_COMMAND}, **{PAPER_MEASURED_AT}**.\n\n"
            + markdown_table(head, rows)
            + "\n\nThe same runs, paired by seed over Continuum without lending:\n\n"
            + markdown_table(("scenario", "basin (lending) / continuum", "basin-proto (lending) / continuum"), ratios))


ABLATIONS = (("as the paper has it", "basin"),
             ("reservation and priority by the true peak (`oracle-peak`)", "basin:oracle-peak"),
             ("a per-benchmark constant (`benchmark-constant`)", "basin:benchmark-constant"),
             ("the current context (`current-context`)", "basin:current-context"),
             ("priority by arrival (`arrival-order`)", "basin:arrival-order"),
             ("fixed budget (`fixed-budget`)", "basin:fixed-budget"),
             ("no shedding (`no-shedding`)", "basin:no-shedding"),
             ("no admission (`no-admission`)", "basin:no-admission"),
             ("the latency gate, beyond the paper (`latency-gate`)", "basin:latency-gate"),
             ("m(q) x prediction, q = 0.5 (`q0.5`)", "basin:q0.5"),
             ("q = 0.75 (`q0.75`)", "basin:q0.75"),
             ("q = 0.95 (`q0.95`)", "basin:q0.95"),
             ("q = 0.99 (`q0.99`)", "basin:q0.99"))


def paper_ablations() -> str:
    runs = PaperRuns(_load(PAPER_JSON))
    scenario = "paper-timed-kill-burst-keep"
    rows = [(name, runs.goodput_text(scenario, "none", label), runs.ratio_text(scenario, "none", label))
            for name, label in ABLATIONS if runs.values(scenario, "none", label)]
    return (f"`basin` with one part changed, the burst kept, lending none (from `{PAPER_JSON}`, "
            f"**{PAPER_MEASURED_AT}**):\n\n"
            + markdown_table(("`basin` with one part changed", "goodput /h", "/ continuum (paired)"), rows))


# --- the field (basin-sim compare --preset field) -----------------------------------------------------------

FIELD_JSON = "docs/results/compare-field.json"
FIELD_COMMAND = ("`basin-sim compare --preset field --jobs 2 --plot-dir docs/field-eval "
                 "--out docs/results/compare-field.json`")
FIELD_BASES = ("sglang", "continuum", "continuum-fixed-ttl", "budgeter", "thunderagent", "concur", "basin")
SESSION_CACHE = "+session-cache"
FIELD_MEASURED_AT = "measured at commit c2ed88c"  # the commit the committed run's code is
FIELD_SCENARIOS = (("TB steady", "paper-timed-steady"), ("TB surge +100%", "paper-timed-surge-100"),
                   ("TB burst killed", "paper-timed-kill-burst"), ("TB burst kept", "paper-timed-kill-burst-keep"),
                   ("SWE-Pro steady", "paper-swebench-pro-steady"),
                   ("SWE-Pro surge +100%", "paper-swebench-pro-surge-100"))


class FieldRuns:
    """The field preset's runs (one deployment, no lending), keyed by (scenario, label, seed)."""

    def __init__(self, doc: dict[str, Any]) -> None:
        self.rows: list[dict[str, Any]] = doc["runs"]
        self.by = {(r["scenario"], r["policy"], r["seed"]): r for r in self.rows}
        present = {r["policy"] for r in self.rows}
        self.labels = [label for base in FIELD_BASES for label in (base, base + SESSION_CACHE) if label in present]

    def values(self, scenario: str, label: str, key: str = "goodput_per_hour") -> list[float]:
        return [float(r[key]) for (s, la, _), r in sorted(self.by.items())
                if (s, la) == (scenario, label) and r.get(key) is not None]

    def ratios(self, scenario: str, label: str, reference: str) -> list[float]:
        """`label` over `reference` seed by seed (same arrivals); a seed whose reference made 0 is left out."""
        seeds = sorted(seed for (s, la, seed) in self.by if (s, la) == (scenario, label))
        pairs = [(self.by[(scenario, label, seed)], self.by.get((scenario, reference, seed))) for seed in seeds]
        return [float(top["goodput_per_hour"]) / float(bottom["goodput_per_hour"]) for top, bottom in pairs
                if bottom is not None and bottom["goodput_per_hour"]]

    def ratio_text(self, scenario: str, label: str, reference: str) -> str:
        ratios = self.ratios(scenario, label, reference)
        if not ratios:
            return "-"
        if all(abs(r - 1) < 5e-4 for r in ratios):
            return "1.000 (equal)"
        return f"{_pm(ratios, '.3f')} ({sum(r > 1 for r in ratios)}/{len(ratios)})"

    def cell_text(self, scenario: str, label: str) -> str:
        goodput = self.values(scenario, label)
        if not goodput:
            return "-"
        stuck = sum(bool(self.by[k]["is_stuck"]) for k in self.by if k[:2] == (scenario, label))
        return _pm(goodput) + (f" ({stuck} stuck)" if stuck else "")

    def mean_text(self, scenario: str, label: str, key: str, spec: str) -> str:
        values = self.values(scenario, label, key)
        return "-" if not values else format(statistics.fmean(values), spec)


def _field() -> FieldRuns:
    return FieldRuns(_load(FIELD_JSON))


def _field_source(doc: dict[str, Any]) -> str:
    return (f"From `{FIELD_JSON}` ({len(doc['seeds'])} seeds, 1P3D H200, no lending), written by {FIELD_COMMAND}, "
            f"**{FIELD_MEASURED_AT}**.")


def _by_scenario(runs: FieldRuns, cell: Callable[[str, str], str], labels: Sequence[str]) -> str:
    head = ("label", *(name for name, _ in FIELD_SCENARIOS))
    return markdown_table(head, [(label, *(cell(s, label) for _, s in FIELD_SCENARIOS)) for label in labels])


def field_table() -> str:
    """Goodput per label and scenario, then the first-call wait p50 and the shed share."""
    runs = _field()
    doc = _load(FIELD_JSON)
    return (f"Goodput /h, mean ± sd over seeds ((n stuck): seeds whose run stayed collapsed). {_field_source(doc)}"
            "\n\n" + _by_scenario(runs, runs.cell_text, runs.labels)
            + "\n\nFirst-call wait p50 (s; the mean over seeds of each run's median over the goodput window's "
            "sessions) and the shed share:\n\n"
            + _by_scenario(runs, lambda s, la: f"{runs.mean_text(s, la, 'first_call_wait_p50_s', '.1f')} s, "
                                               f"{runs.mean_text(s, la, 'shed_share', '.1%')}", runs.labels))


def field_paired() -> str:
    """Every label over Continuum (the paper's estimator, no session cache), paired by seed."""
    runs = _field()
    return ("Goodput over Continuum's in the same seed (the same arrivals), mean ± sd (seeds ahead / seeds):\n\n"
            + _by_scenario(runs, lambda s, la: runs.ratio_text(s, la, "continuum"),
                           [label for label in runs.labels if label != "continuum"]))


def field_session_cache() -> str:
    """Each policy with SGLang's session cache over itself without it, and what the cache evicted."""
    runs = _field()
    bases = [label for label in runs.labels if label + SESSION_CACHE in runs.labels]

    def referenced(scenario: str, base: str) -> str:
        shares = [r["session_cache"]["evicted_referenced_share"] for (s, la, _), r in runs.by.items()
                  if (s, la) == (scenario, base + SESSION_CACHE) and r["session_cache"]["evicted_referenced_share"]
                  is not None]
        return "-" if not shares else f"{statistics.fmean(shares):.0%}"

    return ("With the session cache over without it, paired by seed:\n\n"
            + _by_scenario(runs, lambda s, la: runs.ratio_text(s, la + SESSION_CACHE, la), bases)
            + "\n\nThe share of evicted tokens that were still referenced by a live session (mean over seeds):\n\n"
            + _by_scenario(runs, referenced, bases))


def field_thunderagent() -> str:
    """ThunderAgent over Continuum next to its paper's range, and what its pauses did."""
    runs = _field()
    if "thunderagent" not in runs.labels:
        return "(no ThunderAgent runs)"
    rows = [(name, runs.ratio_text(s, "thunderagent", "continuum"),
             runs.ratio_text(s, "thunderagent", "continuum-fixed-ttl"),
             runs.mean_text(s, "thunderagent", "pauses", ",.0f"),
             runs.mean_text(s, "thunderagent", "pause_new_held", ",.0f"),
             runs.mean_text(s, "thunderagent", "pause_forced_resumes", ",.0f"),
             runs.mean_text(s, "thunderagent", "pause_time_mean_s", ",.0f"),
             f"{runs.mean_text(s, 'thunderagent', 'first_call_wait_p50_s', '.1f')} s") for name, s in FIELD_SCENARIOS]
    head = ("scenario", "/ continuum", "/ continuum-fixed-ttl", "pauses", "new programs held", "forced resumes",
            "mean time paused or held (s)", "first-call wait p50")
    return ("ThunderAgent paired by seed (its paper: 1.17-3.31x Continuum at high concurrency); its pauses, "
            "means over seeds:\n\n" + markdown_table(head, rows))


def field_fixed_ttl() -> str:
    """What Continuum's public code pinned, next to the paper's estimator."""
    runs = _field()
    rows = [(name, *(runs.mean_text(s, label, key, spec) for label in ("continuum", "continuum-fixed-ttl")
                     for key, spec in (("pin_answer_share", ".0%"), ("pin_ttl_mean_s", ".2f"))),
             runs.mean_text(s, "continuum-fixed-ttl", "pin_slow_tool_share", ".0%"),
             runs.mean_text(s, "continuum-fixed-ttl", "pin_held_mean_s", ".2f"),
             runs.ratio_text(s, "continuum-fixed-ttl", "continuum")) for name, s in FIELD_SCENARIOS]
    head = ("scenario", "paper: answers pinned", "paper: mean TTL (s)", "code: answers pinned", "code: mean TTL (s)",
            "code: slow-tool share", "code: mean hold (s)", "code / paper goodput")
    return "Means over seeds:\n\n" + markdown_table(head, rows)


def field_concur() -> str:
    """Concur's admission window over the runs, its moves and the sessions it deferred."""
    runs = _field()
    keys = (("admission_window_min", ".0f"), ("admission_window_mean", ".0f"), ("admission_window_max", ".0f"),
            ("admission_increases", ".0f"), ("admission_decreases", ".1f"), ("admission_deferred", ",.0f"),
            ("admission_wait_mean_s", ".0f"))
    rows = [(name, runs.ratio_text(s, "concur", "continuum"), *(runs.mean_text(s, "concur", k, f) for k, f in keys))
            for name, s in FIELD_SCENARIOS]
    head = ("scenario", "/ continuum", "window: min", "mean", "max", "increases", "decreases", "sessions deferred",
            "their mean wait (s)")
    return "Means over seeds (the window in sessions, over each run's minutes, warm-up included):\n\n" + \
        markdown_table(head, rows)


FIELD_BASELINES = ("sglang", "continuum", "continuum-fixed-ttl", "budgeter", "thunderagent", "concur")
ISSUE_49_ABLATIONS = (("basin:no-revisions", "reservations that follow the session (part 1)"),
                      ("basin:no-task-memory", "the memory of finished tasks (part 2)"),
                      ("basin:no-recovery", "recovery at tool boundaries (part 3)"),
                      ("basin:knee-budget", "the budget where completions peak (part 4)"),
                      ("basin:no-selection", "the first-call predictor chosen out of fold (part 5)"))
STEADY = ("paper-timed-steady", "paper-swebench-pro-steady")


def _best_baseline(runs: FieldRuns, scenario: str) -> str:
    """The baseline label (with or without the session cache) with the highest mean goodput in a scenario."""
    labels = [label for base in FIELD_BASELINES for label in (base, base + SESSION_CACHE) if label in runs.labels]
    return max(labels, key=lambda label: statistics.fmean(runs.values(scenario, label) or [0.0]))


def field_targets() -> str:
    """Issue 49's targets, cell by cell, for `basin` as it ships (no session cache): met or missed."""
    runs = _field()
    if "basin" not in runs.labels:
        return "(no Basin runs)"
    rows = []
    for name, s in FIELD_SCENARIOS:
        collapsed = any(bool(runs.by[k]["is_stuck"]) for k in runs.by if k[:2] == (s, "sglang"))
        if s in STEADY:
            ratios = runs.ratios(s, "basin", "sglang")
            target, met = "cost <= 2% against plain SGLang", bool(ratios) and statistics.fmean(ratios) >= 0.98
            against = "sglang"
        else:
            against = _best_baseline(runs, s)
            ratios = runs.ratios(s, "basin", against)
            need = 1.2 if collapsed else 1.0
            ahead = sum(r > 1 for r in ratios)
            target = f">= {need:.1f}x the best baseline, ahead in >= 6/10"
            met = bool(ratios) and statistics.fmean(ratios) >= need and ahead >= 0.6 * len(ratios)
        waits = runs.values(s, "basin", "first_call_wait_p50_s")
        shed = runs.values(s, "basin", "shed_share")
        wait_text = f"{statistics.fmean(waits):.1f} s, shed {statistics.fmean(shed):.1%}" if waits and shed else "-"
        if s.startswith("paper-timed"):
            wait_met = bool(waits) and statistics.fmean(waits) <= 18 and statistics.fmean(shed) <= 0.05
            wait_text += " (target <= 18 s, <= 5%: " + ("met" if wait_met else "missed") + ")"
        elif s.startswith("paper-swebench-pro"):
            wait_text += f"; / continuum {runs.ratio_text(s, 'basin', 'continuum')} (target >= 1.15)"
        tied = bool(ratios) and all(abs(r - 1) < 5e-4 for r in ratios)
        verdict = "met" if met else "tied (no seed ahead)" if tied else "missed"
        rows.append((name, against, runs.ratio_text(s, "basin", against), target, verdict, wait_text))
    head = ("scenario", "against", "basin / it (seeds ahead)", "target", "", "basin's first-call wait p50")
    return ("Basin (as it ships: every issue-49 part on, no session cache) against issue 49's targets, paired by "
            "seed; the best baseline is the field label (with or without the session cache) of highest mean "
            "goodput in that scenario:\n\n" + markdown_table(head, rows))


def field_ablations() -> str:
    """Basin with one issue-49 part off, over Basin, paired by seed, in each surge."""
    runs = _field()
    present = {r["policy"] for r in runs.rows}
    surges = [(name, s) for name, s in FIELD_SCENARIOS if s not in STEADY]
    rows = [(f"`{label}`", what, *(runs.ratio_text(s, label, "basin") for _, s in surges))
            for label, what in ISSUE_49_ABLATIONS if label in present]
    if not rows:
        return "(no ablation runs)"
    head = ("ablation", "the part off", *(name for name, _ in surges))
    return ("Each ablation's goodput over Basin's in the same seed (below 1: the part helps; seeds where the "
            "ablation is ahead / seeds):\n\n" + markdown_table(head, rows))


# --- the held-out set (basin-sim compare --preset held-out) -----------------------------------------------

HELD_OUT_JSON = "docs/results/compare-held-out.json"
HELD_OUT_COMMAND = ("`basin-sim compare --preset held-out --jobs 2 --plot-dir docs/held-out-eval "
                    "--out docs/results/compare-held-out.json`")
HELD_OUT_MEASURED_AT = "measured once, at commit c2ed88c"


def held_out() -> str:
    """Per held-out cell: each label's goodput, and Basin over the best baseline and over Continuum, paired."""
    doc = _load(HELD_OUT_JSON)
    by: dict[tuple[str, str], FieldRuns] = {}
    for cell in dict.fromkeys((r["scenario"], r["deployment"]) for r in doc["runs"]):
        by[cell] = FieldRuns({"runs": [r for r in doc["runs"] if (r["scenario"], r["deployment"]) == cell]})
    labels = [label for label in FIELD_BASES if any(label in runs.labels for runs in by.values())]
    rows, paired = [], []
    for (scenario, deployment), runs in by.items():
        name = f"{scenario.removeprefix('heldout-')} / {deployment}"
        rows.append((name, *(runs.cell_text(scenario, label) for label in labels)))
        if "basin" not in runs.labels:
            continue
        is_steady = "steady" in scenario
        best = "sglang" if is_steady else _best_baseline(runs, scenario)
        ratios = runs.ratios(scenario, "basin", best)
        stuck = any(bool(runs.by[k]["is_stuck"]) for k in runs.by if k[:2] == (scenario, "sglang"))
        if not ratios:
            verdict = "-"
        elif is_steady:
            verdict = "met" if statistics.fmean(ratios) >= 0.98 else "missed"
        else:
            verdict = "met" if (statistics.fmean(ratios) >= (1.2 if stuck else 1.0)
                                and sum(r > 1 for r in ratios) >= 0.6 * len(ratios)) else "missed"
        paired.append((name, best, runs.ratio_text(scenario, "basin", best), "yes" if stuck else "no",
                       runs.ratio_text(scenario, "basin", "continuum"),
                       f"{runs.mean_text(scenario, 'basin', 'first_call_wait_p50_s', '.1f')} s, "
                       f"{runs.mean_text(scenario, 'basin', 'shed_share', '.1%')}", verdict))
    source = (f"From `{HELD_OUT_JSON}` (seeds {min(doc['seeds'])}-{max(doc['seeds'])}, no lending), written by "
              f"{HELD_OUT_COMMAND}, **{HELD_OUT_MEASURED_AT}**.")
    head = ("scenario / deployment", *labels)
    head2 = ("scenario / deployment", "against (steady: plain SGLang; else the best baseline)",
             "basin / it (seeds ahead)", "plain SGLang stuck",
             "basin / continuum", "basin: first-call wait p50, shed", "issue 49's target")
    return (f"Goodput /h, mean ± sd over seeds ((n stuck): seeds whose run stayed collapsed). {source}\n\n"
            + markdown_table(head, rows) + "\n\nBasin paired by seed (issue 49's targets: in a surge or burst "
            ">= 1.0x the best baseline, >= 1.2x where plain SGLang stays collapsed, ahead in >= 6/10; steady: "
            "a cost of at most 2% against plain SGLang):\n\n"
            + markdown_table(head2, paired))


# --- the pipeline and the DVC simulate stage --------------------------------------------------------------


def spearman() -> str:
    doc = _load("metrics/spearman.json")
    rows = []
    for benchmark, unseen in sorted(doc["unseen_task"].items()):
        seen = doc["seen_task"].get(benchmark)
        base = doc["baselines"][benchmark]
        rows.append((f"{benchmark} ({unseen['sessions']} sessions)", f"{unseen['pooled']:.3f}",
                     f"{unseen['per_benchmark']:.3f}", "n/a" if seen is None else f"{seen['pooled']:.3f}",
                     "n/a" if seen is None else f"{seen['per_benchmark']:.3f}",
                     f"{base['first_prompt_only_spearman']:.3f}", f"{base['task_chars_only_spearman']:.3f}"))
    head = ("benchmark", "unseen task: pooled", "unseen task: own model", "seen task: pooled", "seen task: own",
            "first prompt only", "task length only")
    return "From `metrics/spearman.json` (`make repro`, stage `evaluate`).\n\n" + markdown_table(head, rows)


def simulate_stage() -> str:
    doc = _load("metrics/simulate.json")
    rows = []
    for label, cell in doc["goodput"].items():
        wait = cell.get("first_call_wait_p50_s")
        rows.append((label, f"{cell['mean']:,.0f} ± {cell['sd']:,.0f}", f"{cell['share_stuck']:.0%}",
                     "-" if wait is None else f"{wait:.1f} s", f"{cell['shed_share']:.0%}"))
    ratios = [(name, doc[key]) for name, key in (("basin / continuum", "basin_over_continuum"),
                                                  ("basin-proto / continuum", "proto_over_continuum"),
                                                  ("basin / its steady", "basin_over_own_steady"))]
    lines = [f"{name}: {r['mean']:.3f} ± {r['sd']:.3f} ({r['seeds_ahead']} of {r['seeds']} seeds ahead)"
             for name, r in ratios]
    return (f"`{doc['scenario']}` on `{doc['deployment']}`, lending {doc['lending']}, {len(doc['seeds'])} seeds, "
            f"overload rate {doc['overload_rate_per_s']}/s (from `metrics/simulate.json`, `make repro`):\n\n"
            + markdown_table(("policy", "goodput /h", "stuck", "first-call wait p50", "shed"), rows)
            + "\n\nPaired by seed: " + "; ".join(lines) + ".")


def nested_text(protocol: str = "unseen_task") -> tuple[str, str]:
    """Each benchmark's shipped model's nested per-fold Spearman (mean ± sd over fold seeds), and the task-length
    baseline's, from `metrics/nested.json`."""
    doc = _load("metrics/nested.json")
    models, baselines = [], []
    for bench, entry in sorted(doc[protocol].items()):
        model = entry.get("own_model", entry.get("pooled_model", {}))["per_fold"]
        base = entry["task_chars_only"]["per_fold"]
        models.append(f"{bench} {model['mean']:.2f} ± {model['sd']:.2f}")
        baselines.append(f"{base['mean']:.2f}")
    return ", ".join(models), ", ".join(baselines)


def nested_selected_text(protocol: str = "unseen_task") -> str | None:
    """The selected procedure's nested per-fold Spearman per benchmark (the honest number: the choice between
    the own model, the pooled model and a length line made on inner folds, `basin_pipeline.selection`), then
    each candidate's beside it; None for a `metrics/nested.json` written before the selected procedure."""
    doc = _load("metrics/nested.json")
    if not all("selected" in entry for entry in doc[protocol].values()):
        return None

    def cell(entry: dict[str, Any], key: str) -> str:
        per_fold = entry.get(key, {}).get("per_fold", {})
        return "n/a" if per_fold.get("mean") is None else f"{per_fold['mean']:.2f} ± {per_fold.get('sd') or 0.0:.2f}"

    parts = []
    for bench, entry in sorted(doc[protocol].items()):
        chosen = ", ".join(f"{name} {n}" for name, n in sorted(entry["selected_chosen"].items()))
        parts.append(f"{bench} **{cell(entry, 'selected')}** (chosen: {chosen}; own model {cell(entry, 'own_model')}, "
                     f"pooled {cell(entry, 'pooled_model')}, task length alone {cell(entry, 'task_chars_only')}, "
                     f"first prompt alone {cell(entry, 'first_prompt_only')})")
    return "; ".join(parts)


def _ratio(doc: dict[str, Any], key: str) -> str:
    r = doc[key]
    return f"{r['mean']:.3f} ± {r['sd']:.3f} ({r['seeds_ahead']}/{r['seeds']} seeds ahead)"


def readme_headline() -> str:
    spear = _load("metrics/spearman.json")["unseen_task"]
    sim = _load("metrics/simulate.json")
    honest, baseline = nested_text()
    selected = ", ".join(f"{b} {v['per_benchmark']:.2f}" for b, v in sorted(spear.items()))
    goodput = sim["goodput"]
    sglang, continuum = goodput["sglang"], goodput["continuum"]
    stuck = round(sglang["share_stuck"] * sglang["seeds"])
    chosen = nested_selected_text()
    nested_row = (
        ("Spearman of the predicted peak on tasks never seen in training: nested CV (the tasks scored were never "
         "tuned or fitted on), each benchmark's shipped model, mean ± sd over fold seeds",
         f"{honest} (task length alone: {baseline})", "`make repro` (`metrics/nested.json`)") if chosen is None else
        ("Spearman of the predicted peak on tasks never seen in training: nested CV of the whole procedure that picks "
         "each benchmark's shipped predictor (its own model, the pooled model or a length line, chosen on the inner "
         "folds of each outer fold, scored on its outer-test tasks), mean ± sd over fold seeds; the outer folds' "
         "choices and each candidate's own score beside it", chosen, "`make repro` (`metrics/nested.json`)"))
    rows = [
        nested_row,
        ("the same as Optuna selected it: the best trial's score on the folds it was selected on (optimistic)",
         selected, "`make repro` (`metrics/spearman.json`)"),
        (f"the paper's burst kept on 1P3D H200 ({len(sim['seeds'])} seeds): plain SGLang / Continuum goodput",
         f"{sglang['mean']:,.0f} ± {sglang['sd']:,.0f} /h ({stuck} of {sglang['seeds']} seeds stuck) / "
         f"{continuum['mean']:,.0f} ± {continuum['sd']:,.0f} /h", "`make repro` (`metrics/simulate.json`)"),
        ("Basin / Continuum there (the shipped model, out-of-fold peaks; paired by seed)",
         f"{_ratio(sim, 'basin_over_continuum')}, first-call wait p50 "
         f"{goodput['basin']['first_call_wait_p50_s']:.0f} s",
         "same"),
        ("the paper's prototype (`basin-proto`) / Continuum", _ratio(sim, "proto_over_continuum"), "same"),
        *_field_headline_rows(),
    ]
    return markdown_table(("what", "measured (mean ± sd)", "command"), rows)


def _field_headline_rows() -> list[tuple[str, str, str]]:
    """The field on the burst kept and the held-out set's verdict, from their committed runs (none if absent)."""
    rows = []
    if (ROOT / FIELD_JSON).is_file():
        runs, keep = _field(), "paper-timed-kill-burst-keep"
        others = ", ".join(f"{label} {runs.ratio_text(keep, label, 'continuum').split(' (')[0]}"
                           for label in ("concur", "thunderagent", "budgeter") if label in runs.labels)
        surges = [s for _, s in FIELD_SCENARIOS if s not in STEADY]
        won = sum(1 for s in surges if (r := runs.ratios(s, "basin", _best_baseline(runs, s)))
                  and statistics.fmean(r) >= 1.0 and sum(x > 1 for x in r) >= 0.6 * len(r))
        rows.append(("the field there (ThunderAgent, Concur, the budgeter, Continuum's public code; 10 seeds): "
                     "Basin / Continuum, paired, and the others'",
                     f"Basin {runs.ratio_text(keep, 'basin', 'continuum')}; {others}; Basin ahead of the best "
                     f"baseline in {won} of {len(surges)} surge and burst cells", FIELD_COMMAND))
    if (ROOT / HELD_OUT_JSON).is_file():
        doc = _load(HELD_OUT_JSON)
        verdicts = [row.rsplit("|", 2)[-2].strip() for row in held_out().splitlines()
                    if row.startswith("| ") and row.rstrip().endswith(("| met |", "| missed |"))]
        ratios = []
        for cell in dict.fromkeys((r["scenario"], r["deployment"]) for r in doc["runs"]):
            cell_runs = FieldRuns({"runs": [r for r in doc["runs"] if (r["scenario"], r["deployment"]) == cell]})
            if "steady" not in cell[0] and (values := cell_runs.ratios(cell[0], "basin", "continuum")):
                ratios.append(statistics.fmean(values))
        rows.append(("a held-out set run once at the end (other rates, the H100 1P3D and 3P1D, seeds 11-20): "
                     "issue 49's targets met; Basin / Continuum over its surge and burst cells",
                     f"{verdicts.count('met')} of {len(verdicts)} cells; {min(ratios):.2f}-{max(ratios):.2f}x",
                     HELD_OUT_COMMAND))
    return rows


RENDERERS: dict[str, Callable[[], str]] = {
    "paper-table": paper_table, "paper-ablations": paper_ablations, "spearman": spearman,
    "simulate-stage": simulate_stage, "readme-headline": readme_headline, "field-table": field_table,
    "field-paired": field_paired, "field-session-cache": field_session_cache,
    "field-thunderagent": field_thunderagent, "field-fixed-ttl": field_fixed_ttl, "field-concur": field_concur,
    "field-targets": field_targets, "field-ablations": field_ablations, "held-out": held_out,
}


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def render(text: str, where: Path) -> str:
    """`text` with every generated block rewritten from its JSON."""
    def one(match: re.Match[str]) -> str:
        name = match.group("name")
        renderer = RENDERERS.get(name)
        if renderer is None:
            raise RenderError(f"{where.relative_to(ROOT)}: block {name!r} names no renderer "
                              f"(known: {', '.join(sorted(RENDERERS))})")
        return match.group(1) + renderer().rstrip("\n") + "\n" + match.group(4)
    return BLOCK.sub(one, text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a block is stale")
    args = parser.parse_args(argv)
    stale = []
    try:
        for path in markdown_files():
            text = path.read_text()
            fresh = render(text, path)
            if fresh != text:
                stale.append(str(path.relative_to(ROOT)))
                if not args.check:
                    path.write_text(fresh)
    except RenderError as error:
        print(f"render_results: {error}", file=sys.stderr)
        return 2
    if args.check and stale:
        print("stale generated blocks in: " + ", ".join(stale)
              + " (run `python -m basin_pipeline.render_results` and commit)", file=sys.stderr)
        return 1
    for name in stale:
        print(f"rewrote {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
