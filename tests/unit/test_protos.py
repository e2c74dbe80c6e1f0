"""The committed gRPC stubs are what ``make protos`` generates from the .proto files now."""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_committed_stubs_are_fresh() -> None:
    spec = importlib.util.spec_from_file_location("generate", ROOT / "protos" / "generate.py")
    assert spec is not None and spec.loader is not None
    generate = importlib.util.module_from_spec(spec)
    sys.modules["generate"] = generate
    spec.loader.exec_module(generate)
    assert generate.stale_files() == [], "stale stubs: run `make protos` and commit the result"


def test_stubs_import_under_shared_protos() -> None:
    from shared.protos.baton.v1 import scheduler_pb2_grpc, worker_pb2

    assert worker_pb2.GenerateRequest(prompt_token_ids=[1, 2]).prompt_token_ids == [1, 2]
    assert hasattr(scheduler_pb2_grpc, "GlobalSchedulerStub")
