"""Random state across engines: requests without a seed draw differently in every engine (two
workers of one deployment never repeat each other), unless the engine itself was given a seed
(a reproducible run, as vLLM's ``LLM(seed=...)``); a request's own seed draws the same
everywhere, also when a request is resumed on another engine with its tokens so far."""

from collections.abc import Iterator
from pathlib import Path

import pytest

from baton import LLM, SamplingParams
from services.worker.engine.config import EngineArgs
from shared.sample_seed import continued_seed

KW = {"num_kv_blocks": 64, "max_model_len": 256, "show_progress": False}
PROMPT = "The quick brown fox"
UNSEEDED = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=11)


def tokens(llm: LLM, params: SamplingParams, prompt: str | list[int] = PROMPT) -> list[int]:
    source = {"prompt_token_ids": prompt} if isinstance(prompt, list) else prompt
    return llm.generate(source, params)[0].outputs[0].token_ids


@pytest.fixture(scope="module")
def two_engines(tiny_model: Path) -> Iterator[tuple[LLM, LLM]]:
    """Two engines started alike, without a seed: two fresh workers of one deployment."""
    engines = (LLM(model=str(tiny_model), **KW), LLM(model=str(tiny_model), **KW))
    yield engines
    for e in engines:
        e.shutdown()


def test_fresh_engines_draw_differently_for_unseeded_requests(two_engines: tuple[LLM, LLM]) -> None:
    a, b = two_engines
    first_a, first_b = tokens(a, UNSEEDED), tokens(b, UNSEEDED)  # each engine's first request
    assert first_a != first_b
    assert tokens(a, SEEDED) == tokens(b, SEEDED)  # a request's own seed: the same everywhere


def test_an_engine_seed_makes_unseeded_requests_reproducible(tiny_model: Path) -> None:
    runs = []
    for _ in range(2):
        llm = LLM(model=str(tiny_model), seed=5, **KW)
        runs.append([tokens(llm, UNSEEDED), tokens(llm, UNSEEDED)])
        llm.shutdown()
    assert runs[0] == runs[1]
    assert runs[0][0] != runs[0][1]  # yet one request to the next still differs


def test_engine_seed_resolves_once_per_engine(tiny_model: Path) -> None:
    """Without a seed, dummy weights stay those of seed 0 (every worker and rank alike) and
    only the draws get a random state of their own."""
    unseeded = [EngineArgs(model=str(tiny_model)).create_engine_config().model for _ in "ab"]
    assert [m.seed for m in unseeded] == [0, 0]
    assert unseeded[0].sampling_seed != unseeded[1].sampling_seed
    seeded = EngineArgs(model=str(tiny_model), seed=5).create_engine_config().model
    assert (seeded.seed, seeded.sampling_seed) == (5, 5)


@pytest.mark.parametrize("done", [1, 6])
def test_a_resumed_seeded_request_draws_what_it_would_have(
    two_engines: tuple[LLM, LLM], tiny_model: Path, done: int
) -> None:
    """The gateway resumes a request on another worker with prompt + tokens so far, where its
    token count starts again at 0; ``continued_seed`` keeps its draws (another engine, too)."""
    a, b = two_engines
    whole = a.generate(PROMPT, SEEDED)[0]
    prompt = whole.prompt_token_ids + whole.outputs[0].token_ids[:done]
    rest = SEEDED.clone(max_tokens=16 - done, seed=continued_seed(11, done))
    assert tokens(b, rest, prompt) == whole.outputs[0].token_ids[done:]
    assert len(set(whole.outputs[0].token_ids)) > 3  # really sampled
