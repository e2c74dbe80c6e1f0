"""Disaggregated prefill/decode inside the engine: a prefill engine runs the prompt and leases
its blocks, a decode engine pulls them over NIXL (UCX, DRAM on CPU) and continues from the
handed-over first token. Output must equal a colocated engine's, token for token."""

import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from baton import LLM, SamplingParams
from services.worker.engine.kv_transfer.params import KVTransferParams, RemoteKV
from services.worker.engine.messages import ErrorCode
from services.worker.engine.params import StructuredOutputParams
from shared.text.tokenizer import TextTokenizer
from tests.helpers import disaggregated, wait_all_free

KW = {"num_kv_blocks": 128, "max_model_len": 1024}


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async-scheduling"])
def engines(tiny_model: Path, request: pytest.FixtureRequest) -> Iterator[tuple[LLM, LLM, LLM]]:
    """A colocated reference, a prefill and a decode engine; the P/D pair once one step at a
    time and once with async scheduling (the GPU default), which must change nothing."""
    ref = LLM(model=str(tiny_model), **KW)
    pd = {"multiprocess": True, "kv_transfer": True, "async_scheduling": request.param, **KW}
    prefill = LLM(model=str(tiny_model), **pd)  # type: ignore[arg-type]
    decode = LLM(model=str(tiny_model), **pd)  # type: ignore[arg-type]
    yield ref, prefill, decode
    for e in (ref, prefill, decode):
        e.shutdown()


def prompt(tiny_model: Path, text: str) -> list[int]:
    return TextTokenizer(tiny_model).encode(text)


@pytest.mark.parametrize("text", ["short", "The quick brown fox jumps over the lazy dog " * 6])
def test_greedy_disaggregated_equals_colocated(engines, tiny_model: Path, text: str) -> None:  # type: ignore[no-untyped-def]
    ref, prefill, decode = engines
    ids = prompt(tiny_model, text)
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=2)
    want = ref.generate([{"prompt_token_ids": ids}], params)[0].outputs[0]
    first, rest = disaggregated(prefill, decode, ids, params)
    got = first.outputs[0].token_ids + rest.outputs[0].token_ids
    assert got == want.token_ids
    lps = (first.outputs[0].logprobs or []) + (rest.outputs[0].logprobs or [])
    for a, b in zip(lps, want.logprobs or [], strict=True):
        assert a.keys() == b.keys()
        for t in a:
            assert a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4)
    wait_all_free(prefill)  # the decode side's notification ended the lease
    assert prefill.get_stats().kv_leases_released >= 1
    stats = decode.get_stats()
    assert stats.kv_pulls >= 1 and stats.kv_pull_bytes > 0 and stats.kv_pull_failures == 0


def test_seeded_sampling_continues_exactly(engines, tiny_model: Path) -> None:  # type: ignore[no-untyped-def]
    ref, prefill, decode = engines
    ids = prompt(tiny_model, "Seeded sampling across two engines")
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=16, logprobs=1)
    want = ref.generate([{"prompt_token_ids": ids}], params)[0].outputs[0]
    first, rest = disaggregated(prefill, decode, ids, params)
    assert first.outputs[0].token_ids + rest.outputs[0].token_ids == want.token_ids
    got_lps = (first.outputs[0].logprobs or []) + (rest.outputs[0].logprobs or [])
    assert [next(iter(lp)) for lp in got_lps] == want.token_ids  # sampled token first
    assert len(set(want.token_ids)) > 3  # really sampled, not a degenerate repeat


@pytest.mark.parametrize("kind", ["regex", "json"])
def test_a_grammar_holds_across_the_hand_off(engines, tiny_model: Path, kind: str) -> None:  # type: ignore[no-untyped-def]
    """The prefill engine samples the first token under the grammar; the decode engine's
    matcher starts by accepting it: the output is the colocated engine's, and follows it."""
    ref, prefill, decode = engines
    ids = prompt(tiny_model, "A constrained answer across two engines")
    regex = r"[a-z]{2,9}@[a-z]{2,9}\.(com|org)"
    schema = '{"type": "object", "properties": {"k": {"enum": ["x", "y"]}}, "required": ["k"]}'
    spec = (
        StructuredOutputParams(regex=regex)
        if kind == "regex"
        else StructuredOutputParams(json=schema)
    )
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=40, logprobs=2,
                            structured_outputs=spec)  # fmt: skip
    want = ref.generate([{"prompt_token_ids": ids}], params)[0].outputs[0]
    first, rest = disaggregated(prefill, decode, ids, params)
    got = first.outputs[0].token_ids + rest.outputs[0].token_ids
    assert got == want.token_ids
    if kind == "regex":  # (the random model's JSON may fill its 40 tokens with whitespace)
        assert re.fullmatch(regex, TextTokenizer(tiny_model).decode(got))


