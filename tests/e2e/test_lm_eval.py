"""lm-evaluation-harness (``lm_eval``) as its users run it, on SmolLM2-135M-Instruct: its
``local-completions`` model against ``baton serve`` (the gateway's ``/v1/completions`` with
``echo`` and ``logprobs``, the prompt's log-probabilities) and its ``hf`` model on the same
weights (the GGUF file dequantized by transformers, saved as a safetensors checkpoint), both
through the ``lm_eval`` command on a task of our own (``lm_eval_task/``: 32 questions of four
choices). They must score the same: the same accuracy, every request's log-likelihood within
``TOLERANCE`` and the same greedy flags. ``local-completions`` asks for ``max_tokens: 1`` and
takes ``token_logprobs[ctxlen:-1]`` as the continuation's: every generated token needs its entry,
the end-of-turn token too (without it, 6 of the 128 requests lost their last token).
"""

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from baton.launcher import Cluster
from tests.e2e.conftest import running_cluster
from tests.helpers import ROOT
from tests.smollm2 import transformers_model, transformers_tokenizer

TASK = "baton_facts"
TASK_DIR = Path(__file__).parent / "lm_eval_task"
MODEL = "SmolLM2-135M-Instruct.Q4_1"  # the served name: the file's, without .gguf
# A request's log-likelihood is the sum of its continuation's token log-probabilities (1 to 4
# tokens here); both sides compute in float32 on the CPU, Baton with its own kernels and
# batching, transformers with its own (4.1e-5 the largest difference seen on this VM)
TOLERANCE = 2e-4
LM_EVAL_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def hf_checkpoint(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The GGUF file as transformers reads it (dequantized, q/k un-permuted), saved as a
    Hugging Face checkpoint with its tokenizer: what ``--model hf`` loads, and the tokenizer
    ``local-completions`` tokenizes with."""
    path = tmp_path_factory.mktemp("smollm2-hf")
    transformers_model(smollm2_gguf).save_pretrained(path)
    transformers_tokenizer(smollm2_gguf).save_pretrained(path)
    return path


def lm_eval(
    model: str, model_args: str, out: Path, *flags: str
) -> tuple[dict[str, Any], list[dict]]:
    """``lm_eval --model MODEL --model_args ARGS --tasks baton_facts --include_path ...``, run
    from the checkout's root (the task's data_files are relative to it): the task's metrics and
    its samples (``--log_samples``), each with its requests' (log-likelihood, is-greedy)."""
    cmd = [
        str(Path(sys.executable).parent / "lm_eval"), "--model", model, "--model_args", model_args,
        "--tasks", TASK, "--include_path", str(TASK_DIR.relative_to(ROOT)),
        "--output_path", str(out), "--log_samples", *flags,
    ]  # fmt: skip
    env = {
        **os.environ,
        # nothing from a hub: the task's data is a local file, the models are local folders
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(out / "datasets-cache"),
    }
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=LM_EVAL_TIMEOUT_S)  # fmt: skip
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stderr[-6000:]}"
    (results,) = out.rglob("results_*.json")
    (samples,) = out.rglob(f"samples_{TASK}_*.jsonl")
    metrics = json.loads(results.read_text())["results"][TASK]
    return metrics, [json.loads(line) for line in samples.read_text().splitlines()]


def scores(samples: list[dict]) -> dict[int, list[tuple[float, bool]]]:
    """Each question's (log-likelihood, is-greedy) of each of its choices."""
    return {
        s["doc_id"]: [(float(ll), greedy == "True") for ll, greedy in s["filtered_resps"]]
        for s in samples
    }


@pytest.fixture(scope="module")
def hf_run(hf_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    out = tmp_path_factory.mktemp("lm-eval-hf")
    # batches of 16 (padded): 34 s against 82 s one at a time on this VM, 2.5e-5 apart at most
    args = f"pretrained={hf_checkpoint},dtype=float32"
    return lm_eval("hf", args, out, "--device", "cpu", "--batch_size", "16")


@pytest.fixture(scope="module")
def cluster(smollm2_gguf: Path) -> Iterator[Cluster]:
    with running_cluster(smollm2_gguf, 1, "--device", "cpu") as c:
        yield c


@pytest.fixture(scope="module")
def baton_run(
    cluster: Cluster, hf_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> Any:
    out = tmp_path_factory.mktemp("lm-eval-baton")
    args = f"base_url={cluster.url}/completions,model={MODEL},tokenizer={hf_checkpoint}"
    # 16 prompts a request (one completions request with a batch of token lists, echoed): 22 s
    # against 31 s one at a time on this VM, the same log-likelihoods
    return lm_eval("local-completions", args, out, "--batch_size", "16")


def test_the_hf_model_gets_the_task_partly_right(hf_run: Any) -> None:
    """The task tells a trained model from noise (chance is 0.25) without being saturated."""
    metrics, samples = hf_run
    assert len(samples) == 32
    assert 0.4 <= metrics["acc,none"] < 1.0, metrics
    assert 0.4 <= metrics["acc_norm,none"] < 1.0, metrics


def test_local_completions_against_baton_serve_gets_the_same_accuracy(
    hf_run: Any, baton_run: Any
) -> None:
    (hf_metrics, _), (metrics, samples) = hf_run, baton_run
    assert len(samples) == 32
    for metric in ("acc,none", "acc_norm,none"):
        assert metrics[metric] == hf_metrics[metric], metric


def test_local_completions_against_baton_serve_gets_the_same_loglikelihoods(
    hf_run: Any, baton_run: Any
) -> None:
    """Every request's (log-likelihood, is-greedy) as transformers', within ``TOLERANCE``."""
    want, got = scores(hf_run[1]), scores(baton_run[1])
    assert got.keys() == want.keys()
    for doc, choices in want.items():
        assert [g for _, g in got[doc]] == [g for _, g in choices], (doc, got[doc], choices)
        for (ll, _), (ref, _) in zip(got[doc], choices, strict=True):
            assert abs(ll - ref) <= TOLERANCE, (doc, got[doc], choices)
