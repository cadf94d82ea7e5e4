"""Prometheus metrics of one server (its own registry)."""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"  # set: counters and histograms live in files shared by processes
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
RATIO_BUCKETS = (0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0)
STAGE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


class _CacheCollector:
    """Reads the engine's state cache and compiled question sets at scrape time."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        cache = self.engine.cache
        yield CounterMetricFamily("onepass_state_cache_hits", "State cache hits", value=cache.hits)
        yield CounterMetricFamily("onepass_state_cache_misses", "State cache misses (prefills)", value=cache.misses)
        yield GaugeMetricFamily("onepass_state_cache_bytes", "Bytes of K/V held by the state cache", value=cache.bytes)
        yield GaugeMetricFamily("onepass_state_cache_states", "States held by the state cache", value=len(cache))
        sets = self.engine.question_sets
        yield CounterMetricFamily("onepass_question_set_cache_hits", "Question sets found compiled (no tokenising or "
                                  "packing)", value=sets.hits)
        yield CounterMetricFamily("onepass_question_set_cache_misses", "Question-set lookups that found none (the "
                                  "set compiled, or refused)", value=sets.misses)
        yield GaugeMetricFamily("onepass_question_set_cache_bytes", "Bytes held by compiled question sets",
                                value=sets.bytes)
        yield GaugeMetricFamily("onepass_question_set_cache_sets", "Compiled question sets held", value=len(sets))


class _CostCollector:
    """Reads the engine queue's cost model at scrape time."""

    def __init__(self, cost):
        self.cost = cost

    def collect(self):
        c = self.cost
        yield GaugeMetricFamily("onepass_cost_model_seconds_per_pass", "The fitted fixed cost of one engine pass",
                                value=c.per_pass)
        yield GaugeMetricFamily("onepass_cost_model_seconds_per_work", "The fitted cost of one token-equivalent of "
                                "work (tokens through the weights, attention entries at their FLOP cost)",
                                value=c.per_work)
        yield GaugeMetricFamily("onepass_cost_model_spread", "The high quantile of actual / predicted that admission "
                                "multiplies a prediction by", value=c.spread())
        error = c.error_p90()
        if error is not None:
            yield GaugeMetricFamily("onepass_cost_model_error_p90", "The p90 of |predicted - actual| / actual over "
                                    "the recent groups", value=error)


class _TransportCollector:
    """Reads the transport's refusals and open connections at scrape time."""

    def __init__(self, stats):
        self.stats = stats

    def collect(self):
        refused = CounterMetricFamily("onepass_transport_refusals", "Connections and requests the transport refused "
                                      "before the app (per_client and capacity: 503; penalized: 429; head/body_timeout: "
                                      "408; head_too_large: 431; small_chunks, ambiguous_length, malformed: 400; "
                                      "body_framing: 413)",
                                      labels=["reason"])
        for reason, n in self.stats.refused.items():
            refused.add_metric([reason], n)
        yield refused
        yield GaugeMetricFamily("onepass_connections_open", "Client connections open", value=self.stats.open)
        yield GaugeMetricFamily("onepass_connections_draining", "Refused connections being read to their end before "
                                "they close (so the client reads the refusal, not a reset)", value=self.stats.draining)
        yield GaugeMetricFamily("onepass_connection_clients", "Client addresses with a connection open",
                                value=len(self.stats.by_client))


