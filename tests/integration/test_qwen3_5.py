"""Qwen3.5 (text), a Gated DeltaNet hybrid, against Hugging Face ``transformers`` in float32, on
a tiny checkpoint of four layers (three Gated DeltaNet layers, then a gated full-attention one
with a partial rotary; random norm weights): greedy tokens equal token for token and logprobs
within 1e-4, with whole prompts and chunked prefill, with prefix hits resumed from the
recurrent state's checkpoints (a prefix of 37 tokens that ends mid-block, of which the 32 of
its whole blocks hit; a repeated two-block prompt, of which one block hits; a prefix shared
with a prompt computed past it in one step, hit from its second sharer on); preempted and
recomputed; two tensor-parallel ranks; disaggregated, the decode engine pulling the full
group's blocks and each recurrent group's one page of the prompt's end state. A model whose
recurrent state is zeroed between steps gives other tokens, so the state really carries. The
published multimodal checkpoints' text model serves the same.
"""

from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from baton import LLM, SamplingParams
from baton.tiny_model import make_tiny_model
from services.worker.engine.kv_transfer.params import NO_BLOCK
from tests.helpers import (
    assert_matches_reference,
    disaggregated_equals_colocated,
    generate_in_three_batches,
    hf_continue,
    hf_greedy_with_rows,
)

MAX_NEW = 12
LOGPROB_ATOL = 1e-4
_SHARED = [(7 * i) % 300 + 5 for i in range(37)]  # 2 blocks of 16 and 5 tokens into a third
PROMPTS = [
    [11, 12, 13],
    [*_SHARED, 40, 41, 42, 43],  # computed to 32 (a checkpoint), then its tail
    [*_SHARED, 90, 91, 92],  # its hit: the 32 tokens of the shared prefix's whole blocks
    [(5 * i) % 250 + 3 for i in range(32)],  # two whole blocks: a checkpoint at 16 ...
]
PROMPTS.append(PROMPTS[-1])  # ... again: a hit of one block (the last token is computed)
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=2)
MODES: dict[str, dict[str, Any]] = {
    "default": {},
    "chunked-prefill": {"max_num_batched_tokens": 8, "max_num_seqs": 4},
}
# one page holds one layer's state: 3 × (2·32 + 64) conv values + 4 heads × 16 × 16
STATE_PAGE = 2 * 16 * 2 * 32 * 4  # K, V × tokens × KV heads × head dim × fp32 (one layer)


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("qwen3_5") / "m", arch="qwen3_5")


@cache
def hf_reference(path: str) -> tuple[list[list[int]], list[list[list[float]]]]:
    model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return hf_greedy_with_rows(model, PROMPTS, MAX_NEW)


def _run(path: Path, **kw: Any) -> tuple[list[Any], Any]:
    llm = LLM(model=str(path), show_progress=False, dtype="float32", **kw)
    try:
        outs = generate_in_three_batches(llm, PROMPTS, GREEDY)
        stats = llm.get_stats()
    finally:
        llm.shutdown()
    return outs, stats


def matches_hugging_face_with_hits(path: Path, mode: str) -> None:
    """``PROMPTS`` in ``mode``: tokens and logprobs Hugging Face's, 32 + 16 prompt tokens hit
    (the shared prefix's whole blocks, one block of the repeated prompt), every block freed.
    (Qwen3-Next's and Qwen3.5-MoE's tests run it too.)"""
    outs, stats = _run(path, **MODES[mode])
    assert_matches_reference(outs, *hf_reference(str(path)), LOGPROB_ATOL)
    assert stats.prefix_hit_tokens == 32 + 16
    assert stats.num_free_blocks == stats.num_blocks


@pytest.mark.parametrize("mode", sorted(MODES))
def test_greedy_matches_hugging_face(qwen3_5: Path, mode: str) -> None:
    matches_hugging_face_with_hits(qwen3_5, mode)


