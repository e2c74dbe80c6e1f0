"""Multi-head latent attention (``models/layers/mla.py``) against Hugging Face's DeepSeek-V2/V3
attention on the same weights, step by step through a paged latent cache: a prefill, a chunk
over the cached prefix, then decode rows (the absorbed path). The absorbed decode against an
independent float64 decompressed attention over a batch of contexts; the latent cache rows;
YaRN's tables and softmax scale against Hugging Face's."""

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import DeepseekV2Config, DeepseekV3Config
from transformers.models.deepseek_v2 import modeling_deepseek_v2 as hf_v2
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_v3

from services.worker.engine.attention.backend import AttentionMetadata, LayerKVCache
from services.worker.engine.attention.registry import get_backend
from services.worker.engine.kv_cache.layout import KVCacheLayout, layer_views
from services.worker.engine.model_config import ArchConfig, load_arch_config
from services.worker.engine.models.context import ModelContext
from services.worker.engine.models.layers.mla import (
    MLAAttention,
    latent_decode,
    softmax_scale,
    write_latent,
)
from services.worker.engine.models.layers.rotary import RotaryEmbedding
from services.worker.engine.ops.mla_decode import mla_decode

BS = 4  # tokens a block
# where the Triton kernels run: on the GPU where there is one, else in the interpreter on CPU
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "beta_fast": 32.0,
        "beta_slow": 1.0, "original_max_position_embeddings": 64}  # fmt: skip
SIZES: dict[str, Any] = {
    "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 32,
    "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12,
    "max_position_embeddings": 256, "num_hidden_layers": 1, "num_experts_per_tok": 2,
}  # fmt: skip


def hf_config(version: str, **rope: float) -> Any:
    """V2: one q projection, default rope; V3: q through the low-rank pair, YaRN (``rope``:
    mscale and mscale_all_dim)."""
    cfg: Any
    if version == "v2":
        cfg = DeepseekV2Config(q_lora_rank=None, **SIZES)
    else:
        cfg = DeepseekV3Config(q_lora_rank=24, rope_parameters={**YARN, **rope}, **SIZES)
    cfg._attn_implementation = "eager"
    return cfg


def arch_of(cfg: Any, tmp_path: Path) -> ArchConfig:
    name = "DeepseekV2ForCausalLM" if cfg.model_type == "deepseek_v2" else "DeepseekV3ForCausalLM"
    return load_arch_config(tmp_path, {**cfg.to_dict(), "architectures": [name]})


def hf_attention(version: str, cfg: Any) -> Any:
    torch.manual_seed(0)
    module = hf_v2 if version == "v2" else hf_v3
    attn = (module.DeepseekV2Attention if version == "v2" else module.DeepseekV3Attention)(cfg, 0)
    for name, p in attn.named_parameters():  # norms too, so that their weights matter
        torch.nn.init.normal_(p, mean=1.0 if "layernorm" in name else 0.0, std=0.2)
    rope = hf_v2.DeepseekV2RotaryEmbedding if version == "v2" else hf_v3.DeepseekV3RotaryEmbedding
    return attn.eval(), rope(cfg)


def ours(arch: ArchConfig, hf: Any, backend: str = "torch", kernels: bool = False) -> MLAAttention:
    ctx = ModelContext.build(arch.max_position_embeddings, get_backend(backend), kernels)
    layer = MLAAttention(arch, ctx)
    layer.load_state_dict(hf.state_dict())
    layer.attn.after_load()
    return layer.eval()


def latent_cache(arch: ArchConfig, num_blocks: int, device: Any = "cpu") -> LayerKVCache:
    parts, heads, dim = arch.kv_cache_entry()
    layout = KVCacheLayout(2, heads, dim, BS, torch.float32, parts)
    return layer_views(layout.allocate(num_blocks, device), 1)


