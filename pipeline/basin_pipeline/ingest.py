"""Ingest agent trajectories into the session table.

Any folder:   python -m basin_pipeline.ingest --format FORMAT --benchmark NAME --out OUT.parquet SRC...
DVC stage:    python -m basin_pipeline.ingest --params params.yaml --manifest data/sources.json --out ...

Every input ends as a session or a reject (file, line, reason); the run fails when rejects exceed
the allowed fraction. With no real corpus present the stage falls back to the synthetic corpus and
says so loudly.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path

from basin_pipeline.adapters import format_names
from basin_pipeline.params import IngestParams, corpus_path, ingest_params, or_exit
from basin_pipeline.records import Reject
from basin_pipeline.report import build_report, write_report
from basin_pipeline.sessionize import Corpus, IngestResult, ingest
from basin_runtime.logs import configure_logging
from basin_runtime.session_table import write_sessions
from basin_runtime.task_text import TaskTextRule
from basin_runtime.tokenizer import DEFAULT_TOKENIZER, get_tokenizer

log = logging.getLogger(__name__)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m basin_pipeline.ingest", description=__doc__.splitlines()[0])
    parser.add_argument("sources", nargs="*", type=Path, metavar="SRC", help="files or folders (gzipped or not)")
    parser.add_argument("--format", choices=format_names(), help="trajectory format of SRC")
    parser.add_argument("--benchmark", help="benchmark name given to every session read from SRC "
                        "(gateway-log: to sessions without a workload; the others keep their workload)")
    parser.add_argument("--params", type=Path, help="read corpora and settings from this params.yaml (stage mode)")
    parser.add_argument("--manifest", type=Path, help="stage mode: the `sources` stage's manifest")
    parser.add_argument("--out", type=Path, required=True, help="session table to write (.parquet)")
    parser.add_argument("--rejects", type=Path, help="rejects report to write (JSONL); default OUT.rejects.jsonl")
    parser.add_argument("--report", type=Path, help="folder for the data report (JSON, Markdown, PNG)")
    parser.add_argument("--metrics", type=Path, help="write the report's JSON here instead of REPORT/report.json")
    parser.add_argument("--tokenizer", default=DEFAULT_TOKENIZER)
    parser.add_argument("--task-pattern", help="regex cutting the task text out of the first user message")
    parser.add_argument("--max-reject-fraction", type=float, default=0.05)
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    return parser


def _write_rejects(path: Path, rejects: list[Reject]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as handle:
        for reject in rejects:
            handle.write(json.dumps(reject.to_dict(), ensure_ascii=False) + "\n")


def _stage_corpora(params: IngestParams, manifest: Path, params_file: Path) -> list[Corpus]:
    present = {c["benchmark"]: c["present"] for c in json.loads(manifest.read_text(encoding="utf-8"))["corpora"]}
    corpora = []
    for c in params.corpora:
        if present.get(c.benchmark):
            corpora.append(Corpus(c.benchmark, c.format, (corpus_path(c, params_file),)))
        else:
            log.warning("corpus %s is missing (%s): skipped", c.benchmark, c.path)
    return corpora


def _synthetic(params: IngestParams) -> IngestResult:
    from basin_sim.workload.synthetic import generate_corpus

    banner = "=" * 78
    log.warning("\n%s\nNO REAL CORPUS FOUND: ingesting the SYNTHETIC corpus (seed %d).\n"
                "Models trained on it are for trying the pipeline only and are never published.\n%s",
                banner, params.synthetic.seed, banner)
    sessions = generate_corpus(params.synthetic.seed, params.synthetic.sessions_per_benchmark)
    return IngestResult(sessions=list(sessions))


@dataclass(frozen=True)
class Outputs:
    """Where ingest writes: the session table, its rejects, and the data report (and its JSON) if asked."""

    sessions: Path
    rejects: Path
    report: Path | None
    metrics: Path | None


def _finish(result: IngestResult, outputs: Outputs, max_reject_fraction: float, synthetic: bool) -> int:
    rejects_path = outputs.rejects
    _write_rejects(rejects_path, result.rejects)
    if outputs.report:
        write_report(build_report(result.sessions, len(result.rejects), synthetic), result.sessions, outputs.report,
                     outputs.metrics)
    for reject in result.rejects[:10]:
        log.warning("rejected %s:%d: %s", reject.file, reject.line, reject.reason)
    if not result.sessions:
        log.error("no session could be read; %d rejects listed in %s", len(result.rejects), rejects_path)
        return 1
    write_sessions(outputs.sessions, result.sessions)
    log.info("wrote %d sessions to %s (%d rejects in %s)", len(result.sessions), outputs.sessions,
             len(result.rejects), rejects_path)
    if result.reject_fraction > max_reject_fraction:
        log.error("%.1f%% of inputs were rejected, more than the allowed %.1f%%: see %s",
                  100 * result.reject_fraction, 100 * max_reject_fraction, rejects_path)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    configure_logging()
    outputs = Outputs(args.out, args.rejects or args.out.with_suffix(".rejects.jsonl"), args.report, args.metrics)
    if args.params:
        if not args.manifest:
            _parser().error("--params needs --manifest (the `sources` stage's output)")
        params = or_exit(ingest_params, args.params, "python -m basin_pipeline.ingest")
        corpora = _stage_corpora(params, args.manifest, args.params)
        if not corpora:
            return _finish(_synthetic(params), outputs, params.max_reject_fraction, synthetic=True)
        tokenizer, rule, max_reject = params.tokenizer, TaskTextRule(params.task_text_pattern), \
            params.max_reject_fraction
    else:
        if not (args.format and args.benchmark and args.sources):
            _parser().error("give --format, --benchmark and at least one SRC (or --params for stage mode)")
        corpora = [Corpus(args.benchmark, args.format, tuple(args.sources))]
        tokenizer, rule, max_reject = args.tokenizer, TaskTextRule(args.task_pattern), args.max_reject_fraction
    try:
        result = ingest(corpora, get_tokenizer(tokenizer), rule, show_progress=not args.quiet)
    except (FileNotFoundError, ValueError) as exc:
        log.error("%s", exc)
        return 2
    return _finish(result, outputs, max_reject, synthetic=False)


if __name__ == "__main__":
    sys.exit(main())
