"""The architectures beyond the dense Llama family, served by the whole system with
disaggregated prefill and decode: what the client reads must equal the offline engine's, token
for token.

- a tiny DeepSeek-V3 (MLA, routed experts with sigmoid group-limited routing, shared experts,
  YaRN): the decode worker pulls the latent blocks over NIXL/UCX;
- a tiny gpt-oss (windows of 8 tokens with attention sinks on alternate layers, biased experts
  with the clamped SwiGLU) and a tiny Gemma 3 (two sliding-window layers to each global one):
  the decode worker decodes on past the window from the pulled blocks;
- a tiny Qwen3.5 (three Gated DeltaNet layers to each full-attention one): the decode worker
  pulls the attention's blocks and each recurrent layer's state at the prompt's end, and a
  killed decode worker's streams resume elsewhere;
- a tiny Qwen3-Next (Qwen3.5's layers with experts and a gated shared expert) and a tiny
  Qwen3.5-MoE (experts in every layer, stacked in its checkpoint): the same pull (the resume
  test runs gpt-oss and Qwen3.5)."""

import json
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from baton import LLM, SamplingParams
from baton.launcher import Cluster
from baton.tiny_model import make_tiny_model
from tests.e2e.conftest import (
    disaggregated_routes,
    long_prompt,
    running_cluster,
    wait_for,
    worker_health,
)


@pytest.fixture(
    scope="module",
    params=["deepseek_v3", "gpt_oss", "gemma3", "qwen3_5", "qwen3_next", "qwen3_5_moe"],
)
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp(request.param), arch=request.param)


@pytest.fixture(scope="module")
def pd_cluster(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    policy = tmp_path_factory.mktemp("policy") / "policy.json"
    policy.write_text(json.dumps({"decider": {"min_uncached_tokens": 32}}))
    with running_cluster(model, 0, "--prefill-workers", "1", "--decode-workers", "1",
                         "--routing-policy", str(policy), "--served-model-name", "m",
                         ) as c:  # fmt: skip
        yield c


def test_disaggregated_equals_offline(pd_cluster: Cluster, model: Path) -> None:
    llm = LLM(model=str(model), num_kv_blocks=512, max_model_len=1024)
    try:
        c = openai.OpenAI(base_url=pd_cluster.url, api_key="x", max_retries=0, timeout=60)
        before = disaggregated_routes(pd_cluster)
        for i in range(3):
            prompt = long_prompt(model, 90 + 37 * i, f"pd-{i}")  # (ends mid-block)
            params = SamplingParams(temperature=0, max_tokens=16, logprobs=1)
            want = llm.generate([prompt], params)[0].outputs[0]
            out = c.completions.create(model="m", prompt=prompt, max_tokens=16,
                                       temperature=0, logprobs=1)  # fmt: skip
            assert out.choices[0].text == want.text
            got = out.choices[0].logprobs.token_logprobs  # type: ignore[union-attr]
            ref = [lp[t].logprob for lp, t in zip(want.logprobs or [], want.token_ids,
                                                   strict=True)]  # fmt: skip
            assert got == pytest.approx(ref, abs=1e-4)
    finally:
        llm.shutdown()
    assert disaggregated_routes(pd_cluster) >= before + 3
    wait_for(lambda: worker_health(pd_cluster, "prefill-0").kv_usage == 0, 5.0, "leases to end")


@pytest.mark.parametrize("arch", ["gpt_oss", "qwen3_5"])
def test_a_killed_decode_worker_resumes_a_hybrid_model(tmp_path: Path, arch: str) -> None:
    """gpt-oss (windows of 8 with sinks beside full layers), Qwen3.5 (Gated DeltaNet layers
    beside a full one): the decode worker running most of the streams is killed mid-stream;
    the streams resume elsewhere and what each client reads equals the offline engine's, past
    the window (or from the recurrent state) both before and after the kill."""
    model = make_tiny_model(tmp_path / arch, arch=arch)
    prompts = [long_prompt(model, 40 + 9 * i, f"resume-{i}") for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    with LLM(model=str(model), num_kv_blocks=512, max_model_len=1024,
             show_progress=False) as llm:  # fmt: skip
        want = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps({"decider": {"min_uncached_tokens": 0}}))
    flags = ["--prefill-workers", "1", "--decode-workers", "2", "--routing-policy", str(policy)]
    with running_cluster(model, 0, *flags) as cluster:
        texts = [""] * len(prompts)
        mid = threading.Event()  # a stream is past its start
        errors: list[BaseException] = []

        def stream(i: int) -> None:
            try:
                with openai.OpenAI(base_url=cluster.url, api_key="x", max_retries=0,
                                   timeout=120) as c:  # fmt: skip
                    chunks = c.completions.create(model=model.name, prompt=prompts[i],
                                                  max_tokens=400, temperature=0, stream=True,
                                                  extra_body={"ignore_eos": True})  # fmt: skip
                    for chunk in chunks:
                        texts[i] += chunk.choices[0].text
                        if len(texts[i]) > 40:
                            mid.set()
            except BaseException as e:  # (reported below)
                errors.append(e)

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        assert mid.wait(120)
        busy = {n: worker_health(cluster, n).num_running for n in ("decode-0", "decode-1")}
        victim = max(busy, key=lambda n: busy[n])
        assert busy[victim] > 0
        cluster.procs[victim].send_signal(signal.SIGKILL)
        for t in threads:
            t.join(timeout=180)
    assert not errors, errors
    assert texts == want
