"""``LLM``: offline batch generation, vLLM's API.

    llm = LLM(model="path/to/checkpoint", max_model_len=2048)
    outputs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
    outputs[0].outputs[0].text

The core runs in this process by default (``InprocClient``); ``multiprocess=True`` puts it in a
background process behind ZMQ (``MPClient``) with identical results.
"""

import itertools
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from services.worker.engine.config import EngineArgs
from services.worker.engine.core_client import EngineCoreClient, InprocClient, MPClient
from services.worker.engine.output_processor import OutputProcessor, fan_out
from services.worker.engine.outputs import RequestOutput
from services.worker.engine.params import RequestOutputKind, SamplingParams
from services.worker.engine.processor import InputProcessor, PromptType
from services.worker.engine.tokenizer import HFTokenizer, apply_chat_template, load_tokenizer


class LLM:
    def __init__(
        self, model: str, *, multiprocess: bool = False, show_progress: bool = True, **kwargs: Any
    ):
        unknown = set(kwargs) - EngineArgs.field_names()
        if unknown:
            known = ", ".join(sorted(EngineArgs.field_names() - {"model"}))
            raise TypeError(f"unknown LLM arguments: {', '.join(sorted(unknown))}; known: {known}")
        self.config = EngineArgs(model=model, **kwargs).create_engine_config()
        self.tokenizer = load_tokenizer(self.config.model.tokenizer)
        self._tokens = HFTokenizer(self.tokenizer)
        self.processor = InputProcessor(self.config.model, self._tokens)
        self.show_progress = show_progress
        self.client: EngineCoreClient = (
            MPClient(self.config) if multiprocess else InprocClient(self.config, show_progress)
        )
        self._ids = itertools.count()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in the order of ``prompts``."""
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        params = _per_prompt(sampling_params, len(prompts))
        processor = OutputProcessor(self._tokens)
        order = [self._add(processor, p, sp) for p, sp in zip(prompts, params, strict=True)]
        return self._run(processor, order, use_tqdm and self.show_progress)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts: list[PromptType] = [
            {"prompt_token_ids": apply_chat_template(self.tokenizer, c, add_generation_prompt)}  # type: ignore[arg-type]
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def get_stats(self) -> Any:
        return self.client.call_utility("get_stats")

    def get_model_info(self) -> Any:
        return self.client.call_utility("get_model_info")

    def reset_prefix_cache(self) -> bool:
        return bool(self.client.call_utility("reset_prefix_cache"))

    def shutdown(self) -> None:
        self.client.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def _add(self, processor: OutputProcessor, prompt: PromptType, params: SamplingParams) -> str:
        request_id = str(next(self._ids))
        # Offline generation returns whole results: no need to build intermediate outputs.
        params = params.clone(output_kind=RequestOutputKind.FINAL_ONLY)
        text, request = self.processor.process(request_id, prompt, params)
        core_requests = fan_out(request)
        processor.add_request(text, request, core_requests)
        for r in core_requests:
            self.client.add_request(r)
        return request_id

    def _run(
        self, processor: OutputProcessor, order: list[str], progress: bool
    ) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        with tqdm(total=len(order), desc="Generating", disable=not progress) as bar:
            while processor.has_unfinished():
                result = processor.process_outputs(self.client.get_output().outputs)
                self.client.abort_requests(result.reqs_to_abort)
                for out in result.request_outputs:
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        return [done[rid] for rid in order]


def _per_prompt(
    params: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise ValueError(f"{len(params)} sampling params for {n} prompts")
    return list(params)
