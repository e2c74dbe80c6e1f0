"""allowed_token_ids, bad_words and logit_bias through the offline ``LLM`` (vLLM's API) on the
tiny model, against the unconstrained greedy output as the oracle; and under async scheduling
(the GPU default, here on CPU), where a bad word's prefix may end with the token still in
flight: the outputs equal the one-step-at-a-time engine's."""

from collections.abc import Iterator
from pathlib import Path

import pytest

from baton import LLM, SamplingParams
from services.worker.engine.sample.constraints import tokenize_bad_words

PROMPTS = ["The quick brown fox", "def f(x):\n    return", "This module provides"]
GREEDY = {"temperature": 0, "max_tokens": 24, "ignore_eos": True}


def contains(seq: list[int], sub: list[int]) -> bool:
    return any(seq[i : i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


def first_bigram(ids: list[int]) -> tuple[int, list[int]]:
    """A pair of generated tokens (not at the start) and where it first occurs."""
    for k in range(2, len(ids) - 1):
        pair = ids[k : k + 2]
        if not contains(ids[: k + 1], pair):
            return k, pair
    raise AssertionError("no bigram to ban")


@pytest.fixture(scope="module")
def llm(tiny_model: Path) -> Iterator[LLM]:
    engine = LLM(model=str(tiny_model), show_progress=False, max_model_len=256)
    yield engine
    engine.shutdown()


def greedy(llm: LLM, prompt: str, **extra: object) -> list[int]:
    [out] = llm.generate(prompt, SamplingParams(**GREEDY, **extra))  # type: ignore[arg-type]
    return list(out.outputs[0].token_ids)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_allowed_token_ids_only(llm: LLM, prompt: str) -> None:
    free = greedy(llm, prompt)
    allowed = sorted(set(free[6:12]) - {free[0]})  # the free choice of the first token is out
    got = greedy(llm, prompt, allowed_token_ids=allowed)
    assert set(got) <= set(allowed) and got != free


@pytest.mark.parametrize("prompt", PROMPTS)
def test_bad_word_token_ids_are_never_generated(llm: LLM, prompt: str) -> None:
    free = greedy(llm, prompt)
    k, pair = first_bigram(free)
    got = greedy(llm, prompt, bad_words_token_ids=[pair])
    assert not contains(got, pair)
    assert got[: k + 1] == free[: k + 1] and got[k + 1] != free[k + 1]  # the same until the ban


@pytest.mark.parametrize("prompt", PROMPTS)
def test_logit_bias(llm: LLM, prompt: str) -> None:
    """-100 on each token of the free output bans it; +100 on one token makes it every token."""
    free = greedy(llm, prompt)
    banned = greedy(llm, prompt, logit_bias={t: -100.0 for t in set(free)})
    assert not set(banned) & set(free)
    assert greedy(llm, prompt, logit_bias={free[5]: 100.0}) == [free[5]] * len(free)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_bad_words_as_text(llm: LLM, prompt: str) -> None:
    """The input processor tokenizes them as vLLM does; none of those sequences appears."""
    free = greedy(llm, prompt)

    def sequences(word: str) -> list[list[int]]:
        return tokenize_bad_words(
            [word], lambda t: llm.tokenizer.encode(t, add_special_tokens=False)
        )

    # a word of the free output whose tokenization (with or without its space) occurs in it
    words = [llm.tokenizer.decode(free[k : k + 1]).strip() for k in range(1, len(free))]
    word = next(w for w in words if w and any(contains(free, s) for s in sequences(w)))
    got = greedy(llm, prompt, bad_words=[word])
    assert not any(contains(got, s) for s in sequences(word)) and got != free


def test_token_ids_outside_the_vocabulary_are_refused(llm: LLM) -> None:
    vocab = llm.config.model.arch.vocab_size
    for extra in ({"allowed_token_ids": [vocab]}, {"bad_words_token_ids": [[1, vocab]]},
                  {"stop_token_ids": [vocab]}, {"logit_bias": {vocab: 1.0}}):  # fmt: skip
        with pytest.raises(ValueError, match="outside the vocabulary"):
            greedy(llm, "hi", **extra)


def test_async_scheduling_equals_the_synchronous_engine(tiny_model: Path, llm: LLM) -> None:
    """Each bigram of the free output banned: under async scheduling the host checks the word's
    first token against a token still on the device."""
    frees = [greedy(llm, p) for p in PROMPTS]
    params = [SamplingParams(**GREEDY, bad_words_token_ids=[free[k : k + 2] for k in range(1, 8)])
              for free in frees]  # fmt: skip
    params += [SamplingParams(temperature=0.9, seed=5, max_tokens=16, bad_words=["the", " a"],
                              allowed_token_ids=sorted(set(frees[0] + frees[1])))]  # fmt: skip
    prompts = [*PROMPTS, PROMPTS[0]]
    outs = {}
    for mode in (False, True):
        engine = LLM(model=str(tiny_model), device="cpu", async_scheduling=mode,
                     max_model_len=256, show_progress=False)  # fmt: skip
        outs[mode] = [o.outputs[0].token_ids for o in engine.generate(prompts, params)]
        engine.shutdown()
    assert outs[True] == outs[False]
    for got, p in zip(outs[True], params, strict=True):
        assert not any(contains(list(got), w) for w in p.bad_words_token_ids if not p.bad_words)
