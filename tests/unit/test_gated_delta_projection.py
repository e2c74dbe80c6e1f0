"""Gated DeltaNet's input projections load every checkpoint spelling onto each rank's heads
(``GatedDeltaNetProjection``: Qwen3.5's q, k, v one after another and z, b, a apart;
Qwen3-Next's q ‖ k ‖ v ‖ z and b ‖ a by key head), and an FP8 checkpoint's scales follow
their rows: every row labelled by what it is, at head sizes that do not fall on 128-row
blocks, 1 to 3 value heads per key head, one and two ranks."""

import itertools

import pytest
import torch

from services.worker.engine.attention.torch_ref import TorchAttentionBackend
from services.worker.engine.distributed.parallel_state import GroupCoordinator, use_tp_group
from services.worker.engine.model_config import LinearAttentionConfig
from services.worker.engine.models.context import ModelContext
from services.worker.engine.models.layers.gated_delta_net import GatedDeltaNetProjection
from services.worker.engine.quantization.config import QuantConfig

HIDDEN = 256
Label = tuple[str, int, int]  # (part, head, row of the head)


def _rows(la: LinearAttentionConfig, part: str) -> list[Label]:
    heads, size = {"q": (la.num_key_heads, la.key_head_dim), "k": (la.num_key_heads,
                   la.key_head_dim), "v": (la.num_value_heads, la.value_head_dim),
                   "z": (la.num_value_heads, la.value_head_dim), "b": (la.num_value_heads, 1),
                   "a": (la.num_value_heads, 1)}[part]  # fmt: skip
    return [(part, h, i) for h in range(heads) for i in range(size)]


def _checkpoint(la: LinearAttentionConfig, spelling: str) -> list[Label]:
    """A checkpoint tensor's rows, in the order that spelling stores them."""
    if spelling in ("qkvz", "ba"):  # by key head: each head's parts, its r value heads'
        r = la.num_value_heads // la.num_key_heads
        per = {"q": la.key_head_dim, "k": la.key_head_dim, "v": r * la.value_head_dim,
               "z": r * la.value_head_dim, "b": r, "a": r}  # fmt: skip
        return [row for g in range(la.num_key_heads) for p in spelling
                for row in _rows(la, p)[g * per[p] : (g + 1) * per[p]]]  # fmt: skip
    return [row for p in spelling for row in _rows(la, p)]


def _mine(la: LinearAttentionConfig, parts: str, rank: int, tp: int) -> list[Label]:
    """This rank's rows of the layer: its heads of each part, part after part."""

    def share(part: str) -> list[Label]:
        rows = _rows(la, part)
        n = len(rows) // tp
        return rows[rank * n : (rank + 1) * n]

    return [row for p in parts for row in share(p)]


# a spelling's tensors: (the tensor's parts, its shard id in the packed-module table)
SPELLINGS = {
    "qkvz": {"Qwen3.5": [("qkv", "qkv"), ("z", 3)], "Qwen3-Next": [("qkvz", "qkvz")]},
    "ba": {"Qwen3.5": [("b", 0), ("a", 1)], "Qwen3-Next": [("ba", "ba")]},
}
SHAPES = [(hk, r, dk, dv) for hk, r, dk, dv in itertools.product((2, 4), (1, 3), (48, 64), (40,))]


@pytest.mark.parametrize(("hk", "r", "dk", "dv"), SHAPES)
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("fmt", ["bf16", "fp8-block", "fp8-channel"])
def test_each_rank_loads_its_heads_rows_and_their_scales(
    hk: int, r: int, dk: int, dv: int, tp: int, fmt: str
) -> None:
    la = LinearAttentionConfig(4, hk, hk * r, dk, dv)
    quant = {"bf16": None, "fp8-block": QuantConfig("block", "token_group"),
             "fp8-channel": QuantConfig("channel", "token")}[fmt]  # fmt: skip
    ctx = ModelContext.build(64, TorchAttentionBackend, quant=quant)
    for parts, family in itertools.product(("qkvz", "ba"), ("Qwen3.5", "Qwen3-Next")):
        for rank in range(tp):
            with use_tp_group(GroupCoordinator(rank, tp)):
                layer = GatedDeltaNetProjection(HIDDEN, la, parts, ctx)
            everything = sorted({row for p in "qkvzba" for row in _rows(la, p)})
            code = {row: n for n, row in enumerate(everything)}
            for spelling, shard in SPELLINGS[parts][family]:
                rows = _checkpoint(la, spelling)
                labels = torch.tensor([float(code[row]) for row in rows])
                quantized = parts == "qkvz" and quant is not None
                # the weight: each row its label (in FP8 rounded: there the scales tell)
                weight = labels[:, None].expand(-1, HIDDEN).contiguous()
                with use_tp_group(GroupCoordinator(rank, tp)):
                    layer.weight_loader(layer.weight, weight.to(layer.weight.dtype), shard)
                    if quantized:  # the scale: a block's (its first row's label), or a row's
                        b = 128
                        blocks = labels[::b] if fmt == "fp8-block" else labels
                        cols = -(-HIDDEN // b) if fmt == "fp8-block" else 1
                        scale = (blocks[:, None] + 1.0).expand(-1, cols).contiguous()
                        layer.weight_loader(layer.weight_scale, scale, shard)
            want = _mine(la, parts, rank, tp)
            if parts == "ba" or quant is None:  # (b and a: always in the model's dtype)
                got = [everything[int(v)] for v in layer.weight[:, 0].float().tolist()]
                assert got == want, (parts, family, rank)
            else:
                for spelling, _ in SPELLINGS[parts][family]:
                    order = _checkpoint(la, spelling)
                    where = {row: n for n, row in enumerate(order)}
                    for i, row in enumerate(want):
                        if row not in where:
                            continue
                        src = where[row] if fmt != "fp8-block" else where[row] // 128 * 128
                        expected = code[order[src]] + 1.0
                        assert float(layer.weight_scale[i, 0]) == expected, (family, row)