class Metrics:
    """Request count by status, latency histogram, queue depth, batches, tokens, state cache."""

    def __init__(self, engine, queue_depth):
        self.registry = CollectorRegistry()
        self.requests = Counter("onepass_requests", "HTTP requests by path and status", ["path", "status"],
                                registry=self.registry)
        self.latency = Histogram("onepass_request_seconds", "End-to-end latency of POST /v1/systemone",
                                 buckets=BUCKETS, registry=self.registry)
        self.stages = Histogram("onepass_stage_seconds", "Time of POST /v1/systemone by stage (the Server-Timing "
                                "header's entries: queue, tokenize, prefill, pack, score, readout, cascade)", ["stage"],
                                buckets=STAGE_BUCKETS, registry=self.registry)
        self.tokens = Counter("onepass_tokens", "Tokens processed", ["kind"], registry=self.registry)
        self.batches = Counter("onepass_engine_batches", "Engine batches (one or more merged requests)",
                               registry=self.registry)
        self.batched = Counter("onepass_engine_batched_requests", "Requests answered in engine batches",
                               registry=self.registry)
        self.deadline_drops = Counter("onepass_deadline_drops", "Requests dropped because their deadline passed "
                                      "before they could be answered", registry=self.registry)
        self.memory_releases = Counter("onepass_memory_releases", "Times the idle engine gave back a backend's "
                                       "working memory grown past 1.2x its warm size", registry=self.registry)
        self.engine_failures = Counter("onepass_internal_errors", "Requests answered 500 by an unexpected fault",
                                       registry=self.registry)
        # a teacher (onepass serve --teacher): calls by mode (shadow, gate) and outcome (ok, unavailable, refused,
        # bad_answer; dropped: the shadow queue was full; skipped: every gate connection busy; late: the request's
        # time ran out first; circuit_open: the teacher was found unavailable lately; cancelled: the server stopped;
        # error: an unexpected fault, logged)
        self.teacher_calls = Counter("onepass_teacher_calls", "Calls to the teacher by mode and outcome",
                                     ["mode", "outcome"], registry=self.registry)
        self.teacher_latency = Histogram("onepass_teacher_seconds", "Latency of answered teacher calls", ["mode"],
                                         buckets=BUCKETS, registry=self.registry)
        self.answered = Counter("onepass_questions_answered", "Questions answered, by whom (local: this engine; "
                                "teacher: forwarded by the gate)", ["by"], registry=self.registry)
        self.task_answers = Counter("onepass_task_answers", "Questions asked, by the tuned task they name ('-': "
                                    "none, the engine itself; a doubtful one may then go to the teacher)", ["task"],
                                    registry=self.registry)
        self.shadowed = Counter("onepass_teacher_shadowed_questions", "Questions answered locally and by the teacher "
                                "in shadow mode", registry=self.registry)
        self.agreed = Counter("onepass_teacher_agreements", "Shadowed questions whose local answer is the teacher's "
                              "(agreement = agreements / shadowed questions)", registry=self.registry)
        self.recorded = Counter("onepass_teacher_records", "Teacher answers written as tune rows (--record)",
                                registry=self.registry)
        self.record_failures = Counter("onepass_teacher_record_failures", "Teacher answers that could not be "
                                       "written (a full disk, a closed recorder)", registry=self.registry)
        if not os.environ.get(MULTIPROC_ENV):  # a function gauge is read at scrape time, in-process
            depth = Gauge("onepass_queue_depth", "Requests waiting for or in the engine", registry=self.registry)
            depth.set_function(queue_depth)
        self.registry.register(_CacheCollector(engine))

    def watch_cost(self, cost) -> None:
        """Export the engine queue's cost model (``cost.CostModel``): its coefficients, the spread admission allows
        for, the p90 of its relative error, and every measured group's actual / predicted time."""
        self.registry.register(_CostCollector(cost))
        ratio = Histogram("onepass_cost_model_ratio", "A measured engine group's actual / predicted seconds (1: the "
                          "cost model was exact)", buckets=RATIO_BUCKETS, registry=self.registry)
        cost.listener = lambda predicted, actual: ratio.observe(actual / predicted)

    def watch_transport(self, stats) -> None:
        """Export a :class:`~onepass.runtime.server.transport.TransportStats` (``onepass serve``'s transport)."""
        self.registry.register(_TransportCollector(stats))

    def on_timing(self, timing: dict) -> None:
        """One answered request's stage times (milliseconds, as in Server-Timing)."""
        for stage, ms in timing.items():
            self.stages.labels(stage).observe(ms / 1000.0)

    def on_batch(self, size: int) -> None:
        """Called by the dispatcher after each engine batch."""
        self.batches.inc()
        self.batched.inc(size)
