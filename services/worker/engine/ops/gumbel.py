"""Random sampling as one pass over the logits: the Gumbel-max trick with counter-based noise.

    token = argmax_i( logits_i / T  +  G_i ),   G_i = -log(E_i),  E_i ~ Exp(1)

draws token i with probability softmax(logits / T)_i — the same race as argmax(p_i / E_i), with
no softmax, no normalisation and no noise tensor in memory. The noise is a hash of (the row's
key, the column): ``row_keys`` derives a row's key from the request's seed and the index of the
token being sampled, so a seeded request draws the same tokens whatever batch it is in, on
whichever engine samples its next token (a prefill worker samples token 0, the decode worker
token 1, …: a disaggregated request samples exactly what a colocated one does), and needs no
generator state. A row with ``inv_temperature`` 0 is greedy: a plain argmax (first index on ties,
like ``torch.argmax``).

On a GPU a Triton kernel reads the logits once, in the model's dtype (each program takes a slice
of a row and keeps its best score and index; a small argmax over the slices ends it). Elsewhere
``gumbel_argmax_reference`` computes the same function with PyTorch ops, bit for bit but for the
last place of ``log``; tests hold the two together.
"""

import numpy as np
import torch
import triton
import triton.language as tl

from shared.sample_seed import GOLDEN

_M32 = 0xFFFFFFFF
_C1, _C2 = 0x7FEB352D, 0x846CA68B  # lowbias32 (C. Wellons): a bijective 32-bit mixer
_SERIES_BELOW = 2.0**-10  # -log(1 - v) by its series below this: v is exact, 1 - v is not
SLICE = 8192  # logits per program on the GPU
# ... for greedy rows: a batch-1 row of a 128k vocabulary in 126 programs. On an H200 over it
# torch.argmax took 26.3 us, this 2.9; at 16 rows 26.9 against 5.0, at 256 45.8 against 35.9
# (bf16; docs/performance.md, "Greedy argmax (H200)")
GREEDY_SLICE = 1024


def row_keys(seeds: np.ndarray, counters: np.ndarray) -> np.ndarray:
    """32-bit keys (int64) from 64-bit seeds and per-request token counters (splitmix64: the
    key of ``seed + counter·GOLDEN``, which lets a resumed request continue its sequence,
    ``shared/sample_seed.py``)."""
    with np.errstate(over="ignore"):
        z = seeds.astype(np.uint64) + counters.astype(np.uint64) * np.uint64(GOLDEN)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(32)).astype(np.int64)


def gumbel_argmax(
    x: torch.Tensor, inv_temperature: torch.Tensor, keys: torch.Tensor
) -> torch.Tensor:
    """Sampled column per row of ``x`` [rows, vocab] (any float dtype); int64 [rows]."""
    if not x.is_cuda:
        return gumbel_argmax_reference(x, inv_temperature, keys)
    return gumbel_argmax_triton(x, inv_temperature, keys)


