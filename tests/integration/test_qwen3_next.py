"""Qwen3-Next, Qwen3.5's Gated DeltaNet hybrid with mixture-of-experts feed-forward layers,
against Hugging Face ``transformers`` in float32, on a tiny checkpoint of four layers (three
Gated DeltaNet layers, then a gated full-attention one; 8 experts, 2 a token, and a shared
expert scaled by a sigmoid gate; layer 1 dense): greedy tokens equal token for token and
logprobs within 1e-4, with whole prompts and chunked prefill, with prefix hits resumed from the
recurrent state's checkpoints; two ranks with expert parallelism (each rank half the experts
whole, half the Gated DeltaNet heads); disaggregated, the decode engine pulling the attention
blocks and each recurrent group's end state. Its checkpoints store the Gated DeltaNet
projections by key head (``in_proj_qkvz``, ``in_proj_ba``): a loader that read them as
Qwen3.5's would give other tokens, as would a shared expert without its gate.
"""

from pathlib import Path

import pytest

from baton.tiny_model import make_tiny_model
from tests.helpers import (
    assert_matches_reference,
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
def qwen3_next(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("qwen3_next") / "m", arch="qwen3_next")


def test_the_config_reads_as_a_hybrid_of_experts(qwen3_next: Path) -> None:
    from services.worker.engine.model_config import load_arch_config

    arch = load_arch_config(qwen3_next)
    assert arch.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert arch.moe is not None and arch.linear_attention is not None
    assert arch.moe.sparse_layers == (0, 2, 3)  # (mlp_only_layers: 1)
    assert arch.moe.shared_intermediate_size == 32 and arch.moe.shared_expert_gate
    assert not arch.moe.router_float32  # (its router computes in the model's dtype)


def test_a_prompts_tokens_spread_over_most_experts(qwen3_next: Path) -> None:
    used = experts_chosen(qwen3_next, PROMPTS[3])
    assert sorted(used) == [0, 2, 3]
    assert all(len(chosen) >= 6 for chosen in used.values()), used  # of 8


@pytest.mark.parametrize("mode", sorted(MODES))
def test_greedy_matches_hugging_face(qwen3_next: Path, mode: str) -> None:
    matches_hugging_face_with_hits(qwen3_next, mode)


def test_two_ranks_with_expert_parallelism_equal_hugging_face(qwen3_next: Path) -> None:
    """Each rank half the experts whole, a slice of the shared expert (its gate whole: each
    rank scales its partial sum), one of the two key heads and two of the four value heads of
    every Gated DeltaNet layer; chunked prefill and prefix hits as above."""
    outs, _ = _run(qwen3_next, tensor_parallel_size=2, enable_expert_parallel=True,
                   **MODES["chunked-prefill"])  # fmt: skip
    assert_matches_reference(outs, *hf_reference(str(qwen3_next)), LOGPROB_ATOL)


def test_disaggregated_equals_colocated(qwen3_next: Path) -> None:
    """As Qwen3.5's: the full group's blocks and each recurrent group's end state pulled."""
    pulls_the_full_blocks_and_the_end_state(qwen3_next)
