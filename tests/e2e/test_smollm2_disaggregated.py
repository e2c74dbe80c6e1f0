"""SmolLM2-135M-Instruct, the trained model ``make run`` serves, through the whole system as
``make run`` starts it: the gateway renders each chat with the file's template and tokenizer,
a prefill worker computes the prompt, the decode worker pulls its KV blocks and decodes on.
Greedy answers equal the engine's colocated (in this process) token for token, logprobs
included. tests/integration/test_gguf.py holds that colocated engine to Hugging Face
transformers on the same dequantized weights, for the same chats and token budget."""

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch

from baton import LLM, RequestOutput, SamplingParams
from baton.launcher import Cluster
from shared.gguf_header import read_header
from shared.text.tokenizer import TextTokenizer
from tests.e2e.conftest import disaggregated_routes, running_cluster, wait_for, worker_health
from tests.smollm2 import CHATS

NAME = "SmolLM2-135M-Instruct"  # as `make run` serves it
MAX_NEW = 24  # tests/integration/test_gguf.py's budget: some answers end (eos), some are cut


@pytest.fixture(scope="module")
def colocated(smollm2_gguf: Path) -> list[RequestOutput]:
    """The engine in this process (float32 on CPU, as the workers run), the reference; on one
    thread, as each worker of a cluster on 2 cores runs: two OpenMP threads wait for each other
    whenever another process runs (these chats: 3 s on one thread, 34-46 s on two on this
    2-core VM beside another job)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    llm = LLM(model=str(smollm2_gguf), num_kv_blocks=512, max_model_len=1024,
              show_progress=False)  # fmt: skip
    try:
        params = SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=0)
        return llm.chat(CHATS, params, use_tqdm=False)
    finally:
        llm.shutdown()
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def pd_cluster(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """One prefill and one decode worker; every prompt, however short, prefilled remotely
    (the default policy prefills prompts of under 64 uncached tokens, as these chats are, on
    the decode worker)."""
    policy = tmp_path_factory.mktemp("policy") / "policy.json"
    policy.write_text(json.dumps({"decider": {"min_uncached_tokens": 0}}))
    flags = ["--prefill-workers", "1", "--decode-workers", "1", "--routing-policy", str(policy),
             "--served-model-name", NAME]  # fmt: skip
    with running_cluster(smollm2_gguf, 0, *flags) as c:
        yield c


def test_chats_answer_as_the_colocated_engine_token_for_token(
    colocated: list[RequestOutput], pd_cluster: Cluster, smollm2_gguf: Path
) -> None:
    """(The reference first, before the cluster's four processes start.)"""
    tok = TextTokenizer(smollm2_gguf)  # the gateway's
    eos = read_header(smollm2_gguf).fields["tokenizer.ggml.eos_token_id"]
    before = disaggregated_routes(pd_cluster)
    answers = []
    with openai.OpenAI(base_url=pd_cluster.url, api_key="x", max_retries=0, timeout=120) as c:
        for chat, ref in zip(CHATS, colocated, strict=True):
            out = c.chat.completions.create(model=NAME, messages=chat, max_tokens=MAX_NEW,  # type: ignore[arg-type]
                                            temperature=0, logprobs=True)  # fmt: skip
            [choice] = out.choices
            want = ref.outputs[0]
            ids = list(want.token_ids)
            shown = ids[:-1] if ids[-1] == eos else ids  # the end token adds no text, no entry
            assert out.usage is not None and choice.logprobs is not None
            # the same prompt: the gateway's template and tokenizer, the engine's
            assert out.usage.prompt_tokens == len(ref.prompt_token_ids), chat
            assert out.usage.completion_tokens == len(ids), chat
            entries = choice.logprobs.content or []
            assert [bytes(e.bytes or []) for e in entries] == [tok.token_bytes(t) for t in shown]
            lps = (want.logprobs or [])[: len(shown)]
            want_lps = [lp[t].logprob for lp, t in zip(lps, shown, strict=True)]
            assert [e.logprob for e in entries] == pytest.approx(want_lps, abs=1e-4), chat
            assert choice.message.content == want.text, chat
            assert choice.finish_reason == want.finish_reason, chat
            answers.append(want.text)
    assert "Paris" in answers[0], answers[0]  # a trained model, not noise
    assert {r.outputs[0].finish_reason for r in colocated} == {"stop", "length"}
    # every chat went through the prefill worker, and its KV was pulled (the lease ended)
    assert disaggregated_routes(pd_cluster) == before + len(CHATS)
    wait_for(lambda: worker_health(pd_cluster, "prefill-0").kv_usage == 0, 5.0, "leases to end")
