"""Rotary position embedding (NeoX / Llama "rotate half" style) with the scaling types the
supported checkpoints use: default, linear, llama3 and yarn (DeepSeek-V2/V3, gpt-oss).
Computed in float32 like Hugging Face.
"""

import math

import torch
from torch import nn

from services.worker.engine.attention.backend import LayerKVCache, write_kv
from services.worker.engine.model_config import RopeConfig
from services.worker.engine.models.layers.norm import RMSNorm

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def _inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / (
        rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    )
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_scale(inv_freq, rope)
    if rope.rope_type == "yarn":
        return _yarn_inv_freq(rope, head_dim)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    """Llama 3.1: long wavelengths slow down by ``factor``, short ones stay, a smooth ramp between.

    wavelen:  short  | ramp between high_freq and low_freq wavelengths |  long
    scaling:  1      | interpolate(1, 1/factor)                        |  1/factor
    """
    if rope.original_max_position_embeddings is None:
        raise ValueError("llama3 rope scaling needs original_max_position_embeddings")
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_inv_freq(rope: RopeConfig, dim: int) -> torch.Tensor:
    """YaRN: the fast-turning dimensions keep their trained frequencies, the slow ones are
    interpolated (÷ ``factor``), a linear ramp between the dimensions that turn ``beta_fast``
    and ``beta_slow`` times over the original context (Hugging Face's arithmetic, step by step,
    so that the tables agree bit for bit).

        pair i:   0 ........ low | ramp | high ........ dim/2
        freq:     as trained     | blend | ÷ factor
    """
    if rope.original_max_position_embeddings is None:
        raise ValueError("yarn rope scaling needs original_max_position_embeddings")
    base, orig = rope.theta, rope.original_max_position_embeddings

    def pair(rotations: float) -> float:  # the dimension that turns ``rotations`` times
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low: float = pair(rope.beta_fast)
    high: float = pair(rope.beta_slow)
    if rope.truncate:  # (gpt-oss keeps the fractional ends)
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # (no zero-width ramp)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    interpolated, trained = 1.0 / (rope.factor * pos_freqs), 1.0 / pos_freqs
    keep = 1 - ramp  # each pair's share of its trained frequency
    return interpolated * (1 - keep) + trained * keep


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention correction for a context ``factor`` times the trained one."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rotary_scale(rope: RopeConfig) -> float:
    """What YaRN multiplies the cos/sin tables by (1 for every other type): DeepSeek's configs
    give ``mscale`` = ``mscale_all_dim``, which makes it 1 and moves the whole correction to
    the softmax scale (``models/layers/mla.py``)."""
    if rope.rope_type != "yarn":
        return 1.0
    if rope.attention_factor:  # (the config's own, as Hugging Face takes it first)
        return rope.attention_factor
    if rope.mscale and rope.mscale_all_dim:
        return yarn_mscale(rope.factor, rope.mscale) / yarn_mscale(rope.factor, rope.mscale_all_dim)
    return yarn_mscale(rope.factor)


class RotaryEmbedding(nn.Module):
    """Caches cos/sin for every position up to ``max_positions``; applied per token by position."""

    def __init__(
        self, head_dim: int, max_positions: int, rope: RopeConfig, fused: bool = False,
        rotary_dim: int | None = None, interleaved: bool = False,
    ):  # fmt: skip
        """``rotary_dim``: the rotary turns only each head's first ``rotary_dim`` dims (Qwen3.5's
        partial rotary; the rest pass as they are), its frequencies those of a head of that
        size; the fused kernel takes whole heads only. ``interleaved``: each head's pairs are
        adjacent (DeepSeek's checkpoints) and its rotation comes out in halves."""
        super().__init__()
        self.rotary_dim = rotary_dim if rotary_dim is not None else head_dim
        if fused and self.rotary_dim != head_dim:
            raise ValueError("the fused rotary kernel turns whole heads: no partial rotary")
        head_dim = self.rotary_dim
        self.fused = fused  # rotate q and k in place with one Triton kernel
        self.interleaved = interleaved
        if rope.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"unsupported rope_type {rope.rope_type!r}; supported: "
                + ", ".join(SUPPORTED_ROPE_TYPES)
            )
        freqs = torch.outer(torch.arange(max_positions).float(), _inv_freq(rope, head_dim))
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        scale = rotary_scale(rope)
        if scale != 1.0:
            cos, sin = cos * scale, sin * scale
        self.cos_cache: torch.Tensor
        self.sin_cache: torch.Tensor
        self.register_buffer("cos_cache", cos, persistent=False)
        self.register_buffer("sin_cache", sin, persistent=False)

    def forward(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        norms: tuple[RMSNorm, RMSNorm] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq, D], k: [T, Hk, D]; positions: [T]. ``norms`` (Qwen3's per-head q and k
        norms) run first — fused, in the same kernel."""
        if self.fused:
            from services.worker.engine.ops.fused_ops import rotary_

            weights = (norms[0].weight, norms[1].weight) if norms is not None else None
            eps = norms[0].eps if norms is not None else 0.0
            rotary_(positions, q, k, self.cos_cache, self.sin_cache, weights, eps,
                    interleaved=self.interleaved)  # fmt: skip
            return q, k
        if self.interleaved:  # adjacent pairs → halves
            q = torch.cat((q[..., 0::2], q[..., 1::2]), dim=-1)
            k = torch.cat((k[..., 0::2], k[..., 1::2]), dim=-1)
        if norms is not None:
            q, k = norms[0](q), norms[1](k)
        cos = self.cos_cache[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin_cache[positions].unsqueeze(1).to(q.dtype)
        r = self.rotary_dim
        if r != q.shape[-1]:  # partial: the first r dims turn
            q_r, k_r = q[..., :r], k[..., :r]
            q_r, k_r = q_r * cos + _rotate_half(q_r) * sin, k_r * cos + _rotate_half(k_r) * sin
            return torch.cat((q_r, q[..., r:]), -1), torch.cat((k_r, k[..., r:]), -1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin

    def forward_and_store(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: LayerKVCache,
        slot_mapping: torch.Tensor,
        norms: tuple[RMSNorm, RMSNorm] | None = None,
    ) -> torch.Tensor:
        """Rotate q (returned) and store the keys, rotated, and the values ``v`` [T, Hk, D] into
        the layer's KV cache at ``slot_mapping`` — what the attention backend's forward does
        first unless told the keys are stored (``store_kv=False``). Fused, one kernel does both
        and leaves k as it was; unfused, the keys are rotated, then written
        (``attention/backend.write_kv``)."""
        if self.fused:
            from services.worker.engine.ops.fused_ops import rotary_

            weights = (norms[0].weight, norms[1].weight) if norms is not None else None
            eps = norms[0].eps if norms is not None else 0.0
            rotary_(positions, q, k, self.cos_cache, self.sin_cache, weights, eps,
                    store=(v, cache, slot_mapping))  # fmt: skip
            return q
        q, k = self.forward(positions, q, k, norms)
        write_kv(k, v, cache, slot_mapping[: k.shape[0]])
        return q


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)
