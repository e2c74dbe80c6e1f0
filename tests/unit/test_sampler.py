"""The sampler on hand-made logits."""

import math

import pytest
import torch

from services.worker.engine.params import SamplingParams
from services.worker.engine.sample.sampler import Sampler, apply_penalties, apply_top_k_top_p
from services.worker.engine.worker.input_batch import CachedRequestState, build_sampling_metadata

VOCAB = 8


def state(prompt: list[int], output: list[int] = (), **params: object) -> CachedRequestState:  # type: ignore[assignment]
    sp = SamplingParams(**params)  # type: ignore[arg-type]
    return CachedRequestState("r", [*prompt, *output], len(prompt), sp, (0,), [], 0)


def sample(logits: torch.Tensor, states: list[CachedRequestState]) -> list[int]:
    meta = build_sampling_metadata(states, VOCAB, torch.device("cpu"))
    return Sampler()(logits.clone(), meta).sampled.tolist()


def logits_row(*values: float) -> torch.Tensor:
    return torch.tensor([list(values)], dtype=torch.float32)


def test_greedy_takes_the_argmax() -> None:
    logits = torch.randn(4, VOCAB)
    assert sample(logits, [state([1], temperature=0)] * 4) == logits.argmax(-1).tolist()


def test_top_k_1_is_greedy_even_at_high_temperature() -> None:
    logits = torch.randn(16, VOCAB)
    got = sample(logits, [state([1], temperature=5.0, top_k=1, seed=i) for i in range(16)])
    assert got == logits.argmax(-1).tolist()


def test_top_k_top_p_masks() -> None:
    logits = logits_row(0.0, 1.0, 2.0, 3.0)
    k2 = apply_top_k_top_p(logits, torch.tensor([2]), None)
    assert torch.isinf(k2[0, :2]).all() and torch.isfinite(k2[0, 2:]).all()
    # probabilities ≈ [.03, .09, .24, .64]: top_p 0.5 keeps only the best token
    p = apply_top_k_top_p(logits, None, torch.tensor([0.5]))
    assert torch.isfinite(p[0]).tolist() == [False, False, False, True]


def test_min_p_excludes_unlikely_tokens() -> None:
    logits = logits_row(5.0, 4.9, -5.0, -5.0, -5.0, -5.0, -5.0, -5.0)
    got = {sample(logits, [state([1], seed=i, min_p=0.5)])[0] for i in range(50)}
    assert got == {0, 1}


def test_seeded_sampling_does_not_depend_on_the_batch() -> None:
    torch.manual_seed(0)
    logits = torch.randn(1, VOCAB)
    alone = [sample(logits, [state([1], seed=42)])[0]]
    others = torch.randn(3, VOCAB)
    batch = torch.cat([others[:2], logits, others[2:]])
    mixed = sample(
        batch, [state([1]), state([1], temperature=0), state([1], seed=42), state([1], seed=7)]
    )
    assert mixed[2] == alone[0]
    # the same seed gives the same sequence of draws: token k's noise is keyed by (seed, k)
    wide = torch.zeros(1, VOCAB)

    def draws(seed: int) -> list[int]:
        return [sample(wide, [state([1], [5] * k, seed=seed)])[0] for k in range(12)]

    assert draws(3) == draws(3)
    assert len(set(draws(3))) > 2 and draws(3) != draws(4)


def test_penalties_follow_their_definitions() -> None:
    st = state([1], [2, 2, 3], repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=1.0)
    meta = build_sampling_metadata([st], VOCAB, torch.device("cpu"))
    assert meta.penalties is not None
    base = logits_row(1.0, 4.0, 4.0, -4.0, 4.0, 0.0, 0.0, 0.0)
    got = apply_penalties(base.clone(), meta.penalties)[0].tolist()
    assert got[0] == 1.0  # never seen
    assert got[1] == 2.0  # prompt token: repetition only (4 / 2)
    assert got[2] == 4.0 / 2 - 0.5 * 2 - 1.0  # output twice: rep, frequency × 2, presence
    assert got[3] == -4.0 * 2 - 0.5 - 1.0  # negative logits are multiplied
    assert got[4] == 4.0


