"""Sliding-window attention and attention sinks (attention/backend.py's definitions).

The oracle is an explicit float64 loop over each query's window, itself checked against
Hugging Face's definitions (its sliding-window mask function and gpt-oss's eager attention).
The torch backend is checked against it on every case; the Triton kernels, in Triton's CPU
interpreter, on a few tiny float32 cases (slow there) that still reach every branch: a prefill
chunk whose window reaches into cached blocks, the window's masked edge, whole unmasked tiles
and the causal edge of one query tile, decode rows longer and shorter than the window, split
over the window with the sinks in the combine step. The cache has blocks of 16 tokens and
shuffled block tables; the heads are grouped (GQA).
"""

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from services.worker.engine.attention.backend import AttentionMetadata, LayerKVCache
from services.worker.engine.attention.registry import get_backend
from services.worker.engine.kv_cache.layout import KVCacheLayout, layer_views

BS = 16  # tokens per KV block


def reference(
    q: torch.Tensor,  # [n, Hq, D]: the last n positions of the context
    keys: torch.Tensor,  # [L, Hkv, D]
    values: torch.Tensor,
    scale: float,
    window: int | None,
    sinks: torch.Tensor | None,  # [Hq]
) -> torch.Tensor:
    """Each query at position p over the keys in (p - window, p], one at a time, float64; the
    sink as one more logit of the softmax, dropped before the values."""
    n, hq, _ = q.shape
    length, hkv, _ = keys.shape
    out = torch.empty(q.shape, dtype=torch.float64)
    for j in range(n):
        p = length - n + j
        lo = 0 if window is None else max(0, p - window + 1)
        for h in range(hq):
            k = keys[lo : p + 1, h * hkv // hq].double()
            v = values[lo : p + 1, h * hkv // hq].double()
            logits = k @ q[j, h].double() * scale
            if sinks is not None:
                logits = torch.cat([logits, sinks[h : h + 1].double()])
            probs = logits.softmax(0)[: p + 1 - lo]
            out[j, h] = probs @ v
    return out


def hf_mask(fn: Callable[..., Any], length: int) -> torch.Tensor:
    """A transformers mask function over every (query, key) pair: [length, length] bool."""
    return torch.as_tensor(fn(0, 0, torch.arange(length)[:, None], torch.arange(length)[None, :]))


@pytest.mark.parametrize("window", [1, 4, 7])
def test_the_window_is_hugging_faces(window: int) -> None:
    """(p - W, p]: W keys counting the query's own, as transformers' sliding-window mask."""
    from transformers.masking_utils import sliding_window_causal_mask_function

    length = 12
    hf = hf_mask(sliding_window_causal_mask_function(window), length)
    # the oracle's visible keys: a query over unit values at one key each reads them back
    eye = torch.eye(length)[:, None, :]  # key i's value: the i-th unit vector
    keys = torch.zeros(length, 1, length)
    q = torch.zeros(length, 1, length)
    seen = reference(q, keys, eye, 1.0, window, None)[:, 0] > 0  # uniform over its window
    assert torch.equal(seen, hf)
    assert hf.sum(1).tolist() == [min(p + 1, window) for p in range(length)]


class GptOssLayer(torch.nn.Module):
    """What gpt-oss's eager_attention_forward reads of its attention layer."""

    def __init__(self, sinks: torch.Tensor, groups: int) -> None:
        super().__init__()
        self.sinks = sinks
        self.num_key_value_groups = groups


@pytest.mark.parametrize("window", [None, 5])
def test_sinks_are_gpt_oss_eager_attention(window: int | None) -> None:
    from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    torch.manual_seed(0)
    hq, hkv, d, length = 4, 2, 8, 11
    q, k, v = torch.randn(length, hq, d), torch.randn(length, hkv, d), torch.randn(length, hkv, d)
    sinks = torch.randn(hq) * 2
    fn = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    bias = torch.zeros(length, length).masked_fill(~hf_mask(fn, length), -math.inf)
    q4, k4, v4 = (x.transpose(0, 1)[None].double() for x in (q, k, v))  # [1, heads, L, D]
    layer = GptOssLayer(sinks.double(), hq // hkv)
    hf, _ = eager_attention_forward(layer, q4, k4, v4, bias[None, None].double(), d**-0.5)
    ours = reference(q, k, v, d**-0.5, window, sinks)
    assert torch.allclose(hf[0], ours, atol=1e-12)
    assert not torch.allclose(ours, reference(q, k, v, d**-0.5, window, None), atol=1e-3)


@dataclass
class Case:
    q: torch.Tensor  # this step's queries [T, Hq, D]
    k: torch.Tensor  # ... keys and values [T, Hkv, D]
    v: torch.Tensor
    cache: LayerKVCache  # the prefix already written
    meta: AttentionMetadata
    contexts: list[tuple[torch.Tensor, torch.Tensor]]  # every request's whole keys, values

    def expected(self, window: int | None, sinks: torch.Tensor | None) -> torch.Tensor:
        qsl = self.meta.query_start_loc_cpu
        scale = self.q.shape[-1] ** -0.5
        parts = [reference(self.q[qsl[i] : qsl[i + 1]], keys, values, scale, window, sinks)
                 for i, (keys, values) in enumerate(self.contexts)]  # fmt: skip
        return torch.cat(parts)


def build(rows: list[tuple[int, int]], hq: int, hkv: int, d: int, seed: int = 0) -> Case:
    """rows: (cached tokens, new tokens) per request; garbage in every slot nothing wrote."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    layout = KVCacheLayout(2, hkv, d, BS, torch.float32)
    num_blocks = sum(-(-(c + n) // BS) for c, n in rows) + 2
    cache = layer_views(torch.randn(layout.shape(num_blocks)), 1)
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables, slots, contexts, qsl = [], [], [], [0]
    for cached, new in rows:
        length = cached + new
        table = [free.pop() for _ in range(-(-length // BS))]
        keys, values = torch.randn(length, hkv, d), torch.randn(length, hkv, d)
        for pos in range(length):
            slot = table[pos // BS] * BS + pos % BS
            if pos < cached:
                cache.key[slot // BS, slot % BS] = keys[pos]
                cache.value[slot // BS, slot % BS] = values[pos]
            else:
                slots.append(slot)
        tables.append(table)
        contexts.append((keys, values))
        qsl.append(qsl[-1] + new)
    width = max(map(len, tables))
    seq_lens = [c + n for c, n in rows]
    meta = AttentionMetadata(
        num_tokens=qsl[-1],
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
        max_query_len=max(n for _, n in rows),
        max_seq_len=max(seq_lens),
    )
    new_k = torch.cat([keys[c:] for (keys, _), (c, _) in zip(contexts, rows, strict=True)])
    new_v = torch.cat([values[c:] for (_, values), (c, _) in zip(contexts, rows, strict=True)])
    return Case(torch.randn(qsl[-1], hq, d), new_k, new_v, cache, meta, contexts)


CASES = {
    # prefill chunks: one whose window reaches back into cached blocks, one from scratch, one
    # that starts at a block boundary over a cached prefix
    "chunked": [(40, 9), (0, 23), (16, 17)],
    # decode rows, with contexts longer and shorter than the windows
    "decode": [(50, 1), (3, 1), (33, 1), (15, 1)],
    # a mixed step: prefill chunks, then the trailing decode rows
    "mixed": [(21, 12), (0, 5), (60, 1), (6, 1), (36, 1)],
}
HEADS = [(4, 2, 8), (6, 1, 16)]


def sinks_for(hq: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(hq, generator=torch.Generator().manual_seed(seed)) * 2 + 1


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("window", [4, 7, 16, None])
@pytest.mark.parametrize("with_sinks", [False, True], ids=["no-sinks", "sinks"])
@pytest.mark.parametrize(("hq", "hkv", "d"), HEADS)
def test_torch_backend_matches_the_reference(
    case: str, window: int | None, with_sinks: bool, hq: int, hkv: int, d: int
) -> None:
    c = build(CASES[case], hq, hkv, d)
    sinks = sinks_for(hq) if with_sinks else None
    impl = get_backend("torch")(hq, hkv, d, d**-0.5, sliding_window=window, sinks=sinks)
    out = impl.forward(c.q, c.k, c.v, c.cache, c.meta)
    expected = c.expected(window, sinks)
    assert torch.allclose(out.double(), expected, atol=1e-5, rtol=1e-5)
    if window is not None or with_sinks:  # what the test checks is not dense attention
        assert not torch.allclose(expected, c.expected(None, None), atol=1e-3)


def test_the_sinks_are_read_at_each_forward_not_copied() -> None:
    """A layer may build its backend before it loads its sinks parameter."""
    c = build(CASES["mixed"], 4, 2, 8)
    param = torch.nn.Parameter(torch.zeros(4), requires_grad=False)
    impl = get_backend("torch")(4, 2, 8, 8**-0.5, sliding_window=7, sinks=param)
    with torch.no_grad():
        param.copy_(sinks_for(4))
    out = impl.forward(c.q, c.k, c.v, c.cache, c.meta)
    assert torch.allclose(out.double(), c.expected(7, sinks_for(4)), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_window_under_one_or_misshapen_sinks_are_refused(backend: str) -> None:
    cls = get_backend(backend)
    with pytest.raises(ValueError, match="sliding_window must be at least 1"):
        cls(4, 2, 8, 1.0, sliding_window=0)
    with pytest.raises(ValueError, match=r"sinks must have shape \(4,\)"):
        cls(4, 2, 8, 1.0, sinks=torch.zeros(2))


# The Triton kernels in the interpreter: tiles of 16 queries and 16 keys there, decode split
# over more than 16 tokens (the fixture). Each case names what it reaches.
TRITON_CASES = {
    # W < the tile: masked on both edges; decode rows of one range, sinks folded in the kernel
    "w7-sinks-mixed": (7, True, CASES["mixed"]),
    # decode over a window of 20 split in two, the sinks in the combine step
    "w20-sinks-split-decode": (20, True, [(12, 5), (50, 1), (9, 1), (33, 1)]),
    # the sinks over whole contexts (split over up to 60 tokens)
    "sinks-only": (None, True, CASES["mixed"]),
    # W = 40 > the tile: keys before the window skipped, its left edge masked, whole tiles
    # unmasked, then the causal edge; a chunk over cached blocks
    "w40-long-prefill": (40, False, [(30, 40), (0, 70)]),
}


@pytest.fixture
def small_decode_splits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Split decode contexts of more than 16 tokens (on a GPU only thousands are split)."""
    from services.worker.engine.attention import triton_backend

    rule = triton_backend.num_decode_splits
    monkeypatch.setattr(triton_backend, "num_decode_splits",
                        lambda *a, **kw: rule(*a, **{**kw, "tokens_per_split": 8}))  # fmt: skip


@pytest.mark.usefixtures("small_decode_splits")
@pytest.mark.parametrize("name", sorted(TRITON_CASES))
def test_triton_matches_the_reference_in_the_interpreter(name: str) -> None:
    if torch.cuda.is_available():
        pytest.skip("the interpreter's case; tests/gpu/test_attention_window.py runs the GPU's")
    window, with_sinks, rows = TRITON_CASES[name]
    hq, hkv, d = 4, 2, 16
    c = build(rows, hq, hkv, d, seed=3)
    sinks = sinks_for(hq) if with_sinks else None
    impl = get_backend("triton")(hq, hkv, d, d**-0.5, sliding_window=window, sinks=sinks)
    out = impl.forward(c.q, c.k, c.v, c.cache, c.meta)
    assert torch.allclose(out.double(), c.expected(window, sinks), atol=1e-5, rtol=1e-5)
    blocks, offsets = c.meta.slot_mapping // BS, c.meta.slot_mapping % BS
    assert torch.equal(c.cache.key[blocks, offsets], c.k)


def test_a_windowed_decode_launch_follows_the_window_not_the_context() -> None:
    """A row reads at most W keys: the split count, the launch and so the CUDA graphs'
    context bounds follow min(context, W) (8 SMs on CPU, 8 kv heads, two waves)."""
    from services.worker.engine.attention.triton_backend import TritonAttentionBackend

    config = {"decode": {"head_dim_128": {"long_context": 4096, "waves": 2,
                                          "split_block_n": 128}}}  # fmt: skip
    cpu = torch.device("cpu")
    dense = TritonAttentionBackend(32, 8, 128, 128**-0.5)
    dense.use_config(config)
    assert dense.decode_graph_contexts(1, 131072, cpu) == (4096, 131072)
    short = TritonAttentionBackend(32, 8, 128, 128**-0.5, sliding_window=128)
    short.use_config(config)
    assert short.attended(131072) == 128 and short.attended(100) == 100
    assert short.decode_graph_contexts(1, 131072, cpu) == (131072,)  # never split
    wide = TritonAttentionBackend(32, 8, 128, 128**-0.5, sliding_window=8192)
    wide.use_config(config)
    assert wide.decode_graph_contexts(1, 131072, cpu) == (4096, 131072)
