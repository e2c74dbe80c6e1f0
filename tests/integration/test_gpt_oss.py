"""gpt-oss against Hugging Face ``transformers`` in float32, on a tiny checkpoint of four layers
(sliding, full, twice; a window of 8 tokens; a sink per head; 8 experts, 4 a token, with biases
and a clamped SwiGLU; YaRN without truncation): greedy tokens equal token for token and
logprobs within 1e-4, on prompts up to five times the window, with whole prompts and chunked
prefill, with prefix hits longer than the window (a 37-token prefix ending mid-block, of which
its 32 tokens of whole blocks hit; a repeated two-block prompt, of which one block hits); the
forward a piecewise CUDA graph runner splits, run inline; two tensor-parallel ranks (half the
heads and their sinks each, and a slice of every expert or half the experts whole). Hugging
Face with the window widened past every prompt, or the sinks at -inf, gives other tokens, so
both are really applied; the router spreads a prompt's tokens over most experts; a prefill
peer whose window differs is refused at the KV handshake.
"""

import json
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, Mxfp4Config

from baton import LLM, SamplingParams
from baton.tiny_model import make_tiny_model
from services.worker.engine.kv_transfer.params import NO_BLOCK
from tests.helpers import (
    assert_matches_reference,
    copy_checkpoint,
    disaggregated_equals_colocated,
    generate_in_three_batches,
    hf_continue,
    hf_greedy_with_rows,
    refused_peer,
)

MAX_NEW = 12
LOGPROB_ATOL = 1e-4
_SHARED = [(11 * i) % 400 + 7 for i in range(37)]  # 2 blocks of 16 and 5 tokens into a third
PROMPTS = [
    [21, 22, 23, 24],  # inside the window
    [*_SHARED, 50, 51, 52],
    [*_SHARED, 80, 81, 82, 83],  # its hit: the 32 tokens of the shared prefix's whole blocks
    [(3 * i) % 350 + 9 for i in range(32)],  # two whole blocks ...
]
PROMPTS.append(PROMPTS[-1])  # ... again: a hit of one block (the last token is computed)
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=2)
MODES: dict[str, dict[str, Any]] = {
    "default": {},
    "chunked-prefill": {"max_num_batched_tokens": 8, "max_num_seqs": 4},
}


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("gpt_oss") / "m", arch="gpt_oss")


def _hf_model(path: str, **config: Any) -> Any:
    quant = json.loads((Path(path) / "config.json").read_text()).get("quantization_config")
    if quant is not None and quant.get("quant_method") == "mxfp4":  # dequantized, always
        config["quantization_config"] = Mxfp4Config(dequantize=True)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **config)


def _hf_generate(model: Any) -> tuple[list[list[int]], list[list[list[float]]]]:
    return hf_greedy_with_rows(model, PROMPTS, MAX_NEW)


@cache
def hf_reference(path: str) -> tuple[list[list[int]], list[list[list[float]]]]:
    """Hugging Face's greedy tokens and log-softmax rows for each prompt."""
    return _hf_generate(_hf_model(path))


def _generate(llm: LLM) -> list[Any]:
    return generate_in_three_batches(llm, PROMPTS, GREEDY)


def _assert_hugging_faces(path: Path, outs: list[Any]) -> None:
    assert_matches_reference(outs, *hf_reference(str(path)), LOGPROB_ATOL)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_greedy_matches_hugging_face(gpt_oss: Path, mode: str) -> None:
    llm = LLM(model=str(gpt_oss), show_progress=False, dtype="float32", **MODES[mode])
    try:
        assert llm.config.model.max_model_len > max(map(len, PROMPTS)) + MAX_NEW
        outs = _generate(llm)
        stats = llm.get_stats()
    finally:
        llm.shutdown()
    _assert_hugging_faces(gpt_oss, outs)
    assert stats.prefix_hit_tokens == 32 + 16
    assert stats.num_free_blocks == stats.num_blocks


def test_the_window_and_the_sinks_are_applied(gpt_oss: Path) -> None:
    """Hugging Face with the window widened past every prompt, and with the sinks at -inf
    (no sink): other tokens on the long prompts (so equal tokens above mean the engine's
    sliding layers saw only their window, and every head its sink)."""
    windowed, _ = hf_reference(str(gpt_oss))
    wide, _ = _hf_generate(_hf_model(str(gpt_oss), sliding_window=1024))
    # the 4-token prompt: its first 5 tokens come from contexts inside the window (the same)
    assert windowed[0][:5] == wide[0][:5]
    assert all(a != b for a, b in zip(windowed, wide, strict=True))
    sinkless = _hf_model(str(gpt_oss))
    with torch.no_grad():
        for layer in sinkless.model.layers:
            layer.self_attn.sinks.fill_(float("-inf"))
    tokens, _ = _hf_generate(sinkless)
    assert all(a != b for a, b in zip(windowed, tokens, strict=True))


