"""The committed gRPC stubs are what ``make protos`` generates from the .proto files now."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_committed_stubs_are_fresh() -> None:
    """In an interpreter of its own: grpc_tools' protoc extension crashes on import in a process
    that already holds NIXL's UCX libraries (an in-process KV connector: test_deepseek.py's
    refused-peer test), a clash of native libraries that no service process has."""
    run = subprocess.run([sys.executable, str(ROOT / "protos" / "generate.py"), "--check"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)  # fmt: skip
    assert run.returncode == 0, f"stale stubs: run `make protos` and commit the result\n{run}"
    assert "up to date" in run.stdout


def test_stubs_import_under_shared_protos() -> None:
    from shared.protos.baton.v1 import scheduler_pb2_grpc, worker_pb2

    assert worker_pb2.GenerateRequest(prompt_token_ids=[1, 2]).prompt_token_ids == [1, 2]
    assert hasattr(scheduler_pb2_grpc, "GlobalSchedulerStub")
