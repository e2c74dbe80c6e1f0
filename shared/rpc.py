"""gRPC helpers shared by every service: channel/server options, the request id in metadata,
and the bounded deadlines every call carries."""

import grpc
from grpc import aio

from shared.logs import REQUEST_ID_HEADER, request_id_var

_OPTIONS = [
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.keepalive_permit_without_calls", 1),
    # a peer that restarts (the scheduler, under ``baton serve`` or Kubernetes) is reconnected
    # to within ~1 s of serving again, not after gRPC's default backoff (1 s growing to 120 s).
    # (Not grpc.min_reconnect_backoff_ms: that is also the connect timeout, 20 s by default.)
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


def channel(address: str) -> aio.Channel:
    return aio.insecure_channel(address, options=_OPTIONS)


def server() -> aio.Server:
    # gRPC sets SO_REUSEPORT by default, so a second service could bind a port that is already
    # serving and the kernel would split connections between the two: refuse instead.
    # Our channels ping every 10 s even between calls (a dead peer is noticed); a server at
    # gRPC's default (pings without data at most every 5 min) counts those as strikes and
    # sends GOAWAY "too_many_pings" (seen in a gateway's log), dropping the connection.
    return aio.server(
        options=[
            *_OPTIONS,
            ("grpc.so_reuseport", 0),
            ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
        ]
    )


def metadata(request_id: str) -> tuple[tuple[str, str], ...]:
    return ((REQUEST_ID_HEADER, request_id),)


def adopt_request_id(context: aio.ServicerContext) -> str:
    """Take the caller's request id from metadata into this task's logging context."""
    for key, value in context.invocation_metadata() or ():
        if key == REQUEST_ID_HEADER:
            request_id_var.set(str(value))
            return str(value)
    return request_id_var.get()


UNAVAILABLE_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
