"""A GGUF model's tokenizer and chat template, rebuilt from the file's metadata
(shared/text/gguf_tokenizer.py): the same ids as ``transformers`` loading the same file, split
as llama.cpp splits, on the gateway, the worker's front end and the offline engine alike."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
from gguf import GGUFWriter, TokenType
from tokenizers import Tokenizer, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from services.gateway.app import create_app
from services.gateway.settings import GatewaySettings
from services.worker.engine.tokenizer import apply_chat_template, load_tokenizer
from shared.text.gguf_tokenizer import UnsupportedTokenizer
from shared.text.tokenizer import TextTokenizer

CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's here; we'll SEE what THEY'VE done.",
    "def mean(xs):\n    total = 0\n    for x in xs:\n\t\ttotal += x  # tab-indented\n"
    "    return total / len(xs)\n",
    "Pi is 3.14159; 2024-12-04, 1,000,000 items, x=42, v1.2.3, 0xFF, 1e-9",
    "naïve café — “quotes” ünïcödé 🎉👍🏽 🇫🇷 ∑∫√ 𝔘",
    "日本語のテキスト、中文字符和标点。한국어 텍스트",
    "   three leading, trailing three   ",
    "\n\nlines\n\n\n  indented\n \n\t\n",
    "multiple    internal     spaces",
    "a   1  22\n 3\t4 \n5",  # digits after whitespace: where SmolLM2 splits digits apart
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "text<|im_end|>more <|im_start|> <|endoftext|>",
    "",
    " ",
]
CHATS = [
    [{"role": "user", "content": "What does the json module do?"}],
    [
        {"role": "system", "content": "Answer in 3 words."},
        {"role": "user", "content": "Hi — 日本語 🎉"},
        {"role": "assistant", "content": "Hello there, friend."},
        {"role": "user", "content": "Again:\n  def f():\n\treturn 1"},
    ],
    [{"role": "user", "content": "  spaces  "}, {"role": "assistant", "content": "ok"}],
]
# SmolLM2's own tokenizer.json (and llama.cpp's split for `smollm`): every digit apart, then
# GPT-2's regex. transformers 5.x's GGUF loader does not know `smollm` and splits as GPT-2
# alone, which differs only where whitespace comes before a digit ("a  1": its ["a", "Ġ", "Ġ",
# "1"], the model's ["a", "ĠĠ", "1"]); the reference is its tokenizer with the model's split.
SMOLLM2_SPLIT = pre_tokenizers.Sequence(
    [pre_tokenizers.Digits(individual_digits=True),
     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
)  # fmt: skip


@pytest.fixture(scope="module")
def ours(smollm2_gguf: Path) -> TextTokenizer:
    return TextTokenizer(smollm2_gguf)


@pytest.fixture(scope="module")
def theirs(smollm2_gguf: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)


@pytest.fixture(scope="module")
def reference(theirs: PreTrainedTokenizerBase) -> Tokenizer:
    fixed = Tokenizer.from_str(theirs.backend_tokenizer.to_str())
    fixed.pre_tokenizer = SMOLLM2_SPLIT
    return fixed


def _digit_after_space(text: str) -> bool:
    return re.search(r"\s\d", text) is not None


def test_ids_match_transformers_on_the_same_file(
    ours: TextTokenizer, theirs: PreTrainedTokenizerBase, reference: Tokenizer
) -> None:
    for text in CORPUS:
        ids = ours.encode(text)
        assert ids == reference.encode(text).ids, text
        if not _digit_after_space(text):
            assert ids == theirs(text)["input_ids"], text
        # logprobs' bytes: each token's own, adding up to the text
        assert b"".join(ours.token_bytes(i) for i in ids) == text.encode(), text


def test_digits_after_whitespace_are_split_as_llama_cpp_splits(ours: TextTokenizer) -> None:
    pieces = [ours.tokenizer.id_to_token(i) for i in ours.encode("a   1 22")]
    assert pieces == ["a", "ĠĠĠ", "1", "Ġ", "2", "2"]


def test_decode_round_trips(ours: TextTokenizer, theirs: PreTrainedTokenizerBase) -> None:
    for text in CORPUS:
        ids = ours.encode(text)
        assert ours.decode(ids, skip_special_tokens=False) == text, text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text


def test_control_tokens_are_matched_whole_and_skipped_on_decode(ours: TextTokenizer) -> None:
    ids = ours.encode("<|im_start|>user<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2 and len(ids) == 3
    assert ours.decode(ids) == "user"
    assert ours.special_tokens == {
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
        "unk_token": "<|endoftext|>", "pad_token": "<|im_end|>",
    }  # fmt: skip
    assert ours.encode("x") == ours.encode("x", add_special_tokens=False)  # no add_bos_token


@pytest.mark.parametrize("messages", CHATS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    ours: TextTokenizer,
    theirs: PreTrainedTokenizerBase,
    reference: Tokenizer,
    messages: list[dict[str, str]],
    add_generation_prompt: bool,
) -> None:
    text = theirs.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                      tokenize=False)  # fmt: skip
    assert ours.render_chat_template(messages, add_generation_prompt) == text
    ids = ours.apply_chat_template(messages, add_generation_prompt)
    assert ids == reference.encode(str(text), add_special_tokens=False).ids
    if not _digit_after_space(str(text)):
        expected = theirs.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=True
        )
        assert ids == list(expected if isinstance(expected, list) else expected["input_ids"])
    if messages[0]["role"] != "system":  # the template's default system prompt
        assert ours.decode(ids).startswith("system\nYou are a helpful AI assistant named SmolLM")


def test_the_engine_tokenizes_as_the_gateway(ours: TextTokenizer, smollm2_gguf: Path) -> None:
    """The offline engine's ``transformers`` tokenizer of a GGUF model holds the gateway's."""
    engine = load_tokenizer(str(smollm2_gguf))
    for text in CORPUS:
        assert engine(text)["input_ids"] == ours.encode(text), text
        ids = ours.encode(text)
        assert engine.decode(ids, skip_special_tokens=True) == ours.decode(ids), text
    for messages in CHATS:
        assert apply_chat_template(engine, messages) == ours.apply_chat_template(messages)


def test_the_gateway_serves_a_gguf_model(smollm2_gguf: Path) -> None:
    """Named by the directory that holds the file here (the fixtures take the file itself)."""
    from fastapi.testclient import TestClient

    models = {"smollm2": str(smollm2_gguf.parent)}
    settings = GatewaySettings(scheduler_address="127.0.0.1:9", models=models)
    with TestClient(create_app(settings)) as client:
        listed = client.get("/v1/models").json()
    assert [m["id"] for m in listed["data"]] == ["smollm2"]


def test_the_front_ends_stay_torch_free(smollm2_gguf: Path) -> None:
    """The gateway's tokenizer and the worker's front end (AsyncLLM's tokenizer is
    ``TextTokenizer(config.model.tokenizer)``, the .gguf file) import neither torch nor
    transformers for a GGUF model."""
    code = f"""