def test_windowed_layers_hold_only_their_window(gpt_oss: Path) -> None:
    """The KV cache groups: a full group and a windowed group of two layers each. A request of
    max_model_len (a 50-token prompt in chunks of 8, 14 new tokens) in a cache of exactly what
    the worker sizes for it: 4 blocks of the full group and the 2 blocks that a window of 8
    under a chunk of 8 can touch, where a cache without groups would need 8. It runs to the
    end only if the windowed group hands its older blocks back as the request moves on (no
    block for a preemption to take), and its tokens still equal Hugging Face's."""
    prompt = [(5 * i) % 380 + 11 for i in range(50)]
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    llm = LLM(model=str(gpt_oss), show_progress=False, dtype="float32", max_model_len=64,
              num_kv_blocks=6, max_num_batched_tokens=8, max_num_seqs=4)  # fmt: skip
    try:
        info = llm.get_model_info()
        out = llm.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0]
        stats = llm.get_stats()
    finally:
        llm.shutdown()
    assert info.kv_cache_groups == "2 groups of 2 layers: full, window 8"
    page = 2 * 2 * 16 * 2 * 32 * 4  # layers a page × K, V × tokens × KV heads × head dim × fp32
    assert info.kv_request_bytes == 6 * page  # 4 full blocks, 2 windowed
    assert info.kv_full_attention_request_bytes == 4 * 4 * page // 2  # 4 blocks of 4 layers
    assert stats.num_preemptions == 0 and stats.num_free_blocks == stats.num_blocks == 6
    want = hf_continue(_hf_model(str(gpt_oss)), torch.tensor([prompt]), 14)
    assert out.token_ids == want[0, len(prompt) :].tolist()


def test_disaggregated_pulls_the_full_blocks_and_the_last_window(gpt_oss: Path) -> None:
    """Prefill and decode engines over NIXL (UCX): the handle lists the full group's five
    blocks of the 70-token prompt and, of the windowed group's, only the two the next token's
    window (positions 63..69) touches; the decode engine pulls those seven blocks and decodes
    on past the window to the colocated engine's tokens and logprobs."""
    ids = [(7 * i) % 390 + 5 for i in range(70)]
    kw: dict[str, Any] = {"num_kv_blocks": 64, "max_model_len": 256, "show_progress": False}
    first, stats = disaggregated_equals_colocated(gpt_oss, ids, LOGPROB_ATOL, **kw)
    handle = first.kv_handle
    assert handle is not None and handle.num_groups == 2
    full, window = handle.group_block_ids()
    assert NO_BLOCK not in full and len(full) == 5
    assert window[:3] == [NO_BLOCK] * 3 and NO_BLOCK not in window[3:]
    page = 2 * 2 * 16 * 2 * 32 * 4  # layers a page × K, V × tokens × KV heads × head dim × fp32
    assert stats.kv_pulls == 1 and stats.kv_pull_failures == 0
    assert stats.kv_pull_bytes == 7 * page


