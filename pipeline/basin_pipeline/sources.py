"""Stage `sources`: fingerprint the configured corpora, so ingest re-runs exactly when they change.

The corpora live outside the repository (../shared/trajectories) and may be absent on a user's fresh
clone, so DVC cannot track them directly. This stage (always run, cheap) writes a manifest of which
corpora are present and a SHA-256 over their files; DVC re-runs ingest only when the manifest changes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from basin_pipeline.adapters import FORMATS
from basin_pipeline.adapters.files import find_files
from basin_pipeline.params import CorpusParams, corpus_path, ingest_params, or_exit
from basin_runtime.logs import configure_logging

log = logging.getLogger(__name__)


def fingerprint(corpus: CorpusParams, path: Path) -> dict[str, Any]:
    """Presence, file count and content hash of one corpus found at `path`."""
    entry: dict[str, Any] = {"benchmark": corpus.benchmark, "format": corpus.format, "path": corpus.path}
    if not path.exists():
        return {**entry, "present": False}
    _, endings = FORMATS[corpus.format]
    digest = hashlib.sha256()
    files = find_files([path], endings)
    extras = sorted(p for p in path.rglob("resolved.json")) if path.is_dir() else []
    for file in [*files, *extras]:
        digest.update(str(file.relative_to(path) if path.is_dir() else file.name).encode())
        digest.update(hashlib.sha256(file.read_bytes()).digest())
    return {**entry, "present": True, "files": len(files), "sha256": digest.hexdigest()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m basin_pipeline.sources", description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--out", required=True, help="manifest to write (JSON)")
    args = parser.parse_args(argv)
    configure_logging()
    params = or_exit(ingest_params, args.params, parser.prog)
    corpora = [fingerprint(c, corpus_path(c, args.params)) for c in params.corpora]
    for c in corpora:
        log.info("%s: %s", c["benchmark"], f"{c['files']} files" if c["present"] else f"MISSING at {c['path']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"corpora": corpora}, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
