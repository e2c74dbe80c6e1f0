"""SmolLM2-135M-Instruct (the GGUF file ``make install`` puts in ``.models/``) in the tests: the
chats they ask it, and transformers' reading of the file (``baton/transformers_gguf.py``), the
oracle they hold Baton's outputs to on the same dequantized weights.
"""

from typing import Any

from baton.transformers_gguf import transformers_model, transformers_tokenizer

__all__ = ["CHATS", "chat_prompts", "transformers_model", "transformers_tokenizer"]

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "List three prime numbers."}],
    [{"role": "user", "content": "Explain gravity to a child in one sentence."}],
]  # fmt: skip


def chat_prompts(tokenizer: Any) -> list[list[int]]:
    """``CHATS`` as the tokenizer's chat template renders them, ready for the answer."""
    prompts = []
    for chat in CHATS:
        ids: Any = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids if isinstance(ids, list) else ids["input_ids"]))
    return prompts
