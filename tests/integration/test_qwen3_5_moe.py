"""Qwen3.5-MoE, Qwen3.5's Gated DeltaNet hybrid with a mixture of experts in every layer,
against Hugging Face ``transformers`` in float32, on a tiny checkpoint of four layers (three
Gated DeltaNet layers, then a gated full-attention one; 8 experts, 2 a token, and a shared
expert scaled by a sigmoid gate) whose experts are stacked as the published bf16 checkpoints
keep them (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I]): greedy
tokens equal token for token and logprobs within 1e-4, with whole prompts and chunked
prefill, with prefix hits resumed from the recurrent state's checkpoints; two ranks with
expert parallelism and two with each expert split; disaggregated, the decode engine pulling
the attention blocks and each recurrent group's end state; the published multimodal
checkpoints' text model. (Its FP8 checkpoints, each expert's projections apart:
test_gated_delta_fp8.py.)
"""

import json
from pathlib import Path

import pytest

from baton.tiny_model import make_tiny_model
from tests.helpers import (
    assert_matches_reference,
    copy_checkpoint,
    experts_chosen,
)

# (the same prompts, modes and runs as Qwen3.5's, against this checkpoint's reference)
from tests.integration.test_qwen3_5 import (
    LOGPROB_ATOL,
    MODES,
    PROMPTS,
    _run,
    hf_reference,
    matches_hugging_face_with_hits,
    pulls_the_full_blocks_and_the_end_state,
)


@pytest.fixture(scope="module")
def qwen3_5_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("qwen3_5_moe") / "m", arch="qwen3_5_moe")


def test_the_checkpoint_stacks_its_experts_and_reads_as_a_hybrid_of_experts(
    qwen3_5_moe: Path,
) -> None:
    from safetensors import safe_open

    from services.worker.engine.model_config import load_arch_config

    with safe_open(str(qwen3_5_moe / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert "model.layers.0.mlp.experts.gate_up_proj" in names
    assert not any(".experts.0." in n for n in names)
    arch = load_arch_config(qwen3_5_moe)
    assert arch.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert arch.moe is not None and arch.linear_attention is not None
    assert arch.moe.sparse_layers == (0, 1, 2, 3) and arch.moe.norm_topk_prob
    assert arch.moe.shared_intermediate_size == 32 and arch.moe.shared_expert_gate
    assert arch.partial_rotary_factor == 0.25


def test_a_prompts_tokens_spread_over_most_experts(qwen3_5_moe: Path) -> None:
    used = experts_chosen(qwen3_5_moe, PROMPTS[3])
    assert sorted(used) == [0, 1, 2, 3]
    assert all(len(chosen) >= 6 for chosen in used.values()), used  # of 8


@pytest.mark.parametrize("mode", sorted(MODES))
def test_greedy_matches_hugging_face(qwen3_5_moe: Path, mode: str) -> None:
    matches_hugging_face_with_hits(qwen3_5_moe, mode)


@pytest.mark.parametrize("expert_parallel", [True, False], ids=["experts-whole", "experts-split"])
def test_two_ranks_equal_hugging_face(qwen3_5_moe: Path, expert_parallel: bool) -> None:
    """Each rank half the experts whole (or half of each expert's rows, read from the stacked
    tensor), a slice of the shared expert, one of the two key heads and two of the four value
    heads of every Gated DeltaNet layer; chunked prefill and prefix hits as above."""
    outs, _ = _run(qwen3_5_moe, tensor_parallel_size=2, enable_expert_parallel=expert_parallel,
                   **MODES["chunked-prefill"])  # fmt: skip
    assert_matches_reference(outs, *hf_reference(str(qwen3_5_moe)), LOGPROB_ATOL)


def test_disaggregated_equals_colocated(qwen3_5_moe: Path) -> None:
    """As Qwen3.5's: the full group's blocks and each recurrent group's end state pulled."""
    pulls_the_full_blocks_and_the_end_state(qwen3_5_moe)


def test_the_multimodal_checkpoints_text_model(qwen3_5_moe: Path, tmp_path: Path) -> None:
    """A published checkpoint is ``Qwen3_5MoeForConditionalGeneration``: its text model's
    config nested in ``text_config``, its tensors under ``model.language_model``, a vision
    encoder's beside them (not loaded). The engine serves its text model to the same tokens."""
    import torch
    from safetensors.torch import load_file, save_file

    mm = copy_checkpoint(qwen3_5_moe, tmp_path / "mm")
    text = json.loads((qwen3_5_moe / "config.json").read_text())
    (mm / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
        "text_config": {**text, "architectures": None}, "vision_config": {"depth": 2},
        "tie_word_embeddings": text.get("tie_word_embeddings", False),
    }))  # fmt: skip
    tensors = {
        (k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k): t
        for k, t in load_file(mm / "model.safetensors").items()
    }
    tensors["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 3)
    save_file(tensors, str(mm / "model.safetensors"), metadata={"format": "pt"})
    outs, _ = _run(mm, enable_prefix_caching=False)
    want, _ = hf_reference(str(qwen3_5_moe))
    assert [o.token_ids for o in outs] == want
