"""Write the synthetic session corpus: python -m basin_pipeline.synth --seed N --sessions-per-benchmark N --out F."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from basin_runtime.logs import configure_logging
from basin_runtime.session_table import write_sessions
from basin_sim.workload.synthetic import FAMILIES, generate_corpus

log = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m basin_pipeline.synth", description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--sessions-per-benchmark", type=int, default=300)
    parser.add_argument("--out", type=Path, required=True, help="session table to write (.parquet)")
    args = parser.parse_args(argv)
    configure_logging()
    if args.sessions_per_benchmark < 1:
        parser.error(f"--sessions-per-benchmark must be at least 1, got {args.sessions_per_benchmark}")
    sessions = generate_corpus(args.seed, args.sessions_per_benchmark)
    write_sessions(args.out, sessions)
    log.info("wrote %d synthetic sessions (%s) to %s", len(sessions),
             ", ".join(f.benchmark for f in FAMILIES), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
