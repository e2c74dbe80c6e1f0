"""A GGUF checkpoint (llama.cpp's one-file format) as Baton serves it: the Hugging Face
``config.json`` its metadata amounts to, and its tensors under our parameters' names, any
region of one dequantized to float32 when asked.

Torch-free (numpy and ``gguf``): the engine's configuration reads the config in processes that
never import torch; the loader (``models/loader.py``) hands the tensors to the layers. The file
is read by ``shared/gguf_header.py``, dequantized by ``gguf.quants.dequantize``.

A weight [out, in] is stored row-major as PyTorch keeps it (GGUF lists the dimensions innermost
first, ``ne = [in, out]``), each row cut into blocks of its type (32 or 256 values with their
scales; 1 for F32, F16, BF16). Rows are independent, so a region costs only its own bytes:

    row r:               | block 0 | block 1 | block 2 | ... |     type_size bytes a block
    rows [a, b),         the bytes of rows a..b-1 and of the blocks that hold columns c..d-1,
    columns [c, d):      dequantized, then the columns cut out of those blocks

llama.cpp's converter permutes the rows of each head of ``attn_q`` and ``attn_k`` for its
rotary layout (``LlamaModel.permute`` of convert_hf_to_gguf.py; Qwen's converters do not, and
transformers un-permutes ``llama`` only). Hugging Face and Baton rotate the halves of a head
(x_i with y_i, i < d/2); llama.cpp rotates adjacent pairs, so a head of d rows is stored

    GGUF:  x0 y0 x1 y1 ... x(d/2-1) y(d/2-1)        ours:  x0 x1 ... x(d/2-1) y0 y1 ... y(d/2-1)

and a region of rows is read as the whole heads around it, un-permuted, then cut.
"""

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, Keys
from gguf.quants import dequantize

from shared.gguf_header import GGUFError, TensorEntry, read_header

__all__ = ["ARCHITECTURES", "GGUFCheckpoint", "GGUFError", "GGUFTensor", "hf_config", "our_name"]

# general.architecture → the Hugging Face class that computes it (llama.cpp writes Mistral's
# models as llama; its "mistral3" is another architecture)
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
_PERMUTED = frozenset({"llama"})  # the architectures whose q and k rows llama.cpp permutes

_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_TOP = re.compile(r"(\w+)\.(weight|bias)")
# why a tensor llama.cpp writes has no place here, where a bare "unknown" would not say
_REFUSED = {
    "rope_freqs": "per-frequency RoPE factors (Llama 3.1-style scaling), which Baton does not "
    "take from a GGUF file"
}
_REQUIRED = object()  # (a metadata key without a default)


