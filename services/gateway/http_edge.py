"""The gateway's HTTP edge: uvicorn's httptools protocol with the bounds a hostile or broken
client must not get past (``EdgeLimits``; docs/security.md, "Hostile clients").

    accepted ──► head ──────────────────► body ──────────► response ─────────► keep-alive ─► head …
    │            ≤ header_timeout_s from   ≤ body_timeout_s  its buffers full    uvicorn's 5 s
    │            the accept (a later       (app.py _parse),  for stream_write_
    │            head: its first byte);    else a 408        timeout_s: reset,
    │            ≤ MAX_HEAD_BYTES (431)                      request aborted
    └─ max_connections already open: 503 JSON with Retry-After, closed

uvicorn bounds none of these: its keep-alive timer runs only between requests and is cancelled
by the first byte of the next one, so a connection that sends half a head, or nothing, holds a
descriptor forever; and a client that stops reading leaves its stream blocked in
``flow.drain()`` for as long as the stream lasts.

A connection over the cap is handed to ``Refusal``, which writes its 503 at once and drops what
the client sends until the client closes (closing a socket with unread input resets it, and
the client could lose the answer), at most ``REFUSAL_LINGER_S``.

A stalled response is aborted (a reset: closing would wait for the buffer to drain), which
disconnects its request as a client that leaves does: the stream's disconnect watcher
(sse.py) cancels it and the orchestrator aborts the request on its workers, freeing its KV
blocks. The stall is timed by the transport's own flow control (``pause_writing`` until
``resume_writing``), so a stream that is read pays nothing per chunk. Its buffers are
bounded: uvicorn's (64 KiB, then it pauses) and the kernel's (``SEND_BUFFER_BYTES``).
"""

import asyncio
import dataclasses
import json
import logging
import resource
import socket
from typing import Any, ClassVar, cast

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from services.gateway import errors, metrics
from services.gateway.settings import EdgeLimits

logger = logging.getLogger(__name__)

MAX_HEAD_BYTES = 64 * 1024  # a request line and headers above it get a 431 (h11's is 16 KiB)
# the kernel's send buffer per connection (Linux doubles it for its bookkeeping). Left to
# autotuning it grows to megabytes (4 MiB on loopback): a client that stops reading would hold
# that much, and a token stream would take an hour to fill it and be seen as stalled. 64 KiB
# still moves 2.6 MB/s to a client 50 ms away; a stream sends a few KB/s
SEND_BUFFER_BYTES = 64 * 1024
REFUSAL_LINGER_S = 1.0  # a refused connection is closed this long after its 503, at the latest
RETRY_AFTER_S = 1
# descriptors kept for everything but client connections: gRPC channels to the scheduler and
# each worker, the probe server, model files, refused connections lingering
RESERVED_FDS = 256


