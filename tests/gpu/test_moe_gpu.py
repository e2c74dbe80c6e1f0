"""Mixture-of-experts models on the GPU (the CPU suite is tests/integration/test_moe_models.py):
the experts through the fused Triton kernel (``ops/fused_moe.py``), captured in the decode
CUDA graphs and the piecewise graphs of prefill chunks; against eager execution and Hugging
Face on the CPU (float32); in bfloat16 close to float32; without a host sync in a step; FP8
experts against their dequantizing reference; two GPUs (each expert split, or half the experts
each) equal to one."""

import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from baton import LLM, SamplingParams
from baton.tiny_model import make_tiny_model
from tests.helpers import FP8_GREEDY, FP8_PROMPTS, check_against_fp8_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

ARCHS: dict[str, dict[str, Any]] = {
    "qwen3_moe": {"arch": "qwen3_moe", "num_layers": 3},  # layers 0, 2 MoE; 1 dense
    "mixtral": {"arch": "mixtral"},
}
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
    root = tmp_path_factory.mktemp("moe-gpu")
    return {name: make_tiny_model(root / name, **kw) for name, kw in ARCHS.items()}


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
    """The token count of every eager call of the fused MoE kernel."""
    from services.worker.engine.ops import fused_moe

    calls: list[int] = []
    kernel = fused_moe.fused_moe

    def counted(x: torch.Tensor, *args: Any, **kw: Any) -> torch.Tensor:
        calls.append(x.shape[0])
        return kernel(x, *args, **kw)

    monkeypatch.setattr(fused_moe, "fused_moe", counted)
    yield calls


@pytest.mark.parametrize("name", sorted(ARCHS))
def test_graphs_and_eager_equal_hugging_face(
    models: dict[str, Path], name: str, kernel_calls: list[int]
) -> None:
    want = hf_greedy(models[name])
    eager = LLM(model=str(models[name]), dtype="float32", enforce_eager=True, **KW)
    assert greedy(eager) == want
    assert kernel_calls and max(kernel_calls) > 1  # the experts ran in the kernel, batched
    eager.shutdown()
    graphs = LLM(model=str(models[name]), dtype="float32", **KW)
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
    # decode steps of several batch sizes replayed decode graphs (the experts' kernel captured
    # in them); prefill chunks (mixed with decode rows) replayed piecewise graphs
    assert len({n for n in replays if n > 0}) > 2 and any(n < 0 for n in replays)


def test_bfloat16_is_close_to_float32(models: dict[str, Path]) -> None:
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    path = str(models["qwen3_moe"])
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
    """Routing, the experts' alignment by expert and their GEMMs read nothing back to the host
    inside a step (CUDA's sync check raises on any such call)."""
    path = str(models["qwen3_moe"])
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


@pytest.mark.parametrize(
    "kw",
    [{"quantize": "fp8-channel"},
     {"quantize": "fp8-block", "hidden_size": 128, "moe_intermediate_size": 128, "num_heads": 8}],
    ids=["fp8-channel", "fp8-block"],
)  # fmt: skip
def test_fp8_experts_match_their_dequantizing_reference(
    tmp_path: Path, kw: dict[str, Any], kernel_calls: list[int]
) -> None:
    """As the dense FP8 layers on the GPU (tests/integration/test_fp8.py): the kernel rounds
    activations exactly as the reference does; a near-tie may flip, nine in ten are exact."""
    path = make_tiny_model(tmp_path / "fp8", arch="qwen3_moe", num_layers=3, **kw)
    llm = LLM(model=str(path), show_progress=False)
    try:
        outs = llm.generate(FP8_PROMPTS, FP8_GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    assert kernel_calls  # the FP8 experts ran in the fused kernel
    exact = check_against_fp8_reference(path, outs)
    assert exact >= 0.9 * len(FP8_PROMPTS) * (FP8_GREEDY.max_tokens or 0)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("ep", [False, True], ids=["tp-slices", "expert-parallel"])
def test_two_gpus_equal_hugging_face(models: dict[str, Path], ep: bool) -> None:
    path = models["qwen3_moe"]
    llm = LLM(model=str(path), dtype="float32", tensor_parallel_size=2,
              enable_expert_parallel=ep, **KW)  # fmt: skip
    try:
        assert greedy(llm) == hf_greedy(path)
    finally:
        llm.shutdown()
