"""Prometheus metrics for one app: request outcomes, tokens, latencies, engine scheduler state, and batches.

Each app owns its CollectorRegistry (no process globals), so several apps can live in one process.
Names follow vLLM's (`vllm:` → `hybridserve:`); engine state is read from `engine.workers()` at scrape time, one
series per engine worker (label `worker`), with the router's decisions per worker.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from hybridserve.engine.protocol import SchedulerStats, WorkerStatus

OUTCOMES = ("stop", "length", "abort", "error")
BATCH_OUTCOMES = ("completed", "failed", "expired")

# fmt: off
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 10.0, 20.0, 80.0)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)
# fmt: on


class ServingMetrics:
    """The frontend's instruments, bound to one model name; `render()` is the /metrics body."""

    def __init__(self, model_name: str, workers: Callable[[], list[WorkerStatus]]) -> None:
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        names = list(labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, names, registry=self.registry).labels(**labels)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, names, buckets=buckets, registry=self.registry).labels(**labels)

        outcomes = Counter(
            "hybridserve:request_outcome",
            "Finished sequences (one per choice) by outcome: stop, length, abort, error.",
            [*names, "outcome"],
            registry=self.registry,
        )
        self.outcomes = {o: outcomes.labels(**labels, outcome=o) for o in OUTCOMES}
        self.prompt_tokens = counter("hybridserve:prompt_tokens", "Prompt tokens of admitted requests.")
        self.generation_tokens = counter("hybridserve:generation_tokens", "Generated tokens.")
        self.ttft = histogram(
            "hybridserve:time_to_first_token_seconds",
            "Time from request arrival to its first generated token.",
            TTFT_BUCKETS,
        )
        self.itl = histogram(
            "hybridserve:inter_token_latency_seconds",
            "Time between successive token updates of one sequence.",
            ITL_BUCKETS,
        )
        self.e2e = histogram(
            "hybridserve:e2e_request_latency_seconds",
            "Time from request arrival to its last token.",
            E2E_BUCKETS,
        )
        self.registry.register(_EngineStatsCollector(workers, labels))
        batch_requests = Counter(
            "hybridserve:batch_requests",
            "Batch requests by outcome: completed (output file), failed (error file), expired (never run).",
            [*names, "outcome"],
            registry=self.registry,
        )
        self.batch_requests = {o: batch_requests.labels(**labels, outcome=o) for o in BATCH_OUTCOMES}
        self._labels = labels

    def watch_batches(self, counts: Callable[[], dict[str, int]]) -> None:
        """Reports `counts()` (batches by status) as the `hybridserve:batches` gauge at each scrape."""
        self.registry.register(_BatchStatusCollector(counts, self._labels))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def _hit_rate(s: SchedulerStats) -> float:
    return s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0


