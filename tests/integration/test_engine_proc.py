"""The engine core in a background process behind ZMQ: the same results as in process, streaming
through AsyncLLM, aborts that free every block, and no hang when the core dies."""

import asyncio
import os
import signal
from pathlib import Path

import pytest

from baton import LLM, AsyncLLM, EngineArgs, RequestOutputKind, SamplingParams
from services.worker.engine.core_client import EngineDeadError

PROMPTS = ["Hi", "The quick brown fox jumps over the lazy dog", "def main():\n    return 0" * 4]
PARAMS = [
    SamplingParams(temperature=0, max_tokens=12, logprobs=2),
    SamplingParams(temperature=0.9, top_p=0.9, max_tokens=12, seed=5),
    SamplingParams(temperature=0.7, top_k=20, max_tokens=12, seed=9, n=2),
]


def summary(outs: list) -> list:  # type: ignore[type-arg]
    return [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in outs]


def logprob_values(outs: list) -> list[float]:  # type: ignore[type-arg]
    return [
        lp.logprob
        for o in outs
        for c in o.outputs
        for position in c.logprobs or []
        for lp in position.values()
    ]


def test_multiprocess_equals_inprocess(tiny_model: Path) -> None:
    inproc = LLM(model=str(tiny_model), show_progress=False, max_model_len=256)
    expected = inproc.generate(PROMPTS, PARAMS)
    with LLM(
        model=str(tiny_model), multiprocess=True, show_progress=False, max_model_len=256
    ) as mp:
        got = mp.generate(PROMPTS, PARAMS)
        assert summary(got) == summary(expected)
        # The core may start a step before every request has arrived over the socket, so the
        # batches differ and float rounding with them: logprobs agree closely, not bit for bit.
        got_lps, expected_lps = logprob_values(got), logprob_values(expected)
        assert len(got_lps) == len(expected_lps) > 0
        assert max(abs(a - b) for a, b in zip(got_lps, expected_lps, strict=True)) < 1e-5
        stats = mp.get_stats()
        assert stats.num_free_blocks == stats.num_blocks and stats.prompt_tokens > 0
        assert mp.reset_prefix_cache()


def test_core_survives_a_malformed_message(tiny_model: Path) -> None:
    with LLM(
        model=str(tiny_model), multiprocess=True, show_progress=False, max_model_len=128
    ) as mp:
        mp.client.core.input.send(b"\x93not-a-valid-message")  # type: ignore[attr-defined]
        [out] = mp.generate("still alive", SamplingParams(temperature=0, max_tokens=3))
        assert len(out.outputs[0].token_ids) == 3


def test_dead_core_raises_instead_of_hanging(tiny_model: Path) -> None:
    mp = LLM(model=str(tiny_model), multiprocess=True, show_progress=False, max_model_len=128)
    os.kill(mp.client.core.proc.pid, signal.SIGKILL)  # type: ignore[attr-defined]
    mp.client.core.proc.wait(timeout=10)  # type: ignore[attr-defined]
    with pytest.raises(EngineDeadError):
        mp.generate("anyone there?", SamplingParams(max_tokens=3))
    mp.shutdown()


@pytest.fixture
async def engine(tiny_model: Path):  # type: ignore[no-untyped-def]
    eng = AsyncLLM.from_engine_args(EngineArgs(model=str(tiny_model), max_model_len=256))
    yield eng
    eng.shutdown()


async def test_async_stream_deltas_add_up_to_the_offline_result(
    engine: AsyncLLM, tiny_model: Path
) -> None:
    params = SamplingParams(temperature=0, max_tokens=20, output_kind=RequestOutputKind.DELTA)
    text, tokens, outputs = "", [], 0
    async for out in engine.generate(PROMPTS[1], params, "r1"):
        outputs += 1
        text += out.outputs[0].text
        tokens += out.outputs[0].token_ids
    offline = LLM(model=str(tiny_model), show_progress=False, max_model_len=256)
    expected = offline.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=20))[
        0
    ].outputs[0]
    assert tokens == expected.token_ids and text == expected.text
    assert outputs > 1  # it streamed


async def test_async_concurrent_requests_and_n(engine: AsyncLLM) -> None:
    async def run(i: int) -> list[int]:
        final = None
        params = SamplingParams(temperature=0.8, max_tokens=8, seed=i, n=2, ignore_eos=True)
        async for out in engine.generate(f"prompt {i}", params, f"c{i}"):
            final = out
        assert final is not None and final.finished and len(final.outputs) == 2
        return final.outputs[0].token_ids

    results = await asyncio.gather(*(run(i) for i in range(6)))
    assert all(len(r) == 8 for r in results)
    stats = await engine.get_stats()
    assert stats.num_free_blocks == stats.num_blocks


async def test_async_abort_and_early_exit_free_every_block(engine: AsyncLLM) -> None:
    initial = (await engine.get_stats()).num_free_blocks
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def consume_then_break() -> None:
        async for out in engine.generate("leave early " * 20, long, "early"):
            if len(out.outputs[0].token_ids) >= 3:
                break  # leaving the loop aborts the request

    async def aborted_by_id() -> None:
        with pytest.raises(asyncio.CancelledError):
            async for out in engine.generate("aborted " * 20, long, "abort-me"):
                if len(out.outputs[0].token_ids) >= 2:
                    await engine.abort("abort-me")

    await asyncio.gather(consume_then_break(), aborted_by_id())
    for _ in range(50):  # the core applies aborts between steps; bounded wait
        stats = await engine.get_stats()
        if stats.num_running == 0:
            break
        await asyncio.sleep(0.05)
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.num_free_blocks == initial


async def test_async_bad_input_is_a_value_error(engine: AsyncLLM) -> None:
    with pytest.raises(ValueError, match="context length"):
        async for _ in engine.generate({"prompt_token_ids": [3] * 300}, SamplingParams(), "bad"):
            pass


async def test_async_dead_core_fails_requests(engine: AsyncLLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
    with pytest.raises(EngineDeadError):
        async for _ in engine.generate("doomed " * 10, params, "doomed"):
            os.kill(engine.client.core.proc.pid, signal.SIGKILL)  # type: ignore[attr-defined]


async def test_idle_engine_answers_a_re_announce_at_once(engine: AsyncLLM) -> None:
    """The re-announcement of every cached block comes with the answer to the call, though the
    engine is idle (no step would carry it): a restarted scheduler or a recovered directory gets
    the picture back without traffic."""
    from shared.kv_events import AllBlocksCleared, BlockStored

    async for _ in engine.generate("a prompt long enough to fill two blocks " * 4,
                                   SamplingParams(max_tokens=2), "warm"):  # fmt: skip
        pass
    batches: list = []  # type: ignore[type-arg]
    engine.kv_event_listener = batches.append
    await asyncio.sleep(1.0)  # idle: nothing more comes by itself
    batches.clear()
    await engine.resync_kv_events()
    events = [e for b in batches for e in b.events]
    assert isinstance(events[0], AllBlocksCleared)
    stored = [h for e in events[1:] if isinstance(e, BlockStored) for h in e.block_hashes]
    assert len(stored) >= 2
