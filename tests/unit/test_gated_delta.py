"""Gated DeltaNet's ops (ops/gated_delta.py) over a variable-length batch of paged states: the
PyTorch path and the Triton kernels (the interpreter on CPU) against Hugging Face's Qwen3.5
reference run one sequence at a time, a sequence split over two calls against one call, and the
kernels (decode and chunked prefill, float32 and bfloat16 states) against the PyTorch path."""

import itertools
from typing import TypedDict

import pytest
import torch
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    causal_conv1d_fn,
    causal_conv1d_update,
    torch_recurrent_gated_delta_rule,
)

from services.worker.engine.ops.gated_delta import causal_conv1d, gated_delta_rule

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PATHS = {"torch": False, "triton": True}
K, D = 4, 40  # the convolution's taps and channels (D not a power of two: masked columns)
HK, HV, DK, DV = 2, 4, 16, 24  # dv not a power of two either
PAD = 3  # padding rows after the last sequence
F32 = (1e-4, 1e-4)  # (atol, rtol)
BF16 = (2e-2, 2e-2)
# stored inputs, exact; in bfloat16 within one unit in the last place: Triton's interpreter
# rounds float32 to bfloat16 toward zero (a GPU, and PyTorch, to nearest)
STORED = {torch.float32: (0.0, 0.0), torch.bfloat16: (0.0, 2**-7)}


class Routes(TypedDict):
    """The arguments that place a batch's sequences: rows and pages."""

    query_start_loc: torch.Tensor
    state_src: torch.Tensor
    state_dst: torch.Tensor
    has_state: torch.Tensor


def _close(got: torch.Tensor, want: torch.Tensor, tol: tuple[float, float]) -> None:
    torch.testing.assert_close(got.float(), want.float(), atol=tol[0], rtol=tol[1])


def _routes(lengths: list[int], has_dtype: torch.dtype = torch.bool) -> Routes:
    """query_start_loc and the pages of sequence i, by i % 4: fresh (its source page holds
    values it must not read) · continued into another page · in place · continued again.
    Sequence i's pages are 2i and 2i+1; page 2·len(lengths) belongs to nobody."""
    kinds = [(0, 1, False), (0, 1, True), (0, 0, True), (0, 1, True)]
    pattern = zip(range(len(lengths)), itertools.cycle(kinds))
    src, dst, has = zip(*[(2 * i + a, 2 * i + b, h) for i, (a, b, h) in pattern], strict=True)
    qsl = [0, *itertools.accumulate(lengths)]
    as_tensor = lambda v, dt: torch.tensor(v, dtype=dt, device=DEVICE)  # noqa: E731
    return Routes(
        query_start_loc=as_tensor(qsl, torch.int32),
        state_src=as_tensor(src, torch.int32),
        state_dst=as_tensor(dst, torch.int32),
        has_state=as_tensor(has, has_dtype),
    )


def _lists(r: Routes) -> list[list[int]]:
    """Bounds, sources, destinations and flags as Python lists."""
    fields = (r["query_start_loc"], r["state_src"], r["state_dst"], r["has_state"])
    return [f.tolist() for f in fields]


