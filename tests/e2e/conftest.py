"""A real Baton cluster for end-to-end tests: ``baton serve``'s own launcher starts the global
scheduler, the workers and the gateway as processes (readiness by ready files and /ready,
never a sleep), and stops them after the tests."""

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import httpx
import pytest

from baton.launcher import Cluster, ClusterSpec
from baton.serving import serving
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


def list_workers(cluster: Cluster) -> list[scheduler_pb2.WorkerInfo]:
    with grpc.insecure_channel(cluster.ready["scheduler"]["address"]) as ch:
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
    with grpc.insecure_channel(cluster.ready[name]["address"]) as ch:
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
