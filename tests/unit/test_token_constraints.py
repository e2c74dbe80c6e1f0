"""allowed_token_ids and bad_words (vLLM's semantics) from the request to the sampler: the
tokenization rule, the per-step bans, the masks on hand-made logits (also with a token still
in flight under async scheduling), their validation, and the worker's protobuf conversion."""

import pytest
import torch

from services.worker import convert
from services.worker.engine.params import SamplingParams
from services.worker.engine.sample.constraints import (
    RowBans,
    check_vocabulary,
    row_bad_word_bans,
    tokenize_bad_words,
)
from services.worker.engine.sample.sampler import Sampler
from services.worker.engine.worker.input_batch import (
    CachedRequestState,
    InFlightTokens,
    build_sampling_metadata,
)
from shared.protos.baton.v1 import common_pb2

VOCAB = 8
CPU = torch.device("cpu")


def state(
    prompt: list[int], output: tuple[int, ...] | list[int] = (), rid: str = "r", **params: object
) -> CachedRequestState:
    sp = SamplingParams(**params)  # type: ignore[arg-type]
    return CachedRequestState(rid, [*prompt, *output], len(prompt), sp, (0,), [], 0)


def sample(
    logits: torch.Tensor, states: list[CachedRequestState], in_flight: InFlightTokens | None = None
) -> list[int]:
    meta = build_sampling_metadata(states, VOCAB, CPU, in_flight)
    return Sampler()(logits.clone(), meta).sampled.tolist()


def ramp(rows: int = 1) -> torch.Tensor:
    """Logits whose greedy order is 7, 6, 5, …, 0 on every row."""
    return torch.arange(VOCAB, dtype=torch.float32).repeat(rows, 1)


# ---- allowed_token_ids ---------------------------------------------------------------------
def test_allowed_token_ids_limit_greedy_and_random_rows_and_no_other() -> None:
    states = [
        state([1], temperature=0, allowed_token_ids=[2, 4]),
        state([1], temperature=0),
        state([1], seed=3, allowed_token_ids=[0, 5]),
    ]
    for seed in range(30):
        states[2].params = states[2].params.clone(seed=seed)
        got = sample(ramp(3), states)
        assert got[0] == 4 and got[1] == 7 and got[2] in (0, 5)
    draws = {sample(torch.zeros(1, VOCAB), [state([1], seed=s, allowed_token_ids=[1, 6])])[0]
             for s in range(40)}  # fmt: skip
    assert draws == {1, 6}  # both drawn, nothing else


def test_allowed_token_ids_come_before_top_k_and_penalties() -> None:
    """The mask comes first (as in vLLM): top-k then keeps the best two allowed tokens."""
    draws = {
        sample(ramp(), [state([1], [4], temperature=2.0, top_k=2, seed=s, presence_penalty=2.0,
                              allowed_token_ids=[0, 3, 4])])[0]
        for s in range(40)
    }  # fmt: skip
    assert draws == {3, 4}


def test_unconstrained_batches_build_no_masks() -> None:
    meta = build_sampling_metadata([state([1]), state([2], temperature=0)], VOCAB, CPU)
    assert meta.allowed is None and meta.bad_words is None


# ---- bad_words: the per-row bans -----------------------------------------------------------
@pytest.mark.parametrize(
    ("words", "outputs", "pending", "want"),
    [
        ([[5]], [], False, RowBans([5], [])),  # one token: always banned
        ([[5]], [1], True, RowBans([5], [])),
        ([[2, 5]], [], False, RowBans([], [])),  # nothing generated yet: no prefix
        ([[2, 5]], [1, 2], False, RowBans([5], [])),
        ([[2, 5]], [2, 1], False, RowBans([], [])),
        ([[2, 5]], [], True, RowBans([], [(5, 2)])),  # hangs on the token in flight
        ([[2, 5]], [7], True, RowBans([], [(5, 2)])),
        ([[1, 2, 5]], [0, 1], True, RowBans([], [(5, 2)])),
        ([[1, 2, 5]], [0, 3], True, RowBans([], [])),  # the host already sees a mismatch
        ([[1, 2, 5]], [1], False, RowBans([], [])),
        ([[1, 2, 5]], [], True, RowBans([], [])),  # too short even with the token in flight
        ([[1, 2, 5], [2, 6], [7]], [1, 2], False, RowBans([5, 6, 7], [])),
    ],
)
def test_row_bad_word_bans(
    words: list[list[int]], outputs: list[int], pending: bool, want: RowBans
) -> None:
    assert row_bad_word_bans(words, outputs, pending) == want


