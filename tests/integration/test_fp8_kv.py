"""The FP8 KV cache (``kv_cache_dtype="fp8"``: e4m3, a unit scale per layer) on CPU: the oracle
is Hugging Face ``transformers`` with every key and value rounded through e4m3 as it enters its
cache; a cache of 1 byte an element holds 4× the float32 tokens in the same bytes; P/D moves an
FP8 cache between FP8 engines, and an FP8 engine refuses to read a float one (the handshake's
compatibility hash covers the KV dtype)."""

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers.cache_utils
from transformers import AutoModelForCausalLM, AutoTokenizer

from baton import LLM, SamplingParams
from shared.text.tokenizer import TextTokenizer
from tests.helpers import copy_checkpoint, disaggregated

PROMPTS = ["Hi", "The quick brown fox jumps over the lazy dog", "import os\nimport sys\n\n"]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
TIE = 0.05


@pytest.fixture
def fp8_cache_reference(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """transformers' dynamic cache, storing keys and values rounded through e4m3."""
    update = transformers.cache_utils.DynamicLayer.update

    def rounded(self: Any, k: torch.Tensor, v: torch.Tensor, *a: Any, **kw: Any) -> Any:
        def e4m3(x: torch.Tensor) -> torch.Tensor:
            return x.float().clamp(-448, 448).to(torch.float8_e4m3fn).to(x.dtype)

        return update(self, e4m3(k), e4m3(v), *a, **kw)

    monkeypatch.setattr(transformers.cache_utils.DynamicLayer, "update", rounded)
    yield


@pytest.mark.parametrize("name", ["llama", "qwen2-sharded", "qwen3"])
def test_fp8_kv_cache_matches_transformers_rounding_its_cache(
    tiny_models: dict[str, Path], name: str, fp8_cache_reference: None
) -> None:
    path = tiny_models[name]
    llm = LLM(
        model=str(path),
        kv_cache_dtype="fp8",
        show_progress=False,
        max_num_batched_tokens=8,
        max_num_seqs=4,
    )  # chunked: later chunks read the cache
    try:
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(path)
    exact, steps = 0, 0
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ids = tok(prompt, return_tensors="pt")["input_ids"]
        want = ref.generate(ids, max_new_tokens=GREEDY.max_tokens, do_sample=False,
                            output_logits=True, return_dict_in_generate=True)  # fmt: skip
        got = out.outputs[0].token_ids
        for step, t in enumerate(got):
            row = want.logits[step][0].float().log_softmax(-1)
            if want.sequences[0, ids.shape[1] + step] != t:  # a near-tie broken the other way
                assert row[t] >= row.max() - TIE, (prompt, step)
                break  # the two sequences differ from here on
            exact += 1
            assert out.outputs[0].logprobs[step][t].logprob == pytest.approx(
                float(row[t]), abs=1e-3
            )
        steps += len(got)
    assert exact >= 0.9 * steps


def test_fp8_kv_cache_holds_four_times_the_float32_tokens(tiny_model: Path) -> None:
    budget = {"kv_cache_memory_bytes": 8 << 20, "max_model_len": 512}
    sizes = {}
    for dtype in ("auto", "fp8"):
        llm = LLM(model=str(tiny_model), kv_cache_dtype=dtype, show_progress=False, **budget)
        sizes[dtype] = (llm.get_stats().num_blocks, llm.get_model_info().kv_bytes_per_token)
        llm.shutdown()
    assert sizes["fp8"][1] * 4 == sizes["auto"][1]  # float32 on CPU: 4 bytes → 1
    assert sizes["fp8"][0] == 4 * sizes["auto"][0]


def test_the_triton_kernels_read_an_fp8_cache_as_the_torch_backend_does(tiny_model: Path) -> None:
    """The Triton kernels (here in the interpreter) write and read an FP8 cache: greedy tokens,
    with a prefix hit, equal the torch backend's over the same FP8 cache."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [PROMPTS[1], PROMPTS[1] + " again"]  # the second hits the first's blocks
    outs = {}
    for backend in ("torch", "triton"):
        llm = LLM(model=str(tiny_model), kv_cache_dtype="fp8", attention_backend=backend,
                  num_kv_blocks=64, max_model_len=256, show_progress=False)  # fmt: skip
        try:
            outs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
            assert llm.get_model_info().kv_cache_dtype == "float8_e4m3fn"
        finally:
            llm.shutdown()
    assert outs["triton"] == outs["torch"]
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        LLM(model=str(tiny_model), kv_cache_dtype="int8")


def test_pd_between_fp8_caches_and_refusal_of_a_float_one(tiny_model: Path) -> None:
    kw: dict[str, Any] = {"multiprocess": True, "kv_transfer": True, "num_kv_blocks": 128,
                          "max_model_len": 1024, "show_progress": False}  # fmt: skip
    ref = LLM(model=str(tiny_model), kv_cache_dtype="fp8", num_kv_blocks=128, max_model_len=1024,
              show_progress=False)  # fmt: skip
    prefill = LLM(model=str(tiny_model), kv_cache_dtype="fp8", **kw)
    decode = LLM(model=str(tiny_model), kv_cache_dtype="fp8", **kw)
    plain = LLM(model=str(tiny_model), kv_recompute_on_failure=False, **kw)
    try:
        ids = TextTokenizer(tiny_model).encode("The quick brown fox jumps over the lazy dog " * 4)
        params = SamplingParams(temperature=0, max_tokens=12)
        want = ref.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
        first, rest = disaggregated(prefill, decode, ids, params)
        assert first.outputs[0].token_ids + rest.outputs[0].token_ids == want.outputs[0].token_ids
        stats = decode.get_stats()
        assert stats.kv_pulls == 1 and stats.kv_pull_failures == 0
        # 1 byte an element: the pull moved a quarter of what a float32 cache would
        blocks = len(first.kv_handle.block_ids)  # type: ignore[union-attr]
        assert stats.kv_pull_bytes == blocks * 16 * decode.get_model_info().kv_bytes_per_token
        # an FP8 handle read by a float32 engine: refused at the handshake, the request fails
        _, refused = disaggregated(prefill, plain, ids, params)
        assert refused.outputs[0].finish_reason == "error"
        assert plain.get_stats().kv_pulls == 0 and plain.get_stats().kv_pull_failures == 1
    finally:
        for e in (ref, prefill, decode, plain):
            e.shutdown()


# --- a checkpoint's KV cache scales (compressed-tensors kv_cache_scheme) ---


@pytest.fixture(scope="module")
def scaled_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """FP8 weights per channel, and a key and a value scale per layer calibrated on a text."""
    from baton.tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("kv-scales")
    return make_tiny_model(root / "m", arch="qwen3", quantize="fp8-channel", kv_scales=True)


def _stored_scales(path: Path) -> list[tuple[float, float]]:
    from baton.tiny_fp8 import kv_scales

    scales = kv_scales(path)
    return [scales[i] for i in sorted(scales)]


def test_checkpoint_kv_scales_reach_the_cache_and_match_the_reference(
    scaled_checkpoint: Path,
) -> None:
    """The engine's FP8 cache takes the checkpoint's per-layer scales (none of them 1), and its
    greedy tokens and logprobs are those of the dequantizing reference whose cache holds
    e4m3(k / k_scale) · k_scale and e4m3(v / v_scale) · v_scale (chunked prefill: later chunks
    read the cache)."""
    from baton.tiny_fp8 import rounding_kv_cache
    from tests.helpers import FP8_GREEDY, FP8_PROMPTS, check_against_fp8_reference

    want = _stored_scales(scaled_checkpoint)
    assert len(want) == 2 and all(k != 1.0 and v != 1.0 for k, v in want)
    llm = LLM(model=str(scaled_checkpoint), kv_cache_dtype="fp8", show_progress=False,
              max_num_batched_tokens=8, max_num_seqs=4)  # fmt: skip
    try:
        runner = llm.client.core.executor.worker.runner  # type: ignore[attr-defined]
        assert runner.kv_scales() == want
        views = [a.kv_cache for a in runner.model.attention_layers()]
        assert [(v.k_scale, v.v_scale) for v in views] == want
        assert "KV scales" in llm.get_model_info().quantization
        outs = llm.generate(FP8_PROMPTS, FP8_GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    with rounding_kv_cache(scaled_checkpoint):
        exact = check_against_fp8_reference(scaled_checkpoint, outs)
    assert exact >= 0.9 * len(FP8_PROMPTS) * FP8_GREEDY.max_tokens


def test_kv_scales_by_their_older_names_and_a_float_cache_ignores_them(
    scaled_checkpoint: Path, tmp_path: Path
) -> None:
    """Older compressed-tensors checkpoints call them ``k_proj.output_scale`` /
    ``v_proj.output_scale``; a float KV cache has no use for them (and reads as without)."""
    from safetensors.torch import load_file, save_file

    path = copy_checkpoint(scaled_checkpoint, tmp_path / "old-names")
    tensors = load_file(path / "model.safetensors")
    renamed = {k.replace("self_attn.k_scale", "self_attn.k_proj.output_scale")
                .replace("self_attn.v_scale", "self_attn.v_proj.output_scale"): v
               for k, v in tensors.items()}  # fmt: skip
    save_file(renamed, str(path / "model.safetensors"), metadata={"format": "pt"})
    llm = LLM(model=str(path), kv_cache_dtype="fp8", show_progress=False)
    try:
        assert llm.client.core.executor.worker.runner.kv_scales() == _stored_scales(  # type: ignore[attr-defined]
            scaled_checkpoint
        )
    finally:
        llm.shutdown()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    plain = LLM(model=str(scaled_checkpoint), show_progress=False)  # float32 cache
    try:
        views = [
            a.kv_cache for a in plain.client.core.executor.worker.runner.model.attention_layers()
        ]  # type: ignore[attr-defined]
        assert all((v.k_scale, v.v_scale) == (1.0, 1.0) for v in views)
        assert plain.generate(PROMPTS, params, use_tqdm=False)[0].outputs[0].token_ids
    finally:
        plain.shutdown()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("dynamic", "kv_cache_scheme: static 8-bit float"),
        ("two-values", r"model\.layers\.0\.self_attn\.k_scale.*one value"),
        ("missing", r"lacks weights for: model\.layers\.0\.self_attn\.k_scale"),
    ],
)
def test_kv_scales_the_engine_cannot_use_are_refused(
    scaled_checkpoint: Path, tmp_path: Path, change: str, message: str
) -> None:
    import json

    from safetensors.torch import load_file, save_file

    path = copy_checkpoint(scaled_checkpoint, tmp_path / change)
    tensors = load_file(path / "model.safetensors")
    name = "model.layers.0.self_attn.k_scale"
    if change == "dynamic":
        config = json.loads((path / "config.json").read_text())
        config["quantization_config"]["kv_cache_scheme"]["dynamic"] = True
        (path / "config.json").write_text(json.dumps(config))
    elif change == "two-values":
        tensors[name] = tensors[name].reshape(1).repeat(2)  # a scale per head, say
    else:
        del tensors[name]
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=message):
        LLM(model=str(path), kv_cache_dtype="fp8", show_progress=False)


def test_the_kv_compatibility_hash_covers_the_scales() -> None:
    """P/D peers whose FP8 caches have other scales refuse each other at the handshake: the
    same codes would be other values."""
    from services.worker.engine.kv_transfer.connector import compat_hash

    geometry = ("m", "float8_e4m3fn", 16, 2, 2, 16)
    unit = compat_hash(*geometry, [(1.0, 1.0), (1.0, 1.0)])
    assert compat_hash(*geometry, [(1.0, 1.0), (1.0, 1.0)]) == unit
    assert compat_hash(*geometry, [(1.0, 1.0), (0.5, 1.0)]) != unit
    assert compat_hash(*geometry, [(1.0, 1.0), (1.0, 0.25)]) != unit
