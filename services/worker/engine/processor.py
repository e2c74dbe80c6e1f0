"""Turns a user's prompt and parameters into an ``EngineCoreRequest``: tokenizes, checks the
length against the context, and fails early with a clear ``ValueError``."""

import time
from typing import Any

from services.worker.engine.config import ModelConfig
from services.worker.engine.kv_transfer.params import KVTransferParams
from services.worker.engine.messages import EngineCoreRequest
from services.worker.engine.params import SamplingParams
from services.worker.engine.sample.constraints import check_vocabulary, tokenize_bad_words
from services.worker.engine.tokenizer import Tokenizer

# What ``generate`` accepts as one prompt: text, or {"prompt_token_ids": [...]} (vLLM's form),
# optionally with "cache_salt" and, for a leg of a disaggregated request, "kv_transfer".
PromptType = str | dict[str, Any]


class InputProcessor:
    def __init__(self, config: ModelConfig, tokenizer: Tokenizer):
        self.config = config
        self.tokenizer = tokenizer

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in ids
            ):
                raise ValueError("prompt_token_ids must be a list of integers")
            return prompt.get("prompt"), list(ids)
        raise ValueError("a prompt is a string or a dict with 'prompt_token_ids'")

    def process(
        self, request_id: str, prompt: PromptType, params: SamplingParams
    ) -> tuple[str | None, EngineCoreRequest]:
        if not isinstance(params, SamplingParams):
            raise ValueError("sampling params must be a SamplingParams")
        text, ids = self.tokenize(prompt)
        max_len = self.config.max_model_len
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) >= max_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens but the context length is {max_len}; "
                "shorten the prompt (at least one token must be left to generate)"
            )
        vocab = self.config.arch.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab})")
        params = self._token_constraints(params)
        salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        kv_transfer = prompt.get("kv_transfer") if isinstance(prompt, dict) else None
        if kv_transfer is not None and not isinstance(kv_transfer, KVTransferParams):
            raise ValueError("kv_transfer must be a KVTransferParams")
        return text, EngineCoreRequest(request_id, ids, params, time.time(), salt, kv_transfer)

    def _token_constraints(self, params: SamplingParams) -> SamplingParams:
        """``params`` with its bad words tokenized (vLLM does this on admission too), after
        checking every token id it masks the logits with against the vocabulary."""
        if params.bad_words:
            words = tokenize_bad_words(
                params.bad_words, lambda t: self.tokenizer.encode(t, add_special_tokens=False)
            )
            params = params.clone(bad_words_token_ids=words)
        check_vocabulary(params, self.config.arch.vocab_size)
        return params