# ---- the reference (PyTorch ops; int64 holding uint32 values) ----------------------------
def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 without overflowing int64: c split into 16-bit halves."""
    hi, lo = c >> 16, c & 0xFFFF
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, _C1)
    x = x ^ (x >> 15)
    x = _mul32(x, _C2)
    return x ^ (x >> 16)


def _exponential(h: torch.Tensor) -> torch.Tensor:
    """Exp(1) from 32 random bits: -log(1 - v), v uniform in (0, 1)."""
    v = (h.to(torch.float32) + 0.5) * 2.0**-32
    series = v * (1.0 + v * (0.5 + v * (1.0 / 3.0)))
    return torch.where(v < _SERIES_BELOW, series, -torch.log(1.0 - v))


def gumbel_argmax_reference(
    x: torch.Tensor, inv_temperature: torch.Tensor, keys: torch.Tensor
) -> torch.Tensor:
    vocab = x.shape[1]
    cols = torch.arange(vocab, dtype=torch.int64, device=x.device)
    h = _mix32(_mix32(cols).unsqueeze(0) ^ keys.unsqueeze(1))
    t = inv_temperature.to(torch.float32).unsqueeze(1)
    score = x.to(torch.float32) * t - torch.log(_exponential(h))
    return torch.where(t > 0, score, x.to(torch.float32)).argmax(-1)


# ---- the kernel --------------------------------------------------------------------------
@triton.jit
def _mix32_tl(x):
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * tl.full([1], 0x846CA68B, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def _gumbel_argmax(
    X, stride_x, INV_T, KEYS, BEST_V, BEST_I, vocab, per_program,
    NUM_SLICES: tl.constexpr, BLOCK: tl.constexpr, GREEDY: tl.constexpr = False,
):  # fmt: skip
    """The best score and its column in slice ``part`` of row ``row``. GREEDY: every row's
    inverse temperature is 0 (INV_T and KEYS unread): the logits are the scores."""
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    start = part * per_program
    end = tl.minimum(start + per_program, vocab)
    best_v = -float("inf")
    best_i = start
    for off in range(start, end, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        ok = cols < end
        x = tl.load(X + row * stride_x + cols, mask=ok, other=-float("inf")).to(tl.float32)
        if GREEDY:
            score = x
        else:
            inv_t = tl.load(INV_T + row).to(tl.float32)
            key = tl.load(KEYS + row).to(tl.uint32)
            h = _mix32_tl(_mix32_tl(cols.to(tl.uint32)) ^ key)
            v = (h.to(tl.float32) + 0.5) * 2.3283064365386963e-10  # 2^-32
            series = v * (1.0 + v * (0.5 + v * (1.0 / 3.0)))
            e = tl.where(v < 0.0009765625, series, -tl.log(1.0 - v))
            noisy = x * inv_t - tl.log(e)
            score = tl.where(inv_t > 0, noisy, x)
        score = tl.where(ok, score, -float("inf"))
        v_max = tl.max(score, 0)
        i_max = tl.argmax(score, 0) + off
        take = v_max > best_v  # strictly: the earlier slice keeps ties
        best_i = tl.where(take, i_max, best_i)
        best_v = tl.where(take, v_max, best_v)
    tl.store(BEST_V + row * NUM_SLICES + part, best_v)
    tl.store(BEST_I + row * NUM_SLICES + part, best_i.to(tl.int64))


@triton.jit
def _best_slice(BEST_V, BEST_I, OUT, NUM_SLICES: tl.constexpr, BLOCK: tl.constexpr):
    """A row's column: that of its best slice (the first of equal ones, as the slices' own
    loops keep the first)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    v = tl.load(BEST_V + row * NUM_SLICES + offs, mask=offs < NUM_SLICES, other=-float("inf"))
    best = tl.argmax(v, 0, tie_break_left=True)
    tl.store(OUT + row, tl.load(BEST_I + row * NUM_SLICES + best))


def _argmax_slices(
    x: torch.Tensor, inv_temperature: torch.Tensor | None, keys: torch.Tensor | None,
    slice_len: int,
) -> torch.Tensor:  # fmt: skip
    rows, vocab = x.shape
    assert x.stride(1) == 1
    slices = triton.cdiv(vocab, slice_len)
    best_v = torch.empty(rows, slices, dtype=torch.float32, device=x.device)
    best_i = torch.empty(rows, slices, dtype=torch.int64, device=x.device)
    block = min(1024, triton.next_power_of_2(slice_len))
    greedy = inv_temperature is None
    _gumbel_argmax[(rows, slices)](
        x, x.stride(0), best_v if greedy else inv_temperature, best_i if greedy else keys,
        best_v, best_i, vocab, slice_len, NUM_SLICES=slices, BLOCK=block, GREEDY=greedy,
    )  # fmt: skip
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    _best_slice[(rows,)](best_v, best_i, out, NUM_SLICES=slices,
                         BLOCK=triton.next_power_of_2(slices))  # fmt: skip
    return out


def gumbel_argmax_triton(
    x: torch.Tensor, inv_temperature: torch.Tensor, keys: torch.Tensor, slice_len: int = SLICE
) -> torch.Tensor:
    return _argmax_slices(x, inv_temperature, keys, slice_len)


def greedy_argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)`` of [rows, vocab] logits, int64 [rows] (the first column of equal
    best ones); on a GPU in slices of GREEDY_SLICE, one pass over the logits: torch's
    reduction takes a batch-1 row of a large vocabulary on few SMs. One slice length at every
    batch size, so a model compiles one variant (at start-up: worker/model_runner.py)."""
    if not x.is_cuda or x.stride(1) != 1:
        return x.argmax(-1)
    return greedy_argmax_triton(x, GREEDY_SLICE)


def greedy_argmax_triton(x: torch.Tensor, slice_len: int) -> torch.Tensor:
    return _argmax_slices(x, None, None, slice_len)
