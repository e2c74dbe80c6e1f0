"""Tokenizers of the engine's front ends.

What input and output processing use of one is ``Tokenizer``: text to ids, one token's text,
and the Rust ``tokenizers`` model that incremental detokenization steps through. Two kinds
meet it:

- ``LLM`` (offline) loads the ``transformers`` tokenizer (``load_tokenizer``, wrapped by
  ``HFTokenizer``): its chat templates, and what ``LLM.tokenizer`` users expect. Of a GGUF
  model it is ``TextTokenizer``'s Rust model inside a ``transformers`` tokenizer, not the one
  ``transformers`` builds from the file (``gguf_file=``): that one splits text as GPT-2 does
  where it does not know the file's pre-tokenizer (SmolLM2's ``smollm``), and would give
  other ids than the gateway and llama.cpp for a prompt such as "a   1".
- ``AsyncLLM`` (the worker service's front end, whose core runs in another process) takes
  ``shared.text.tokenizer.TextTokenizer``, torch-free as the gateway is. ``transformers``
  imports torch when it is installed; the two were 5.8 s of the 6.2 s that importing that
  process's modules took on a 2-core VM, for a process that never runs a model. The gateway
  already tokenizes with it; its ids are checked equal to ``transformers``' on every test
  checkpoint (tests/unit/test_text_tokenizer.py).
"""

from typing import TYPE_CHECKING, Any, Protocol

import tokenizers

from shared.gguf_files import gguf_path
from shared.text.tokenizer import TextTokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class Tokenizer(Protocol):
    tokenizer: tokenizers.Tokenizer  # the Rust model (incremental detokenization)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def token_text(self, token_id: int) -> str: ...


class HFTokenizer:
    """A ``transformers`` fast tokenizer as a ``Tokenizer``."""

    def __init__(self, hf: "PreTrainedTokenizerBase"):
        self.hf = hf
        self.tokenizer: tokenizers.Tokenizer = hf.backend_tokenizer

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf(text, add_special_tokens=add_special_tokens)["input_ids"])

    def token_text(self, token_id: int) -> str:
        return str(self.hf.decode([token_id]))


def load_tokenizer(path: str) -> "PreTrainedTokenizerBase":
    """A checkpoint directory's ``transformers`` tokenizer; for a GGUF model (a file, or a
    directory holding one), the gateway's ``TextTokenizer`` wrapped as one (see above why)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if gguf_path(path) is None:
        return AutoTokenizer.from_pretrained(path)
    text = TextTokenizer(path)
    specials = {k: v for k, v in text.special_tokens.items() if v is not None}
    return PreTrainedTokenizerFast(
        tokenizer_object=text.tokenizer, chat_template=text.chat_template, **specials
    )


def apply_chat_template(
    tokenizer: "PreTrainedTokenizerBase",
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
) -> list[int]:
    if not messages:
        raise ValueError("messages must not be empty")
    if tokenizer.chat_template is None:
        raise ValueError("this model's tokenizer has no chat template")
    out: Any = tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True
    )
    if not isinstance(out, list):  # a BatchEncoding in transformers 5
        out = out["input_ids"]
    return [int(t) for t in out]
