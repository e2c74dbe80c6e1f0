"""The global scheduler's Prometheus metrics (``baton_scheduler_*``)."""

from prometheus_client import Counter, Gauge, Histogram

WORKERS_ALIVE = Gauge("baton_scheduler_workers_alive", "Live workers, by role", ["role"])
ROUTES = Counter(
    "baton_scheduler_route_decisions", "Route decisions, by outcome and deciding factor",
    ["outcome", "factor"],
)  # fmt: skip
ROUTE_SECONDS = Histogram(
    "baton_scheduler_route_seconds", "Time to answer one Route call",
    buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05),
)  # fmt: skip
PREFILL_DECISIONS = Counter(
    "baton_scheduler_prefill_decisions",
    "The P/D decider (with a prefill pool): where the prompt runs, and why",
    ["decision", "reason"],  # remote | local; long_prompt | short_prompt | pool_busy
)
PREDICTED_HIT_TOKENS = Counter(
    "baton_scheduler_predicted_prefix_hit_tokens",
    "Prompt tokens the directory says the chosen worker holds (confirmed by its KV events) or "
    "is about to hold (pending: routed there, not confirmed yet)",
    ["source"],  # confirmed | pending
)
ENGINE_HIT_TOKENS = Counter(
    "baton_scheduler_engine_prefix_hit_tokens",
    "Prompt tokens the engines served from their prefix caches, as the workers report them",
)
WORKER_EVENTS = Counter(
    "baton_scheduler_worker_events", "Worker registrations and removals", ["event"]
)
KV_EVENTS = Counter("baton_scheduler_kv_events", "KV events applied to the directory")
DIRECTORY_DEGRADED = Gauge(
    "baton_scheduler_directory_degraded",
    "1 while the prefix directory's backend is unreachable (routing on load alone)",
)
