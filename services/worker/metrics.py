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
KV_USAGE = Gauge("baton_worker_kv_usage", "Fraction of KV-cache blocks in use")
IN_FLIGHT = Gauge("baton_worker_in_flight_requests", "Requests the worker service is serving")
