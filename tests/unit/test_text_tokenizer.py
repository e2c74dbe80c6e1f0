"""The gateway's torch-free tokenizer and chat template give exactly the token ids that
``transformers`` (which the engine and Hugging Face use) gives, on every test checkpoint."""

import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from shared.text.tokenizer import ChatTemplateError, TextTokenizer

TEXTS = ["Hello, world!", "  leading spaces\nand lines\t", "héllo — 日本語 🎉", ""]
CHATS = [
    [{"role": "user", "content": "What does the json module do?"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Again — ünïcode"},
    ],
]


@pytest.mark.parametrize("text", TEXTS)
def test_encode_and_decode_match_transformers(tiny_models: dict[str, Path], text: str) -> None:
    for name, path in tiny_models.items():
        ours, theirs = TextTokenizer(path), AutoTokenizer.from_pretrained(path)
        ids = theirs(text)["input_ids"]
        assert ours.encode(text) == ids, name
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), name


@pytest.mark.parametrize("messages", CHATS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    tiny_models: dict[str, Path], messages: list[dict[str, str]], add_generation_prompt: bool
) -> None:
    for name, path in tiny_models.items():
        theirs = AutoTokenizer.from_pretrained(path).apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=True
        )
        expected = theirs["input_ids"] if not isinstance(theirs, list) else theirs
        got = TextTokenizer(path).apply_chat_template(messages, add_generation_prompt)
        assert got == list(expected), name


def test_chat_template_errors_are_value_errors(tiny_model: Path) -> None:
    tok = TextTokenizer(tiny_model)
    with pytest.raises(ChatTemplateError, match="empty"):
        tok.apply_chat_template([])
    tok.chat_template = None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_missing_tokenizer_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        TextTokenizer(tmp_path)


def test_does_not_import_torch(tiny_model: Path) -> None:
    code = (
        "import sys; from shared.text.tokenizer import TextTokenizer; "
        f"t = TextTokenizer({str(tiny_model)!r}); t.apply_chat_template([{{'role': 'user', "
        "'content': 'x'}]); print('torch' in sys.modules, 'transformers' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_tiny_model_corpus_does_not_depend_on_what_the_process_imported() -> None:
    """The tokenizer (and so the tiny model every test uses) is trained on this corpus: it
    changed with the packages a process had imported (a submodule such as email.utils is an
    attribute of its package only once imported), and a test's expectations with it."""
    import subprocess
    import sys

    show = ("from baton.tiny_model import corpus; import hashlib; "
            "print(hashlib.sha1(chr(10).join(corpus()).encode()).hexdigest())")  # fmt: skip
    plain = subprocess.run([sys.executable, "-c", show], capture_output=True, text=True)
    more = subprocess.run(
        [sys.executable, "-c", "import email.mime.text, logging.handlers, http.server; " + show],
        capture_output=True, text=True,
    )  # fmt: skip
    assert plain.returncode == more.returncode == 0, plain.stderr + more.stderr
    assert plain.stdout == more.stdout


@pytest.mark.parametrize("text", TEXTS)
def test_token_bytes_add_up_to_the_text(tiny_models: dict[str, Path], text: str) -> None:
    """Logprobs' ``bytes``: each token's own bytes, so a client can join them into the text
    even where one character spans several tokens (each of which alone prints as U+FFFD)."""
    for name, path in tiny_models.items():
        tok = TextTokenizer(path)
        ids = tok.encode(text, add_special_tokens=False)
        assert b"".join(tok.token_bytes(i) for i in ids) == text.encode(), name
    partial = [i for i in ids if tok.token_text(i) == "\ufffd"]
    if text == TEXTS[2]:  # this text's characters are split across tokens here
        assert partial and all(tok.token_bytes(i) != "\ufffd".encode() for i in partial)


def test_token_bytes_of_a_sentencepiece_tokenizer(tmp_path: Path) -> None:
    """SentencePiece style (Llama 2, Mistral): '▁' is a space, and unknown characters fall
    back to byte tokens such as <0xE2>."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    words = ["<unk>", "▁", "h", "i", "▁h", "▁hi"]
    vocab = {w: i for i, w in enumerate(words)} | {f"<0x{b:02X}>": 6 + b for b in range(256)}
    merges = [("▁", "h"), ("▁h", "i")]
    sp = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    sp.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    sp.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
         decoders.Strip(" ", 1, 0)]
    )  # fmt: skip
    sp.save(str(tmp_path / "tokenizer.json"))
    tok = TextTokenizer(tmp_path)
    ids = tok.encode("hi ✓", add_special_tokens=False)
    assert [tok.token_bytes(i) for i in ids] == [b" hi", b" ", b"\xe2", b"\x9c", b"\x93"]


CONTINUED = [
    [{"role": "user", "content": "Name a module."}, {"role": "assistant", "content": "The json"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, trailing  "}],
]


@pytest.mark.parametrize("messages", CONTINUED)
def test_continue_final_message_matches_transformers(
    tiny_models: dict[str, Path], messages: list[dict[str, str]]
) -> None:
    """The prompt ends with the assistant's text, no end of turn after it: the model goes on."""
    for name, path in tiny_models.items():
        theirs = AutoTokenizer.from_pretrained(path).apply_chat_template(
            messages, add_generation_prompt=False, continue_final_message=True, tokenize=False
        )
        ours = TextTokenizer(path).render_chat_template(messages, False, True)
        assert ours == theirs, name
        assert ours.rstrip().endswith(messages[-1]["content"].rstrip())


def test_template_kwargs_reach_the_template(tiny_model: Path) -> None:
    tok = TextTokenizer(tiny_model)
    tok.chat_template = (
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        "{% if enable_thinking is defined and not enable_thinking %}<no-think>{% endif %}"
        "{{ add_generation_prompt }}"
    )
    messages = [{"role": "user", "content": "x"}]
    assert tok.render_chat_template(messages, True) == "xTrue"
    off = {"enable_thinking": False}
    assert tok.render_chat_template(messages, True, template_kwargs=off) == "x<no-think>True"
    # they never replace the template's own inputs
    clash = {"messages": [], "add_generation_prompt": False}
    assert tok.render_chat_template(messages, True, template_kwargs=clash) == "xTrue"
    ids = tok.apply_chat_template(messages, True, template_kwargs=off)
    assert tok.decode(ids) == "x<no-think>True"
    # a value the template cannot use is the request's error, not the server's
    typed = TextTokenizer(tiny_model)
    typed.chat_template = "{{ messages[0]['content'] }}{{ depth + 1 }}"
    assert typed.render_chat_template(messages, True, template_kwargs={"depth": 1}) == "x2"
    with pytest.raises(ChatTemplateError, match="TypeError"):
        typed.render_chat_template(messages, True, template_kwargs={"depth": "deep"})


def test_continue_final_message_needs_its_content_in_the_text(tiny_model: Path) -> None:
    tok = TextTokenizer(tiny_model)
    tok.chat_template = "{% for m in messages %}[{{ m['role'] }}]{% endfor %}"  # drops content
    with pytest.raises(ChatTemplateError, match="continue_final_message"):
        tok.render_chat_template([{"role": "assistant", "content": "abc"}], False, True)
