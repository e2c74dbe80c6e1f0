"""Gemma 3 (text) configs: the real 12B's, as its hub config.json spells it (transformers 4:
``rope_local_base_freq``, ``sliding_window_pattern``), and transformers 5's spelling (rotary
parameters nested by layer type, ``layer_types`` written out)."""

import json
from pathlib import Path

import pytest

from benchmarks.shapes import SHAPES
from services.worker.engine.config import EngineArgs
from services.worker.engine.model_config import ArchConfig, RopeConfig, load_arch_config

SLIDING, FULL = "sliding_attention", "full_attention"


def _arch(tmp_path: Path, cfg: dict) -> ArchConfig:
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return load_arch_config(tmp_path)


def test_gemma_3_12b_shape(tmp_path: Path) -> None:
    arch = _arch(tmp_path, SHAPES["gemma-3-12b"])
    assert arch.layer_types == ((SLIDING,) * 5 + (FULL,)) * 8  # every sixth layer global
    assert arch.sliding_window == 1024
    assert arch.rope == RopeConfig(theta=1e6, rope_type="linear", factor=8.0)
    assert arch.rope_local == RopeConfig(theta=1e4)
    assert arch.hidden_act == "gelu_pytorch_tanh" and arch.query_pre_attn_scalar == 256
    assert arch.final_logit_softcapping is None and arch.attn_logit_softcapping is None
    assert arch.tie_word_embeddings and arch.kv_cache_entry() == (2, 8, 256)


def test_gemma_3_defaults_where_the_config_is_silent(tmp_path: Path) -> None:
    """Gemma3TextConfig's defaults: bases 1M and 10k, a pattern of 6, tied embeddings; Gemma's
    ``hidden_activation`` wins over a ``hidden_act`` it ignores."""
    cfg = {k: v for k, v in SHAPES["gemma-3-12b"].items()
           if not k.startswith(("rope", "sliding_window_pattern", "tie_"))}  # fmt: skip
    arch = _arch(tmp_path, dict(cfg, num_hidden_layers=7, hidden_act="gelu"))
    assert arch.rope == RopeConfig(theta=1e6) and arch.rope_local == RopeConfig(theta=1e4)
    assert arch.layer_types == (SLIDING,) * 5 + (FULL, SLIDING)
    assert arch.tie_word_embeddings and arch.hidden_act == "gelu_pytorch_tanh"


def test_transformers_5_nests_the_rotary_by_layer_type(tmp_path: Path) -> None:
    cfg = dict(
        SHAPES["gemma-3-12b"], num_hidden_layers=3, layer_types=[SLIDING, FULL, SLIDING],
        rope_parameters={
            SLIDING: {"rope_type": "default", "rope_theta": 5000.0},
            FULL: {"rope_type": "linear", "rope_theta": 2e6, "factor": 4.0},
        },
    )  # fmt: skip
    for key in ("rope_theta", "rope_local_base_freq", "rope_scaling", "sliding_window_pattern"):
        cfg.pop(key)
    arch = _arch(tmp_path, cfg)
    assert arch.layer_types == (SLIDING, FULL, SLIDING)
    assert arch.rope == RopeConfig(theta=2e6, rope_type="linear", factor=4.0)
    assert arch.rope_local == RopeConfig(theta=5000.0)


def test_layer_types_must_name_every_layer(tmp_path: Path) -> None:
    cfg = dict(SHAPES["gemma-3-12b"], layer_types=[SLIDING, FULL])
    with pytest.raises(ValueError, match="layer_types names 2 layers, the model has 48"):
        _arch(tmp_path, cfg)


def test_a_dense_model_has_one_rotary(tmp_path: Path) -> None:
    arch = _arch(tmp_path, SHAPES["llama-3.1-8b"])
    assert arch.rope_local is None and arch.layer_types == ()
    assert arch.query_pre_attn_scalar is None and arch.final_logit_softcapping is None


def test_the_context_is_the_configs_and_not_cut_at_the_window(tmp_path: Path) -> None:
    """The model applies its window (Mistral's is a limit: no window there), and Gemma 3's
    131072 positions are those of its linear scaling already (Llama's would be multiplied)."""
    _arch(tmp_path, SHAPES["gemma-3-12b"])
    config = EngineArgs(model=str(tmp_path), device="cpu").create_engine_config()
    assert config.model.max_model_len == 131072