def test_a_shared_prefix_hits_from_its_second_sharer_on(qwen3_5: Path) -> None:
    """A 70-token prompt computed in one step (to 64, then its tail) leaves no state inside
    the 40 tokens it shares with the next two prompts: the first of them hits nothing but stops
    its first step at 32, where the shared whole blocks end; the second hits those 32. Each
    request alone, each equal to Hugging Face."""
    prefix = [(11 * i) % 280 + 7 for i in range(40)]
    prompts = [[*prefix, *range(100, 130)], [*prefix, *range(150, 160)], [*prefix, 200, 201]]
    model: Any = AutoModelForCausalLM.from_pretrained(qwen3_5, dtype=torch.float32)
    want = hf_greedy_with_rows(model, prompts, MAX_NEW)
    hits = []
    with LLM(model=str(qwen3_5), show_progress=False, dtype="float32") as llm:
        outs = []
        for p in prompts:
            before = llm.get_stats().prefix_hit_tokens
            outs += llm.generate([{"prompt_token_ids": p}], GREEDY, use_tqdm=False)
            hits.append(llm.get_stats().prefix_hit_tokens - before)
    assert hits == [0, 0, 32]
    assert_matches_reference([o.outputs[0] for o in outs], *want, LOGPROB_ATOL)


def test_preempted_requests_recompute_to_hugging_face(qwen3_5: Path) -> None:
    """Too few blocks for every request at once: some are preempted, freed, and resumed
    from their checkpoints (or from scratch) to the same tokens."""
    outs, stats = _run(
        qwen3_5, num_kv_blocks=14, max_model_len=64, max_num_batched_tokens=16, max_num_seqs=4
    )
    assert stats.num_preemptions > 0
    assert_matches_reference(outs, *hf_reference(str(qwen3_5)), LOGPROB_ATOL)


def test_the_state_carries_between_steps(qwen3_5: Path) -> None:
    """The recurrent state zeroed before every step (a decode step then sees only its own
    token) changes the tokens: the equal tokens above are the state's doing."""
    from services.worker.engine.models.layers import gated_delta_net

    pages = gated_delta_net.state_pages

    def forgetful(meta: Any, block_size: int) -> Any:
        src, dst, has = pages(meta, block_size)
        return src, dst, torch.zeros_like(has)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gated_delta_net, "state_pages", forgetful)
        outs, _ = _run(qwen3_5, enable_prefix_caching=False)
    want, _ = hf_reference(str(qwen3_5))
    assert all(o.token_ids[1:] != w[1:] for o, w in zip(outs, want, strict=True))


def test_two_ranks_equal_hugging_face(qwen3_5: Path) -> None:
    """Each rank one of the two key heads and two of the four value heads of every Gated
    DeltaNet layer (their convolution's channels, decays and state), one KV head and half the
    query heads of the attention; chunked prefill and prefix hits as above."""
    outs, stats = _run(qwen3_5, tensor_parallel_size=2, **MODES["chunked-prefill"])
    assert_matches_reference(outs, *hf_reference(str(qwen3_5)), LOGPROB_ATOL)
    assert stats.prefix_hit_tokens == 32 + 16


def test_the_engine_reports_its_groups(qwen3_5: Path) -> None:
    with LLM(model=str(qwen3_5), show_progress=False, dtype="float32", max_model_len=256) as llm:
        info = llm.client.core.executor.worker.runner.model_info()  # type: ignore[attr-defined]
    assert info.kv_cache_groups == "4 groups of 1 layers: full, recurrent, recurrent, recurrent"
    # at 256 tokens: the full layer's 16 blocks, and each recurrent layer's two pages (the one
    # a step reads, the one it writes)
    assert info.kv_request_bytes == (16 + 3 * 2) * STATE_PAGE
    assert info.kv_full_attention_request_bytes == 16 * 4 * STATE_PAGE  # every layer's K, V
    assert info.kv_bytes_per_token == STATE_PAGE // 16  # the one attention layer's
    assert info.recurrent_state_bytes == 3 * STATE_PAGE


def pulls_the_full_blocks_and_the_end_state(model: Path) -> Any:
    """Prefill and decode engines over NIXL (UCX) on a 70-token prompt: the handle lists the
    full group's five blocks and, of each recurrent group, only the page of the state after
    its last token; the decode engine decodes on to the colocated engine's tokens and
    logprobs. Returns the decode engine's stats. (Qwen3-Next's test runs it too.)"""
    ids = [(7 * i) % 390 + 5 for i in range(70)]
    kw: dict[str, Any] = {"num_kv_blocks": 64, "max_model_len": 256, "show_progress": False,
                          "dtype": "float32"}  # fmt: skip
    first, stats = disaggregated_equals_colocated(model, ids, LOGPROB_ATOL, **kw)
    handle = first.kv_handle
    assert handle is not None and handle.num_groups == 4
    full, *recurrent = handle.group_block_ids()
    assert NO_BLOCK not in full and len(full) == 5
    for pages in recurrent:
        assert pages[:4] == [NO_BLOCK] * 4 and pages[4] != NO_BLOCK
    assert stats.kv_pulls == 1 and stats.kv_pull_failures == 0
    return stats


