"""Qwen3.5's configs as the engine reads them: the published multimodal checkpoints' text model
(``model_config.text_config``), its layers' cache kinds, and the block size its recurrent
state raises (``config.state_block_size``), from the 27B shape's config."""

from benchmarks.shapes import SHAPES
from services.worker.engine.config import state_block_size
from services.worker.engine.kv_cache.groups import RECURRENT
from services.worker.engine.model_config import load_arch_config, text_config

TEXT = dict(SHAPES["qwen3.5-27b"])


def test_a_multimodal_config_reads_as_its_text_models() -> None:
    text = {**TEXT, "eos_token_id": None, "tie_word_embeddings": True}
    cfg = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
           "text_config": text, "vision_config": {"depth": 27}, "eos_token_id": 7,
           "dtype": "bfloat16"}  # fmt: skip
    merged = text_config(cfg)
    assert merged["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    assert merged["model_type"] == "qwen3_5_text" and merged["hidden_size"] == 5120
    assert merged["eos_token_id"] == 7  # (a null in the text config does not hide it)
    assert merged["tie_word_embeddings"] is False  # the multimodal model's default
    assert "vision_config" not in merged and "text_config" not in merged
    arch = load_arch_config("", cfg)
    assert arch.linear_attention is not None and arch.linear_attention.num_value_heads == 48
    assert arch.eos_token_ids == (7,)
    other = {"model_type": "gemma3", "text_config": {"hidden_size": 8}}
    assert text_config(other) is other  # only the listed multimodal types


def test_the_27b_shapes_kinds_and_block_size() -> None:
    arch = load_arch_config("", TEXT)
    kinds = arch.layer_cache_kinds()
    assert kinds[:4] == (RECURRENT, RECURRENT, RECURRENT, None) and len(kinds) == 64
    # a float32 state of 3 × 10,240 conv values + 48 × 128 × 128: 3,268,608 bytes; a bf16
    # slot holds 2 × 4 heads × 256 × 2 = 4,096 bytes a token: 798 tokens, 800 in 16s
    assert arch.linear_attention is not None
    assert arch.linear_attention.state_elements() * 4 == 3_268_608
    assert state_block_size(arch, 16, 1, 2) == 800
    assert state_block_size(arch, 16, 2, 2) == 800  # each rank half the state, half the heads
    assert state_block_size(arch, 16, 8, 2) == 400  # an eighth of the state, 1 KV head of 4
    assert state_block_size(arch, 1024, 1, 2) == 1024  # already large enough
