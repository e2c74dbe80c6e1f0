"""The FlashAttention backend on the GPU (skipped without CUDA, or without FlashAttention-4 on
a Hopper GPU): greedy outputs equal to the Triton backend's through chunked prefill, prefix
hits and preemption (in bfloat16: up to a near-tie, see ``assert_same_greedy``), and a P/D
pair with a FlashAttention prefill engine and a Triton decode engine equal to a colocated
engine. The kernel against dense attention in float32, float16 and bfloat16 is
tests/unit/test_attention.py, which runs every backend (this one too, there)."""

from pathlib import Path

import pytest
import torch

from baton import LLM, SamplingParams
from baton.tiny_model import make_tiny_model
from services.worker.engine.attention.flash_attn_backend import available
from services.worker.engine.kv_transfer.params import KVTransferParams

NO_FA4 = "needs FlashAttention-4 on a Hopper GPU (pip install '.[flash-attn]')"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(torch.cuda.is_available() and not available(), reason=NO_FA4),
]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """head_dim 64 (FlashAttention's tiles), GQA 2:1, 2 layers, random weights."""
    return make_tiny_model(tmp_path_factory.mktemp("fa") / "m", "llama", hidden_size=512,
                           num_layers=2, num_heads=8, num_kv_heads=4,
                           max_position_embeddings=4096)  # fmt: skip


def prompts() -> list[list[int]]:
    shared = [(7 * i) % 900 + 3 for i in range(300)]  # a prefix several prompts share
    out = [shared + [(11 * i + k) % 900 + 3 for i in range(40 + 13 * k)] for k in range(6)]
    out += [[(5 * i + k) % 900 + 3 for i in range(700 + 50 * k)] for k in range(3)]
    return out


NEAR_TIE = 0.3  # nats between the top two choices: below it bf16 rounding may pick either


def greedy(llm: LLM, ids: list[list[int]], n: int = 24) -> list[tuple[list[int], list[float]]]:
    """Each prompt's greedy tokens, with the margin between its top two at every step."""
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
    result = []
    for o in outs:
        margins = []
        for lp in o.outputs[0].logprobs or []:
            top = sorted((x.logprob for x in lp.values()), reverse=True)
            margins.append(top[0] - top[1] if len(top) > 1 else float("inf"))
        result.append((o.outputs[0].token_ids, margins))
    return result


def assert_same_greedy(flash: list, triton: list) -> None:  # type: ignore[type-arg]
    """Token for token, except after a step where Triton's own choice was a near-tie: two bf16
    kernels that sum in different orders (their logprobs differ by ~0.003-0.06 here) may part
    there, and only there. Both kernels match dense float64 attention in
    tests/unit/test_attention.py; a wrong mask or a wrong page would part at a clear choice."""
    for (f_ids, _), (t_ids, t_margins) in zip(flash, triton, strict=True):
        first = next((i for i, (a, b) in enumerate(zip(f_ids, t_ids, strict=True)) if a != b),
                     None)  # fmt: skip
        if first is not None:
            assert first > 0 and t_margins[first] < NEAR_TIE, (first, t_margins[first])


def engine(model: Path, backend: str, **kw: object) -> LLM:
    args = {"max_model_len": 2048, "max_num_batched_tokens": 256, "num_kv_blocks": 512, **kw}
    return LLM(model=str(model), attention_backend=backend, show_progress=False, **args)  # type: ignore[arg-type]


def test_auto_picks_flash_attn_on_hopper(model: Path) -> None:
    llm = engine(model, "auto")
    assert llm.config.attention.backend == "flash_attn"
    llm.shutdown()


@pytest.mark.parametrize("kv", [{"block_size": 16}, {"block_size": 128, "num_kv_blocks": 64}],
                         ids=["page16", "page128"])  # fmt: skip
def test_greedy_equals_triton_with_chunks_prefix_hits_and_preemption(
    model: Path, kv: dict[str, int]
) -> None:
    ids = prompts()
    results = {}
    for backend in ("triton", "flash_attn"):
        llm = engine(model, backend, **kv)
        first = greedy(llm, ids)  # chunked (256-token budget), the shared prefix cached after one
        again = greedy(llm, ids[:3])  # whole-prompt prefix hits
        stats = llm.get_stats()
        assert stats.prefix_hit_tokens > 0
        results[backend] = first + again
        llm.shutdown()
    assert_same_greedy(results["flash_attn"], results["triton"])
    # preemption: a cache too small for the batch
    tight = {**kv, "num_kv_blocks": 40 if kv["block_size"] == 16 else 10, "max_model_len": 512}
    outs = {}
    for backend in ("triton", "flash_attn"):
        llm = engine(model, backend, **tight)
        outs[backend] = greedy(llm, ids[:6], n=48)
        assert llm.get_stats().num_preemptions > 0
        llm.shutdown()
    assert_same_greedy(outs["flash_attn"], outs["triton"])


def test_pd_with_a_flash_attn_prefill_and_a_triton_decode_equals_colocated(model: Path) -> None:
    ids = prompts()[6]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref = engine(model, "triton")
    (want,) = greedy(ref, [ids])
    ref.shutdown()
    pd = {"multiprocess": True, "kv_transfer": True}
    prefill, decode = engine(model, "flash_attn", **pd), engine(model, "triton", **pd)
    try:
        first = prefill.generate(
            [{"prompt_token_ids": ids, "kv_transfer": KVTransferParams(do_remote_decode=True)}],
            params.clone(max_tokens=1, min_tokens=0), use_tqdm=False,
        )[0]  # fmt: skip
        assert first.kv_handle is not None
        leg = KVTransferParams(remote=first.kv_handle, first_token_id=first.outputs[0].token_ids[0])
        rest = decode.generate([{"prompt_token_ids": ids, "kv_transfer": leg}], params,
                               use_tqdm=False)[0]  # fmt: skip
        got = first.outputs[0].token_ids + rest.outputs[0].token_ids
        assert len(got) == len(want[0])
        assert_same_greedy([(got, [])], [want])
        assert decode.get_stats().kv_pulls >= 1
    finally:
        prefill.shutdown()
        decode.shutdown()
