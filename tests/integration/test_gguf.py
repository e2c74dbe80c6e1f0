"""GGUF checkpoints through the engine: ``EngineArgs(model="x.gguf")`` reads its config from the
file; every layer loads, through its ``weight_loader``, exactly ``gguf.quants.dequantize``'s
values of its tensor (q and k rows un-permuted), a tensor-parallel rank only its slice, for
every tested type, and FP8 quantizes those values at load; SmolLM2-135M-Instruct (Q4_1) answers
chat prompts token for token as Hugging Face transformers does on the same file, on one rank and
on three.
"""

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from baton import LLM, SamplingParams
from services.worker.engine.config import EngineArgs
from services.worker.engine.distributed import parallel_state
from services.worker.engine.distributed.parallel_state import GroupCoordinator
from services.worker.engine.quantization.fp8_math import quantize_rows
from services.worker.engine.worker.model_runner import ModelRunner
from tests.smollm2 import chat_prompts, transformers_model, transformers_tokenizer
from tests.tiny_gguf import T, reference, write_tiny_gguf

TYPES = [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q4_K, T.Q5_K, T.Q6_K]
MAX_NEW = 24
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW)


def _load(path: Path, rank: int = 0, size: int = 1, **kw: Any) -> ModelRunner:
    """One rank's share of the model, loaded in this process (no collectives)."""
    config = EngineArgs(model=str(path), device="cpu", **kw).create_engine_config()
    with parallel_state.use_tp_group(GroupCoordinator(rank, size)):
        runner = ModelRunner(config, torch.device("cpu"))
        runner.load_model(show_progress=False)
    return runner


def _expected(ref: dict[str, np.ndarray], rank: int, size: int) -> dict[str, np.ndarray]:
    """Each parameter of rank ``rank`` of ``size`` as the Megatron split cuts the tensors."""

    def rows(name: str) -> np.ndarray:
        t = ref[name]
        n = t.shape[0] // size
        return t[rank * n : (rank + 1) * n]

    def cols(name: str) -> np.ndarray:
        t = ref[name]
        n = t.shape[1] // size
        return t[:, rank * n : (rank + 1) * n]

    want = {
        "model.embed_tokens.weight": rows("token_embd.weight"),
        "model.norm.weight": ref["output_norm.weight"],
    }
    if "output.weight" in ref:
        want["lm_head.weight"] = rows("output.weight")
    layers = sum(name.endswith(".attn_norm.weight") for name in ref)
    for i in range(layers):
        layer, blk = f"model.layers.{i}.", f"blk.{i}."
        want |= {
            layer + "input_layernorm.weight": ref[blk + "attn_norm.weight"],
            layer + "post_attention_layernorm.weight": ref[blk + "ffn_norm.weight"],
            layer + "self_attn.o_proj.weight": cols(blk + "attn_output.weight"),
            layer + "mlp.gate_up_proj.weight": np.concatenate(
                [rows(blk + "ffn_gate.weight"), rows(blk + "ffn_up.weight")]
            ),
            layer + "mlp.down_proj.weight": cols(blk + "ffn_down.weight"),
        }
        for kind in ("weight", "bias"):
            if f"{blk}attn_q.{kind}" in ref:
                qkv = [rows(f"{blk}attn_{x}.{kind}") for x in "qkv"]
                want[f"{layer}self_attn.qkv_proj.{kind}"] = np.concatenate(qkv)
        for norm in ("q_norm", "k_norm"):
            if f"{blk}attn_{norm}.weight" in ref:
                want[f"{layer}self_attn.{norm}.weight"] = ref[f"{blk}attn_{norm}.weight"]
    return want


def _check_ranks(
    path: Path, heads: tuple[int, int] | None, ranks: tuple[tuple[int, int], ...], **kw: Any
) -> None:
    ref = reference(path, heads)
    for rank, size in ranks:
        runner = _load(path, rank, size, **kw)
        params = dict(runner.model.named_parameters())
        want = _expected(ref, rank, size)
        assert set(params) == set(want)
        for name, param in params.items():
            assert torch.equal(param, torch.from_numpy(want[name])), (name, rank, size)
        # only this rank's slices are dequantized (the tied LM head is the embedding)
        assert runner.read.bytes == sum(w.nbytes for w in want.values())


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_each_rank_loads_its_slice_of_the_dequantized_tensors(tmp_path: Path, qtype: T) -> None:
    """Bit for bit, through every layer's ``weight_loader``: the K-quants' 256-value blocks
    are cut mid-block by the row-parallel o_proj's 128 columns a rank."""
    path = write_tiny_gguf(tmp_path / "tiny.gguf", qtype, tied=False)
    _check_ranks(path, (4, 2), ((0, 1), (0, 2), (1, 2)))


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_loads_its_rows_as_they_lie(tmp_path: Path, arch: str) -> None:
    """q/k/v biases (qwen2), q/k norms and a head_dim of its own (qwen3), nothing permuted."""
    path = write_tiny_gguf(tmp_path / "tiny.gguf", T.Q8_0, arch, head_dim=32, tied=arch == "qwen3")
    _check_ranks(path, None, ((0, 1), (0, 2), (1, 2)))


