"""Ingest throughput over the real shared corpora (target: all of them in under 60 s on 2 cores).

    python benchmarks/bench_ingest.py [--params params.yaml]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from basin_pipeline.params import corpus_path, ingest_params
from basin_pipeline.sessionize import Corpus, ingest
from basin_runtime.task_text import TaskTextRule
from basin_runtime.tokenizer import get_tokenizer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=Path, default=Path("params.yaml"))
    args = parser.parse_args(argv)
    params = ingest_params(args.params)
    corpora = [Corpus(c.benchmark, c.format, (corpus_path(c, args.params),)) for c in params.corpora
               if corpus_path(c, args.params).exists()]
    if not corpora:
        print("no real corpus found; nothing to measure", file=sys.stderr)
        return 1
    started = time.perf_counter()
    tokenizer = get_tokenizer(params.tokenizer)
    loaded = time.perf_counter()
    result = ingest(corpora, tokenizer, TaskTextRule(params.task_text_pattern), show_progress=False)
    counted = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        from basin_runtime.session_table import write_sessions

        write_sessions(Path(tmp) / "s.parquet", result.sessions)
    done = time.perf_counter()
    calls = sum(s.n_calls for s in result.sessions)
    tokens = sum(s.peak_prompt_tokens for s in result.sessions)
    print(f"sessions {len(result.sessions)}  rejects {len(result.rejects)}  calls {calls}")
    print(f"tokenizer load {loaded - started:.2f} s, read+count {counted - loaded:.2f} s, "
          f"validate+write {done - counted:.2f} s, total {done - started:.2f} s")
    print(f"throughput {len(result.sessions) / (done - started):.1f} sessions/s, "
          f"{calls / (done - started):.0f} calls/s, {tokens / (done - started) / 1e6:.2f} M peak tokens/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