import sys
from services.worker.engine.config import EngineArgs
from services.worker.engine.processor import InputProcessor
from shared.text.tokenizer import TextTokenizer
config = EngineArgs(model={str(smollm2_gguf)!r}, device="cpu").create_engine_config()
tok = TextTokenizer(config.model.tokenizer)
InputProcessor(config.model, tok).tokenize("hello")
tok.apply_chat_template([{{"role": "user", "content": "x"}}])
print(config.model.tokenizer.endswith(".gguf"), sorted(m for m in ("torch", "transformers")
                                                     if m in sys.modules))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True []", out.stdout


# A small byte-level vocabulary (every byte, then three merges and whole tokens) to see how
# each pre-tokenizer family splits "a 123\nabc": "Ġ1", "12" and "123" come from merges; "abc"
# has none, so only a split that ignores merges for a piece in the vocabulary reaches it.
BYTES = sorted(pre_tokenizers.ByteLevel.alphabet())
SPECIAL = ["<s>", "</s>", "<tool>"]
TOKENS = [*BYTES, "Ġ1", "12", "123", "abc", *SPECIAL]
TYPES = [TokenType.NORMAL] * (len(TOKENS) - 3) + [TokenType.CONTROL] * 2 + [TokenType.USER_DEFINED]


def _write_tokenizer_gguf(path: Path, model: str = "gpt2", pre: str | None = "gpt-2",
                          add_bos: bool | None = None) -> Path:  # fmt: skip
    """A GGUF file of tokenizer metadata only (no tensors)."""
    w = GGUFWriter(path, "llama")
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(TOKENS)
    w.add_token_types(TYPES)
    w.add_token_merges(["Ġ 1", "1 2", "12 3"])
    w.add_bos_token_id(TOKENS.index("<s>"))
    w.add_eos_token_id(TOKENS.index("</s>"))
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    w.add_chat_template("{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    return path


@pytest.mark.parametrize(
    ("pre", "pieces"),
    [
        ("gpt-2", ["<s>", "a", "Ġ1", "2", "3", "Ċ", "a", "b", "c"]),  # " 123" one piece
        ("smollm", ["<s>", "a", "Ġ", "1", "2", "3", "Ċ", "a", "b", "c"]),  # digits apart
        ("qwen2", ["<s>", "a", "Ġ", "1", "2", "3", "Ċ", "a", "b", "c"]),  # \p{N}
        ("llama-bpe", ["<s>", "a", "Ġ", "123", "Ċ", "abc"]),  # \p{N}{1,3}, ignore_merges
    ],
)
def test_each_pre_tokenizer_splits_as_llama_cpp(
    tmp_path: Path, pre: str, pieces: list[str]
) -> None:
    tok = TextTokenizer(_write_tokenizer_gguf(tmp_path / "t.gguf", pre=pre, add_bos=True))
    assert [tok.tokenizer.id_to_token(i) for i in tok.encode("a 123\nabc")] == pieces


def test_add_bos_token_and_added_tokens(tmp_path: Path) -> None:
    """llama.cpp adds BOS for the Llama 3 family unless the file says not to; control tokens
    are special, user-defined ones are matched whole but kept when decoding."""
    default = TextTokenizer(_write_tokenizer_gguf(tmp_path / "a.gguf", pre="llama-bpe"))
    assert default.encode("a")[0] == TOKENS.index("<s>")
    off = TextTokenizer(_write_tokenizer_gguf(tmp_path / "b.gguf", pre="llama-bpe", add_bos=False))
    ids = off.encode("a<tool>b</s>")
    assert ids == [TOKENS.index(t) for t in ("a", "<tool>", "b", "</s>")]
    assert off.decode(ids) == "a<tool>b"
    assert off.special_tokens["bos_token"] == "<s>" and off.special_tokens["unk_token"] is None
    assert off.render_chat_template([{"role": "user", "content": "x"}]) == "<s>x</s>"


@pytest.mark.parametrize(
    ("model", "pre", "named"),
    [("gpt2", "made-up-pre", "'made-up-pre'"), ("gpt2", None, "None"), ("bert", "gpt-2", "'bert'")],
)
def test_an_unknown_tokenizer_is_refused_by_name(
    tmp_path: Path, model: str, pre: str | None, named: str
) -> None:
    path = _write_tokenizer_gguf(tmp_path / "t.gguf", model=model, pre=pre)
    with pytest.raises(UnsupportedTokenizer, match=re.escape(named) + ".*known: "):
        TextTokenizer(path)