def test_min_tokens_bans_eos_and_stop_ids() -> None:
    logits = logits_row(9.0, 8.0, 0.0, 0.0, 0.0, 7.0, 0.0, 0.0)  # eos (0) is the best
    assert sample(logits, [state([3], temperature=0, min_tokens=2, stop_token_ids=[1])]) == [5]
    assert sample(logits, [state([3], [4, 4], temperature=0, min_tokens=2)]) == [0]


def test_logprobs_are_of_the_raw_distribution_with_ranks() -> None:
    logits = logits_row(0.0, 2.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    st = state([1], temperature=0, logprobs=2, repetition_penalty=1.5)
    meta = build_sampling_metadata([st], VOCAB, torch.device("cpu"))
    out = Sampler()(logits.clone(), meta)
    raw = logits.log_softmax(-1)[0]
    assert out.top_ids is not None and out.top_ids[0].tolist() == [1, 2]
    assert out.top_logprobs is not None
    assert torch.allclose(out.top_logprobs[0], raw[[1, 2]])
    assert out.sampled_ranks is not None and out.sampled_logprobs is not None
    sampled = int(out.sampled[0])
    assert out.sampled_ranks[0] == 1 + int((raw > raw[sampled]).sum())
    assert math.isclose(float(out.sampled_logprobs[0]), float(raw[sampled]), rel_tol=1e-6)


def test_temperature_sampling_follows_the_distribution() -> None:
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1, 0, 0, 0, 0, 0]]) + 1e-12)
    draws = [sample(logits, [state([1], seed=i)])[0] for i in range(400)]
    share = draws.count(0) / len(draws)
    assert 0.6 < share < 0.8 and set(draws) <= {0, 1, 2}


def test_logit_bias_moves_the_draw_not_the_logprobs() -> None:
    """OpenAI's logit_bias: added to a row's logits before any draw (greedy or random); the
    logprobs stay those of the model's raw distribution, as vLLM reports them."""
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]] * 2)
    rows = [state([1], temperature=0, logit_bias={3: 100.0}), state([1], temperature=0)]
    assert sample(logits, rows) == [3, 0]  # each row its own biases
    assert sample(logits[:1], [state([1], temperature=0, logit_bias={0: -100.0})]) == [1]
    assert sample(logits[:1], [state([1], temperature=0, logit_bias={0: -0.5})]) == [0]
    meta = build_sampling_metadata(
        [state([1], temperature=0, logprobs=1, logit_bias={3: 100.0})], VOCAB, torch.device("cpu")
    )
    out = Sampler()(logits[:1].clone(), meta)
    raw = logits[0].log_softmax(-1)
    assert out.sampled.tolist() == [3]
    assert out.sampled_logprobs is not None and out.sampled_ranks is not None
    assert out.sampled_logprobs.tolist() == pytest.approx([raw[3].item()])
    assert out.sampled_ranks.tolist() == [4]  # its raw rank: three tokens above it
    # a random draw follows the biased distribution: +10 on a token the model gives e^-3 of
    # the best's weight makes it ~e^7 times the best's
    drawn = [sample(logits[:1], [state([1], seed=i, logit_bias={3: 10.0})])[0] for i in range(40)]
    assert drawn.count(3) >= 38


@pytest.mark.parametrize(
    "bad",
    [
        {"temperature": -1},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_k": -2},
        {"min_p": 2.0},
        {"prompt_logprobs": 21},
        {"logit_bias": {1: 100.5}},
        {"logit_bias": {-1: 1.0}},
        {"max_tokens": -5},
        {"n": 0},
        {"logprobs": 21},
        {"presence_penalty": 3.0},
        {"repetition_penalty": 0.0},
        {"min_tokens": 5, "max_tokens": 2},
        {"stop": [""]},
        {"temperature": "hot"},
        {"max_tokens": 2.5},
        {"seed": True},
    ],
)
def test_bad_params_raise_value_error_naming_the_field(bad: dict[str, object]) -> None:
    with pytest.raises(
        ValueError, match=next(iter(bad)) if "min_tokens" not in bad else "min_tokens"
    ):
        SamplingParams(**bad)  # type: ignore[arg-type]


def test_params_normalise() -> None:
    sp = SamplingParams(stop="###", top_k=-1)
    assert sp.stop == ["###"] and sp.top_k == 0
