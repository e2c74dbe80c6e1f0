"""A real Baton cluster for end-to-end tests: ``baton serve``'s own launcher starts the global
scheduler, the workers and the gateway as processes (readiness by ready files and /ready,
never a sleep), and stops them after the tests."""

import contextlib
import dataclasses
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import httpx
import pytest

from baton.launcher import Cluster, ClusterSpec
from baton.serving import serving
from shared.internal_auth import TOKEN_ENV
from shared.protos.baton.v1 import scheduler_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc
from shared.text.tokenizer import TextTokenizer

if TYPE_CHECKING:
    from baton import LLM

TEST_ENGINE_FLAGS = ["--num-kv-blocks", "512", "--max-num-seqs", "16", "--max-model-len", "1024"]


@contextlib.contextmanager
def running_cluster(model: Path, workers: int, *extra: str) -> Iterator[Cluster]:
    with serving("--model", str(model), "--workers", str(workers), *TEST_ENGINE_FLAGS,
                 *extra) as cluster:  # fmt: skip
        yield cluster


class _WithToken(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds the internal token (the one the test session's clusters share) to every call."""

    def _add(self, details):  # type: ignore[no-untyped-def]
        token = os.environ[TOKEN_ENV]
        metadata = [*(details.metadata or ()), ("authorization", f"Bearer {token}")]
        return details._replace(metadata=metadata)

    def intercept_unary_unary(self, continuation, details, request):  # type: ignore[no-untyped-def]
        return continuation(self._add(details), request)

    intercept_unary_stream = intercept_unary_unary

    def intercept_stream_unary(self, continuation, details, requests):  # type: ignore[no-untyped-def]
        return continuation(self._add(details), requests)

    intercept_stream_stream = intercept_stream_unary


def internal_channel(address: str) -> grpc.Channel:
    """A channel to a service of a test cluster, authenticated as the gateway's would be."""
    return grpc.intercept_channel(grpc.insecure_channel(address), _WithToken())


def list_workers(cluster: Cluster) -> list[scheduler_pb2.WorkerInfo]:
    with internal_channel(cluster.ready["scheduler"]["address"]) as ch:
        stub = scheduler_pb2_grpc.GlobalSchedulerStub(ch)
        return list(stub.ListWorkers(scheduler_pb2.ListWorkersRequest(), timeout=5).workers)


@pytest.fixture(scope="module")
def cluster(tiny_model: Path) -> Iterator[Cluster]:
    """Two colocated workers behind one gateway, shared by a module's tests."""
    with running_cluster(tiny_model, 2) as c:
        yield c


@pytest.fixture(scope="module")
def offline(tiny_model: Path) -> Iterator["LLM"]:
    """The engine in this process, configured like the cluster's workers: the reference."""
    from baton import LLM

    llm = LLM(model=str(tiny_model), num_kv_blocks=512, max_model_len=1024)
    yield llm
    llm.shutdown()


def wait_for(
    cond: Callable[[], bool],
    timeout_s: float,
    what: str,
    state: Callable[[], object] | None = None,
) -> float:
    """Poll until ``cond()``; returns the seconds it took (fails after the bound, with what
    ``state()`` says then)."""
    start = time.monotonic()
    while not cond():
        if time.monotonic() - start > timeout_s:
            seen = f"; state: {state()}" if state is not None else ""
            pytest.fail(f"timed out after {timeout_s} s waiting for {what}{seen}")
        time.sleep(0.02)
    return time.monotonic() - start


def worker_health(cluster: Cluster, name: str) -> worker_pb2.HealthResponse:
    with internal_channel(cluster.ready[name]["address"]) as ch:
        return worker_pb2_grpc.WorkerStub(ch).Health(worker_pb2.HealthRequest(), timeout=5)


def long_prompt(tiny_model: Path, tokens: int, salt: str) -> str:
    tok = TextTokenizer(tiny_model)
    text = f"{salt}: " + " ".join(f"word{i}" for i in range(tokens))
    ids = tok.encode(text)[:tokens]
    return tok.decode(ids)


def scheduler_metric(cluster: Cluster, name: str, service: str = "scheduler") -> float:
    """A sample from a service's /metrics (the scheduler's, or a worker started with
    ``--worker-metrics``); fails if it is not exported yet."""
    port = cluster.ready[service]["metrics_port"]
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not exported")


def disaggregated_routes(cluster: Cluster) -> float:
    """The requests the scheduler has routed to a prefill and a decode worker."""
    text = "baton_scheduler_route_decisions_total"
    total = 0.0
    for factor in ("prefix", "load"):
        with contextlib.suppress(AssertionError):  # not exported until it first counts
            total += scheduler_metric(
                cluster, f'{text}{{factor="{factor}",outcome="disaggregated"}}'
            )
    return total


def start_replicas(
    group: Cluster, model: Path, redis_url: str, *scheduler_flags: str
) -> tuple[list[str], list[str]]:
    """Two scheduler replicas sharing one Redis and two workers heartbeating to both, started
    in ``group``: (scheduler addresses, worker addresses)."""
    addrs = []
    for i in range(2):
        argv = ["global-scheduler", "--port", "0", "--redis-url", redis_url, *scheduler_flags]
        ready = group.spawn(f"scheduler-{i}", argv, ready=True)
        addrs.append(group.wait_ready(f"scheduler-{i}", ready, 30)["address"])
    workers = []
    for i in range(2):
        argv = ["worker", "--model", str(model), "--worker-id", f"w{i}",
                "--scheduler", ",".join(addrs), *TEST_ENGINE_FLAGS]  # fmt: skip
        workers.append(group.wait_ready(f"w{i}", group.spawn(f"w{i}", argv, ready=True), 120))
    return addrs, [w["address"] for w in workers]


def service_group(model: Path) -> Cluster:
    """An empty launcher: its ``spawn``/``wait_ready``/``wait_http`` start extra services
    (scheduler replicas, a second gateway) that its ``stop`` stops."""
    return Cluster(ClusterSpec(model=str(model)))


WORKER_PREFIXES = ("worker-", "prefill-", "decode-")


def directory_is_whole(cluster: Cluster) -> bool:
    """The scheduler's directory holds, for every worker of the cluster, as many blocks as the
    worker's own prefix cache (and at least one worker holds some)."""
    held = {w.registration.worker_id: w.num_cached_blocks for w in list_workers(cluster)}
    names = [n for n in cluster.procs if n.startswith(WORKER_PREFIXES)]
    cached = {n: worker_health(cluster, n).num_cached_blocks for n in names}
    return held == cached and any(cached.values())


@dataclasses.dataclass
class Outcome:
    """One request of a ``StreamLoad``."""

    start: float
    prompt: str = ""
    first: float | None = None  # when its first chunk came
    end: float = 0.0
    status: int = 0
    text: str = ""
    error: str = ""  # the error JSON's message (a non-200, or an error event in the stream)
    retry_after: str | None = None
    max_gap: float = 0.0  # the longest wait for a chunk (the first: from the start)
    last: float = 0.0  # when the last chunk (or the request) was sent

    def chunk(self) -> None:
        now = time.monotonic()
        self.max_gap = max(self.max_gap, now - (self.last or self.start))
        self.last = now


class StreamLoad:
    """``clients`` threads streaming completions back to back (greedy, ``max_tokens`` each)
    until stopped, every outcome kept; a 503 is retried after a short pause, as a client
    honouring Retry-After would. With ``lockstep`` the clients start each round of requests
    together (a batch job's shape), so that every round has a moment when all of them are
    early in their streams."""

    def __init__(
        self, url: str, clients: int = 16, max_tokens: int = 16,
        prompt: Callable[[int, int], str] = lambda c, i: f"client {c} request {i}",
        lockstep: bool = False,
    ):  # fmt: skip
        self.url, self.max_tokens, self.prompt = url, max_tokens, prompt
        self.outcomes: list[Outcome] = []
        self._current: dict[int, Outcome] = {}  # each client's request in progress
        self._stop = threading.Event()
        self._round = threading.Barrier(clients) if lockstep else None
        self._threads = [threading.Thread(target=self._client, args=(c,), daemon=True)
                         for c in range(clients)]  # fmt: skip

    def __enter__(self) -> "StreamLoad":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        if self._round is not None:
            self._round.abort()  # the clients waiting for a round leave
        for t in self._threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in self._threads), "a client hung"

    def ok(self, since: float = 0.0) -> list[Outcome]:
        return [o for o in self.outcomes if o.status == 200 and not o.error and o.start >= since]

    def failed(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status != 200 or o.error]

    def streaming(self) -> list[Outcome]:
        """The requests past their first chunk and not ended yet, at this moment."""
        return [o for o in list(self._current.values()) if o.first is not None and not o.end]

    def _client(self, c: int) -> None:
        i = 0
        with httpx.Client(timeout=60) as http:
            while not self._stop.is_set():
                if self._round is not None:
                    try:
                        self._round.wait(timeout=120)  # a request that hung fails the test
                    except threading.BrokenBarrierError:
                        return
                self.outcomes.append(self._one(http, c, self.prompt(c, i)))
                if self.outcomes[-1].status == 503:
                    time.sleep(0.2)
                i += 1

    def _one(self, http: httpx.Client, c: int, prompt: str) -> Outcome:
        body = {"model": "qwen3", "prompt": prompt, "max_tokens": self.max_tokens,
                "temperature": 0, "stream": True}  # fmt: skip
        out = self._current[c] = Outcome(time.monotonic(), prompt)
        try:
            with http.stream("POST", f"{self.url}/completions", json=body) as resp:
                out.status = resp.status_code
                if resp.status_code != 200:
                    resp.read()
                    out.error = resp.json()["error"]["message"]
                    out.retry_after = resp.headers.get("retry-after")
                    return out
                for line in resp.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line.removeprefix("data: "))
                    if "error" in event:
                        out.error = event["error"]["message"]
                    else:
                        out.first = out.first or time.monotonic()
                        out.chunk()
                        out.text += event["choices"][0]["text"]
        except (httpx.HTTPError, ValueError, KeyError) as e:
            out.error = f"{type(e).__name__}: {e}"
        finally:
            out.end = time.monotonic()
        return out