def our_name(gguf_name: str) -> str:
    """Our parameter's (Hugging Face's) name for a llama.cpp tensor name; refuses others."""
    if m := _BLOCK.fullmatch(gguf_name):
        layer, part, kind = m.groups()
        if part in _BLOCK_NAMES:
            return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{kind}"
    elif (m := _TOP.fullmatch(gguf_name)) and m.group(1) in _TOP_NAMES:
        return f"{_TOP_NAMES[m.group(1)]}.{m.group(2)}"
    stem = gguf_name.partition(".")[0]
    why = _REFUSED.get(stem, "not a tensor of the supported architectures")
    raise GGUFError(f"unknown tensor {gguf_name!r}: {why}")


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of an open file: its bytes stay memory-mapped until a region is read."""

    name: str  # our parameter's name
    gguf_name: str  # llama.cpp's
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]  # as PyTorch orders it: [rows, columns], or [n]
    data: np.ndarray = field(repr=False)  # its bytes, [rows, bytes a row] (or [bytes]), mapped
    head_dim: int  # > 0: rows permuted per head of this many (llama's q and k), undone on read

    def read(self, region: tuple[slice, ...]) -> np.ndarray:
        """The region (a slice per dimension, steps of 1) as a new float32 array."""
        if len(self.shape) == 1:
            whole = self._dequantize(self.data.reshape(1, -1))[0]
            if self.head_dim:
                whole = _unpermute(whole[:, None], self.head_dim)[:, 0]
            return np.require(whole[region[0]], np.float32, ["C", "W"])
        rows, cols = region
        first, last = rows.start, rows.stop
        if self.head_dim:  # the whole heads around the rows
            first -= first % self.head_dim
            last += -last % self.head_dim
        block, size = GGML_QUANT_SIZES[self.qtype]
        b0, b1 = cols.start // block, -(-cols.stop // block)
        out = self._dequantize(self.data[first:last, b0 * size : b1 * size])
        out = out[:, cols.start - b0 * block : cols.stop - b0 * block]
        if self.head_dim:
            out = _unpermute(out, self.head_dim)[rows.start - first : rows.stop - first]
        return np.require(out, np.float32, ["C", "W"])

    def _dequantize(self, raw: np.ndarray) -> np.ndarray:
        return np.asarray(dequantize(raw, self.qtype), dtype=np.float32)


def _unpermute(rows: np.ndarray, head_dim: int) -> np.ndarray:
    """Each head's rows from llama.cpp's interleaved order to halves (the module's picture)."""
    heads = rows.shape[0] // head_dim
    pairs = rows.reshape(heads, head_dim // 2, 2, *rows.shape[1:])
    return pairs.swapaxes(1, 2).reshape(rows.shape)


class GGUFCheckpoint:
    """An open GGUF file (memory-mapped: reading a region pages in only its bytes).

    Opening refuses a file that cannot be read whole (truncated, damaged), an architecture
    Baton does not serve, and any tensor it has no parameter for or cannot dequantize.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        header = read_header(self.path)
        self._fields = header.fields
        self.architecture = str(self._fields.get(Keys.General.ARCHITECTURE, ""))
        if self.architecture not in ARCHITECTURES:
            raise GGUFError(f"{self.path}: unsupported architecture {self.architecture!r}; "
                            f"supported: {', '.join(sorted(ARCHITECTURES))}")  # fmt: skip
        if int(self._field(Keys.Split.LLM_KV_SPLIT_COUNT, 1)) > 1:
            raise GGUFError(f"{self.path} is one part of a split GGUF model: merge the parts "
                            "into one file (llama-gguf-split --merge)")  # fmt: skip
        self.tensors = [self._tensor(entry) for entry in header.tensors]

    def _field(self, key: str, default: Any = _REQUIRED) -> Any:
        """A metadata value (``{arch}`` filled in); refuses a missing one without a default."""
        key = key.format(arch=self.architecture)
        if key in self._fields:
            return self._fields[key]
        if default is _REQUIRED:
            raise GGUFError(f"{self.path} lacks the metadata key {key!r}")
        return default

    def _tensor(self, t: TensorEntry) -> GGUFTensor:
        name = our_name(t.name)
        if not _can_dequantize(t.qtype):
            raise GGUFError(f"tensor {t.name!r} is of type {t.qtype.name}, which Baton cannot "
                            "dequantize")  # fmt: skip
        head_dim = 0
        part = t.name.split(".")[-2]  # blk.N.attn_q.weight: attn_q
        if self.architecture in _PERMUTED and part in ("attn_q", "attn_k"):
            heads = self._heads()[part == "attn_k"]
            head_dim = t.shape[0] // heads
            if head_dim * heads != t.shape[0] or head_dim % 2:
                raise GGUFError(f"tensor {t.name!r} of shape {t.shape} does not split into "
                                f"{heads} heads of an even size")  # fmt: skip
        return GGUFTensor(name, t.name, t.qtype, t.shape, t.data, head_dim)

    def _heads(self) -> tuple[int, int]:
        """(query heads, key/value heads)."""
        heads = int(self._field(Keys.Attention.HEAD_COUNT))
        kv = self._field(Keys.Attention.HEAD_COUNT_KV, heads)
        if not isinstance(kv, int):  # llama.cpp writes a list where layers differ
            raise GGUFError(f"{self.path}: key/value heads differ between layers ({kv})")
        return heads, kv

    def hf_config(self) -> dict[str, Any]:
        """The Hugging Face ``config.json`` of this model, as ``model_config`` reads one."""
        f = self._field
        heads, kv_heads = self._heads()
        hidden = int(f(Keys.LLM.EMBEDDING_LENGTH))
        head_dim = int(f(Keys.Attention.KEY_LENGTH, hidden // heads))
        rotary = int(f(Keys.Rope.DIMENSION_COUNT, head_dim))
        if rotary != head_dim:
            raise GGUFError(f"{self.path}: rotary over {rotary} of a head's {head_dim} "
                            "dimensions is not supported")  # fmt: skip
        names = {t.gguf_name for t in self.tensors}
        tokens = self._fields.get(Keys.Tokenizer.LIST)
        eos = [f(key, -1) for key in (Keys.Tokenizer.EOS_ID, Keys.Tokenizer.EOT_ID,
                                      Keys.Tokenizer.EOM_ID)]  # fmt: skip
        return {
            "architectures": [ARCHITECTURES[self.architecture]],
            "model_type": self.architecture,
            "vocab_size": len(tokens) if tokens else int(f(Keys.LLM.VOCAB_SIZE)),
            "hidden_size": hidden,
            "intermediate_size": int(f(Keys.LLM.FEED_FORWARD_LENGTH)),
            "num_hidden_layers": int(f(Keys.LLM.BLOCK_COUNT)),
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "head_dim": head_dim,
            "rms_norm_eps": float(f(Keys.Attention.LAYERNORM_RMS_EPS)),
            "max_position_embeddings": int(f(Keys.LLM.CONTEXT_LENGTH)),
            "rope_theta": float(f(Keys.Rope.FREQ_BASE, 10000.0)),
            "rope_scaling": self._rope_scaling(),
            "sliding_window": f(Keys.Attention.SLIDING_WINDOW, 0) or None,
            "hidden_act": "silu",
            "attention_bias": "blk.0.attn_q.bias" in names,
            "mlp_bias": "blk.0.ffn_up.bias" in names,
            "tie_word_embeddings": "output.weight" not in names,
            "bos_token_id": f(Keys.Tokenizer.BOS_ID, None),
            "eos_token_id": list(dict.fromkeys(int(i) for i in eos if i >= 0)),
            # the weights are dequantized to whatever dtype the engine runs; on a GPU "auto"
            # takes bfloat16 (float32's range: no overflow where a float16 run could)
            "torch_dtype": "bfloat16",
        }

    def _rope_scaling(self) -> dict[str, Any] | None:
        kind = str(self._field(Keys.Rope.SCALING_TYPE, "none"))
        factor = float(self._field(Keys.Rope.SCALING_FACTOR, 1.0))
        if kind == "none":  # (older files: rope.scale_linear)
            factor = float(self._field("{arch}.rope.scale_linear", 1.0))
            kind = "linear" if factor != 1.0 else kind
        if kind == "none":
            return None
        if kind != "linear":
            raise GGUFError(f"{self.path}: RoPE scaling {kind!r} is not supported (linear only)")
        return {"rope_type": "linear", "factor": factor}


def hf_config(path: str | Path) -> dict[str, Any]:
    """The Hugging Face ``config.json`` dict of the GGUF file at ``path``."""
    return GGUFCheckpoint(path).hf_config()


def _can_dequantize(qtype: GGMLQuantizationType) -> bool:
    """Whether ``gguf.quants.dequantize`` knows the type (it raises for the others)."""
    try:
        dequantize(np.zeros((1, GGML_QUANT_SIZES[qtype][1]), np.uint8), qtype)
    except NotImplementedError:
        return False
    return True
