"""Tokenizer and chat template from the checkpoint directory, through ``transformers``."""

from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(path)


def apply_chat_template(
    tokenizer: PreTrainedTokenizerBase,
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