def test_a_peer_with_other_kv_groups_is_refused(
    gpt_oss: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The same model under the same name but with a window of 16 on the prefill side: each
    cache's geometry is the same and only the groups differ (its windowed blocks would be the
    wrong ones), so the handshake refuses it, naming both groups, reads nothing, and the decode
    engine recomputes the prompt."""
    wider = copy_checkpoint(gpt_oss, tmp_path / "wider")
    config = json.loads((wider / "config.json").read_text())
    (wider / "config.json").write_text(json.dumps({**config, "sliding_window": 16}))
    ids = [(7 * i) % 390 + 5 for i in range(40)]
    kw: dict[str, Any] = {"num_kv_blocks": 64, "max_model_len": 256, "show_progress": False,
                          "served_model_name": "gpt-oss"}  # fmt: skip
    refusal = refused_peer(wider, gpt_oss, ids, caplog, **kw)
    assert "4 layers in 2 groups of 2 layers: full, window 16, blocks of 16" in refusal  # theirs
    assert "4 layers in 2 groups of 2 layers: full, window 8, blocks of 16" in refusal  # ours


def test_a_prompts_tokens_spread_over_most_experts(gpt_oss: Path) -> None:
    """Routing that sent every token to the same few experts would leave most experts'
    weights (their loading from the stacked tensors, their slicing over ranks) untested."""
    model = _hf_model(str(gpt_oss))
    used: dict[int, set[int]] = {}
    for i, layer in enumerate(model.model.layers):  # its router returns (logits, weights, ids)
        layer.mlp.router.register_forward_hook(
            lambda mod, args, out, i=i: used.setdefault(i, set()).update(out[2].flatten().tolist())
        )
    with torch.no_grad():
        model(torch.tensor([PROMPTS[1]]))
    assert sorted(used) == [0, 1, 2, 3]
    assert all(len(chosen) >= 0.75 * model.config.num_local_experts for chosen in used.values())


def test_piecewise_split_forward_matches_hugging_face(gpt_oss: Path) -> None:
    """The forward a piecewise CUDA graph runner splits at each layer's attention call, run
    inline (CPU): sliding and full layers between the pieces, padding rows, mixed steps."""
    llm = LLM(model=str(gpt_oss), show_progress=False, dtype="float32",
              max_num_batched_tokens=24, max_num_seqs=4)  # fmt: skip
    try:
        runner = llm.client.core.executor.worker.runner  # type: ignore[attr-defined]
        runner.start_piecewise_graphs((8, 16, 24), capture=False)
        outs = _generate(llm)
    finally:
        llm.shutdown()
    _assert_hugging_faces(gpt_oss, outs)


@pytest.mark.parametrize("ep", [False, True], ids=["tp-slices", "expert-parallel"])
def test_two_ranks_equal_hugging_face(gpt_oss: Path, ep: bool) -> None:
    """Each rank one of the two KV heads, half the query heads and their sinks, and half of
    every expert's intermediate columns (the down bias added by rank 0 alone) or half the
    experts whole; chunked prefill and prefix hits as above."""
    llm = LLM(model=str(gpt_oss), show_progress=False, dtype="float32", tensor_parallel_size=2,
              enable_expert_parallel=ep, **MODES["chunked-prefill"])  # fmt: skip
    try:
        outs = _generate(llm)
        stats = llm.get_stats()
    finally:
        llm.shutdown()
    _assert_hugging_faces(gpt_oss, outs)
    assert stats.prefix_hit_tokens == 32 + 16


@pytest.fixture(scope="module")
def gpt_oss_mxfp4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same model with its experts in MXFP4, as openai publishes gpt-oss."""
    path = tmp_path_factory.mktemp("gpt_oss_mxfp4") / "m"
    return make_tiny_model(path, arch="gpt_oss", quantize="mxfp4")


_RANKS = [{}, {"tensor_parallel_size": 2},
          {"tensor_parallel_size": 2, "enable_expert_parallel": True}]  # fmt: skip


@pytest.mark.parametrize("kw", _RANKS, ids=["one-rank", "tp-slices", "expert-parallel"])
def test_the_published_mxfp4_checkpoint_equals_hugging_face(
    gpt_oss_mxfp4: Path, gpt_oss: Path, kw: dict[str, Any]
) -> None:
    """The engine dequantizes the experts' blocks and scales at load (each rank its share of
    them) and equals Hugging Face, which dequantizes the same checkpoint, token for token. The
    float model they were quantized from gives other tokens: the MXFP4 weights are the ones
    run."""
    with LLM(model=str(gpt_oss_mxfp4), show_progress=False, dtype="float32",
             **kw, **MODES["chunked-prefill"]) as llm:  # fmt: skip
        assert llm.config.model.quantization is None  # (dequantized: run as a float model)
        outs = _generate(llm)
    _assert_hugging_faces(gpt_oss_mxfp4, outs)
    assert hf_reference(str(gpt_oss_mxfp4))[0] != hf_reference(str(gpt_oss))[0]


def test_an_mxfp4_checkpoint_quantized_to_fp8_at_load(gpt_oss_mxfp4: Path, tmp_path: Path) -> None:
    """``quantization="fp8"``: the dequantized experts are quantized again as a float
    checkpoint's are (per channel): the same tokens and logprobs as a float copy of the
    dequantized model quantized at load."""
    from safetensors.torch import load_file, save_file

    from services.worker.engine.models import mxfp4

    copy = copy_checkpoint(gpt_oss_mxfp4, tmp_path / "float")
    tensors = load_file(copy / "model.safetensors")
    for name in [n for n in tensors if n.endswith("_blocks")]:
        base = name.removesuffix("_blocks")  # [E, out, in] → transformers' [E, in, out]
        w = mxfp4.dequantize(tensors.pop(name), tensors.pop(f"{base}_scales"), torch.float32)
        tensors[base] = w.transpose(1, 2).contiguous()
    save_file(tensors, str(copy / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((copy / "config.json").read_text())
    del config["quantization_config"]
    (copy / "config.json").write_text(json.dumps(config))
    outs = []
    for path in (gpt_oss_mxfp4, copy):
        with LLM(model=str(path), show_progress=False, dtype="float32",
                 quantization="fp8") as llm:  # fmt: skip
            quant = llm.config.model.quantization
            assert quant is not None and quant.online
            outs.append(_generate(llm))
    (mx, fl) = outs
    assert [o.token_ids for o in mx] == [o.token_ids for o in fl]
    for a, b in zip(mx, fl, strict=True):
        for x, y, t in zip(a.logprobs, b.logprobs, a.token_ids,
                           strict=True):  # fmt: skip
            assert x[t].logprob == pytest.approx(y[t].logprob, abs=1e-5)