def test_decode_reuses_its_own_prefix_blocks(engines, tiny_model: Path) -> None:  # type: ignore[no-untyped-def]
    ref, prefill, decode = engines
    ids = prompt(tiny_model, "A shared prefix that the decode engine already holds " * 4)
    decode.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1))  # warm it
    params = SamplingParams(temperature=0, max_tokens=8)
    want = ref.generate([{"prompt_token_ids": ids}], params)[0].outputs[0].token_ids
    first, rest = disaggregated(prefill, decode, ids, params)
    assert first.outputs[0].token_ids + rest.outputs[0].token_ids == want
    assert rest.num_cached_tokens >= (len(ids) - 1) // 16 * 16  # pulled only the rest


def test_a_pull_after_an_aborted_lease_still_ends(engines, tiny_model: Path) -> None:  # type: ignore[no-untyped-def]
    """The gateway ends a lease (Abort) when its client leaves, while the decode engine may
    already be reading. The prefill engine is idle then; without a progress thread (CPU) it
    must still progress its NIXL agent, or the READ waits for its next request (seen: the
    full 30 s transfer timeout, with the decode engine's blocks held all along)."""
    _, prefill, decode = engines
    ids = prompt(tiny_model, "the client left while its KV cache was moving " * 3)
    params = SamplingParams(temperature=0, max_tokens=4)
    first = prefill.generate(
        [{"prompt_token_ids": ids, "kv_transfer": KVTransferParams(do_remote_decode=True)}],
        params.clone(max_tokens=1),
    )[0]
    assert first.kv_handle is not None
    prefill.client.abort_requests([first.kv_handle.request_id])  # what the worker's Abort does
    wait_all_free(prefill)
    time.sleep(0.2)  # the prefill engine is idle now
    leg = KVTransferParams(remote=first.kv_handle, first_token_id=first.outputs[0].token_ids[0])
    start = time.monotonic()
    decode.generate([{"prompt_token_ids": ids, "kv_transfer": leg}], params)
    assert time.monotonic() - start < 5.0
    wait_all_free(decode)


def test_unpulled_lease_expires(tiny_model: Path, engines) -> None:  # type: ignore[no-untyped-def]
    """An unread lease frees its blocks; a decode leg that comes with its handle later fails
    without reading them (the prefill engine may have reused them: wrong text, silently): by
    default it recomputes the prompt and gives the colocated text; opted out, an error."""
    ref, _, decode = engines
    llm = LLM(
        model=str(tiny_model), multiprocess=True, kv_transfer=True, kv_lease_seconds=0.3, **KW
    )
    try:
        ids = prompt(tiny_model, "nobody pulls this " * 3)
        out = llm.generate(
            [{"prompt_token_ids": ids, "kv_transfer": KVTransferParams(do_remote_decode=True)}],
            SamplingParams(max_tokens=1),
        )[0]
        assert out.kv_handle is not None
        assert llm.get_stats().num_free_blocks < llm.get_stats().num_blocks  # leased
        assert 0.1 < wait_all_free(llm) < 3.0
        assert llm.get_stats().kv_leases_expired == 1
        leg = KVTransferParams(remote=out.kv_handle, first_token_id=out.outputs[0].token_ids[0])
        greedy = SamplingParams(temperature=0, max_tokens=4)
        first = out.outputs[0].token_ids[0]  # (sampled): the recompute goes on from it
        rest = ref.generate([{"prompt_token_ids": [*ids, first]}], greedy.clone(max_tokens=3))
        expected = rest[0].outputs[0].token_ids  # (the first token is the prefill leg's)
        strict = LLM(model=str(tiny_model), multiprocess=True, kv_transfer=True,
                     kv_recompute_on_failure=False, **KW)  # fmt: skip
        try:
            for engine, recompute in ((decode, True), (strict, False)):
                before = engine.get_stats()
                late = engine.generate([{"prompt_token_ids": ids, "kv_transfer": leg}], greedy)[0]
                if recompute:
                    assert late.outputs[0].token_ids == expected
                else:
                    assert late.outputs[0].finish_reason == "error"
                    assert "expired" in (late.error or "")
                    assert late.error_code == ErrorCode.KV_TRANSFER_FAILED
                after = engine.get_stats()
                assert after.kv_stale_handles == before.kv_stale_handles + 1
                assert after.kv_pulls == before.kv_pulls  # nothing was read
                wait_all_free(engine)
        finally:
            strict.shutdown()
    finally:
        llm.shutdown()


