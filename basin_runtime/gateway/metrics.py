"""Prometheus metrics of the gateway.

The gateway's Prometheus metrics, in a registry of its own (one per app, so tests and several
gateways in one process never collide).

Rules:
- Gauges of the policy's state (working set, budget, reserved, queued, live, hit rate) are set
  from one `PolicySnapshot` by `refresh`, which runs after every tick and on every scrape.
- Counters and histograms are fed by the gateway as things happen: admissions (with the queue
  wait), session ends (with the reason, and the predictor's error), call ends (with usage).
- The predictor's error is judged on sessions that ran to their end (`ended`, `idle`), made a
  call and were not adopted after a restart (their first calls are in the previous run): true
  peak = the largest prompt of any call (what the predictor predicts), ratio = true peak /
  predicted peak (the bare prediction); an overflow is a true peak above the reservation
  (m(q) x the prediction), so at q = 0.9 about a tenth of judged sessions overflow.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from basin_runtime.gateway.sessions import SessionEntry
from basin_runtime.gateway.signals import Usage
from basin_runtime.policy import PolicySnapshot

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
WAIT_BUCKETS_S = (0.01, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
LATENCY_BUCKETS_S = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1)
RATIO_BUCKETS = (0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5, 2, 3, 5)
JUDGED_REASONS = frozenset({"ended", "idle"})


class GatewayMetrics:
    """Every metric the gateway exports."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.working_set = Gauge("basin_working_set_tokens", "Sum of live sessions' current context", registry=r)
        self.budget = Gauge("basin_budget_tokens", "Working-set budget now in force", registry=r)
        self.reference_budget = Gauge("basin_reference_budget_tokens", "Operator's reference budget", registry=r)
        self.reserved = Gauge("basin_reserved_tokens", "Tokens reserved by live sessions' predicted peaks", registry=r)
        self.queued = Gauge("basin_queued_sessions", "Sessions waiting for admission", registry=r)
        self.live = Gauge("basin_live_sessions", "Admitted sessions not yet ended", registry=r)
        self.calls_in_flight = Gauge("basin_calls_in_flight", "Calls forwarded upstream and not yet ended",
                                     registry=r)
        self.hit_ratio = Gauge("basin_prefix_hit_ratio", "Windowed upstream cached/prompt tokens (NaN: no data)",
                               registry=r)
        self.engine_ttft = Gauge("basin_engine_ttft_seconds", "Windowed median time to the first bytes of forwarded "
                                 "answers, calls still waiting counted (NaN: too few calls)", registry=r)
        self.is_engaged = Gauge("basin_admission_engaged", "1 while arrivals go through the queue", registry=r)
        self.is_shadow = Gauge("basin_shadow_mode", "1 while the gateway decides but holds no one", registry=r)
        self.admitted = Counter("basin_sessions_admitted", "Sessions admitted (adopted ones included)", registry=r)
        self.shed = Counter("basin_sessions_shed", "Sessions shed from the queue", registry=r)
        self.ended = Counter("basin_sessions_ended", "Sessions that left, by reason", ["reason"], registry=r)
        self.overflowed = Counter("basin_sessions_overflowed", "Sessions whose true peak passed their reservation "
                                  "(m(q) x predicted peak)",
                                  registry=r)
        self.judged = Counter("basin_sessions_judged", "Sessions whose peak prediction was judged", registry=r)
        self.recovery_holds = Counter("basin_recovery_holds", "Live sessions held at their tool boundary by "
                                      "recovery (a collapse under way)", registry=r)
        self.recovery_held = Gauge("basin_recovery_held_sessions", "Live sessions held at their tool boundary now",
                                   registry=r)
        self.shadow_held = Counter("basin_shadow_would_hold", "Calls shadow mode let through that would wait",
                                   registry=r)
        self.engine_scrape_errors = Counter("basin_engine_scrape_errors", "Failed scrapes of engines' /metrics",
                                            registry=r)
        self.engine_session_close_failures = Counter(
            "basin_engine_session_close_failures", "Failed /close_session posts to an engine (engine_session_cache)",
            ["engine"], registry=r)
        self.calls = Counter("basin_calls", "Calls forwarded upstream, by outcome", ["outcome"], registry=r)
        self.prompt_tokens = Counter("basin_upstream_prompt_tokens", "Prompt tokens the upstream reported",
                                     registry=r)
        self.cached_tokens = Counter("basin_upstream_cached_tokens", "Cached prompt tokens the upstream reported",
                                     registry=r)
        self.cached_by_tier = Counter("basin_upstream_cached_tier_tokens", "Cached prompt tokens by the tier the "
                                      "engine reported (device, host, storage)", ["tier"], registry=r)
        self.calls_moved = Counter("basin_decode_instance_moves", "Calls a different decode instance served than "
                                   "the session's call before (sticky routing missed)", registry=r)
        self.queue_wait = Histogram("basin_queue_wait_seconds", "Wait from arrival to admission", registry=r,
                                    buckets=WAIT_BUCKETS_S)
        self.recovery_hold_time = Histogram(
            "basin_recovery_hold_seconds", "Time a held session waited at its tool boundary until resumed", registry=r,
            buckets=(1, 5, 15, 30, 60, 120, 300, 600, 900))
        self.added_latency = Histogram("basin_gateway_added_latency_seconds",
                                       "Gateway time before forwarding a call (queue wait excluded)", registry=r,
                                       buckets=LATENCY_BUCKETS_S)
        self.peak_ratio = Histogram("basin_peak_prediction_ratio", "True peak / predicted peak at session end",
                                    registry=r, buckets=RATIO_BUCKETS)
        self.log_failed = Gauge("basin_session_log_failed_records",
                                "Finished sessions the session log could not write (bad record or I/O error)",
                                registry=r)
        self.log_dropped = Gauge("basin_session_log_dropped_records",
                                 "Finished sessions dropped because the session log's queue was full", registry=r)
        self.state_up = Gauge("basin_state_backend_up", "1 while the admission state can be reached (always, in "
                              "process; with --state, Redis)", registry=r)
        self.state_leader = Gauge("basin_state_leader", "1 while this replica does the deployment's periodic work "
                                  "(always, in process)", registry=r)
        self.state_pending = Gauge("basin_state_pending_steps", "Policy steps waiting to reach the shared state",
                                   registry=r)
        self.state_errors = Counter("basin_state_errors", "Shared-state failures, by kind (an unreachable Redis, a "
                                    "step the policy refused)", ["kind"], registry=r)
        self.state_dropped = Counter("basin_state_dropped_steps", "Observe/revise steps dropped: too many waiting "
                                     "while the shared state was out of reach, or made for a state that is gone",
                                     registry=r)
        self.state_step_seconds = Histogram("basin_state_step_seconds", "Round trip of one batch of policy steps "
                                            "to the shared state", registry=r, buckets=LATENCY_BUCKETS_S)
        self.state_apply_lag = Histogram("basin_state_apply_lag_seconds", "From another replica's step (Redis's "
                                         "clock) to its application here: how soon a decision made elsewhere wakes "
                                         "a session waiting here", registry=r, buckets=LATENCY_BUCKETS_S)
        self.hit_ratio.set(float("nan"))
        self.state_up.set(1)
        self.state_leader.set(1)

    def refresh(self, snapshot: PolicySnapshot, hit_rate: float | None, is_shadow: bool,
                ttft_s: float | None = None, recovery_held: int = 0) -> None:
        """Set the state gauges from one policy snapshot (and the windowed signals the policy ticks with, and
        the sessions recovery holds here now)."""
        self.recovery_held.set(recovery_held)
        self.working_set.set(snapshot.working_set_tokens)
        self.budget.set(snapshot.budget_tokens)
        self.reference_budget.set(snapshot.reference_budget_tokens)
        self.reserved.set(snapshot.reserved_tokens)
        self.queued.set(len(snapshot.queued))
        self.live.set(len(snapshot.live))
        self.hit_ratio.set(float("nan") if hit_rate is None else hit_rate)
        self.engine_ttft.set(float("nan") if ttft_s is None else ttft_s)
        self.is_engaged.set(1 if snapshot.is_engaged else 0)
        self.is_shadow.set(1 if is_shadow else 0)

    def refresh_state(self, is_up: bool, is_leader: bool, num_pending: int) -> None:
        """Set the state backend's gauges."""
        self.state_up.set(1 if is_up else 0)
        self.state_leader.set(1 if is_leader else 0)
        self.state_pending.set(num_pending)

    def session_admitted(self, waited_s: float) -> None:
        """Count an admission and its queue wait."""
        self.admitted.inc()
        self.queue_wait.observe(max(0.0, waited_s))

    def session_ended(self, entry: SessionEntry, reason: str) -> None:
        """Count a session's end and judge its peak prediction."""
        self.ended.labels(reason).inc()
        if reason == "shed":
            self.shed.inc()
        if (reason not in JUDGED_REASONS or entry.is_adopted or not entry.calls
                or entry.predicted_peak_tokens <= 0):  # an adopted session's record starts mid-way
            return
        true_peak = max(c.prompt_tokens for c in entry.calls)
        self.judged.inc()
        self.peak_ratio.observe(true_peak / entry.predicted_peak_tokens)
        if true_peak > entry.reserved_peak_tokens:
            self.overflowed.inc()

    def call_ended(self, outcome: str, usage: Usage | None) -> None:
        """Count a call and the tokens the upstream reported for it."""
        self.calls.labels(outcome).inc()
        if usage is not None and usage.prompt_tokens is not None and usage.cached_tokens is not None:
            self.prompt_tokens.inc(usage.prompt_tokens)
            self.cached_tokens.inc(min(usage.cached_tokens, usage.prompt_tokens))
        if usage is not None and usage.cached_tiers is not None:
            for tier, tokens in usage.cached_tiers.items():
                self.cached_by_tier.labels(tier).inc(tokens)

    def render(self) -> bytes:
        """The text exposition of every metric."""
        return generate_latest(self.registry)