class EdgeProtocol(HttpToolsProtocol):
    """One client connection (uvicorn makes one per accept). ``limits`` is set on a subclass
    per gateway (``protocol``): uvicorn builds the protocol from its class."""

    limits: ClassVar[EdgeLimits]  # max_connections fitted to the descriptor limit

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.head_timer: asyncio.TimerHandle | None = None
        self.head_bytes = 0  # bytes received while the current head is incomplete
        self.stall_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.limits.max_connections:
            metrics.EDGE.labels("over_capacity").inc()
            refusal = Refusal(self.limits.max_connections)
            transport.set_protocol(refusal)
            refusal.connection_made(transport)
            return
        super().connection_made(transport)
        metrics.CONNECTIONS.inc()
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        if self.stall_timer is not None:
            self.stall_timer.cancel()
        metrics.CONNECTIONS.dec()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        pending = self.head_timer is not None
        super().data_received(data)
        if pending and self.head_timer is not None:  # a head incomplete before and after
            self.head_bytes += len(data)
            if self.head_bytes > MAX_HEAD_BYTES and not self.transport.is_closing():
                self._refuse_head()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self.head_timer is None:  # a later request: timed from its first byte (the first
            self._arm_head_timer()  # one, from the accept: a timer less per connection)

    def on_headers_complete(self) -> None:
        self._disarm_head_timer()
        super().on_headers_complete()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self.stall_timer is None:
            timeout = self.limits.stream_write_timeout_s
            self.stall_timer = self.loop.call_later(timeout, self._on_stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self.stall_timer is not None:
            self.stall_timer.cancel()
            self.stall_timer = None

    def _arm_head_timer(self) -> None:
        self.head_timer = self.loop.call_later(self.limits.header_timeout_s, self._on_head_late)

    def _disarm_head_timer(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None
        self.head_bytes = 0

    def _on_head_late(self) -> None:
        self.head_timer = None
        if not self.transport.is_closing():
            metrics.EDGE.labels("header_timeout").inc()
            self.transport.close()

    def _refuse_head(self) -> None:
        metrics.EDGE.labels("header_too_large").inc()
        self._disarm_head_timer()
        self.transport.write(_response(errors.head_too_large(MAX_HEAD_BYTES)))
        self.transport.close()

    def _on_stalled(self) -> None:
        self.stall_timer = None
        if self.transport.is_closing():
            return
        metrics.EDGE.labels("slow_reader").inc()
        path = self.scope.get("path", "?") if self.scope is not None else "?"
        logger.warning("%s: the client read nothing for %g s: response abandoned", path,
                       self.limits.stream_write_timeout_s)  # fmt: skip
        self.transport.abort()  # connection_lost: the request sees a disconnect


class Refusal(asyncio.Protocol):
    """A connection over the cap: answered 503 (OpenAI's error JSON, Retry-After) at once, its
    input read and dropped until the client closes, closed after ``REFUSAL_LINGER_S`` at most."""

    def __init__(self, cap: int) -> None:
        self.answer = _response(errors.too_many_connections(cap), retry_after=RETRY_AFTER_S)
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # (uvloop's is no asyncio.Transport)
        transport.write(self.answer)
        if transport.can_write_eof():
            transport.write_eof()
        self.timer = asyncio.get_running_loop().call_later(REFUSAL_LINGER_S, transport.close)

    def data_received(self, data: bytes) -> None:
        pass  # the request it sent anyway: read, so that closing does not reset the connection

    def eof_received(self) -> bool:
        return False  # the client closed its side: the transport closes

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()


def _response(e: errors.APIError, retry_after: int | None = None) -> bytes:
    """``e`` as a whole HTTP/1.1 response that closes the connection."""
    body = json.dumps(e.body()).encode()
    head = [f"HTTP/1.1 {e.status} {_REASONS[e.status]}", "content-type: application/json",
            f"content-length: {len(body)}", "connection: close"]  # fmt: skip
    if retry_after is not None:
        head.append(f"retry-after: {retry_after}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


_REASONS = {431: "Request Header Fields Too Large", 503: "Service Unavailable"}


def protocol(limits: EdgeLimits) -> type[EdgeProtocol]:
    """The protocol class to give uvicorn (``Config(http=...)``), bound to ``limits``."""
    fitted = dataclasses.replace(limits, max_connections=connection_cap(limits.max_connections))

    class Bound(EdgeProtocol):
        pass

    Bound.limits = fitted
    return Bound


def connection_cap(wanted: int) -> int:
    """``wanted`` connections, or as many as the descriptor limit allows. The soft limit is
    raised to the hard one first: containers often start with a soft limit of 1,024 (Docker,
    containerd 2) and a hard one of 500,000 or more, and a server past its limit fails its
    accepts instead of answering 503."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or hard > soft):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as e:  # (macOS refuses an infinite soft limit)
            logger.info("could not raise the descriptor limit from %d: %s", soft, e)
    if soft == resource.RLIM_INFINITY or wanted + RESERVED_FDS <= soft:
        return wanted
    cap = max(1, soft - RESERVED_FDS)
    logger.warning("--max-connections %d lowered to %d: this process may open %d descriptors",
                   wanted, cap, soft)  # fmt: skip
    return cap