def test_disaggregated_pulls_the_full_blocks_and_the_end_state(qwen3_5: Path) -> None:
    """The decode engine pulls eight pages: five blocks and three end states."""
    stats = pulls_the_full_blocks_and_the_end_state(qwen3_5)
    assert stats.kv_pull_bytes == 8 * STATE_PAGE


def test_every_forward_works_out_its_state_pages(qwen3_5: Path) -> None:
    """A decode graph is captured by forwards over one metadata object whose buffers every
    replay refills: each forward must work the state pages out from them (so that the capture
    records it), not keep the first forward's (the padding rows' pad page, no state)."""
    from services.worker.engine.worker.cuda_graphs import CudaGraphRunner

    with LLM(model=str(qwen3_5), show_progress=False, dtype="float32", num_kv_blocks=32,
             max_model_len=64) as llm:  # fmt: skip
        runner = llm.client.core.executor.worker.runner  # type: ignore[attr-defined]
        groups = runner.kv_groups.num_groups
        graphs = CudaGraphRunner(runner.model, (4,), 64, 16, pad_block=runner.pad_block,
                                 device=torch.device("cpu"), num_groups=groups)  # fmt: skip
        meta = graphs.capture_metadata(4, 64)
        graphs._forward(4, meta)  # as a warm-up: every row padding
        graphs.seq_lens[:2] = torch.tensor([21, 38])  # as a replay: two decode rows
        graphs.block_tables[:, 0, :2] = torch.tensor([5, 6])
        graphs.block_tables[:, 1, :3] = torch.tensor([7, 8, 9])
        graphs._forward(4, meta)
        pad = runner.pad_block
        for g in range(1, groups):  # the recurrent groups
            pages = meta.group(g).state_pages
            assert pages is not None
            src, dst, has = (t.tolist() for t in pages)
            assert (src, dst, has) == ([6, 9, pad, pad], [6, 9, pad, pad], [1, 1, 0, 0])


def test_the_multimodal_checkpoints_text_model(qwen3_5: Path, tmp_path: Path) -> None:
    """Qwen3.5 is published as ``Qwen3_5ForConditionalGeneration`` (a vision encoder beside
    the decoder, whose config is its ``text_config`` and whose weights are under
    ``model.language_model``; multi-token-prediction weights beside): the engine serves its
    text model, equal to Hugging Face's on text."""
    import shutil

    import transformers

    text: Any = AutoModelForCausalLM.from_pretrained(qwen3_5, dtype=torch.float32)
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
              "patch_size": 4, "out_hidden_size": text.config.hidden_size}  # fmt: skip
    config = transformers.Qwen3_5Config(text_config=text.config.to_dict(), vision_config=vision)
    full: Any = transformers.Qwen3_5ForConditionalGeneration(config)
    full.model.language_model.load_state_dict(text.model.state_dict())
    full.lm_head.load_state_dict(text.lm_head.state_dict())
    out = tmp_path / "vl"
    full.save_pretrained(out)
    from safetensors.torch import save_file  # (a draft layer's weights, as the real ones ship)

    save_file({"mtp.fc.weight": torch.zeros(2, 2)}, out / "mtp.safetensors")
    for f in qwen3_5.iterdir():  # the tokenizer's files
        if f.name.startswith(("tokenizer", "special_tokens", "generation")):
            shutil.copy(f, out / f.name)
    prompt = PROMPTS[1]
    want = hf_continue(full, torch.tensor([prompt]), MAX_NEW)[0, len(prompt) :].tolist()
    with LLM(model=str(out), show_progress=False, dtype="float32") as llm:
        assert llm.config.model.arch.architecture == "Qwen3_5ForConditionalGeneration"
        got = llm.generate([{"prompt_token_ids": prompt}], GREEDY)[0].outputs[0].token_ids
    assert got == want == hf_reference(str(qwen3_5))[0][1]