def test_smollm2_ranks_load_their_slices_bit_for_bit(smollm2_gguf: Path) -> None:
    """The model's own types (Q8_0 embedding, Q4_1 projections, F32 norms) and heads: rank 1
    of 3 holds query heads 3-5 and KV head 1, the vocabulary's second third."""
    _check_ranks(smollm2_gguf, (9, 3), ((1, 3),), max_model_len=64)


def test_fp8_quantizes_the_dequantized_weights(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "tiny.gguf", T.Q4_K)
    want = _expected(reference(path, heads=(4, 2)), 0, 1)
    runner = _load(path, quantization="fp8")
    assert runner.config.model.quantization is not None
    params = dict(runner.model.named_parameters())
    for proj in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
        name = f"model.layers.0.{proj}"
        codes, scale = quantize_rows(torch.from_numpy(want[f"{name}.weight"]))
        assert params[f"{name}.weight"].dtype == torch.float8_e4m3fn
        assert torch.equal(params[f"{name}.weight"].view(torch.uint8), codes.view(torch.uint8))
        assert torch.equal(params[f"{name}.weight_scale"], scale)


def test_the_engine_config_comes_from_the_file(smollm2_gguf: Path, tmp_path: Path) -> None:
    config = EngineArgs(model=str(smollm2_gguf), device="cpu").create_engine_config()
    model = config.model
    assert (model.served_model_name, model.load_format, model.dtype) == (
        "SmolLM2-135M-Instruct.Q4_1", "gguf", "float32",
    )  # fmt: skip
    arch = model.arch
    assert (arch.architecture, arch.num_layers, arch.num_heads, arch.num_kv_heads) == (
        "LlamaForCausalLM", 30, 9, 3,
    )  # fmt: skip
    assert (arch.head_dim, arch.vocab_size, arch.rope.theta) == (64, 49152, 100000.0)
    assert arch.tie_word_embeddings and arch.eos_token_ids == (2,) and model.max_model_len == 8192
    folder = tmp_path / "smollm2"  # a directory holding the file
    folder.mkdir()
    (folder / smollm2_gguf.name).symlink_to(smollm2_gguf)
    config = EngineArgs(model=str(folder), device="cpu").create_engine_config()
    assert (config.model.served_model_name, config.model.load_format) == ("smollm2", "gguf")
    with pytest.raises(ValueError, match=r"load_format='safetensors', but .* is a gguf"):
        EngineArgs(model=str(folder), load_format="safetensors").create_engine_config()
    gpt2 = write_tiny_gguf(tmp_path / "gpt2.gguf", arch="gpt2")
    with pytest.raises(ValueError, match=r"unsupported architecture 'gpt2'"):
        EngineArgs(model=str(gpt2)).create_engine_config()


@pytest.fixture(scope="module")
def transformers_side(
    smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[list[list[int]], list[list[int]], Path]:
    """The chat prompts as transformers' tokenizer renders them, transformers' greedy tokens,
    and that tokenizer saved for the engine's front end."""
    tok = transformers_tokenizer(smollm2_gguf)
    prompts = chat_prompts(tok)
    model = transformers_model(smollm2_gguf)
    tokens = []
    with torch.no_grad():
        for ids in prompts:
            out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False)
            tokens.append(out[0, len(ids) :].tolist())
    saved = tmp_path_factory.mktemp("smollm2-tokenizer")
    tok.save_pretrained(saved)
    return prompts, tokens, saved


def _generate(path: Path, tokenizer: Path, prompts: list[list[int]], **kw: Any) -> list[Any]:
    """Greedy tokens of Baton on CPU in float32 (as transformers runs), the prompts as ids."""
    llm = LLM(model=str(path), tokenizer=str(tokenizer), device="cpu", dtype="float32",
              show_progress=False, **kw)  # fmt: skip
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def one_rank(smollm2_gguf: Path, transformers_side: Any) -> list[list[int]]:
    prompts, _, tokenizer = transformers_side
    return _generate(smollm2_gguf, tokenizer, prompts)


def test_smollm2_answers_as_transformers_does(transformers_side: Any, one_rank: Any) -> None:
    _, want, _ = transformers_side
    assert one_rank == want
    assert sum(len(t) for t in want) > 2 * MAX_NEW  # not all stopped at once


def test_smollm2_on_three_ranks_answers_as_on_one(
    smollm2_gguf: Path, transformers_side: Any, one_rank: Any
) -> None:
    """9 query heads and 3 KV heads, one KV head a rank; the vocabulary in thirds."""
    prompts, _, tokenizer = transformers_side
    assert _generate(smollm2_gguf, tokenizer, prompts, tensor_parallel_size=3) == one_rank
