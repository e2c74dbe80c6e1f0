"""A GGUF file as Baton reads it (shared/gguf_header.py, shared/gguf_checkpoint.py),
torch-free: any region of any tensor equals ``gguf.quants.dequantize`` of the whole as
``gguf.GGUFReader`` reads it, bit for bit, for every type Baton is tested on (llama's q and k
rows un-permuted, checked against the tests' own un-permute); the metadata equals
``GGUFReader``'s; the Hugging Face config of SmolLM2 and of tiny Qwen files; and refusals that
name what they found.
"""

from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGUFReader

from shared.gguf_checkpoint import GGUFCheckpoint, GGUFError, hf_config
from shared.gguf_header import read_header
from tests.tiny_gguf import T, halves, reference, type_offset, write_tiny_gguf

TYPES = [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q4_K, T.Q5_K, T.Q6_K]


def regions(shape: tuple[int, ...], rng: np.random.Generator) -> list[tuple[slice, ...]]:
    """The whole tensor, then random regions (starts and ends anywhere, not on blocks)."""
    found = [tuple(slice(0, n) for n in shape)]
    for _ in range(4):
        cut = []
        for n in shape:
            a, b = sorted(rng.choice(n + 1, 2, replace=False))
            cut.append(slice(int(a), int(b)))
        found.append(tuple(cut))
    return found


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_any_region_equals_dequantize_bit_for_bit(tmp_path: Path, qtype: T) -> None:
    path = write_tiny_gguf(tmp_path / "tiny.gguf", qtype, tied=False)
    want = reference(path, heads=(4, 2))
    rng = np.random.default_rng(1)
    checkpoint = GGUFCheckpoint(path)
    assert {t.qtype for t in checkpoint.tensors} == {qtype, T.F32}
    for t in checkpoint.tensors:
        for region in regions(t.shape, rng):
            got = t.read(region)
            assert got.dtype == np.float32 and got.flags.writeable
            assert got.tobytes() == np.ascontiguousarray(want[t.gguf_name][region]).tobytes(), (
                t.gguf_name,
                region,
            )


