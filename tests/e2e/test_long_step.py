"""A worker busy in one long engine step stays in service: a real long prompt on CPU, one
prefill step of several seconds (several times the scheduler's heartbeat timeout), colocated
and disaggregated. Throughout, ``/ready`` stays 200 and the scheduler lists every worker; a
request sent meanwhile is served once the step ends (queued, not refused with a 503); no worker
is ever dropped; and the disaggregated request's KV is pulled, not recomputed."""

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from baton.launcher import Cluster
from baton.serving import serving
from baton.tiny_model import make_tiny_model
from tests.e2e.conftest import list_workers

HEARTBEAT_TIMEOUT_S = 1.5  # the global scheduler's default
PROMPT_TOKENS = 3000  # one prefill step of ~5 s on a 2-core CPU with the model below
FLAGS = ["--max-model-len", "4096", "--max-num-batched-tokens", "4096", "--num-kv-blocks", "512",
         "--max-num-seqs", "8", "--worker-metrics"]  # fmt: skip


@pytest.fixture(scope="module")
def slow_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Wide and deep enough that a 3,000-token prefill takes seconds on CPU."""
    return make_tiny_model(tmp_path_factory.mktemp("slow") / "slow", arch="qwen3",
                           hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=2,
                           max_position_embeddings=4096)  # fmt: skip


class Watch:
    """Polls the gateway's /ready and the scheduler's worker list until stopped."""

    def __init__(self, cluster: Cluster, workers: int):
        self.cluster, self.workers = cluster, workers
        self.polls = 0
        self.problems: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "Watch":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        assert self.cluster.url is not None
        ready = self.cluster.url.removesuffix("/v1") + "/ready"
        with httpx.Client(timeout=5) as http:
            while not self._stop.is_set():
                status = http.get(ready).status_code
                listed = len(list_workers(self.cluster))
                self.polls += 1
                if status != 200 or listed != self.workers:
                    self.problems.append(f"/ready {status}, {listed} workers listed")
                time.sleep(0.05)


def scheduler_events(cluster: Cluster) -> dict[str, float]:
    port = cluster.ready["scheduler"]["metrics_port"]
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    return {s.labels["event"]: s.value for f in text_string_to_metric_families(text)
            if f.name == "baton_scheduler_worker_events" for s in f.samples
            if s.name.endswith("_total")}  # fmt: skip


def worker_metric(cluster: Cluster, worker: str, name: str) -> float:
    port = cluster.ready[worker]["metrics_port"]
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name)  # fmt: skip


@pytest.fixture(params=["colocated", "disaggregated"], scope="module")
def topology(request: pytest.FixtureRequest, slow_model: Path) -> Iterator[tuple[Cluster, int]]:
    pools = ["--workers", "1"] if request.param == "colocated" else \
        ["--prefill-workers", "1", "--decode-workers", "1"]  # fmt: skip
    with serving("--model", str(slow_model), *pools, *FLAGS) as cluster:
        yield cluster, 1 if request.param == "colocated" else 2


def test_a_long_step_keeps_every_worker_in_service(topology: tuple[Cluster, int]) -> None:
    cluster, workers = topology
    assert cluster.url is not None
    long_body = {"model": "slow", "prompt": [10 + i % 500 for i in range(PROMPT_TOKENS)],
                 "max_tokens": 4, "temperature": 0}  # fmt: skip
    short: dict[str, object] = {}

    def send_short() -> None:
        time.sleep(1.0)  # inside the long step
        start = time.monotonic()
        resp = httpx.post(f"{cluster.url}/completions", timeout=120,
                          json={"model": "slow", "prompt": "hi", "max_tokens": 2})  # fmt: skip
        short.update(status=resp.status_code, body=resp.text, s=time.monotonic() - start)

    with Watch(cluster, workers) as watch:
        sender = threading.Thread(target=send_short)
        sender.start()
        start = time.monotonic()
        resp = httpx.post(f"{cluster.url}/completions", json=long_body, timeout=300)
        took = time.monotonic() - start
        sender.join(timeout=120)
        time.sleep(3 * HEARTBEAT_TIMEOUT_S)  # and the scheduler still has them after the step
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["prompt_tokens"] == PROMPT_TOKENS
    if took < 2 * HEARTBEAT_TIMEOUT_S:
        pytest.fail(f"the long request took {took:.1f} s: too short a step to test anything")
    assert short.get("status") == 200, short
    assert watch.polls > 10 and not watch.problems, watch.problems[:5]
    events = scheduler_events(cluster)
    assert events.get("expired", 0) == 0 and events.get("removed", 0) == 0, events
    if workers == 2:  # the decode worker pulled the prompt's KV (no failed pull, no recompute)
        assert worker_metric(cluster, "decode-0", "baton_worker_kv_pulls_total") >= 1
        assert worker_metric(cluster, "decode-0", "baton_worker_kv_pull_failures_total") == 0
