"""Tiny GGUF files for the tests, written with ``gguf.GGUFWriter``: llama.cpp's metadata keys
and tensor names, random weights stored in any tensor type.

Types that ``gguf`` can quantize (BF16, Q8_0, Q4_0, Q4_1) quantize random floats; the K-quants
(which it only dequantizes) are random block bytes with sane float16 scales, as dequantizing
reads any bytes. The q and k rows are random, so their order in the file is whatever the
reader makes of it: the tests un-permute on their own (``halves``), and read the file with
``gguf.GGUFReader`` (``reference``), not with Baton's reader.
"""

from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize, quantize

T = GGMLQuantizationType
# the byte offsets of a K-quant block's float16 scales (d, dmin; Q6_K keeps d at its end)
_K_SCALES = {T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}


def encode(values: np.ndarray, qtype: GGMLQuantizationType, rng: np.random.Generator) -> np.ndarray:
    """``values`` (float32, [rows, cols]) stored as ``qtype``: elements, or raw block bytes."""
    if qtype == T.F32:
        return values
    if qtype == T.F16:
        return values.astype(np.float16)
    if qtype not in _K_SCALES:
        return quantize(values, qtype)
    block, size = GGML_QUANT_SIZES[qtype]
    rows, cols = values.shape
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for at in _K_SCALES[qtype]:
        scales = rng.uniform(1e-3, 1e-2, (rows, cols // block)).astype(np.float16)
        raw[..., at : at + 2] = scales.view(np.uint8).reshape(rows, cols // block, 2)
    return raw.reshape(rows, -1)


def write_tiny_gguf(
    path: Path,
    qtype: GGMLQuantizationType = T.Q8_0,
    arch: str = "llama",
    *,
    hidden: int = 256,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 64,
    tied: bool = True,
    seed: int = 0,
    extra: dict[str, tuple[np.ndarray, GGMLQuantizationType]] | None = None,
) -> Path:
    """One decoder layer of ``arch`` (qwen2: q/k/v biases; qwen3: q/k norms and a head_dim
    apart from hidden / heads), its 2-D weights in ``qtype``, norms and biases in F32;
    ``extra``: more tensors, by name, with their values (floats, or the bytes as stored) and
    type."""
    rng = np.random.default_rng(seed)
    inter, vocab = 2 * hidden, 96
    w = GGUFWriter(path, arch)
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_dimension_count(head_dim)
    if head_dim * heads != hidden:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_token_list([f"t{i}" for i in range(vocab)])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def matrix(rows: int, cols: int) -> tuple[np.ndarray, GGMLQuantizationType]:
        return rng.standard_normal((rows, cols), dtype=np.float32) * 0.05, qtype

    def vector(n: int) -> tuple[np.ndarray, GGMLQuantizationType]:
        return 1.0 + rng.standard_normal(n, dtype=np.float32) * 0.1, T.F32

    q, kv = heads * head_dim, kv_heads * head_dim
    tensors = {
        "token_embd.weight": matrix(vocab, hidden),
        "output_norm.weight": vector(hidden),
        "blk.0.attn_norm.weight": vector(hidden),
        "blk.0.attn_q.weight": matrix(q, hidden),
        "blk.0.attn_k.weight": matrix(kv, hidden),
        "blk.0.attn_v.weight": matrix(kv, hidden),
        "blk.0.attn_output.weight": matrix(hidden, q),
        "blk.0.ffn_norm.weight": vector(hidden),
        "blk.0.ffn_gate.weight": matrix(inter, hidden),
        "blk.0.ffn_up.weight": matrix(inter, hidden),
        "blk.0.ffn_down.weight": matrix(hidden, inter),
    }
    if not tied:
        tensors["output.weight"] = matrix(vocab, hidden)
    if arch == "qwen2":
        for name, n in (("attn_q", q), ("attn_k", kv), ("attn_v", kv)):
            tensors[f"blk.0.{name}.bias"] = vector(n)
    if arch == "qwen3":
        tensors["blk.0.attn_q_norm.weight"] = vector(head_dim)
        tensors["blk.0.attn_k_norm.weight"] = vector(head_dim)
    tensors.update(extra or {})
    for name, (values, kind) in tensors.items():
        raw_bytes = values.ndim == 1 or values.dtype == np.uint8  # (already as stored)
        data = values if raw_bytes else encode(values, kind, rng)
        raw = kind if data.dtype == np.uint8 else None
        w.add_tensor(name, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def type_offset(path: Path, name: str) -> int:
    """Where the type of tensor ``name`` is written in the file's header (to overwrite it)."""
    data = path.read_bytes()
    key = len(name).to_bytes(8, "little") + name.encode()
    at = data.index(key) + len(key)
    dims = int.from_bytes(data[at : at + 4], "little")
    return at + 4 + 8 * dims


def halves(rows: np.ndarray, head_dim: int) -> np.ndarray:
    """llama.cpp's interleaved rotary rows back to Hugging Face's halves, row by row: within a
    head, row j < d/2 is the file's row 2j, row d/2 + j its row 2j + 1."""
    order = []
    for head in range(rows.shape[0] // head_dim):
        base = head * head_dim
        order += [base + 2 * j for j in range(head_dim // 2)]
        order += [base + 2 * j + 1 for j in range(head_dim // 2)]
    return rows[order]


def reference(path: Path, heads: tuple[int, int] | None) -> dict[str, np.ndarray]:
    """Every tensor as gguf reads and dequantizes it whole, [rows, cols]; with ``heads``
    (query, key/value) llama's q and k rows un-permuted."""
    out = {}
    for t in GGUFReader(path).tensors:
        values = np.array(dequantize(t.data, t.tensor_type))  # (F32: a read-only view)
        if heads and (".attn_q." in t.name or ".attn_k." in t.name):
            n = heads[0] if ".attn_q." in t.name else heads[1]
            values = halves(values, values.shape[0] // n)
        out[t.name] = values
    return out