def test_failed_pull_is_an_error_or_a_recompute(tiny_model: Path) -> None:
    """(Its engines are its own: it runs once, not once per scheduling mode of ``engines``.)"""
    ref = LLM(model=str(tiny_model), show_progress=False, **KW)  # type: ignore[arg-type]
    ids = prompt(tiny_model, "the prefill side has gone away")
    bogus = RemoteKV("baton-gone", "tcp://127.0.0.1:9", list(range(-(-len(ids) // 16))), len(ids))
    params = SamplingParams(temperature=0, max_tokens=6)
    want = ref.generate([{"prompt_token_ids": ids}], params)[0].outputs[0].token_ids
    for recompute in (False, True):
        llm = LLM(model=str(tiny_model), multiprocess=True, kv_transfer=True,
                  kv_recompute_on_failure=recompute, **KW)  # fmt: skip
        try:
            res = llm.generate(
                [{"prompt_token_ids": ids,
                  "kv_transfer": KVTransferParams(remote=bogus, first_token_id=want[0])}],
                params,
            )[0]  # fmt: skip
            out = res.outputs[0]
            if recompute:
                assert [want[0], *out.token_ids] == want
            else:
                assert out.finish_reason == "error" and out.token_ids == []
                # the gateway's 502 comes from it
                assert res.error_code == ErrorCode.KV_TRANSFER_FAILED
            assert llm.get_stats().num_free_blocks == llm.get_stats().num_blocks
        finally:
            llm.shutdown()
    ref.shutdown()


def test_bad_handles_are_clear_errors(engines, tiny_model: Path) -> None:  # type: ignore[no-untyped-def]
    _, _, decode = engines
    ids = prompt(tiny_model, "mismatch")
    handle = RemoteKV("x", "tcp://127.0.0.1:9", [0, 1, 2], len(ids) + 5)
    leg = KVTransferParams(remote=handle, first_token_id=1)
    out = decode.generate(
        [{"prompt_token_ids": ids, "kv_transfer": leg}], SamplingParams(max_tokens=2)
    )[0]
    assert out.outputs[0].finish_reason == "error" and "covers" in (out.error or "")


def test_fake_connector_through_the_engine(tiny_model: Path) -> None:
    """The same P/D path with the in-process connector (``kv_connector="fake"``): the core
    reaches it only through its executor, and the output equals colocated."""
    ref = LLM(model=str(tiny_model), **KW)  # type: ignore[arg-type]
    pd = {"kv_transfer": True, "kv_connector": "fake", **KW}
    prefill = LLM(model=str(tiny_model), **pd)  # type: ignore[arg-type]
    decode = LLM(model=str(tiny_model), **pd)  # type: ignore[arg-type]
    try:
        ids = prompt(tiny_model, "The quick brown fox jumps over the lazy dog " * 3)
        params = SamplingParams(temperature=0, max_tokens=12)
        want = ref.generate([{"prompt_token_ids": ids}], params)[0].outputs[0].token_ids
        first, rest = disaggregated(prefill, decode, ids, params)
        assert first.outputs[0].token_ids + rest.outputs[0].token_ids == want
        stats = decode.get_stats()
        assert stats.kv_pulls == 1 and stats.kv_pull_bytes > 0 and stats.kv_pull_failures == 0
        prefill.generate([{"prompt_token_ids": ids[:5]}], params)  # a step polls the notice
        assert prefill.get_stats().kv_leases_released == 1
    finally:
        for e in (ref, prefill, decode):
            e.shutdown()
