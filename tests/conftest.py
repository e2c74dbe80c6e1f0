"""Shared fixtures: tiny Hugging Face checkpoints of every supported family, made once per run."""

import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors. The switch is read
# when a kernel is defined, so it must be set before any engine module imports Triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from baton.tiny_model import make_tiny_model

if TYPE_CHECKING:
    from tests.redis_server import RedisServer

# the shared helpers' asserts report as a test module's do (before anything imports them)
pytest.register_assert_rewrite("tests.helpers")

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The internal token every cluster a test starts shares (the launcher passes it on, as it
# would its own); the e2e helpers' channels carry it.
os.environ.setdefault("BATON_INTERNAL_TOKEN", secrets.token_urlsafe(24))
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

# name → make_tiny_model kwargs. Together they cover: untied + tied embeddings, q/k/v bias,
# q/k norm with an explicit head_dim, llama3 RoPE scaling, and a sharded checkpoint.
TINY_MODELS = {
    "llama": {"arch": "llama"},
    "llama3-tied": {"arch": "llama3", "tie_word_embeddings": True},
    "mistral": {"arch": "mistral"},
    "qwen2-sharded": {"arch": "qwen2", "num_shards": 3},
    "qwen3": {"arch": "qwen3"},
}


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-models")
    return {name: make_tiny_model(root / name, **kw) for name, kw in TINY_MODELS.items()}


# SmolLM2-135M-Instruct as GGUF (Q4_1): a trained model, put in place by `make install`
SMOLLM2 = Path(__file__).resolve().parents[1] / ".models" / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The trained model's file. Missing, the test fails (not skips): `make install` puts it
    there on every machine that runs the tests."""
    if not SMOLLM2.is_file():
        pytest.fail(f"{SMOLLM2} is missing: run `make install` (or `make {SMOLLM2.parent.name}/"
                    f"{SMOLLM2.name}`)", pytrace=False)  # fmt: skip
    return SMOLLM2


@pytest.fixture(scope="session")
def tiny_model(tiny_models: dict[str, Path]) -> Path:
    """The default checkpoint for tests that need any one model."""
    return tiny_models["qwen3"]


@pytest.fixture(autouse=True)
def _free_gpu_memory() -> object:
    """On a GPU, give each test's engines' memory back before the next test sizes its cache."""
    yield
    if torch.cuda.is_available():
        import gc

        gc.collect()
        torch.cuda.empty_cache()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run on the GPU machine with `make test-gpu`)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def redis_server() -> Iterator["RedisServer"]:
    """A real redis-server on a free port for the whole run (``make install`` installs it)."""
    from tests.redis_server import RedisServer

    server = RedisServer.start()
    try:
        yield server
    finally:
        server.stop()
