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
LOST_NOTICES = Counter(
    "baton_scheduler_lost_worker_notices",
    "WorkersLost notices for the gateways' RouteStreams: queued, or dropped (MAX_NOTICES "
    "already waiting on a stream its gateway does not read)",
    ["outcome"],
)
STALLS = Counter(
    "baton_scheduler_stalls",
    "Sweeps that came so late that the scheduler itself had stalled (stopped, or its loop "
    "blocked): nobody expired on them",
)
DIRECTORY_DEGRADED = Gauge(
    "baton_scheduler_directory_degraded",
    "1 while the prefix directory's backend is unreachable (routing on load alone)",
)
DISCOVERY_EVENTS = Counter(
    "baton_scheduler_discovery_events",
    "What pod discovery did: cordoned (deletionTimestamp), removed (pod gone), watch_failed",
    ["event"],
)
PODS_UNREGISTERED = Gauge(
    "baton_scheduler_pods_unregistered",
    "Worker pods Ready for a while that never registered (discovery on Kubernetes)",
)
# Scaling signals, per pool (prefill | decode | both), from the live registry only: a worker
# that left stops counting at once (no stale per-pod gauge keeps a trigger high).
POOL_WORKERS = Gauge("baton_pool_workers", "Registered workers, by pool", ["pool"])
POOL_BACKLOG_S = Gauge(
    "baton_pool_prefill_backlog_seconds",
    "Uncached prompt tokens queued on the pool ÷ its measured prefill throughput",
    ["pool"],
)
POOL_KV_USAGE = Gauge("baton_pool_kv_usage", "Mean KV-cache occupancy of the pool (0-1)", ["pool"])
POOL_RUNNING = Gauge("baton_pool_running_requests", "Requests running on the pool", ["pool"])
POOL_WAITING = Gauge("baton_pool_waiting_requests", "Requests waiting on the pool", ["pool"])
DESIRED_REPLICAS = Gauge(
    "baton_planner_desired_replicas",
    "The planner's desired replicas per pool (what HPA/KEDA act on, or what it sets itself)",
    ["pool"],
)
PLANNER_DRAINING = Gauge(
    "baton_planner_draining_workers",
    "Workers the planner is emptying (cordoned) before it lowers the pool's replicas",
    ["pool"],
)
