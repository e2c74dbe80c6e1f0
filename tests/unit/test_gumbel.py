"""The Gumbel-max sampler: the Triton kernel against its PyTorch reference (Triton's interpreter
on CPU), and both against the distribution they must draw from."""

import numpy as np
import pytest
import torch

from services.worker.engine.ops.gumbel import (
    greedy_argmax_triton,
    gumbel_argmax_reference,
    gumbel_argmax_triton,
    row_keys,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def keys_for(n: int, seed: int = 0) -> torch.Tensor:
    return torch.from_numpy(row_keys(np.full(n, seed), np.arange(n))).to(DEVICE)


@pytest.mark.parametrize(
    ("rows", "vocab", "slice_len"), [(6, 300, 64), (3, 1000, 1000), (2, 77, 16)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_kernel_equals_the_reference(
    rows: int, vocab: int, slice_len: int, dtype: torch.dtype
) -> None:
    torch.manual_seed(rows)
    x = (torch.randn(rows, vocab, device=DEVICE) * 3).to(dtype)
    inv_t = torch.tensor([0.0, 1.0, 0.5, 2.0, 0.0, 1.7][:rows], device=DEVICE)
    keys = keys_for(rows, seed=vocab)
    got = gumbel_argmax_triton(x, inv_t, keys, slice_len=slice_len)
    assert got.tolist() == gumbel_argmax_reference(x, inv_t, keys).tolist()
    greedy = (inv_t == 0).nonzero().flatten()
    assert got[greedy].tolist() == x.float().argmax(-1)[greedy].tolist()


def test_masked_columns_are_never_drawn_and_ties_take_the_first() -> None:
    x = torch.full((4, 50), float("-inf"), device=DEVICE)
    x[:, 7] = x[:, 31] = 0.0  # two equally likely tokens, the rest masked
    inv_t = torch.tensor([1.0, 1.0, 1.0, 0.0], device=DEVICE)
    got = gumbel_argmax_triton(x, inv_t, keys_for(4), slice_len=16).tolist()
    assert set(got[:3]) <= {7, 31} and got[3] == 7


def test_draws_follow_softmax_of_the_scaled_logits() -> None:
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1])
    n = 4000
    x = probs.log().repeat(n, 1) * 2.0  # at temperature 2 the draw is from `probs` again
    inv_t = torch.full((n,), 0.5)
    drawn = gumbel_argmax_reference(x, inv_t, torch.from_numpy(row_keys(np.arange(n), np.zeros(n))))
    freq = torch.bincount(drawn, minlength=4).float() / n
    assert torch.allclose(freq, probs, atol=0.025), freq


def test_keys_depend_on_seed_and_counter_only() -> None:
    a = row_keys(np.array([1, 1, 2, -5]), np.array([0, 1, 0, 3]))
    assert len(set(a.tolist())) == 4 and (a >= 0).all() and (a < 2**32).all()
    assert row_keys(np.array([-5]), np.array([3]))[0] == a[3]


@pytest.mark.parametrize(
    ("rows", "vocab", "slice_len"), [(1, 5000, 1024), (3, 1000, 128), (2, 77, 16), (4, 64, 64)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_greedy_kernel_is_argmax(rows: int, vocab: int, slice_len: int, dtype: torch.dtype) -> None:
    torch.manual_seed(vocab)
    x = (torch.randn(rows, vocab, device=DEVICE) * 3).to(dtype)
    x[0, :] = float("-inf")  # a row with nothing allowed takes column 0, as torch's
    first = (slice_len + 3) % (vocab - 4)  # past the first slice where there are two
    if rows > 1:  # equal best values in two slices, and twice in one: the first column
        x[1, :] = 0.0
        x[1, [vocab - 1, first, first + 2]] = 9.0
    if rows > 2:
        x[2, [5, 6]] = 100.0
    got = greedy_argmax_triton(x, slice_len)
    assert got.dtype == torch.int64
    assert got.tolist() == x.argmax(-1).tolist()
    if rows > 1:
        assert got[1].item() == first
