"""gRPC helpers shared by every service: channel/server options, the request id in metadata,
the bounded deadlines every call carries, and the security of every internal connection.

Security (``Security``, set once per process by ``configure`` before the first channel or
server; docs/security.md):

- a shared token that every call carries (``authorization: Bearer …`` metadata, attached by
  ``metadata``/``auth``) and every server demands (an interceptor: UNAUTHENTICATED otherwise,
  compared in constant time). The services refuse to start without one (``require_token``);
  ``baton serve`` makes one for its children.
- with certificates (a directory holding ``tls.crt``, ``tls.key`` and ``ca.crt``, the layout of a
  Kubernetes TLS Secret mounted as a volume): TLS on every channel and server, and mutual
  authentication: a server demands a client certificate signed by the same CA.
"""

import hmac

import grpc
from grpc import aio

from shared.internal_auth import Security
from shared.logs import REQUEST_ID_HEADER, request_id_var

AUTH_HEADER = "authorization"

_security = Security()


def configure(security: Security) -> None:
    """The security of every channel and server this process makes from now on."""
    global _security
    _security = security


def security() -> Security:
    return _security


_OPTIONS = [
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    # a peer that stops answering (stopped, hung, a dead host whose TCP never closes) is
    # noticed within ~8 s on an idle channel: a ping every 5 s, unanswered for 3 s
    ("grpc.keepalive_time_ms", 5_000),
    ("grpc.keepalive_timeout_ms", 3_000),
    ("grpc.http2.max_pings_without_data", 0),
    # gRPC core gives a ping 60 s for its answer (grpc.http2.ping_timeout_ms), whatever
    # keepalive_timeout says: a stopped peer held every stream on it for a minute
    ("grpc.http2.ping_timeout_ms", 3_000),
    ("grpc.keepalive_permit_without_calls", 1),
    # a peer that restarts (the scheduler, under ``baton serve`` or Kubernetes) is reconnected
    # to within ~1 s of serving again, not after gRPC's default backoff (1 s growing to 120 s).
    # (Not grpc.min_reconnect_backoff_ms: that is also the connect timeout, 20 s by default.)
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


def channel(address: str, tls_name: str | None = None) -> aio.Channel:
    """A channel to ``address``; with TLS, the server's certificate is checked against
    ``tls_name`` when given (an address found through a DNS name: the certificate names the
    service, not each pod's IP), else against the address's host."""
    if _security.tls_dir is None:
        return aio.insecure_channel(address, options=_OPTIONS)
    ca, key, cert = _security.files()
    creds = grpc.ssl_channel_credentials(ca, key, cert)
    options = _OPTIONS if tls_name is None else [*_OPTIONS, ("grpc.ssl_target_name_override",
                                                              tls_name)]  # fmt: skip
    return aio.secure_channel(address, creds, options=options)


def add_port(server: aio.Server, address: str) -> int:
    """Listen on ``address`` (TLS with mutual authentication when configured); the port."""
    if _security.tls_dir is None:
        return server.add_insecure_port(address)
    ca, key, cert = _security.files()
    creds = grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                        require_client_auth=True)  # fmt: skip
    return server.add_secure_port(address, creds)


class _TokenCheck(aio.ServerInterceptor):
    """Every call must carry the shared token; one that does not ends UNAUTHENTICATED before
    its handler runs (the request's messages are never read)."""

    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        for key, value in details.invocation_metadata or ():
            if key == AUTH_HEADER:
                given = value.encode() if isinstance(value, str) else bytes(value)
                if hmac.compare_digest(given, self._expected):
                    return handler
        return None if handler is None else _denied(handler)


def _denied(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    message = "this service needs the internal token (authorization metadata)"

    async def unary(request: object, context: aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def stream(request: object, context: aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # (a generator: the handler type of a streaming response)

    kinds = {
        (False, False): (grpc.unary_unary_rpc_method_handler, unary),
        (False, True): (grpc.unary_stream_rpc_method_handler, stream),
        (True, False): (grpc.stream_unary_rpc_method_handler, unary),
        (True, True): (grpc.stream_stream_rpc_method_handler, stream),
    }
    make, fn = kinds[(handler.request_streaming, handler.response_streaming)]
    return make(fn, handler.request_deserializer, handler.response_serializer)


def server() -> aio.Server:
    # gRPC sets SO_REUSEPORT by default, so a second service could bind a port that is already
    # serving and the kernel would split connections between the two: refuse instead.
    # Our channels ping every 5 s even between calls (a dead peer is noticed); a server at
    # gRPC's default (pings without data at most every 5 min) counts those as strikes and
    # sends GOAWAY "too_many_pings" (seen in a gateway's log), dropping the connection. (4 s
    # here: a ping a little early is no strike.)
    return aio.server(
        options=[
            *_OPTIONS,
            ("grpc.so_reuseport", 0),
            ("grpc.http2.min_ping_interval_without_data_ms", 4_000),
        ],
        interceptors=[_TokenCheck(_security.token)] if _security.token else None,
    )


def auth() -> tuple[tuple[str, str], ...]:
    """The metadata that authenticates a call (none without a token)."""
    token = _security.token
    return ((AUTH_HEADER, f"Bearer {token}"),) if token else ()


def metadata(request_id: str) -> tuple[tuple[str, str], ...]:
    return ((REQUEST_ID_HEADER, request_id), *auth())


def adopt_request_id(context: aio.ServicerContext) -> str:
    """Take the caller's request id from metadata into this task's logging context."""
    for key, value in context.invocation_metadata() or ():
        if key == REQUEST_ID_HEADER:
            request_id_var.set(str(value))
            return str(value)
    return request_id_var.get()


UNAVAILABLE_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
