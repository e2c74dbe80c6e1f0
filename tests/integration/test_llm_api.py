"""The public offline API: output shapes, n, seeds, stop strings, logprobs, chat, prefix reuse,
freeing, and clear errors for bad input."""

import json
import shutil
from pathlib import Path

import pytest

from baton import LLM, SamplingParams

LONG = "A custom key function can be supplied to customize the sort order of the list. " * 3


@pytest.fixture(scope="module")
def llm(tiny_model: Path) -> LLM:
    return LLM(model=str(tiny_model), show_progress=False, max_model_len=512)


def test_outputs_have_vllm_shape(llm: LLM) -> None:
    [out] = llm.generate("Hello there", SamplingParams(temperature=0, max_tokens=5))
    assert out.prompt == "Hello there"
    assert out.prompt_token_ids == llm.tokenizer("Hello there")["input_ids"]
    [c] = out.outputs
    assert len(c.token_ids) == 5 and c.finish_reason == "length" and out.finished
    assert c.text == llm.tokenizer.decode(c.token_ids, skip_special_tokens=True)


def test_token_id_prompts_and_order_is_kept(llm: LLM) -> None:
    prompts = [{"prompt_token_ids": [5, 6, 7]}, "two", {"prompt_token_ids": [9] * 40}]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=3))
    assert [o.prompt_token_ids for o in outs] == [
        [5, 6, 7],
        llm.tokenizer("two")["input_ids"],
        [9] * 40,
    ]


def test_n_samples_differ_and_seed_reproduces(llm: LLM) -> None:
    params = SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=1234)
    first = llm.generate("Once upon a time", params)[0]
    again = llm.generate("Once upon a time", params)[0]
    assert [c.index for c in first.outputs] == [0, 1, 2]
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]
    assert len({tuple(c.token_ids) for c in first.outputs}) > 1


def test_seeded_output_does_not_depend_on_the_batch(llm: LLM) -> None:
    seeded = SamplingParams(temperature=1.0, max_tokens=16, seed=7)
    alone = llm.generate("Seeded prompt", seeded)[0].outputs[0].token_ids
    noise = SamplingParams(temperature=1.0, max_tokens=20)
    batch = llm.generate(["other one", "Seeded prompt", LONG], [noise, seeded, noise])
    assert batch[1].outputs[0].token_ids == alone


def test_stop_string_cuts_text_and_names_the_reason(llm: LLM) -> None:
    free = llm.generate("The module", SamplingParams(temperature=0, max_tokens=30))[0].outputs[0]
    stop = free.text[5:8]  # a string the greedy continuation is known to contain
    assert len(stop) == 3
    cut = llm.generate("The module", SamplingParams(temperature=0, max_tokens=30, stop=[stop]))
    c = cut[0].outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == free.text[: free.text.index(stop)]
    kept = llm.generate(
        "The module",
        SamplingParams(temperature=0, max_tokens=30, stop=[stop], include_stop_str_in_output=True),
    )[0].outputs[0]
    assert kept.text == free.text[: free.text.index(stop) + len(stop)]


def test_stop_token_ids(llm: LLM) -> None:
    free = llm.generate("abc", SamplingParams(temperature=0, max_tokens=10))[0].outputs[0]
    target = free.token_ids[3]
    out = llm.generate("abc", SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[target]))
    c = out[0].outputs[0]
    assert c.token_ids == free.token_ids[: free.token_ids.index(target) + 1]
    assert c.finish_reason == "stop" and c.stop_reason == target


def test_logprobs_shape(llm: LLM) -> None:
    c = llm.generate("logprobs", SamplingParams(temperature=0, max_tokens=4, logprobs=3))[
        0
    ].outputs[0]
    assert c.logprobs is not None and len(c.logprobs) == 4
    for token, position in zip(c.token_ids, c.logprobs, strict=True):
        assert token in position and position[token].rank == 1  # greedy: the sampled is the top
        assert 3 <= len(position) <= 4
        assert all(lp.logprob <= 0 and lp.decoded_token is not None for lp in position.values())


def test_chat_uses_the_template(llm: LLM) -> None:
    messages = [{"role": "user", "content": "hello"}]
    [out] = llm.chat(messages, SamplingParams(temperature=0, max_tokens=4))
    text = llm.tokenizer.decode(out.prompt_token_ids)
    assert text == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"


def test_prefix_is_reused_and_only_new_tokens_computed(llm: LLM) -> None:
    llm.reset_prefix_cache()
    before = llm.get_stats()
    llm.generate(LONG, SamplingParams(temperature=0, max_tokens=2))
    [out] = llm.generate(LONG + " Then more.", SamplingParams(temperature=0, max_tokens=2))
    n_prompt = len(llm.tokenizer(LONG)["input_ids"])
    assert out.num_cached_tokens == (n_prompt // 16) * 16 > 0
    after = llm.get_stats()
    assert after.prefix_hit_tokens - before.prefix_hit_tokens == out.num_cached_tokens
    # what the model really ran: the first request's whole prompt and one decode step, then
    # only the uncached part of the second prompt and one decode step
    n_second = len(out.prompt_token_ids)
    ran = after.computed_tokens - before.computed_tokens
    assert ran == (n_prompt + 1) + (n_second - out.num_cached_tokens + 1)
    assert after.num_free_blocks == after.num_blocks  # finished requests hold nothing


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"prompt_logprobs": 100}, "prompt_logprobs"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 2}, "top_p"),
        ({"logprobs": 100}, "logprobs"),
    ],
)
def test_bad_sampling_params(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_bad_prompts(llm: LLM) -> None:
    params = SamplingParams(max_tokens=4)
    with pytest.raises(ValueError, match="context length"):
        llm.generate({"prompt_token_ids": [5] * 512}, params)
    with pytest.raises(ValueError, match="empty"):
        llm.generate({"prompt_token_ids": []}, params)
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate({"prompt_token_ids": [10**9]}, params)
    with pytest.raises(ValueError, match="list of integers"):
        llm.generate({"prompt_token_ids": ["a"]}, params)
    with pytest.raises(ValueError, match="2 sampling params for 1 prompts"):
        llm.generate(["x"], [params, params])
    stats = llm.get_stats()
    assert stats.num_waiting == 0 and stats.num_running == 0


def test_bad_engine_arguments(tiny_model: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(model=str(tiny_model), max_model_len=10**6)
    known = "auto, flash_attn, torch, triton"
    with pytest.raises(ValueError, match=rf"unknown attention backend .nope.; known: {known}"):
        LLM(model=str(tiny_model), attention_backend="nope")
    with pytest.raises(ValueError, match="dtype"):
        LLM(model=str(tiny_model), dtype="float8")
    with pytest.raises(TypeError, match="unknown LLM arguments: max_num_sequences"):
        LLM(model=str(tiny_model), max_num_sequences=4)
    with pytest.raises(ValueError, match="KV cache holds 2 blocks"):
        LLM(model=str(tiny_model), num_kv_blocks=2, max_model_len=512)
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        LLM(model=str(tmp_path))


def test_unknown_architecture_lists_the_supported_ones(tiny_model: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(tiny_model, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["GPTBigCodeForCausalLM"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"unsupported model architecture .*LlamaForCausalLM"):
        LLM(model=str(bad))


def test_dummy_weights_load_and_generate(tiny_model: Path) -> None:
    llm = LLM(model=str(tiny_model), load_format="dummy", show_progress=False, max_model_len=128)
    [out] = llm.generate("dummy", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 3
