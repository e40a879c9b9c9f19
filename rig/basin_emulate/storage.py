"""The HiCache storage tier on the filesystem, as SGLang's file backend (`--hicache-storage-backend file`).

A folder any number of emulator processes share, so what one decode offloads a prefill reads: extents
of conversations' KV, keyed by prefix digests.

Rules:
- SGLang's HiCacheFile writes one file per KV page, named by the page's hash chained from the
  conversation's start over its token ids (mem_cache/hicache_storage.py). The emulator has no token
  ids, so it keys *runs* of pages by what identifies them here (identity.py): an extent is the token
  range [start, end) of a conversation whose first `units` units (messages) have the prefix digest
  `digest`. One empty file per extent, named `<units>-<digest>-<start>-<end>`, under a folder per
  conversation key: creating a file is atomic, so concurrent writers never clobber each other.
- A prompt is stored up to the end of the longest run from token 0 over the extents whose prefix it
  repeats (its own digest of that many units matches): a changed conversation reaches nothing past
  what it shares, as changed token ids break SGLang's hash chain.
- `clear` removes everything (SGLang's POST /hicache/storage-backend/clear); /flush_cache does not.
- I/O errors are not swallowed: a lookup or a write that fails raises `OSError` to the caller, which
  turns it into a 500 naming the folder.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from basin_emulate.identity import Prompt

ROOT_NAME = "basin-emulate"


class FileStore:
    """Extents of stored KV in a folder shared by every emulator that names it."""

    def __init__(self, folder: str | Path, model_name: str) -> None:
        model = hashlib.blake2b(model_name.encode(), digest_size=6).hexdigest()  # SGLang suffixes keys by model
        self.root = Path(folder) / ROOT_NAME / model
        self.root.mkdir(parents=True, exist_ok=True)

    def _folder(self, conversation_key: str) -> Path:
        return self.root / hashlib.blake2b(conversation_key.encode(), digest_size=16).hexdigest()

    def put(self, conversation_key: str, units: int, digest: bytes, start: int, end: int) -> bool:
        """Store tokens [start, end) of a conversation whose first `units` units have `digest`; True if new."""
        if end <= start:
            return False
        folder = self._folder(conversation_key)
        folder.mkdir(exist_ok=True)
        try:
            with open(folder / f"{units}-{digest.hex()}-{start}-{end}", "x"):
                pass
        except FileExistsError:
            return False
        return True

    def stored_end(self, prompt: Prompt) -> int:
        """How many leading tokens of `prompt` storage holds (0: none)."""
        folder = self._folder(prompt.conversation_key)
        try:
            names = os.listdir(folder)
        except FileNotFoundError:
            return 0
        runs = []
        for name in names:
            units_text, digest_hex, start_text, end_text = name.split("-")
            units = int(units_text)
            if units <= prompt.length and prompt.digest_of(units).hex() == digest_hex:
                runs.append((int(start_text), int(end_text)))
        end = 0
        for start, stop in sorted(runs):
            if start > end:
                break
            end = max(end, stop)
        return end

    def clear(self) -> None:
        """Remove everything stored."""
        shutil.rmtree(self.root, ignore_errors=True)
        self.root.mkdir(parents=True, exist_ok=True)
