"""P/D between engines of different tensor-parallel sizes, over NIXL (UCX, DRAM on CPU): each
decode rank pulls the KV heads it holds from the prefill rank(s) that hold them. The output
equals a colocated TP=1 engine's (greedy with logprobs within 1e-4, and seeded), the KV really
moved (no recompute), and the prefill engine's lease ends once every decode rank has read."""

import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from baton import LLM, SamplingParams
from services.worker.engine.kv_transfer.params import KVTransferParams
from shared.text.tokenizer import TextTokenizer
from tests.helpers import disaggregated, wait_all_free

KW = {"num_kv_blocks": 128, "max_model_len": 1024}
TEXT = "The quick brown fox jumps over the lazy dog " * 6


@pytest.fixture(scope="module")
def ref(tiny_model: Path) -> Iterator[LLM]:
    llm = LLM(model=str(tiny_model), show_progress=False, **KW)
    yield llm
    llm.shutdown()


@pytest.mark.parametrize(("p", "d"), [(1, 2), (2, 1), (2, 2)], ids=["1to2", "2to1", "2to2"])
def test_pd_across_tp_sizes_equals_colocated(ref: LLM, tiny_model: Path, p: int, d: int) -> None:
    pd = {"multiprocess": True, "kv_transfer": True, "show_progress": False, **KW}
    prefill = LLM(model=str(tiny_model), tensor_parallel_size=p, **pd)  # type: ignore[arg-type]
    decode = LLM(model=str(tiny_model), tensor_parallel_size=d, **pd)  # type: ignore[arg-type]
    try:
        greedy = SamplingParams(temperature=0, max_tokens=16, logprobs=2)
        seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=3, max_tokens=16)
        for i, params in enumerate((greedy, seeded)):
            text = TEXT if i == 0 else "Seeded, over a prompt of its own " * 5
            ids = TextTokenizer(tiny_model).encode(text)
            want = ref.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].outputs[0]
            first, rest = disaggregated(prefill, decode, ids, params)
            assert first.kv_handle is not None
            assert len(first.kv_handle.side_channel.split(",")) == p  # one address per rank
            assert first.outputs[0].token_ids + rest.outputs[0].token_ids == want.token_ids
            lps = (first.outputs[0].logprobs or []) + (rest.outputs[0].logprobs or [])
            for a, b in zip(lps, want.logprobs or [], strict=True):
                assert a.keys() == b.keys()
                for t in a:
                    assert a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4)
            wait_all_free(prefill)  # every decode rank's notice ended the lease
            if i == 0:
                stats, blocks = decode.get_stats(), len(first.kv_handle.block_ids)
        assert stats.kv_pull_failures == 0 and stats.kv_pulls == 1  # read, not recomputed
        assert decode.get_stats().kv_pulls == 2  # requests, whatever the ranks
        assert prefill.get_stats().kv_leases_released == 2
        arch = decode.config.model.arch
        rows = arch.num_layers * 2 * 16  # of a block: one descriptor each when p ≠ d
        runs = max(1, p // d)  # prefill ranks each decode rank reads from
        assert stats.kv_pull_descriptors == d * blocks * (1 if p == d else rows * runs)
        kv_bytes = arch.num_layers * 2 * 16 * arch.num_kv_heads * arch.head_dim * 4
        assert stats.kv_pull_bytes == blocks * kv_bytes  # every head once, whatever the split
        if p > 1:  # a handle naming the ranks out of order is refused at the handshake
            _misnamed_ranks_are_refused(prefill, decode, tiny_model)
    finally:
        for e in (prefill, decode):
            e.shutdown()


def _misnamed_ranks_are_refused(prefill: LLM, decode: LLM, tiny_model: Path) -> None:
    """Each prefill rank says which rank it is: side channels listed in the wrong order fail
    the pull (the prompt is recomputed instead), and soon."""
    ids = TextTokenizer(tiny_model).encode("misnamed " * 20)
    params = SamplingParams(temperature=0, max_tokens=4)
    first = prefill.generate(
        [{"prompt_token_ids": ids, "kv_transfer": KVTransferParams(do_remote_decode=True)}],
        params.clone(max_tokens=1), use_tqdm=False,
    )[0]  # fmt: skip
    assert first.kv_handle is not None
    swapped = ",".join(reversed(first.kv_handle.side_channel.split(",")))
    handle = msgspec.structs.replace(first.kv_handle, side_channel=swapped)
    leg = KVTransferParams(remote=handle, first_token_id=first.outputs[0].token_ids[0])
    before = decode.get_stats()
    start = time.monotonic()
    decode.generate([{"prompt_token_ids": ids, "kv_transfer": leg}], params, use_tqdm=False)
    assert time.monotonic() - start < 10
    after = decode.get_stats()
    assert after.kv_pulls == before.kv_pulls
    assert after.kv_pull_failures == before.kv_pull_failures + 1