# fmt: off
_ENGINE_METRICS = (
    (GaugeMetricFamily, "num_requests_running", "Requests in the engine's running batch.",
     lambda s: s.num_running),
    (GaugeMetricFamily, "num_requests_waiting", "Requests queued in the engine.", lambda s: s.num_waiting),
    (GaugeMetricFamily, "kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0 to 1).",
     lambda s: s.kv_cache_usage),
    (CounterMetricFamily, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
     lambda s: s.prefix_cache_queries),
    (CounterMetricFamily, "prefix_cache_hits", "Prompt tokens served from the prefix cache.",
     lambda s: s.prefix_cache_hits),
    (GaugeMetricFamily, "prefix_cache_hit_rate", "Prefix-cache hits over queries since start.", _hit_rate),
    (CounterMetricFamily, "num_preemptions", "Requests preempted by the scheduler.",
     lambda s: s.num_preemptions),
    (GaugeMetricFamily, "num_state_snapshots", "Recurrent-state snapshots held for prefix hits (hybrid models).",
     lambda s: s.num_state_snapshots),
    (GaugeMetricFamily, "state_snapshot_usage_perc", "Fraction of recurrent-state snapshot slots in use (0 to 1).",
     lambda s: s.state_snapshot_usage),
    (CounterMetricFamily, "state_snapshot_hits", "Prefix hits that restored recurrent state from a snapshot.",
     lambda s: s.state_snapshot_hits),
    (GaugeMetricFamily, "kv_transfer_held_requests",
     "Prefill worker: prefilled requests whose KV and state wait for their decode worker.", lambda s: s.kv_held),
    (GaugeMetricFamily, "kv_transfer_pulling_requests",
     "Decode worker: requests whose KV and state are being read from a prefill worker.", lambda s: s.kv_pulling),
    (CounterMetricFamily, "kv_transfer_pulls", "Decode worker: KV and state reads that landed.",
     lambda s: s.kv_pulls_done),
    (CounterMetricFamily, "kv_transfer_pull_failures",
     "Decode worker: KV and state reads that failed (peer gone, error, deadline).", lambda s: s.kv_pulls_failed),
    (CounterMetricFamily, "kv_transfer_leases_expired",
     "Prefill worker: held requests let go because no decode worker read them within the lease.",
     lambda s: s.kv_leases_expired),
    (CounterMetricFamily, "kv_transfer_staged",
     "Requests whose fragmented KV blocks were packed into (prefill) or scattered from (decode) the staging arena.",
     lambda s: s.kv_staged),
    (CounterMetricFamily, "kv_transfer_kv_bytes", "Decode worker: bytes of KV blocks read from prefill workers.",
     lambda s: s.kv_pulled_kv_bytes),
    (CounterMetricFamily, "kv_transfer_state_bytes",
     "Decode worker: bytes of recurrent state read from prefill workers.", lambda s: s.kv_pulled_state_bytes),
    (CounterMetricFamily, "kv_transfer_kv_seconds", "Decode worker: seconds the KV parts of reads took, summed.",
     lambda s: s.kv_pull_kv_seconds),
    (CounterMetricFamily, "kv_transfer_state_seconds",
     "Decode worker: seconds the recurrent-state parts of reads took, summed.", lambda s: s.kv_pull_state_seconds),
    (CounterMetricFamily, "spec_decode_num_drafts",
     "Speculative decoding: verifications of a request's draft tokens.", lambda s: s.spec_decode_num_drafts),
    (CounterMetricFamily, "spec_decode_num_draft_tokens", "Speculative decoding: draft tokens verified.",
     lambda s: s.spec_decode_num_draft_tokens),
    (CounterMetricFamily, "spec_decode_num_accepted_tokens", "Speculative decoding: draft tokens accepted.",
     lambda s: s.spec_decode_num_accepted_tokens),
)
# fmt: on


class _EngineStatsCollector:
    """Reads each engine worker's latest scheduler stats and routing counts when Prometheus scrapes."""

    def __init__(self, workers: Callable[[], list[WorkerStatus]], labels: dict[str, str]) -> None:
        self.workers = workers
        self.names, self.values = [*labels, "worker"], list(labels.values())

    def collect(self) -> Iterator[Metric]:
        workers = self.workers()
        for kind, name, doc, value in _ENGINE_METRICS:
            metric = kind(f"hybridserve:{name}", doc, labels=self.names)
            for w in workers:
                metric.add_metric([*self.values, w.name], value(w.stats))
            yield metric
        up = GaugeMetricFamily("hybridserve:worker_up", "1 while the engine worker serves, else 0.", labels=self.names)
        load = GaugeMetricFamily(
            "hybridserve:worker_load_tokens",
            "Tokens of the requests routed to the worker and not finished.",
            labels=self.names,
        )
        decisions = CounterMetricFamily(
            "hybridserve:router_decisions",
            "Requests routed to the worker by policy and outcome: hit (matched cached blocks there) or miss.",
            labels=[*self.names, "policy", "outcome"],
        )
        matched = CounterMetricFamily(
            "hybridserve:router_matched_blocks",
            "Cached prompt blocks the routed requests matched on the worker.",
            labels=[*self.names, "policy"],
        )
        restarts = CounterMetricFamily(
            "hybridserve:worker_restarts",
            "Times a local engine worker's process was started again after it died.",
            labels=self.names,
        )
        for w in workers:
            key = [*self.values, w.name]
            up.add_metric(key, float(w.state == "up"))
            restarts.add_metric(key, w.restarts)
            load.add_metric(key, w.load_tokens)
            decisions.add_metric([*key, w.policy, "hit"], w.routed_hits)
            decisions.add_metric([*key, w.policy, "miss"], w.routed_misses)
            matched.add_metric([*key, w.policy], w.matched_blocks)
        yield from (up, load, decisions, matched, restarts)


class _BatchStatusCollector:
    def __init__(self, counts: Callable[[], dict[str, int]], labels: dict[str, str]) -> None:
        self.counts = counts
        self.names, self.values = list(labels), list(labels.values())

    def collect(self) -> Iterator[Metric]:
        metric = GaugeMetricFamily("hybridserve:batches", "Batches by status.", labels=[*self.names, "status"])
        for status, count in self.counts().items():
            metric.add_metric([*self.values, status], count)
        yield metric