def test_llamas_q_and_k_biases_are_unpermuted_too(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    biases = {f"blk.0.attn_{x}.bias": (rng.standard_normal(n, dtype=np.float32), T.F32)
              for x, n in (("q", 256), ("k", 128), ("v", 128))}  # fmt: skip
    path = write_tiny_gguf(tmp_path / "bias.gguf", extra=biases)
    want = reference(path, heads=(4, 2))
    assert not np.array_equal(want["blk.0.attn_q.bias"], biases["blk.0.attn_q.bias"][0])
    for t in GGUFCheckpoint(path).tensors:
        if t.gguf_name in biases:
            for region in regions(t.shape, rng):
                assert t.read(region).tobytes() == want[t.gguf_name][region].tobytes()


def test_the_permutation_is_llamas_alone(tmp_path: Path) -> None:
    """The test's un-permute is not the identity, and Qwen's rows are read as they lie."""
    llama = write_tiny_gguf(tmp_path / "llama.gguf")
    raw = reference(llama, heads=None)["blk.0.attn_q.weight"]
    assert not np.array_equal(halves(raw, 64), raw)
    for arch in ("qwen2", "qwen3"):
        path = write_tiny_gguf(tmp_path / f"{arch}.gguf", arch=arch, head_dim=32)
        want = reference(path, heads=None)
        for t in GGUFCheckpoint(path).tensors:
            full = tuple(slice(0, n) for n in t.shape)
            assert t.read(full).tobytes() == want[t.gguf_name].tobytes(), t.gguf_name


def test_names_and_config_of_qwen(tmp_path: Path) -> None:
    qwen3 = GGUFCheckpoint(write_tiny_gguf(tmp_path / "q3.gguf", arch="qwen3", head_dim=32))
    names = {t.name for t in qwen3.tensors}
    assert "model.layers.0.self_attn.q_norm.weight" in names
    assert "model.layers.0.mlp.down_proj.weight" in names
    assert "lm_head.weight" not in names  # tied: no output.weight
    config = qwen3.hf_config()
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert config["head_dim"] == 32  # attention.key_length, not hidden / heads = 64
    assert config["tie_word_embeddings"] and not config["attention_bias"]
    qwen2 = hf_config(write_tiny_gguf(tmp_path / "q2.gguf", arch="qwen2", tied=False))
    assert qwen2["architectures"] == ["Qwen2ForCausalLM"]
    assert qwen2["attention_bias"] and not qwen2["tie_word_embeddings"]


def test_the_header_reads_as_gguf_reader_reads_it(smollm2_gguf: Path) -> None:
    ours, theirs = read_header(smollm2_gguf), GGUFReader(smollm2_gguf)
    fields = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert ours.fields == fields  # every key, the vocabulary and merges included
    assert len(ours.tensors) == len(theirs.tensors) == 272
    for mine, t in zip(ours.tensors, theirs.tensors, strict=True):
        assert (mine.name, mine.qtype) == (t.name, t.tensor_type)
        assert mine.shape == tuple(reversed(t.shape.tolist()))
        assert not mine.data.flags.writeable  # a view of the mapped file
        assert np.array_equal(mine.data, t.data.view(np.uint8))


def test_the_config_of_smollm2(smollm2_gguf: Path) -> None:
    config = hf_config(smollm2_gguf)
    assert config == config | {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 49152,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "max_position_embeddings": 8192,
        "rope_theta": 100000.0,
        "rope_scaling": None,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "bos_token_id": 1,
        "eos_token_id": [2],
        "torch_dtype": "bfloat16",
    }
    assert config["rms_norm_eps"] == pytest.approx(1e-5)


def test_a_truncated_file_is_refused(tmp_path: Path) -> None:
    whole = write_tiny_gguf(tmp_path / "whole.gguf").read_bytes()
    for size in (0, 20, 300, len(whole) // 2, len(whole) - 1):
        cut = tmp_path / f"cut-{size}.gguf"
        cut.write_bytes(whole[:size])
        with pytest.raises(GGUFError, match="truncated") as refused:
            GGUFCheckpoint(cut)
        assert str(cut) in str(refused.value)


def test_unknown_architectures_tensors_and_types_are_refused(tmp_path: Path) -> None:
    with pytest.raises(GGUFError, match=r"'gpt2'; supported: llama, qwen2, qwen3"):
        GGUFCheckpoint(write_tiny_gguf(tmp_path / "gpt2.gguf", arch="gpt2"))
    experts = np.zeros((512, 256), np.float32), T.F32
    path = write_tiny_gguf(tmp_path / "moe.gguf", extra={"blk.0.ffn_gate_exps.weight": experts})
    with pytest.raises(GGUFError, match=r"unknown tensor 'blk\.0\.ffn_gate_exps\.weight'"):
        GGUFCheckpoint(path)
    factors = np.ones((1, 32), np.float32), T.F32
    path = write_tiny_gguf(tmp_path / "llama3.gguf", extra={"rope_freqs.weight": factors})
    with pytest.raises(GGUFError, match=r"'rope_freqs\.weight': per-frequency RoPE factors"):
        GGUFCheckpoint(path)
    # a type gguf cannot dequantize: Q8_K (llama.cpp's intermediate for K-quant products)
    block, size = GGML_QUANT_SIZES[T.Q8_K]
    q8k = np.zeros((96, 256 // block * size), np.uint8), T.Q8_K
    path = write_tiny_gguf(tmp_path / "q8k.gguf", extra={"output.weight": q8k})
    with pytest.raises(GGUFError, match=r"'output\.weight' is of type Q8_K"):
        GGUFCheckpoint(path)
    # a type id no gguf release knows (written by a newer llama.cpp)
    path = write_tiny_gguf(tmp_path / "new.gguf")
    data = bytearray(path.read_bytes())
    at = type_offset(path, "blk.0.attn_v.weight")
    data[at : at + 4] = (99).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match=r"'blk\.0\.attn_v\.weight' .* has type id 99"):
        GGUFCheckpoint(path)
