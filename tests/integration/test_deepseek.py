"""DeepSeek-V2 and -V3 (multi-head latent attention, a mixture of experts beside shared experts,
the first layer dense) against Hugging Face ``transformers`` in float32: greedy tokens equal
token for token, with prefix caching (a prompt sharing a prefix that ends mid-block with an
earlier one, an exact repeat), chunked prefill, and the piecewise split forward; two
tensor-parallel ranks equal one; a disaggregated prefill → decode pair, the latent blocks pulled
over NIXL, equals a colocated engine (each rank of a two-rank decode engine pulls the whole
latent); an MLA engine refuses a dense engine as its KV peer.

The V3 checkpoint carries a multi-token-prediction layer past its decoder, as DeepSeek-V3's
does: the engine must skip it (Hugging Face ignores it too).
"""

from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoConfig

from baton import LLM, SamplingParams
from baton.tiny_model import make_tiny_model
from services.worker.engine.config import EngineArgs
from tests import helpers
from tests.helpers import add_draft_layer, disaggregated, refused_peer, wait_all_free

ARCHS = ("deepseek_v2", "deepseek_v3")
MAX_NEW = 16
LOGPROB_ATOL = 1e-4
_SHARED = [(7 * i) % 300 + 5 for i in range(37)]  # 2 blocks of 16 and 5 tokens into a third
PROMPTS = [
    [11, 12],  # shorter than a block
    [*_SHARED, 40, 41, 42, 43],
    [*_SHARED, 90, 91, 92],  # its hit: the 32 tokens of the shared prefix's whole blocks
    [(5 * i) % 250 + 3 for i in range(32)],  # two whole blocks ...
]
PROMPTS.append(PROMPTS[-1])  # ... again: a hit of one block (the last token is computed)
MODES: dict[str, dict[str, Any]] = {
    "default": {},
    "chunked-prefill": {"max_num_batched_tokens": 8, "max_num_seqs": 4},
    "no-prefix-cache": {"enable_prefix_caching": False},
}
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("deepseek")
    paths = {arch: make_tiny_model(root / arch, arch=arch) for arch in ARCHS}
    add_draft_layer(paths["deepseek_v3"], 2)  # (its multi-token-prediction module)
    return paths


@cache
def hf_greedy(path: str) -> list[list[int]]:
    return helpers.hf_greedy(Path(path), PROMPTS, MAX_NEW)


def _generate(llm: LLM) -> list[Any]:
    """The first two prompts, then the rest (their prefixes cached by then)."""
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    first = llm.generate(prompts[:2], GREEDY, use_tqdm=False)
    rest = llm.generate(prompts[2:4], GREEDY, use_tqdm=False)
    again = llm.generate(prompts[4:], GREEDY, use_tqdm=False)
    return [o.outputs[0] for o in first + rest + again]


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_hugging_face(models: dict[str, Path], arch: str, mode: str) -> None:
    want = hf_greedy(str(models[arch]))
    llm = LLM(model=str(models[arch]), show_progress=False, dtype="float32", **MODES[mode])
    try:
        got = [o.token_ids for o in _generate(llm)]
        stats = llm.get_stats()
    finally:
        llm.shutdown()
    assert got == want
    if mode != "no-prefix-cache":
        assert stats.prefix_hit_tokens == 32 + 16
    assert stats.num_free_blocks == stats.num_blocks


def test_piecewise_split_forward_matches_hugging_face(models: dict[str, Path]) -> None:
    """The forward a piecewise CUDA graph runner splits at each layer's attention call, run
    inline (CPU): the latent attention between the pieces, padding rows, mixed steps."""
    path = models["deepseek_v3"]
    llm = LLM(model=str(path), show_progress=False, dtype="float32",
              max_num_batched_tokens=24, max_num_seqs=4)  # fmt: skip
    try:
        runner = llm.client.core.executor.worker.runner  # type: ignore[attr-defined]
        runner.start_piecewise_graphs((8, 16, 24), capture=False)
        run, padded = runner.pieces.run, []

        def counted(inputs: Any, fill: Any = None) -> Any:
            hidden, rows = run(inputs, fill)
            padded.append(hidden.shape[0] > inputs.num_tokens)
            return hidden, rows

        runner.pieces.run = counted
        got = [o.token_ids for o in _generate(llm)]
    finally:
        llm.shutdown()
    assert got == hf_greedy(str(path))
    assert any(padded) and len(padded) > 10  # every step ran split, some padded


