"""SGLang's session references on the emulated prefix cache: which session tag holds which cache chain.

SGLang tags a request with its top-level `session_id` and, at a normal finish, registers a reference for
that session on the request's cached path; `/close_session` drops the session's references (the KV stays,
unreferenced, and is evicted first) and tombstones the id (field-sources.md section 2). The emulator's
cache (basin_sim's RadixCache with `session_refs=True`) keys its references by cache chain, and a chain is
the conversation's identity (identity.py), so several tags may share one chain and one tag may span several
chains (a rewritten conversation starts a new one; SGLang keeps a set of frontier leaves per session).

Rules:
- `open(tag)` (a tagged request arrives): the tag's generation, a new one if it has none, which also lifts
  its tombstone (SGLang's `ensure_session_generation` / `open_radix_session`): a closed tag used again
  reopens.
- `finished(tag, generation, chain)` (a tagged request's normal finish, not an abort) registers the tag on
  the chain and gives the chain its reference (`RadixCache.release(..., finished=True)`), unless the tag
  was closed since the request arrived (tombstoned, or its generation is not the request's): then it is a
  late finish, counted, and takes none.
- `close(tag)` drops the tag's generation and tombstones it (the last CLOSED_SESSION_TOMBSTONE_LIMIT
  tags, as SGLang) and takes it off each of its chains; a chain no open tag holds any more loses its reference
  (`RadixCache.drop_reference`, which keeps the chain reusable by a later tag). Closing an unknown or
  closed tag changes nothing but the count: idempotent, as SGLang's close answers 200 either way.
- `reset(cache)` (the cache was flushed): every tag, generation and tombstone is forgotten, as SGLang's
  tracker `reset`; the counts and the generation counter go on (a counter never goes back).
- A reference the cache dropped by itself (its KV evicted down to nothing) leaves the tag's record as is;
  dropping it again at the close is a no-op.

Invariants: `_chains_of` and `_tags_of` are inverse; no closed tag is in either, nor has a generation.
"""

from __future__ import annotations

from collections import OrderedDict

from basin_sim.radix_cache import CLOSED_SESSION_TOMBSTONE_LIMIT, RadixCache


class SessionRefs:
    """The session tags holding references on one prefix cache, and what they did."""

    def __init__(self, cache: RadixCache) -> None:
        self.cache = cache
        self._chains_of: dict[str, set[str]] = {}  # tag -> chains it references
        self._tags_of: dict[str, set[str]] = {}  # chain -> open tags referencing it
        self._closed: OrderedDict[str, None] = OrderedDict()
        self._generations: dict[str, int] = {}
        self._last_generation = 0
        self.tagged_requests = 0  # requests that arrived with a tag (`open`)
        self.references_taken = 0
        self.late_finishes = 0
        self.sessions_closed = 0  # every /close_session, repeats included
        self.references_dropped = 0  # chains that lost their reference at a close

    def reset(self, cache: RadixCache) -> None:
        """The cache was replaced by an empty one (/flush_cache): forget every tag, generation and tombstone."""
        self.cache = cache
        self._chains_of.clear()
        self._tags_of.clear()
        self._closed.clear()
        self._generations.clear()

    @property
    def num_open_sessions(self) -> int:
        """Tags holding at least one chain now."""
        return len(self._chains_of)

    def is_closed(self, tag: str) -> bool:
        """True while the tag is tombstoned."""
        return tag in self._closed

    def open(self, tag: str) -> int:
        """A tagged request arrived: the tag's generation (a new one, its tombstone lifted, if it has none)."""
        self.tagged_requests += 1
        generation = self._generations.get(tag)
        if generation is None:
            self._closed.pop(tag, None)
            self._last_generation += 1
            generation = self._generations[tag] = self._last_generation
        return generation

    def finished(self, tag: str, generation: int, chain_key: str, now: float) -> bool:
        """A tagged request's normal finish on its (pinned) chain: unpin it, taking the tag's reference unless the
        tag was closed since the request arrived (`generation`: what `open` gave it); True if one was taken."""
        if tag in self._closed or self._generations.get(tag) != generation:
            self.late_finishes += 1
            self.cache.release(chain_key, now)
            return False
        self.cache.release(chain_key, now, finished=True)
        self._chains_of.setdefault(tag, set()).add(chain_key)
        self._tags_of.setdefault(chain_key, set()).add(tag)
        self.references_taken += 1
        return True

    def close(self, tag: str) -> int:
        """The session ended (`/close_session`): tombstone it and drop what only it referenced; chains dereferenced."""
        self.sessions_closed += 1
        self._generations.pop(tag, None)
        self._closed[tag] = None
        self._closed.move_to_end(tag)
        if len(self._closed) > CLOSED_SESSION_TOMBSTONE_LIMIT:
            self._closed.popitem(last=False)
        dropped = 0
        for chain_key in self._chains_of.pop(tag, set()):
            tags = self._tags_of[chain_key]
            tags.discard(tag)
            if tags:
                continue
            del self._tags_of[chain_key]
            dropped += self.cache.drop_reference(chain_key)
        self.references_dropped += dropped
        return dropped
