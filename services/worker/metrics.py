"""The worker's Prometheus metrics (``baton_worker_*``)."""

from prometheus_client import Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

REQUESTS = Counter("baton_worker_requests", "Requests served, by outcome", ["outcome"])
TTFT = Histogram(
    "baton_worker_ttft_seconds", "Arrival to first token, in the worker", buckets=_LATENCY_BUCKETS
)
E2E = Histogram(
    "baton_worker_e2e_seconds", "Arrival to the last token, in the worker", buckets=_LATENCY_BUCKETS
)
QUEUE = Histogram(
    "baton_worker_queue_seconds", "Time a request waited in the engine's scheduler",
    buckets=_LATENCY_BUCKETS,
)  # fmt: skip
PROMPT_TOKENS = Counter("baton_worker_prompt_tokens", "Prompt tokens admitted")
PREFIX_HIT_TOKENS = Counter(
    "baton_worker_prefix_hit_tokens", "Prompt tokens served from the engine's prefix cache"
)
RUNNING = Gauge("baton_worker_running_requests", "Requests the engine is running")
WAITING = Gauge("baton_worker_waiting_requests", "Requests queued in the engine")
KV_HANDLES_REFUSED = Counter(
    "baton_worker_kv_handles_refused",
    "Decode legs whose KV handle pointed at no registered prefill worker (not read)",
)
KV_USAGE = Gauge("baton_worker_kv_usage", "Fraction of KV-cache blocks in use")
KV_LEASES_HELD = Gauge(
    "baton_worker_kv_leases_held", "Prefill side: finished prefills whose KV waits to be pulled"
)
IN_FLIGHT = Gauge("baton_worker_in_flight_requests", "Requests the worker service is serving")

# the watchdog (watchdog.py)
LIVE = Gauge("baton_worker_live", "1 while the engine progresses whenever it has work; 0 once "
             "the watchdog found it hung (the worker then exits)")  # fmt: skip
ENGINE_STALLED = Gauge(
    "baton_worker_engine_stalled_seconds",
    "How long the engine has had work and shown no progress (0 while it progresses or idles)",
)
WATCHDOG_TRIPS = Counter(
    "baton_worker_watchdog_trips", "Times the engine was found hung, by what it was doing",
    ["reason"],
)  # fmt: skip
REINCARNATIONS = Counter(
    "baton_worker_reincarnations",
    "Times a scheduler had dropped this worker (its heartbeats had stopped) and it registered "
    "again as a new incarnation",
)

# KV transfer (disaggregated prefill/decode), mirrored from the engine's counters
KV_PULLS = Counter("baton_worker_kv_pulls", "KV pulls completed (decode side)")
KV_PULL_FAILURES = Counter("baton_worker_kv_pull_failures", "KV pulls that failed")
KV_PULL_BYTES = Counter("baton_worker_kv_pull_bytes", "Bytes of KV pulled")
KV_PULL_DESCRIPTORS = Counter("baton_worker_kv_pull_descriptors", "NIXL descriptors pulled")
KV_PULL_SECONDS = Counter("baton_worker_kv_pull_seconds", "Time from a pull's start to its end")
KV_NOTIFY_SECONDS = Counter(
    "baton_worker_kv_notify_seconds", "Time the engine spent sending release notifications"
)
KV_LEASES_RELEASED = Counter("baton_worker_kv_leases_released", "Leases ended by a pull or abort")
KV_LEASES_EXPIRED = Counter("baton_worker_kv_leases_expired", "Leases nobody pulled in time")
KV_STALE_HANDLES = Counter(
    "baton_worker_kv_stale_handles", "Decode legs whose KV handle's lease had expired (not read)"
)

_ENGINE_COUNTERS = {
    "kv_pulls": KV_PULLS,
    "kv_pull_failures": KV_PULL_FAILURES,
    "kv_pull_bytes": KV_PULL_BYTES,
    "kv_pull_descriptors": KV_PULL_DESCRIPTORS,
    "kv_pull_seconds": KV_PULL_SECONDS,
    "kv_notify_seconds": KV_NOTIFY_SECONDS,
    "kv_leases_released": KV_LEASES_RELEASED,
    "kv_leases_expired": KV_LEASES_EXPIRED,
    "kv_stale_handles": KV_STALE_HANDLES,
}


class EngineCounters:
    """Turns the engine's since-start totals into Prometheus counter increments."""

    def __init__(self) -> None:
        self._last: dict[str, float] = dict.fromkeys(_ENGINE_COUNTERS, 0.0)

    def update(self, stats: object) -> None:
        for name, counter in _ENGINE_COUNTERS.items():
            value = float(getattr(stats, name))
            if value > self._last[name]:
                counter.inc(value - self._last[name])
            self._last[name] = value