def test_the_latent_cache_is_one_vector_a_token_and_layer(models: dict[str, Path]) -> None:
    llm = LLM(model=str(models["deepseek_v2"]), show_progress=False, dtype="float32")
    try:
        info = llm.client.call_utility("get_model_info")
    finally:
        llm.shutdown()
    assert info.kv_bytes_per_token == 2 * (32 + 8) * 4  # layers × (latent + rotary key) × fp32


def test_an_fp8_latent_cache_is_refused(models: dict[str, Path]) -> None:
    args = EngineArgs(model=str(models["deepseek_v3"]), kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8' is not supported for Deepseek"):
        args.create_engine_config()


def test_an_fp8_block_checkpoint_in_deepseeks_format(tmp_path: Path) -> None:
    """DeepSeek-V3's own FP8 format: every projection of attention and the experts in 128×128
    blocks (``weight_scale_inv``; kv_a_proj_with_mqa's 40 rows a partial block), the router in
    float. Greedy, teacher-forced, against a plain-PyTorch model that dequantizes the same
    weights and rounds each linear input as the engine does (``baton/tiny_fp8.py``): every
    token exact. The latent enters kv_b_proj unrounded in prefill as in decode, which
    absorbs it; rounding it in prefill only made the first decoded token differ by 0.39 nats."""
    from tests.helpers import FP8_GREEDY, FP8_PROMPTS, check_against_fp8_reference

    path = make_tiny_model(tmp_path / "ds3-fp8", arch="deepseek_v3", quantize="fp8-block",
                           hidden_size=128, moe_intermediate_size=128, num_heads=8,
                           num_kv_heads=8)  # fmt: skip
    llm = LLM(model=str(path), dtype="float32", num_kv_blocks=64)
    try:
        outs = llm.generate(FP8_PROMPTS, FP8_GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    exact = check_against_fp8_reference(path, outs)
    assert exact == len(FP8_PROMPTS) * (FP8_GREEDY.max_tokens or 0)


def _logprobs_close(got: list[Any], want: list[Any]) -> None:
    for a, b in zip(got, want, strict=True):
        assert a.token_ids == b.token_ids
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert x.keys() == y.keys()
            assert all(abs(x[t].logprob - y[t].logprob) <= LOGPROB_ATOL for t in x)


@pytest.mark.parametrize(
    ("arch", "ep"), [("deepseek_v2", False), ("deepseek_v3", False), ("deepseek_v3", True)],
    ids=["deepseek_v2", "deepseek_v3", "deepseek_v3-expert-parallel"],
)  # fmt: skip
def test_tp2_equals_tp1(models: dict[str, Path], arch: str, ep: bool) -> None:
    """Heads split over two ranks (gloo on CPU), the latent cached whole by each; the experts
    split by their intermediate dimension, or (``ep``) whole, half of them on each rank, the
    shared experts still split; chunked prefill over cached prefixes."""
    mode = {"max_num_batched_tokens": 8, "max_num_seqs": 4}
    ref = LLM(model=str(models[arch]), show_progress=False, **mode)  # type: ignore[arg-type]
    try:
        want = _generate(ref)
    finally:
        ref.shutdown()
    llm = LLM(model=str(models[arch]), tensor_parallel_size=2, enable_expert_parallel=ep,
              show_progress=False, **mode)  # type: ignore[arg-type]  # fmt: skip
    try:
        got = _generate(llm)
        stats = llm.client.call_utility("get_stats")
    finally:
        llm.shutdown()
    _logprobs_close(got, want)
    assert stats.prefix_hit_tokens > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_a_prompts_tokens_spread_over_most_experts(models: dict[str, Path], arch: str) -> None:
    """The tiny routers (grouped top-k, V3's sigmoid scores with their correction bias) send a
    prompt's tokens to most routed experts of every MoE layer (the first is dense), not to a
    few: the parity and the expert-parallel split read most experts' weights."""
    config = AutoConfig.from_pretrained(models[arch])
    used = helpers.experts_chosen(models[arch], [(3 * i) % 280 + 4 for i in range(48)])
    moe = range(config.first_k_dense_replace, config.num_hidden_layers)
    assert sorted(used) == list(moe)
    assert all(len(chosen) >= 0.75 * config.n_routed_experts for chosen in used.values()), used


KW = {"num_kv_blocks": 64, "max_model_len": 256, "show_progress": False}
TEXT_IDS = [(3 * i) % 280 + 4 for i in range(70)]  # 4 whole blocks and 6 tokens


@pytest.fixture(scope="module")
def pd(models: dict[str, Path]) -> Iterator[tuple[LLM, LLM, LLM]]:
    """A colocated reference, a prefill and a decode engine of the V3 model (NIXL over UCX)."""
    path = str(models["deepseek_v3"])
    ref = LLM(model=path, **KW)  # type: ignore[arg-type]
    prefill = LLM(model=path, multiprocess=True, kv_transfer=True, **KW)  # type: ignore[arg-type]
    decode = LLM(model=path, multiprocess=True, kv_transfer=True, **KW)  # type: ignore[arg-type]
    yield ref, prefill, decode
    for e in (ref, prefill, decode):
        e.shutdown()


def test_disaggregated_equals_colocated(pd: tuple[LLM, LLM, LLM]) -> None:
    ref, prefill, decode = pd
    want = ref.generate([{"prompt_token_ids": TEXT_IDS}], GREEDY, use_tqdm=False)[0].outputs[0]
    first, rest = disaggregated(prefill, decode, TEXT_IDS, GREEDY)
    got = first.outputs[0].token_ids + rest.outputs[0].token_ids
    assert got == want.token_ids
    lps = (first.outputs[0].logprobs or []) + (rest.outputs[0].logprobs or [])
    for a, b in zip(lps, want.logprobs or [], strict=True):
        assert a.keys() == b.keys()
        assert all(abs(a[t].logprob - b[t].logprob) <= LOGPROB_ATOL for t in a)
    wait_all_free(prefill)
    stats = decode.get_stats()
    assert stats.kv_pulls == 1 and stats.kv_pull_failures == 0
    assert first.kv_handle is not None
    latent_block = 2 * 1 * 16 * (32 + 8) * 4  # layers × one part × tokens × (latent + k_pe) × fp32
    assert stats.kv_pull_bytes == len(first.kv_handle.block_ids) * latent_block


def test_a_decode_engine_of_two_ranks_pulls_the_whole_latent_to_each(
    models: dict[str, Path], pd: tuple[LLM, LLM, LLM]
) -> None:
    """Every rank caches the whole latent: each of two decode ranks reads every block from
    the one prefill rank."""
    ref, prefill, _ = pd
    decode = LLM(model=str(models["deepseek_v3"]), multiprocess=True, kv_transfer=True,
                 tensor_parallel_size=2, **KW)  # type: ignore[arg-type]  # fmt: skip
    try:
        want = ref.generate([{"prompt_token_ids": TEXT_IDS}], GREEDY, use_tqdm=False)
        first, rest = disaggregated(prefill, decode, TEXT_IDS, GREEDY)
        wait_all_free(prefill)  # both ranks' notices ended the lease
        stats = decode.get_stats()
    finally:
        decode.shutdown()
    assert first.outputs[0].token_ids + rest.outputs[0].token_ids == want[0].outputs[0].token_ids
    assert first.kv_handle is not None
    latent_block = 2 * 1 * 16 * (32 + 8) * 4
    assert stats.kv_pulls == 1 and stats.kv_pull_failures == 0
    assert stats.kv_pull_bytes == 2 * len(first.kv_handle.block_ids) * latent_block


def test_a_dense_engine_is_refused_as_a_kv_peer(
    models: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A decode leg whose KV handle names a dense (Llama) engine: the handshake refuses it,
    naming both caches' layouts, and nothing is read (the prompt is recomputed)."""
    dense = make_tiny_model(tmp_path / "llama", arch="llama")  # (the same tokenizer and vocab)
    refusal = refused_peer(dense, models["deepseek_v3"], TEXT_IDS, caplog, **KW)
    assert "'K|V 2x16, float32, 2 layers, blocks of 16" in refusal  # theirs
    assert "'latent 1x40, float32, 2 layers, blocks of 16" in refusal  # ours