def test_bad_words_mask_the_last_token_after_the_prefix() -> None:
    words = [[7], [2, 6]]
    assert sample(ramp(), [state([1], temperature=0, bad_words_token_ids=words)]) == [6]
    # the prompt does not count: only generated tokens make the prefix (vLLM)
    assert sample(ramp(), [state([2], temperature=0, bad_words_token_ids=words)]) == [6]
    assert sample(ramp(), [state([1], [2], temperature=0, bad_words_token_ids=words)]) == [5]
    assert sample(ramp(), [state([1], [2], temperature=0)]) == [7]  # another row: untouched


@pytest.mark.parametrize(
    ("prior", "in_flight", "want"),
    [([], 2, 6), ([], 1, 7), ([3], 4, 6), ([1], 4, 7), ([3], 2, 6)],
)
def test_bad_words_on_the_token_in_flight_are_decided_on_the_device(
    prior: list[int], in_flight: int, want: int
) -> None:
    """Async scheduling: the row's last token is still on the device when its next step's
    metadata is built; the ban holds exactly when that token completes the word's prefix
    (both words ban 7: two conditions on one token, either of which bans it)."""
    st = state([1], prior, rid="a", temperature=0, bad_words_token_ids=[[2, 7], [3, 4, 7]])
    st.num_pending = 1
    other = state([1], rid="b", temperature=0)
    flight = InFlightTokens(torch.tensor([5, in_flight]), {"b": 0, "a": 1})
    assert sample(ramp(2), [st, other], flight) == [want, 7]


def test_tokenize_bad_words_follows_vllms_rule() -> None:
    vocab = {"cat": [10], " cat": [11], "two words": [20, 21], " two words": [22, 21],
             "dog": [30], " dog": [30], "a b": [40, 41], " a b": [42, 43, 44]}  # fmt: skip

    def encode(text: str) -> list[int]:
        return vocab[text]

    # " cat" is another token: both; " two words" starts with another token: both; " dog"
    # starts with the same one: once; " a b" has another length: once
    assert tokenize_bad_words(["cat", "  two words", "dog", "a b"], encode) == [
        [10], [11], [20, 21], [22, 21], [30], [40, 41],
    ]  # fmt: skip
    with pytest.raises(ValueError, match="bad_words"):
        tokenize_bad_words(["x"], lambda _: [])


# ---- validation ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("allowed_token_ids", []),
        ("allowed_token_ids", [-1]),
        ("allowed_token_ids", [1.5]),
        ("bad_words", [" "]),
        ("bad_words", ["x" * 5000]),
        ("bad_words", ["w"] * 1025),
        ("bad_words_token_ids", [[]]),
        ("bad_words_token_ids", [[-3]]),
    ],
)
def test_bad_constraints_raise_value_error_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})  # type: ignore[arg-type]


def test_token_ids_outside_the_vocabulary_are_refused() -> None:
    check_vocabulary(SamplingParams(allowed_token_ids=[7], bad_words_token_ids=[[1, 7]]), VOCAB)
    for params, field in [
        (SamplingParams(allowed_token_ids=[1, 8]), "allowed_token_ids"),
        (SamplingParams(bad_words_token_ids=[[1, 9]]), "bad_words"),
        (SamplingParams(stop_token_ids=[8]), "stop_token_ids"),
    ]:
        with pytest.raises(ValueError, match=field):
            check_vocabulary(params, VOCAB)


def test_worker_conversion_carries_the_constraints() -> None:
    wire = common_pb2.SamplingParams(allowed_token_ids=[3, 4], bad_words=["cat", "a dog"])
    params = convert.sampling_params(wire)
    assert params.allowed_token_ids == [3, 4] and params.bad_words == ["cat", "a dog"]
    plain = convert.sampling_params(common_pb2.SamplingParams())
    assert plain.allowed_token_ids is None and plain.bad_words == []
    with pytest.raises(ValueError, match="bad_words"):
        convert.sampling_params(common_pb2.SamplingParams(bad_words=["w"] * 1025))