def _pages(shape: tuple[int, ...], n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(the whole cache, its pages): slot 1 of [n, 2, *shape], so that the pages' first
    dimension is strided and slot 0 shows any write outside them."""
    cache = (0.5 * torch.randn(n, 2, *shape, device=DEVICE)).to(dtype)
    return cache, cache[:, 1]


def _gdn_inputs(
    t: int, dtype: torch.dtype, dims: tuple[int, int, int, int] = (HK, HV, DK, DV)
) -> dict[str, torch.Tensor]:
    hk, hv, dk, dv = dims

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=DEVICE)

    return {
        "q": r(t, hk, dk).to(dtype),
        "k": r(t, hk, dk).to(dtype),
        "v": r(t, hv, dv).to(dtype),
        "g": -torch.nn.functional.softplus(r(t, hv) - 1.0),  # log-decays, float32
        "beta": torch.sigmoid(r(t, hv)).to(dtype),
    }


def _hf_conv(
    x: torch.Tensor, w: torch.Tensor, prev: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, Hugging Face's way: (y [L, D], the last K-1 inputs [D, K-1])."""
    xs = x.t()[None].float()
    if prev is None:
        zeros = torch.zeros(1, D, K - 1, device=DEVICE)
        last = torch.cat([zeros, xs], dim=2)[0, :, -(K - 1) :]
        return causal_conv1d_fn(xs, w.float(), activation="silu")[0].t(), last
    state = prev[None].float().clone()
    y = causal_conv1d_update(xs, state, w.float(), activation="silu")
    return y[0].t(), state[0]


def _hf_gdn(
    inputs: dict[str, torch.Tensor], prev: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, Hugging Face's token loop: (o [L, Hv, dv], the final state). q and k are
    repeated to the value heads first, as Hugging Face's layer does (some transformers
    versions' loop takes them so, others repeat them itself)."""
    r = inputs["v"].shape[1] // inputs["q"].shape[1]
    qk = {n: inputs[n].repeat_interleave(r, dim=1) for n in ("q", "k")}
    o, s = torch_recurrent_gated_delta_rule(
        *({**inputs, **qk}[n][None].float() for n in ("q", "k", "v", "g", "beta")),
        initial_state=None if prev is None else prev[None].float(),
        output_final_state=True, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    return o[0], s[0]


def _check_pages(cache: torch.Tensor, before: torch.Tensor, want: dict[int, torch.Tensor],
                 tol: tuple[float, float]) -> None:  # fmt: skip
    """Each destination page holds what ``want`` says; every other page and slot is as it was
    (sources read into other pages among them)."""
    for page in range(cache.shape[0]):
        if page in want:
            _close(cache[page, 1], want[page], tol)
        else:
            assert torch.equal(cache[page, 1], before[page, 1]), f"page {page} was written"
    assert torch.equal(cache[:, 0], before[:, 0]), "a write outside the pages"


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("path", sorted(PATHS))
def test_conv_equals_hugging_face(path: str, state_dtype: torch.dtype) -> None:
    """Fresh, continued (into another page, with fewer than K-1 tokens), in place, a single
    token; padding rows; has_state as int32."""
    torch.manual_seed(0)
    lengths = [7, 2, 9, 1]
    routes = _routes(lengths, has_dtype=torch.int32)
    x = torch.randn(sum(lengths) + PAD, D, device=DEVICE)
    weight = 0.5 * torch.randn(D, K, device=DEVICE)
    cache, conv_state = _pages((D, K - 1), 2 * len(lengths) + 1, state_dtype)
    before = cache.clone()
    y = causal_conv1d(x, weight, conv_state, **routes, use_kernel=PATHS[path])
    assert y.shape == x.shape and y.dtype == x.dtype
    want = {}
    bounds, src, dst, has = _lists(routes)
    for i in range(len(lengths)):
        rows = slice(bounds[i], bounds[i + 1])
        y_ref, last = _hf_conv(x[rows], weight, before[src[i], 1] if has[i] else None)
        _close(y[rows], y_ref, (1e-5, 1e-5))
        want[dst[i]] = last.to(state_dtype)
    _check_pages(cache, before, want, STORED[state_dtype])


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("path", sorted(PATHS))
def test_delta_rule_equals_hugging_face(path: str, state_dtype: torch.dtype) -> None:
    """The same kinds of sequences, two of them over more than one chunk of 64 tokens."""
    torch.manual_seed(1)
    lengths = [70, 2, 130, 1]
    routes = _routes(lengths)
    inputs = _gdn_inputs(sum(lengths) + PAD, torch.float32)
    cache, state = _pages((HV, DK, DV), 2 * len(lengths) + 1, state_dtype)
    before = cache.clone()
    o = gated_delta_rule(**inputs, state=state, **routes, max_query_len=max(lengths),
                         use_kernel=PATHS[path])  # fmt: skip
    assert o.shape == inputs["v"].shape and o.dtype == torch.float32
    want = {}
    bounds, src, dst, has = _lists(routes)
    for i in range(len(lengths)):
        rows = slice(bounds[i], bounds[i + 1])
        seq = {n: x[rows] for n, x in inputs.items()}
        o_ref, last = _hf_gdn(seq, before[src[i], 1] if has[i] else None)
        _close(o[rows], o_ref, F32)
        want[dst[i]] = last.to(state_dtype)
    _check_pages(cache, before, want, F32 if state_dtype == torch.float32 else BF16)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_a_sequence_split_over_two_calls_equals_one_call(path: str) -> None:
    """Both ops: 100 tokens at once, or 37 then 63 with the state carried through page 1."""
    torch.manual_seed(2)
    use_kernel, n, cut = PATHS[path], 100, 37
    x = torch.randn(n, D, device=DEVICE)
    weight = 0.5 * torch.randn(D, K, device=DEVICE)
    inputs = _gdn_inputs(n, torch.float32)

    def run(rows: slice, src: int, dst: int, has: bool) -> tuple[torch.Tensor, torch.Tensor]:
        i32 = lambda v: torch.tensor(v, dtype=torch.int32, device=DEVICE)  # noqa: E731
        tokens = rows.stop - rows.start
        has_state = torch.tensor([has], device=DEVICE)
        routes = Routes(query_start_loc=i32([0, tokens]), state_src=i32([src]),
                        state_dst=i32([dst]), has_state=has_state)  # fmt: skip
        y = causal_conv1d(x[rows], weight, conv_state, **routes, use_kernel=use_kernel)
        o = gated_delta_rule(**{k: v[rows] for k, v in inputs.items()}, state=state, **routes,
                             max_query_len=tokens, use_kernel=use_kernel)  # fmt: skip
        return y, o

    conv_state = torch.zeros(3, D, K - 1, device=DEVICE)
    state = torch.zeros(3, HV, DK, DV, device=DEVICE)
    y_one, o_one = run(slice(0, n), 0, 2, False)
    y_a, o_a = run(slice(0, cut), 0, 1, False)
    y_b, o_b = run(slice(cut, n), 1, 1, True)
    _close(torch.cat([y_a, y_b]), y_one, (1e-5, 1e-5))
    _close(torch.cat([o_a, o_b]), o_one, F32)
    _close(conv_state[1], conv_state[2], (0.0, 0.0))
    _close(state[1], state[2], F32)


CASES = {
    "decode": [1, 1, 1, 1, 1, 1],  # the recurrent kernel
    "prefill": [64, 150, 1, 37],  # the chunked kernels: a whole chunk, 2 and a part, under one
    # several chunks each, the last ones partial (one token in the second), the third in place
    "chunks": [150, 129, 200, 70],
    # a mixed step: prefill chunks, then decode rows that the recurrent kernel takes
    "mixed": [70, 3, 1, 1, 1],
}
DTYPES = {"float32": (torch.float32, F32), "bfloat16": (torch.bfloat16, BF16)}


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("case", sorted(CASES))
def test_kernels_equal_the_torch_path(case: str, dtype: str) -> None:
    """Activations and states in ``dtype`` (bfloat16 as on a GPU), padding rows."""
    torch.manual_seed(3)
    lengths = CASES[case]
    act, tol = DTYPES[dtype]
    routes = _routes(lengths)
    t = sum(lengths) + PAD
    x = torch.randn(t, D, device=DEVICE).to(act)
    weight = (0.5 * torch.randn(D, K, device=DEVICE)).to(act)
    inputs = _gdn_inputs(t, act)
    pages = 2 * len(lengths) + 1
    conv_cache, _ = _pages((D, K - 1), pages, act)
    gdn_cache, _ = _pages((HV, DK, DV), pages, act)
    decodes = 3 if case == "mixed" else 0  # (the trailing rows of one token)
    results = []
    for use_kernel in (False, True):
        conv, gdn = conv_cache.clone(), gdn_cache.clone()
        y = causal_conv1d(x, weight, conv[:, 1], **routes, use_kernel=use_kernel)
        o = gated_delta_rule(**inputs, state=gdn[:, 1], **routes, max_query_len=max(lengths),
                             use_kernel=use_kernel, num_decodes=decodes)  # fmt: skip
        results.append((y[: t - PAD], o[: t - PAD], conv, gdn))
    for got, want in zip(results[1], results[0], strict=True):
        _close(got, want, tol)


# dk 40 (three slices of 16, the last partial), dv 72 (three blocks of 32 columns); and the
# real models' heads of 128 (Qwen3.5's and Qwen3-Next's), in bfloat16 as they run
WIDE = {"40x72-float32": ((1, 2, 40, 72), "float32"),
        "40x72-bfloat16": ((1, 2, 40, 72), "bfloat16"),
        "128x128-bfloat16": ((1, 2, 128, 128), "bfloat16")}  # fmt: skip


@pytest.mark.parametrize("case", sorted(WIDE))
def test_chunked_kernels_over_wider_heads_equal_the_torch_path(case: str) -> None:
    """The chunked kernels' slices and blocks over wider heads; sequences of several chunks,
    the last ones partial, the third in place; a fresh source page filled with values it must
    not read."""
    torch.manual_seed(4)
    dims, dtype = WIDE[case]
    lengths = [150, 129, 200, 70]
    act, tol = DTYPES[dtype]
    routes = _routes(lengths)
    t = sum(lengths) + PAD
    inputs = _gdn_inputs(t, act, dims)
    cache, _ = _pages(dims[1:], 2 * len(lengths) + 1, act)
    results = []
    for use_kernel in (False, True):
        pages = cache.clone()
        o = gated_delta_rule(**inputs, state=pages[:, 1], **routes, max_query_len=max(lengths),
                             use_kernel=use_kernel)  # fmt: skip
        results.append((o[: t - PAD], pages))
    for got, want in zip(results[1], results[0], strict=True):
        _close(got, want, tol)
