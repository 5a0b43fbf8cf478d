"""Prometheus metrics, named as vLLM's (`vllm:` -> `llamajet:`) so existing
dashboards and autoscalers carry over. One registry per app (tests run
several servers in one process).

Gauges are read when scraped (running / waiting requests, KV use); counters
and histograms are updated by the request handlers as tokens stream out.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

disable_created_metrics()  # no *_created series: dashboards never read them

_LATENCY = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
            20.0, 40.0, 80.0, 160.0, 640.0)
_ITL = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


class Metrics:
    def __init__(self, model_name: str) -> None:
        r = self.registry = CollectorRegistry()
        lab = ["model_name"]
        self.model_name = model_name
        self.running = Gauge("llamajet:num_requests_running", "Requests admitted to the running batch", lab,
                             registry=r)
        self.waiting = Gauge("llamajet:num_requests_waiting", "Requests queued, not yet admitted", lab, registry=r)
        self.kv_usage = Gauge("llamajet:kv_cache_usage_perc", "Fraction of KV cache blocks held (0..1)", lab,
                              registry=r)
        self.prefix_queries = Counter("llamajet:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      lab, registry=r)
        self.prefix_hits = Counter("llamajet:prefix_cache_hits", "Prompt tokens served from the prefix cache",
                                   lab, registry=r)
        self.prompt_tokens = Counter("llamajet:prompt_tokens", "Prompt tokens of admitted requests", lab,
                                     registry=r)
        self.generation_tokens = Counter("llamajet:generation_tokens", "Tokens generated", lab, registry=r)
        self.success = Counter("llamajet:request_success", "Requests finished, by finish reason",
                               lab + ["finished_reason"], registry=r)
        self.failure = Counter("llamajet:request_failure", "Requests answered with an error, by status",
                               lab + ["code"], registry=r)
        self.preemptions = Counter("llamajet:num_preemptions", "Sequences preempted (KV pool full)", lab,
                                   registry=r)
        self.ttft = Histogram("llamajet:time_to_first_token_seconds", "Arrival to first token", lab,
                              buckets=_LATENCY, registry=r)
        self.itl = Histogram("llamajet:inter_token_latency_seconds", "Time between tokens of a stream", lab,
                             buckets=_ITL, registry=r)
        self.e2e = Histogram("llamajet:e2e_request_latency_seconds", "Arrival to last token", lab,
                             buckets=_LATENCY, registry=r)
        self.queue = Histogram("llamajet:request_queue_time_seconds", "Arrival to admission", lab,
                               buckets=_LATENCY, registry=r)
        self.http = Counter("llamajet:http_requests", "HTTP requests by route and status", ["route", "status"],
                            registry=r)
        self.idle = Gauge("llamajet:thread_idle_fraction",
                          "Share of the compute threads' time in the steps since the last scrape spent waiting "
                          "rather than computing: a few percent on a quiet machine, far more when other programs "
                          "hold the cores", lab, registry=r)
        # speculative decoding (engine/speculative.py), vLLM's spec_decode_* names
        self.spec_drafts = Counter("llamajet:spec_decode_num_drafts", "Verifications of proposed tokens", lab,
                                   registry=r)
        self.spec_draft_tokens = Counter("llamajet:spec_decode_num_draft_tokens", "Tokens proposed and computed",
                                         lab, registry=r)
        self.spec_accepted = Counter("llamajet:spec_decode_num_accepted_tokens",
                                     "Proposed tokens that were the sequence's next tokens", lab, registry=r)
        self.spec_per_pos = Counter("llamajet:spec_decode_num_accepted_tokens_per_pos",
                                    "Proposed tokens accepted, by their position in the proposal (0: the first)",
                                    ["model_name", "position"], registry=r)
        self._spec_seen = (0, 0, 0)
        self._spec_pos_seen: list[int] = []
        self._idle_seen = (0, 0)
        self._preempt_seen = 0
        for m in (self.prefix_queries, self.prefix_hits, self.prompt_tokens, self.generation_tokens,
                  self.preemptions, self.spec_drafts, self.spec_draft_tokens, self.spec_accepted):
            m.labels(model_name)  # exported at 0 before the first request
        self.spec_per_pos.labels(model_name, "0")  # exported at 0 (the dashboard's query) before any proposal
        for reason in ("stop", "length", "tool_calls", "abort"):
            self.success.labels(model_name, reason)
        for code in ("400", "401", "404", "413", "429", "500", "503"):
            self.failure.labels(model_name, code)

    def refresh(self, engine, running: int, waiting: int) -> None:
        """Sets the gauges (and the preemption counter) from the engine's state."""
        m = self.model_name
        self.running.labels(m).set(running)
        self.waiting.labels(m).set(waiting)
        if engine is not None:
            b = engine.blocks
            self.kv_usage.labels(m).set(b.num_used / b.num_blocks)
            # cycles in kernels / steps' cycles x threads, over the steps since the last scrape
            work, wall = engine.runner.exe.idle_counters()
            dw, dt = work - self._idle_seen[0], wall - self._idle_seen[1]
            if dt > 0 and dw >= 0:  # (a reset of the counters: skip one reading)
                self.idle.labels(m).set(max(0.0, 1.0 - dw / dt))
            self._idle_seen = (work, wall)
            n = engine.scheduler.num_preemptions
            if n > self._preempt_seen:
                self.preemptions.labels(m).inc(n - self._preempt_seen)
                self._preempt_seen = n
            st = engine.stats
            now = (st.spec_drafts, st.spec_draft_tokens, st.spec_accepted_tokens)
            for c, new, seen in zip((self.spec_drafts, self.spec_draft_tokens, self.spec_accepted), now,
                                    self._spec_seen):
                if new > seen:
                    c.labels(m).inc(new - seen)
            self._spec_seen = now
            per, seen = st.spec_accepted_per_pos, self._spec_pos_seen
            for j, new in enumerate(per):
                old = seen[j] if j < len(seen) else 0
                if new > old:
                    self.spec_per_pos.labels(m, str(j)).inc(new - old)
            self._spec_pos_seen = list(per)
