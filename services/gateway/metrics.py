"""The gateway's Prometheus metrics (``baton_gateway_*``), served on its own ``/metrics``."""

from prometheus_client import Counter, Gauge, Histogram

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_FAST = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)

REQUESTS = Counter(
    "baton_gateway_requests", "Requests by endpoint and outcome (HTTP status or 'disconnected')",
    ["endpoint", "outcome"],
)  # fmt: skip
TTFT = Histogram("baton_gateway_ttft_seconds", "Arrival to first token", buckets=_LATENCY)
ITL = Histogram("baton_gateway_itl_seconds", "Time between streamed token deltas", buckets=_FAST)
E2E = Histogram("baton_gateway_e2e_seconds", "Arrival to the last token", buckets=_LATENCY)
ROUTE_SECONDS = Histogram("baton_gateway_route_seconds", "Route call latency", buckets=_FAST)
ROUTE_CALLS = Counter(
    "baton_gateway_route_calls", "Route calls by transport (the long-lived stream, or unary)",
    ["transport"],
)  # fmt: skip
GENERATE_CALLS = Counter(
    "baton_gateway_generate_calls",
    "Generate calls to workers by transport (the worker's long-lived stream, or unary)",
    ["transport"],
)  # fmt: skip
PROMPT_TOKENS = Counter("baton_gateway_prompt_tokens", "Prompt tokens received")
COMPLETION_TOKENS = Counter("baton_gateway_completion_tokens", "Tokens generated")
CACHED_TOKENS = Counter(
    "baton_gateway_prefix_hit_tokens", "Prompt tokens the engines served from their prefix cache"
)
RESUMES = Counter(
    "baton_gateway_resumes",
    "Choices resumed on another worker after a worker failed or drained, by stage: refused "
    "(before that worker produced a token, e.g. it was draining) or mid_stream (cut short)",
    ["stage"],
)
STALLS = Counter(
    "baton_gateway_stalls",
    "Legs whose worker sent nothing within the progress bound (a hung worker), by leg: "
    "decode (resumed on another worker) or prefill (prefilled on the decode worker)",
    ["leg"],
)
EDGE = Counter(
    "baton_gateway_edge_refusals",
    "Connections and requests the HTTP edge cut short (http_edge.py), by reason: "
    "over_capacity (503 at accept), header_timeout, header_too_large (431), body_timeout "
    "(408), slow_reader (a response the client stopped reading, its request aborted)",
    ["reason"],
)
CONNECTIONS = Gauge("baton_gateway_open_connections", "Client connections open (HTTP edge)")
PREFILL_SECONDS = Histogram(
    "baton_gateway_prefill_seconds", "Prefill leg of disaggregated requests (to the KV handle)",
    buckets=_LATENCY,
)  # fmt: skip