def metadata(
    steps: list[tuple[int, int]], tables: list[list[int]], device: Any = "cpu"
) -> AttentionMetadata:
    """One step: (cached tokens, new tokens) per request, and each request's blocks."""
    qsl, lens, slots = [0], [], []
    for (cached, new), table in zip(steps, tables, strict=True):
        qsl.append(qsl[-1] + new)
        lens.append(cached + new)
        slots += [table[p // BS] * BS + p % BS for p in range(cached, cached + new)]
    width = max(map(len, tables))
    padded = [t + [0] * (width - len(t)) for t in tables]

    def on_device(values: list[Any], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    return AttentionMetadata(
        num_tokens=len(slots), query_start_loc=on_device(qsl, torch.int32),
        seq_lens=on_device(lens, torch.int32), block_tables=on_device(padded, torch.int32),
        slot_mapping=on_device(slots, torch.int64), query_start_loc_cpu=qsl,
        seq_lens_cpu=lens, max_query_len=max(n for _, n in steps), max_seq_len=max(lens),
    )  # fmt: skip


def hf_forward(version: str, attn: Any, rope: Any, x: torch.Tensor) -> torch.Tensor:
    n = x.shape[0]
    positions = torch.arange(n)[None]
    mask = torch.full((n, n), -math.inf).triu(1)[None, None]
    emb = rope(x[None], positions)
    if version == "v2":
        return attn(x[None], attention_mask=mask, position_embeddings=emb)[0][0]
    return attn(x[None], position_embeddings=emb, attention_mask=mask)[0][0]


@pytest.mark.parametrize("kernels", [False, True], ids=["pytorch-ops", "kernels"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("version", ["v2", "v3"])
@torch.no_grad()
def test_prefill_chunk_and_decode_equal_hugging_face(
    version: str, backend: str, kernels: bool, tmp_path: Path
) -> None:
    """The prefill rows through the model's attention backend's ``attend_contiguous``:
    ``triton``, its prefill kernel (the GPU's path; here Triton's interpreter), the values (12
    wide) in a buffer of the keys' 24. With the engine's kernels the norms and the rotary are
    Triton's (the rotary in place on q's and the latent's rotary parts, DeepSeek's adjacent
    pairs written in halves)."""
    cfg = hf_config(version, mscale=1.0, mscale_all_dim=0.8)
    attn, rope = hf_attention(version, cfg)
    arch = arch_of(cfg, tmp_path)
    layer = ours(arch, attn, backend, kernels).to(DEVICE)
    assert layer.rotary.fused == kernels and layer.rotary.interleaved
    assert layer.attn.prefill.name == backend
    cache = latent_cache(arch, 8, DEVICE)
    layer.kv_cache = cache
    torch.manual_seed(1)
    x = torch.randn(13, cfg.hidden_size)
    want = hf_forward(version, attn, rope, x)
    table = [5, 2, 7, 0]  # shuffled blocks: 13 tokens in 4 blocks of 4
    got = []
    # a prefill of 6, a chunk of 4 over it (across a block edge), three decode steps
    for cached, new in [(0, 6), (6, 4), (10, 1), (11, 1), (12, 1)]:
        meta = metadata([(cached, new)], [table], DEVICE)
        positions = torch.arange(cached, cached + new, device=DEVICE)
        got.append(layer(positions, x[cached : cached + new].to(DEVICE), meta).cpu())
    torch.testing.assert_close(torch.cat(got), want, rtol=1e-5, atol=1e-5)
    assert meta.num_decodes == 1  # (the last steps ran the absorbed path)


@torch.no_grad()
def test_the_cache_holds_the_normed_latent_and_the_rotated_key(tmp_path: Path) -> None:
    """Hugging Face's V3 rotates DeepSeek's interleaved pairs into halves, as the cache keeps
    them; nothing but the written slots changes."""
    cfg = hf_config("v3")
    attn, rope = hf_attention("v3", cfg)
    arch = arch_of(cfg, tmp_path)
    layer = ours(arch, attn)
    layer.kv_cache = cache = latent_cache(arch, 4)
    x = torch.randn(6, cfg.hidden_size)
    table = [3, 1]
    layer(torch.arange(6), x, metadata([(0, 6)], [table]))
    lr = cfg.kv_lora_rank
    c, k_pe = attn.kv_a_proj_with_mqa(x).split([lr, cfg.qk_rope_head_dim], dim=-1)
    cos, sin = rope(x[None], torch.arange(6)[None])
    _, k_rot = hf_v3.apply_rotary_pos_emb_interleave(k_pe[None, None], k_pe[None, None], cos, sin)
    want = torch.cat((attn.kv_a_layernorm(c), k_rot[0, 0]), dim=-1)
    rows = torch.cat((cache.key[3], cache.key[1, :2]))[:, 0]
    torch.testing.assert_close(rows, want, rtol=1e-6, atol=1e-6)
    assert cache.value.data_ptr() == cache.key.data_ptr()  # one latent: both views
    assert not cache.key[1, 2:].any() and not cache.key[0].any() and not cache.key[2].any()


def decompressed(
    q: torch.Tensor, rows: torch.Tensor, w_kv: torch.Tensor, lr: int, nope: int, scale: float
) -> torch.Tensor:
    """One query [H, qk] over a context of cache rows [L, Lr + R]: keys and values per head
    from kv_b_proj's weight [H * (nope + v), Lr], in float64. [H, v]."""
    heads = q.shape[0]
    kv = (rows[:, :lr].double() @ w_kv.double().T).view(rows.shape[0], heads, -1)
    k_pe = rows[:, None, lr:].double().expand(-1, heads, -1)
    k = torch.cat((kv[..., :nope], k_pe), dim=-1)
    scores = torch.einsum("hd,lhd->hl", q.double(), k) * scale
    return torch.einsum("hl,lhd->hd", scores.softmax(-1), kv[..., nope:])


@torch.no_grad()
def test_absorbed_decode_equals_decompressed_attention(tmp_path: Path) -> None:
    """A batch of decode rows of different contexts (one longer than the others by blocks,
    the padding of the shorter masked) against a float64 attention over keys and values
    decompressed from the same cache."""
    cfg = hf_config("v3")
    attn, _ = hf_attention("v3", cfg)
    arch = arch_of(cfg, tmp_path)
    layer = ours(arch, attn)
    torch.manual_seed(2)
    layer.kv_cache = cache = latent_cache(arch, 12)
    cache.key.copy_(torch.randn(cache.key.shape))  # every context's rows, and garbage past them
    lens, tables = [3, 13, 6], [[4], [9, 0, 11, 2], [7, 1]]
    heads, qk = cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    q = torch.randn(3, heads, qk)
    meta = metadata([(n - 1, 1) for n in lens], tables)
    meta.slot_mapping.fill_(10 * BS)  # (this step's rows go to a block nobody reads)
    out = layer.attn.forward(q, torch.zeros(3, 1, arch.mla.cache_dim), None, cache, meta)  # type: ignore[arg-type, union-attr]
    lr, nope = cfg.kv_lora_rank, cfg.qk_nope_head_dim
    for i, (n, table) in enumerate(zip(lens, tables, strict=True)):
        rows = torch.cat([cache.key[b, :, 0] for b in table])[:n]
        want = decompressed(q[i], rows, attn.kv_b_proj.weight, lr, nope, layer.attn.scale)
        torch.testing.assert_close(out[i].double(), want, rtol=1e-5, atol=1e-5)
    # what a GPU runs in its place, the Triton kernel (on the GPU where there is one, else in
    # the interpreter), on the same operands as the layer hands it: the absorbed query's
    # strides, the cache's layer view
    q_lat = torch.bmm(q[..., :nope].transpose(0, 1), layer.attn.w_uk).transpose(0, 1)
    lat = latent_decode(q_lat, q[..., nope:], cache.key, meta.block_tables, meta.seq_lens, 13,
                        layer.attn.scale)  # fmt: skip
    operands = [strided_on(DEVICE, t) for t in (q_lat, q[..., nope:], cache.key,
                                                meta.block_tables, meta.seq_lens)]  # fmt: skip
    kernel = mla_decode(*operands, layer.attn.scale, max_seq_len=13)
    torch.testing.assert_close(kernel.cpu(), lat, rtol=1e-5, atol=1e-5)


def strided_on(device: torch.device, t: torch.Tensor) -> torch.Tensor:
    """``t`` on ``device`` with its strides (``.to`` would compact a view with gaps)."""
    if t.device == device:
        return t
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
    return out.copy_(t)


def test_the_latent_store_is_the_scatter_in_one_launch() -> None:
    """``ops/attention.store_rows`` (what ``write_latent`` runs on a GPU; here in Triton's
    interpreter, or on the GPU) puts each row where PyTorch's scatter puts it, in a layer view
    with gaps between blocks, and nothing anywhere else."""
    from services.worker.engine.ops.attention import store_rows

    torch.manual_seed(4)
    base = torch.randn(6, 2, BS, 1, 10, device=DEVICE)  # blocks, then this layer's and another's
    want = base.cpu().clone()  # (on the CPU: write_latent's PyTorch path writes it)
    rows = torch.randn(5, 1, 10, device=DEVICE)
    slots = torch.tensor([9, 0, 22, 3, 13], device=DEVICE)
    write_latent(rows.cpu(), want[:, 0], slots.cpu())  # (PyTorch's scatter: the CPU path)
    got = base.clone()
    store_rows(rows, got[:, 0], slots)
    assert torch.equal(got.cpu(), want.cpu())
    assert not torch.equal(got[:, 0], base[:, 0])  # (rows were written)


def test_latent_decode_masks_past_each_context() -> None:
    """The padded batch's positions past a row's length do not count, whatever they hold."""
    torch.manual_seed(3)
    cache = torch.randn(6, BS, 1, 10)
    q_lat, q_pe = torch.randn(2, 3, 8), torch.randn(2, 3, 2)
    tables = torch.tensor([[2, 5], [1, 3]], dtype=torch.int32)
    full = latent_decode(q_lat, q_pe, cache, tables, torch.tensor([5, 8]), 8, 0.3)
    short = latent_decode(q_lat[:1], q_pe[:1], cache, tables[:1], torch.tensor([5]), 5, 0.3)
    torch.testing.assert_close(full[:1], short)
    cache[5, 1:] = float("nan")  # past row 0's five tokens
    torch.testing.assert_close(
        latent_decode(q_lat, q_pe, cache, tables, torch.tensor([5, 8]), 8, 0.3)[0], full[0]
    )


@pytest.mark.parametrize(("mscale", "mscale_all_dim"), [(0.707, 0.707), (1.0, 0.8), (1.0, 0.0)])
def test_yarn_tables_and_scale_equal_hugging_face(
    mscale: float, mscale_all_dim: float, tmp_path: Path
) -> None:
    """DeepSeek's own (mscale = mscale_all_dim: tables unscaled, the softmax scale corrected),
    tables scaled too, and no softmax correction."""
    cfg = hf_config("v3", mscale=mscale, mscale_all_dim=mscale_all_dim)
    attn, rope = hf_attention("v3", cfg)
    arch = arch_of(cfg, tmp_path)
    ours_rope = RotaryEmbedding(cfg.qk_rope_head_dim, 256, arch.rope)
    cos, sin = rope(torch.zeros(1), torch.arange(256)[None])
    assert torch.equal(ours_rope.cos_cache, cos[0]) and torch.equal(ours_rope.sin_cache, sin[0])
    if mscale != mscale_all_dim:
        assert rope.attention_scaling != 1.0  # (the tables' scale was really tested)
    assert softmax_scale(arch) == attn.scaling
    assert (attn.scaling != arch.mla.qk_head_dim**-0.5) == bool(mscale_all_dim)  # type: ignore[union-attr]
