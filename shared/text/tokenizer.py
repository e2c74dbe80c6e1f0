"""Tokenization and chat templates without ``transformers`` (which imports torch when it is
installed): the gateway must stay torch-free. Reads a Hugging Face checkpoint directory:

    tokenizer.json          the ``tokenizers`` model (normalizer, pre-tokenizer, BOS post-processor)
    tokenizer_config.json   special tokens, ``chat_template``, ``add_bos_token``
    chat_template.jinja     the chat template, when not in tokenizer_config.json

or a GGUF file (or a directory holding one), whose metadata carries all of these
(gguf_tokenizer.py builds the ``tokenizers`` model from it).

The chat template is rendered the way ``transformers`` renders it (a sandboxed Jinja2
environment with ``trim_blocks``/``lstrip_blocks``, ``raise_exception`` and ``tojson``); the
tests check both give the same token ids on every test checkpoint.
"""

import json
import re
from collections.abc import Mapping
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from shared.gguf_files import gguf_path
from shared.text.gguf_tokenizer import TokenizerParts, load_gguf_tokenizer

_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_chars() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's): printable Latin-1 bytes stand for themselves, every
    other byte for the next unused code point from 256 up, in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    chars = {chr(b): b for b in printable}
    chars.update({chr(256 + i): b for i, b in enumerate(others)})
    return chars


_BYTE_OF_CHAR = _byte_level_chars()


class ChatTemplateError(ValueError):
    """The messages do not fit the model's chat template (or it has none)."""


class TextTokenizer:
    def __init__(self, model: str | Path):
        """``model``: a checkpoint directory, a GGUF file or a directory holding one."""
        gguf = gguf_path(model)
        loaded = load_gguf_tokenizer(gguf) if gguf is not None else _load_hf_dir(Path(model))
        self.tokenizer: Tokenizer = loaded.tokenizer
        self.special_tokens = loaded.special_tokens  # bos_token, ... (template variables)
        self.chat_template: str | None = loaded.chat_template

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))

    def token_text(self, token_id: int) -> str:
        """One token as text, for logprobs (may be part of a multi-byte character)."""
        return str(self.tokenizer.decode([token_id], skip_special_tokens=False))

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token adds to the text (OpenAI's logprob ``bytes``). Its text cannot
        say: a token that is part of a multi-byte character decodes to U+FFFD alone, and
        SentencePiece drops a leading space when a token is decoded by itself."""
        piece = self.tokenizer.id_to_token(token_id)
        if piece is None:
            return b""
        if self._decoder == "ByteLevel":  # GPT-2 style: each byte stored as one character
            raw = [_BYTE_OF_CHAR.get(c) for c in piece]
            if all(b is not None for b in raw):
                return bytes(raw)  # type: ignore[arg-type]
        elif (m := _BYTE_FALLBACK.fullmatch(piece)) is not None:  # SentencePiece: <0xE2>
            return bytes([int(m.group(1), 16)])
        elif self._decoder in ("Metaspace", "Sequence") and "\u2581" in piece:
            return piece.replace("\u2581", " ").encode()
        return self.token_text(token_id).encode()  # added and special tokens: plain text

    @cached_property
    def _decoder(self) -> str:
        decoder = json.loads(self.tokenizer.to_str()).get("decoder") or {}
        return str(decoder.get("type", ""))

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        *,
        continue_final_message: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
        add_special_tokens: bool = False,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """The token ids of ``render_chat_template``'s text (``add_special_tokens``: also the
        tokenizer's own, a BOS the template may already have written)."""
        text = self.render_chat_template(
            messages, add_generation_prompt, continue_final_message, template_kwargs, tools
        )
        return self.encode(text, add_special_tokens=add_special_tokens)

    def render_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The prompt as ``transformers`` renders it: ``template_kwargs`` are extra template
        variables (they do not replace the messages or the generation-prompt flag);
        ``continue_final_message`` ends the text with the last message's content, so that the
        model continues it (no end-of-turn after it). ``tools``: JSON schemas of functions,
        ``[{"type": "function", "function": {"name", "description", "parameters"}}]``, the
        ``tools`` variable (None as ``transformers`` passes it without tools); a message's
        ``tool_calls`` and a ``tool`` message's ``tool_call_id`` are the template's to
        render."""
        if not messages:
            raise ChatTemplateError("messages must not be empty")
        if self.chat_template is None:
            raise ChatTemplateError("this model's tokenizer has no chat template")
        variables: dict[str, Any] = {k: v for k, v in self.special_tokens.items() if v is not None}
        variables.update(template_kwargs or {})
        variables.update(messages=messages, add_generation_prompt=add_generation_prompt,
                         tools=tools)  # fmt: skip
        try:
            text = self._template.render(**variables)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template: {e}") from e
        except (TypeError, ValueError, LookupError, ArithmeticError) as e:
            # the template meets a value of the request it cannot use (a template kwarg of
            # another type than it expects): the request's fault, not the server's
            raise ChatTemplateError(f"chat template: {type(e).__name__}: {e}") from e
        return _cut_after_final(text, messages[-1]) if continue_final_message else text

    @cached_property
    def _template(self) -> jinja2.Template:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        assert self.chat_template is not None
        return env.from_string(self.chat_template)


def _load_hf_dir(path: Path) -> TokenizerParts:
    if not (path / "tokenizer.json").exists():
        raise FileNotFoundError(f"{path} has no tokenizer.json (a fast tokenizer is required)")
    config_path = path / "tokenizer_config.json"
    config: dict[str, Any] = json.loads(config_path.read_text()) if config_path.exists() else {}
    template = config.get("chat_template")
    if template is None and (path / "chat_template.jinja").exists():
        template = (path / "chat_template.jinja").read_text()
    return TokenizerParts(
        Tokenizer.from_file(str(path / "tokenizer.json")),
        {k: _token_text(config.get(k)) for k in _SPECIAL_KEYS},
        template if isinstance(template, str) else None,
    )


def _cut_after_final(text: str, final: dict[str, Any]) -> str:
    """``text`` up to the end of the final message's content, as ``transformers`` cuts it
    (the content's last occurrence; its trailing whitespace only where the template kept it)."""
    content = str(final.get("content") or "")
    if not content.strip():
        raise ChatTemplateError("continue_final_message: the final message has no content")
    if content.strip() not in text:
        raise ChatTemplateError(
            "continue_final_message: the chat template does not write the final message's "
            "content as it is"
        )
    at = text.rindex(content.strip())
    if text[at : at + len(content.lstrip())] == content:
        return text[: at + len(content.lstrip())]
    return text[: at + len(content.strip())]


def _token_text(value: object) -> str | None:
    """A special token as tokenizer_config.json spells it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _tojson(x: object, ensure_ascii: bool = False, indent: int | None = None, **_: object) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent)


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)
