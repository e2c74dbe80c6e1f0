"""Hostile and broken clients at the HTTP edge of a running ``baton serve`` (real gateway,
scheduler and tiny worker processes; bounds of 1 s through the gateway's flags): half a
request head, half a body, an oversized head, more connections than the gateway takes, and a
client that stops reading its stream. Each is cut off within its bound, with an answer where
HTTP has one, while other clients are served."""

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from baton.launcher import Cluster, free_port
from baton.serving import serving

BOUND_S = 1.0  # --header-timeout, --body-timeout and --stream-write-timeout
ENGINE_FLAGS = ["--num-kv-blocks", "512", "--max-num-seqs", "16", "--max-model-len", "1024"]
EDGE_FLAGS = ["--header-timeout", str(BOUND_S), "--body-timeout", str(BOUND_S),
              "--stream-write-timeout", str(BOUND_S)]  # fmt: skip
HALF_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\nContent-"


@pytest.fixture(scope="module")
def cluster(tiny_model: Path) -> Iterator[Cluster]:
    # (not supervised: the test that starts a second gateway stops it itself)
    with serving("--model", str(tiny_model), "--workers", "1", "--worker-metrics",
                 *ENGINE_FLAGS, *EDGE_FLAGS, supervise=False) as c:  # fmt: skip
        yield c


def _connect(port: int, rcvbuf: int | None = None) -> socket.socket:
    s = socket.socket()
    if rcvbuf is not None:  # before connecting: it sets the window the client offers
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect(("127.0.0.1", port))
    return s


def _until_closed(s: socket.socket, deadline: float) -> bytes | None:
    """All the server sends until it closes the connection; None if it is still open at
    ``deadline`` (a reset counts as closed)."""
    data = b""
    while True:
        s.settimeout(max(deadline - time.monotonic(), 0.001))
        try:
            chunk = s.recv(65536)
        except TimeoutError:
            return None
        except ConnectionResetError:
            return data
        if not chunk:
            return data
        data += chunk


def _response(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines)
    return int(status_line.split()[1]), headers, body


def _request(model: str, body: dict[str, object]) -> bytes:
    payload = json.dumps({"model": model, **body}).encode()
    return (b"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\ncontent-type: application/json"
            b"\r\ncontent-length: %d\r\n\r\n" % len(payload)) + payload  # fmt: skip


def _metric(url: str, line_start: str) -> float:
    text = httpx.get(url, timeout=5).text
    return sum(float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith(line_start))


def test_half_heads_are_closed_while_others_are_served(cluster: Cluster) -> None:
    """100 connections that send half a request head and then nothing are all closed (EOF)
    within --header-timeout + 1 s, and a completion sent meanwhile is served."""
    socks = [_connect(cluster.spec.port) for _ in range(100)]
    try:
        for s in socks:
            s.sendall(HALF_HEAD)
        deadline = time.monotonic() + BOUND_S + 1.0
        body = {"model": cluster.model_name, "prompt": "hi", "max_tokens": 2}
        served = httpx.post(f"{cluster.url}/completions", json=body, timeout=10)
        assert served.status_code == 200, served.text
        still_open = [i for i, s in enumerate(socks) if _until_closed(s, deadline) != b""]
        assert not still_open, f"{len(still_open)} half heads still open, or answered"
    finally:
        for s in socks:
            s.close()


def test_a_silent_connection_is_closed(cluster: Cluster) -> None:
    """A connection that sends nothing at all is closed --header-timeout after its accept."""
    with _connect(cluster.spec.port) as s:
        assert _until_closed(s, time.monotonic() + BOUND_S + 1.0) == b""


def test_half_a_body_gets_408(cluster: Cluster) -> None:
    """A request whose body stops half way gets a 408 in OpenAI's error JSON after
    --body-timeout, and the connection is closed."""
    request = _request(cluster.model_name, {"prompt": "hi", "max_tokens": 2})
    with _connect(cluster.spec.port) as s:
        s.sendall(request[: len(request) - 10])
        start = time.monotonic()
        raw = _until_closed(s, start + BOUND_S + 2.0)
        assert raw is not None, "still open past the body timeout"
        assert time.monotonic() - start >= BOUND_S * 0.9
    status, _, body = _response(raw)
    assert status == 408
    assert json.loads(body)["error"]["code"] == "request_timeout"


