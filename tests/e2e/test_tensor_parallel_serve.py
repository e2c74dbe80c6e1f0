"""``baton serve --tensor-parallel-size 2``: two workers of two rank processes each answer the
OpenAI API exactly like the one-rank engine, and a rank killed in the middle of a stream ends
its worker's requests, which the gateway resumes on the other worker: the client sees the whole
answer, unchanged. P/D between a prefill pool and a decode pool of different TP sizes answers
like the one-rank engine too."""

import json
import signal
import time
from pathlib import Path

import openai
import psutil
import pytest

from baton import LLM, SamplingParams
from tests.e2e.conftest import (
    disaggregated_routes,
    long_prompt,
    running_cluster,
    scheduler_metric,
    wait_for,
    worker_health,
)

MODEL = "qwen3"
PROMPTS = ["Hi", "The quick brown fox jumps over the lazy dog", "import os\nimport sys\n"]


def _metric(cluster, name: str) -> float:  # type: ignore[no-untyped-def]
    try:
        return scheduler_metric(cluster, name, "decode-0")
    except AssertionError:  # not exported until it first counts
        return 0.0


def _ranks(pid: int) -> list[psutil.Process]:
    """The rank processes under a worker (worker → engine core → ranks)."""
    kids = psutil.Process(pid).children(recursive=True)
    return [p for p in kids if "services.worker.engine.executor.rank_proc" in " ".join(p.cmdline())]


def test_tp2_workers_serve_and_survive_a_rank_killed_mid_stream(tiny_model: Path) -> None:
    long_prompt, long_max = "a long answer", 300
    llm = LLM(model=str(tiny_model), num_kv_blocks=512, max_model_len=1024, show_progress=False)
    greedy = SamplingParams(temperature=0, max_tokens=16)
    expected = [o.outputs[0].text for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
    params = SamplingParams(temperature=0, max_tokens=long_max, ignore_eos=True)
    expected_long = llm.generate([long_prompt], params, use_tqdm=False)[0].outputs[0].text
    llm.shutdown()
    with running_cluster(tiny_model, 2, "--tensor-parallel-size", "2") as cluster:
        for name in ("worker-0", "worker-1"):
            assert len(_ranks(cluster.procs[name].pid)) == 2
        c = openai.OpenAI(base_url=cluster.url, api_key="x", max_retries=0, timeout=60)
        got = [c.completions.create(model=MODEL, prompt=p, max_tokens=16, temperature=0)
               .choices[0].text for p in PROMPTS]  # fmt: skip
        assert got == expected
        stream = c.completions.create(
            model=MODEL, prompt=long_prompt, max_tokens=long_max, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        text, killed_at, victim = "", 0.0, ""
        for chunk in stream:
            text += chunk.choices[0].text
            if not killed_at and len(text) > 20:
                busy = [n for n in ("worker-0", "worker-1")
                        if worker_health(cluster, n).num_running]  # fmt: skip
                assert len(busy) == 1
                victim = busy[0]
                _ranks(cluster.procs[victim].pid)[1].send_signal(signal.SIGKILL)
                killed_at = time.monotonic()
        assert killed_at
        assert text == expected_long  # greedy: resumed on the other worker, nothing changed
        assert time.monotonic() - killed_at < 30
        # the rank's death ended its engine and so its worker, which the launcher restarts
        wait_for(lambda: cluster.restarts.get(victim, 0) >= 1, 30.0, "the worker's restart")


# (2 → 1 and 2 → 2 run at the engine level: tests/integration/test_pd_tensor_parallel.py)
@pytest.mark.parametrize(("p", "d"), [(1, 2)], ids=["prefill1-decode2"])
def test_pd_between_pools_of_different_tp_sizes(
    tiny_model: Path, tmp_path: Path, p: int, d: int
) -> None:
    """``baton serve --prefill-tensor-parallel-size p --decode-tensor-parallel-size d``: long
    prompts are disaggregated, their KV pulled head by head across the TP split, and the
    answers (greedy with logprobs, and seeded) equal the one-rank offline engine's."""
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps({"decider": {"min_uncached_tokens": 32}}))
    llm = LLM(model=str(tiny_model), num_kv_blocks=512, max_model_len=1024, show_progress=False)
    prompts = [long_prompt(tiny_model, 100 + 40 * i, f"tp-pd-{p}{d}-{i}") for i in range(2)]
    greedy = SamplingParams(temperature=0, max_tokens=16, logprobs=1)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=5)
    want = [o.outputs[0] for o in llm.generate(prompts, greedy, use_tqdm=False)]
    want_seeded = llm.generate(prompts[:1], seeded, use_tqdm=False)[0].outputs[0].text
    llm.shutdown()
    with running_cluster(tiny_model, 0, "--prefill-workers", "1", "--decode-workers", "1",
                         "--prefill-tensor-parallel-size", str(p),
                         "--decode-tensor-parallel-size", str(d), "--worker-metrics",
                         "--routing-policy", str(policy)) as cluster:  # fmt: skip
        assert len(_ranks(cluster.procs["prefill-0"].pid)) == (p if p > 1 else 0)
        assert len(_ranks(cluster.procs["decode-0"].pid)) == (d if d > 1 else 0)
        c = openai.OpenAI(base_url=cluster.url, api_key="x", max_retries=0, timeout=60)
        before = disaggregated_routes(cluster)
        for prompt, ref in zip(prompts, want, strict=True):
            out = c.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                       logprobs=1)  # fmt: skip
            assert out.choices[0].text == ref.text
            lps = out.choices[0].logprobs.token_logprobs  # type: ignore[union-attr]
            expected = [lp[t].logprob for lp, t in zip(ref.logprobs or [], ref.token_ids,
                                                       strict=True)]  # fmt: skip
            assert lps == pytest.approx(expected, abs=1e-4)
        assert disaggregated_routes(cluster) >= before + 2
        # pulled, not recomputed: both prompts' KV moved, and no pull failed
        wait_for(lambda: _metric(cluster, "baton_worker_kv_pulls_total") >= 2, 5.0, "the pulls")
        assert _metric(cluster, "baton_worker_kv_pull_failures_total") == 0
        wait_for(lambda: worker_health(cluster, "prefill-0").kv_usage == 0, 5.0, "leases to end")
        seeded_out = c.completions.create(model=MODEL, prompt=prompts[0], max_tokens=12,
                                          temperature=1.0, top_p=0.9, seed=5)  # fmt: skip
        assert seeded_out.choices[0].text == want_seeded
