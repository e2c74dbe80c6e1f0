"""A real Baton cluster for end-to-end tests: ``baton serve``'s own launcher starts the global
scheduler, the workers and the gateway as processes (readiness by ready files and /health,
never a sleep), and stops them after the tests."""

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import pytest

from baton.cli import build_parser
from baton.launcher import Cluster, free_port
from baton.service_cli import engine_flags_argv
from shared.protos.baton.v1 import scheduler_pb2, scheduler_pb2_grpc

if TYPE_CHECKING:
    from baton import LLM

TEST_ENGINE_FLAGS = ["--num-kv-blocks", "512", "--max-num-seqs", "16", "--max-model-len", "1024"]


@contextlib.contextmanager
def running_cluster(model: Path, workers: int, *extra: str) -> Iterator[Cluster]:
    argv = ["serve", "--model", str(model), "--workers", str(workers), "--port", str(free_port()),
            *TEST_ENGINE_FLAGS, *extra]  # fmt: skip
    args = build_parser().parse_args(argv)
    cluster = Cluster(args, engine_flags_argv(args))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


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