def test_an_oversized_head_gets_431(cluster: Cluster) -> None:
    with _connect(cluster.spec.port) as s:
        s.sendall(HALF_HEAD.replace(b"Content-", b"x-filler: " + b"a" * 100_000 + b"\r\n"))
        raw = _until_closed(s, time.monotonic() + BOUND_S)  # (before the header timeout)
    assert raw is not None, "an oversized head was not refused"
    status, _, body = _response(raw)
    assert status == 431
    assert json.loads(body)["error"]["code"] == "request_header_too_large"


def test_connections_past_the_cap_get_503(cluster: Cluster) -> None:
    """A gateway with --max-connections 20, 40 idle connections: the last 20 are answered 503
    with OpenAI's error JSON and Retry-After, and closed; the first 20 stay open. Once they
    close, a new connection is served."""
    port = free_port()
    argv = ["gateway", "--model", cluster.spec.model, "--served-model-name", cluster.model_name,
            "--scheduler", cluster.ready["scheduler"]["address"], "--port", str(port),
            "--max-connections", "20"]  # fmt: skip
    cluster.spawn("gateway-capped", argv, ready=False)
    try:
        cluster.wait_http("gateway-capped", f"http://127.0.0.1:{port}/ready", 30)
        socks = [_connect(port) for _ in range(40)]
        try:
            deadline = time.monotonic() + 2.0
            answers = [_until_closed(s, deadline) for s in socks[20:]]
            assert all(a is not None for a in answers), "a connection past the cap left open"
            for raw in answers:
                assert raw is not None
                status, headers, body = _response(raw)
                assert (status, headers["retry-after"]) == (503, "1")
                assert json.loads(body)["error"]["code"] == "too_many_connections"
            held = [_until_closed(s, time.monotonic() + 0.05) for s in socks[:20]]
            assert held == [None] * 20, "a connection within the cap was closed"
        finally:
            for s in socks:
                s.close()
        deadline = time.monotonic() + 2.0  # (the gateway sees the closes)
        while (r := httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5)).status_code != 200:
            assert time.monotonic() < deadline, r.text
            time.sleep(0.05)
    finally:
        cluster.procs["gateway-capped"].terminate()
        cluster.procs["gateway-capped"].wait(timeout=30)


def test_a_client_that_stops_reading_is_cut_off(cluster: Cluster) -> None:
    """A stream (16 choices with logprobs, hundreds of tokens each: about a minute of output)
    whose client reads nothing: once the gateway's buffers for it are full, after
    --stream-write-timeout it is abandoned and its requests are aborted on the worker, which
    holds no KV block for them any more."""
    gateway_metrics = f"{cluster.url.removesuffix('/v1')}/metrics"
    worker_metrics = f"http://127.0.0.1:{cluster.ready['worker-0']['metrics_port']}/metrics"
    cancelled = 'baton_worker_requests_total{outcome="cancelled"}'
    before = _metric(worker_metrics, cancelled)
    request = _request(cluster.model_name, {"prompt": "hi", "max_tokens": 900, "n": 16,
                       "logprobs": 20, "ignore_eos": True, "stream": True})  # fmt: skip
    with _connect(cluster.spec.port, rcvbuf=4096) as s:
        s.sendall(request)
        start = time.monotonic()
        while _metric(worker_metrics, "baton_worker_running_requests") < 16:
            assert time.monotonic() - start < 5, "the request did not start"
            time.sleep(0.05)
        while _metric(worker_metrics, cancelled) < before + 16:
            assert time.monotonic() - start < BOUND_S + 10, "the stream was not cut off"
            time.sleep(0.1)
        while _metric(worker_metrics, "baton_worker_kv_usage") > 0:
            assert time.monotonic() - start < BOUND_S + 12, "KV blocks still held"
            time.sleep(0.1)
    assert _metric(gateway_metrics, 'baton_gateway_edge_refusals_total{reason="slow_reader"}') == 1
