"""Tokenization and chat templates without ``transformers`` (which imports torch when it is
installed): the gateway must stay torch-free. Reads a Hugging Face checkpoint directory:

    tokenizer.json          the ``tokenizers`` model (normalizer, pre-tokenizer, BOS post-processor)
    tokenizer_config.json   special tokens, ``chat_template``, ``add_bos_token``
    chat_template.jinja     the chat template, when not in tokenizer_config.json

The chat template is rendered the way ``transformers`` renders it (a sandboxed Jinja2
environment with ``trim_blocks``/``lstrip_blocks``, ``raise_exception`` and ``tojson``); the
tests check both give the same token ids on every test checkpoint.
"""

import json
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


class ChatTemplateError(ValueError):
    """The messages do not fit the model's chat template (or it has none)."""


class TextTokenizer:
    def __init__(self, model_dir: str | Path):
        path = Path(model_dir)
        if not (path / "tokenizer.json").exists():
            raise FileNotFoundError(f"{path} has no tokenizer.json (a fast tokenizer is required)")
        self.tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        config_path = path / "tokenizer_config.json"
        self._config: dict[str, Any] = (
            json.loads(config_path.read_text()) if config_path.exists() else {}
        )
        self.special_tokens = {k: _token_text(self._config.get(k)) for k in _SPECIAL_KEYS}
        template_file = path / "chat_template.jinja"
        template = self._config.get("chat_template")
        if template is None and template_file.exists():
            template = template_file.read_text()
        self.chat_template: str | None = template if isinstance(template, str) else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))

    def token_text(self, token_id: int) -> str:
        """One token as text, for logprobs (may be part of a multi-byte character)."""
        return str(self.tokenizer.decode([token_id], skip_special_tokens=False))

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]:
        if not messages:
            raise ChatTemplateError("messages must not be empty")
        if self.chat_template is None:
            raise ChatTemplateError("this model's tokenizer has no chat template")
        try:
            text = self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                **{k: v for k, v in self.special_tokens.items() if v is not None},
            )
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template: {e}") from e
        return self.encode(text, add_special_tokens=False)

    @cached_property
    def _template(self) -> jinja2.Template:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        assert self.chat_template is not None
        return env.from_string(self.chat_template)


def _token_text(value: object) -> str | None:
    """A special token as tokenizer_config.json spells it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _tojson(x: object, ensure_ascii: bool = False, indent: int | None = None, **_: object) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent)


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)
