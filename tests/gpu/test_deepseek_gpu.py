"""DeepSeek-V2/V3 on the GPU (the CPU suite is tests/integration/test_deepseek.py): the absorbed
MLA decode through the Triton kernel (``ops/mla_decode.py``), captured in the decode CUDA
graphs; prefill chunks in piecewise CUDA graphs, the latent attention run between the pieces;
against eager execution and Hugging Face on the CPU (float32), in bfloat16 close to float32,
and under async scheduling without a host sync in a step."""

import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from baton import LLM, SamplingParams
from baton.tiny_model import make_tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

ARCHS = ("deepseek_v2", "deepseek_v3")
MAX_NEW = 24
_SHARED = [(7 * i) % 300 + 5 for i in range(37)]
# a long prompt (chunked at a budget of 64), two sharing a prefix, and short ones: decode
# batches of 1 to 10 rows replay several captured sizes
PROMPTS = [[(5 * i) % 250 + 3 for i in range(150)], [*_SHARED, 40, 41], [*_SHARED, 90]] + [
    [11 + i, 12 + 2 * i, 13] for i in range(7)
]
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
KW: dict[str, Any] = {"max_num_batched_tokens": 64, "max_num_seqs": 16, "show_progress": False}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("deepseek-gpu")
    return {arch: make_tiny_model(root / arch, arch=arch) for arch in ARCHS}


def hf_greedy(path: Path) -> list[list[int]]:
    model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    out = []
    for ids in PROMPTS:
        seq = model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False,
                             min_new_tokens=MAX_NEW)  # fmt: skip
        out.append(seq[0, len(ids) :].tolist())
    return out


def greedy(llm: LLM) -> list[list[int]]:
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.fixture
def kernel_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The batch size of every eager call of the MLA decode kernel."""
    from services.worker.engine.ops import mla_decode

    calls: list[int] = []
    kernel = mla_decode.mla_decode

    def counted(q_lat: torch.Tensor, *args: Any, **kw: Any) -> torch.Tensor:
        calls.append(q_lat.shape[0])
        return kernel(q_lat, *args, **kw)

    monkeypatch.setattr(mla_decode, "mla_decode", counted)
    yield calls


@pytest.mark.parametrize("arch", ARCHS)
def test_graphs_and_eager_equal_hugging_face(
    models: dict[str, Path], arch: str, kernel_calls: list[int]
) -> None:
    want = hf_greedy(models[arch])
    eager = LLM(model=str(models[arch]), dtype="float32", enforce_eager=True, **KW)
    assert greedy(eager) == want
    assert kernel_calls and max(kernel_calls) > 1  # the absorbed decode ran the kernel, batched
    eager.shutdown()
    graphs = LLM(model=str(models[arch]), dtype="float32", **KW)
    runner = graphs.client.core.executor.worker.runner  # type: ignore[attr-defined]
    assert runner.graphs is not None and runner.pieces is not None
    replays: list[int] = []
    replay, pieces = runner.graphs.run, runner.pieces.run

    def counted(inputs: Any, fill: Any = None) -> Any:
        replays.append(len(inputs.req_ids))
        return replay(inputs, fill)

    def split(inputs: Any, fill: Any = None) -> Any:
        replays.append(-inputs.num_tokens)
        return pieces(inputs, fill)

    runner.graphs.run, runner.pieces.run = counted, split
    assert greedy(graphs) == want
    graphs.shutdown()
    # decode steps of several batch sizes replayed decode graphs (the kernel captured in them);
    # prefill chunks (mixed with decode rows) ran split
    assert len({n for n in replays if n > 0}) > 2 and any(n < 0 for n in replays)


def test_bfloat16_is_close_to_float32(models: dict[str, Path]) -> None:
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    path = str(models["deepseek_v3"])
    bf16 = LLM(model=path, **KW)
    assert bf16.config.model.dtype == "bfloat16"
    low = bf16.generate(prompts, params, use_tqdm=False)
    bf16.shutdown()
    fp32 = LLM(model=path, dtype="float32", **KW)
    high = fp32.generate(prompts, params, use_tqdm=False)
    fp32.shutdown()
    for a, b in zip(low, high, strict=True):
        la, lb = a.outputs[0].logprobs, b.outputs[0].logprobs
        assert la is not None and lb is not None
        shared = set(la[0]) & set(lb[0])
        assert len(shared) >= 3
        assert all(abs(la[0][t].logprob - lb[0][t].logprob) < 0.1 for t in shared)


def test_async_scheduling_steps_never_sync(models: dict[str, Path]) -> None:
    """The latent cache's writes, the chunks' gathers and the absorbed decode read nothing
    back to the host inside a step (CUDA's sync check raises on any such call)."""
    path = str(models["deepseek_v3"])
    want = greedy(LLM(model=path, dtype="float32", async_scheduling=False, **KW))
    llm = LLM(model=path, dtype="float32", **KW)
    assert llm.config.scheduler.async_scheduling
    greedy(llm)  # warm: first-use allocations may sync
    with warnings.catch_warnings():  # "a prototype feature", says torch: we know
        warnings.simplefilter("ignore", UserWarning)
        torch.cuda.set_sync_debug_mode("error")
    try:
        got = greedy(llm)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert got == want
