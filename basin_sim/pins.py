"""Pins between calls (a policy's `PinRule`: Continuum) as one strategy object; `NoPins` for every other policy.

Rules (radix_cache.py keeps the holds; the rule says how long):
- The prefill cache holds a session's chain from its KV transfer until the call's answer, and then
  for the TTL the rule gives that answer (`ttl_after_answer_s`, asked at every answer, the session's
  last included; 0: unpinned at once, and the instance may start a batch with the room).
- The next call takes the hold over (the cache turns it into the request's pin when it is admitted).
- Expired holds are unpinned whenever the instance forms a batch and on every tick.
- An ended session's hold is dropped at once (its instance may start a batch); a request withdrawn
  while decoding drops its session's hold (the caller starts batches once every withdrawal is done).
- The rule is told when each call is scheduled (`on_scheduled`: its prefill starts).
- A `WaitingPinRule` (Continuum's public code) keeps an expired hold while `keeps_pin` says so; it is
  looked at again at every later expiry (each batch formed, each tick).
- Without a rule nothing is held: a chain is unpinned when its KV reaches decode.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from basin_sim.policies.base import PinRule, WaitingPinRule
from basin_sim.prefill import PrefillInstance, PrefillJob
from basin_sim.radix_cache import RadixCache


class NoPins:
    """No pins between calls (every policy but Continuum)."""

    hold_until_s: float | None = None  # what the chain's release at the end of its KV transfer holds it until

    def expire(self, prefill: PrefillInstance, now: float) -> bool:
        """Unpin the instance's expired holds; True if any went."""
        return False

    def scheduled(self, job: PrefillJob, now: float) -> None:
        """A call's prefill starts now."""

    def ttl_after_answer_s(self, session_id: str, now: float, context_tokens: int) -> float:
        """How long to hold the answered call's chain (asked at every answer)."""
        return 0.0

    def after_answer(self, prefill: PrefillInstance, session_id: str, ttl_s: float, now: float) -> bool:
        """After an answer that is not the session's last: start its TTL hold; True if the hold went instead."""
        return False

    def withdrawn(self, prefill: PrefillInstance, session_id: str) -> None:
        """A request of the session was withdrawn while decoding: its hold goes (the caller starts batches)."""

    def forget(self, prefill: PrefillInstance, session_id: str) -> bool:
        """The session ended: drop its hold on this instance; True if there was one."""
        return False

    def held_tokens(self, caches: Iterable[RadixCache]) -> int:
        """Device tokens held between calls now."""
        return 0


class TtlPins(NoPins):
    """Holds with a TTL after each answer, as the rule gives them."""

    hold_until_s: float | None = math.inf  # held from the transfer until the TTL after the answer

    def __init__(self, rule: PinRule) -> None:
        self.rule = rule

    def expire(self, prefill: PrefillInstance, now: float) -> bool:
        """Unpin the instance's expired holds; True if any went."""
        return bool(prefill.cache.expire_holds(now))

    def scheduled(self, job: PrefillJob, now: float) -> None:
        """Tell the rule: a call of the session is scheduled."""
        self.rule.on_scheduled(job.session_key, now)

    def ttl_after_answer_s(self, session_id: str, now: float, context_tokens: int) -> float:
        """The rule's TTL for this answer."""
        return self.rule.ttl_after_answer_s(session_id, now, context_tokens)

    def after_answer(self, prefill: PrefillInstance, session_id: str, ttl_s: float, now: float) -> bool:
        """Hold the chain for `ttl_s`; with no TTL, drop the hold (True if there was one)."""
        if ttl_s > 0:
            prefill.cache.hold(session_id, now + ttl_s)
            return False
        return prefill.cache.drop_hold(session_id)

    def withdrawn(self, prefill: PrefillInstance, session_id: str) -> None:
        """Drop the session's hold."""
        prefill.cache.drop_hold(session_id)

    def forget(self, prefill: PrefillInstance, session_id: str) -> bool:
        """Drop the session's hold on this instance; True if there was one."""
        return prefill.cache.drop_hold(session_id)

    def held_tokens(self, caches: Iterable[RadixCache]) -> int:
        """Device tokens the caches hold for a TTL after an answer."""
        return sum(cache.held_tokens for cache in caches)


class WaitingPins(TtlPins):
    """TTL holds that the rule may keep past their TTL (while the session's next call waits)."""

    def __init__(self, rule: WaitingPinRule) -> None:
        super().__init__(rule)
        self.keeps_pin = rule.keeps_pin

    def expire(self, prefill: PrefillInstance, now: float) -> bool:
        """Unpin the instance's expired holds the rule does not keep; True if any went."""
        return bool(prefill.cache.expire_holds(now, keep=self.keeps_pin))


def pins_for(rule: PinRule | None) -> NoPins:
    """The strategy for a policy's pin rule (None: no pins)."""
    if rule is None:
        return NoPins()
    return WaitingPins(rule) if isinstance(rule, WaitingPinRule) else TtlPins(rule)
