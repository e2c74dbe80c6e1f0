"""``baton serve --tensor-parallel-size 2``: two workers of two rank processes each answer the
OpenAI API exactly like the one-rank engine, and a rank killed in the middle of a stream ends
its worker's requests, which the gateway resumes on the other worker: the client sees the whole
answer, unchanged."""

import signal
import time
from pathlib import Path

import openai
import psutil

from baton import LLM, SamplingParams
from tests.e2e.conftest import running_cluster, wait_for, worker_health

MODEL = "qwen3"
PROMPTS = ["Hi", "The quick brown fox jumps over the lazy dog", "import os\nimport sys\n"]


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
