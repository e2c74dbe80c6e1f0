"""Helpers that more than one test module uses, for every kind of test (unit, integration,
the chart): a test module imports them from here, never from another test module. Fixtures
stay in the conftest files; the e2e tests' cluster helpers are ``tests/e2e/conftest.py``'s.

Light to import: what only annotates is imported for the type checker alone (a unit test of
the scheduler loads no model, no torch). ``tests/conftest.py`` has pytest rewrite the asserts
here, as in a test module.
"""

import functools
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import yaml

from baton import tiny_fp8
from services.global_scheduler.registry import WorkerLoad, WorkerState
from services.worker.engine.config import CacheConfig, SchedulerConfig
from services.worker.engine.kv_transfer.params import KVTransferParams
from services.worker.engine.kv_transfer.scheduler_side import KVTransferBookkeeping
from services.worker.engine.params import SamplingParams
from services.worker.engine.request import Request
from services.worker.engine.sched.output import ModelRunnerOutput, SchedulerOutput
from services.worker.engine.sched.scheduler import Scheduler
from shared.ids import RequestId, WorkerId

if TYPE_CHECKING:
    from baton import LLM, RequestOutput
    from services.global_scheduler.directory import Match

ROOT = Path(__file__).resolve().parents[1]

# ---- the engine's scheduler and KV bookkeeping (no model, no torch) ---------------------------

EOS = 0


class Clock:
    """A clock the test moves (``now``), for code that takes one in place of the real time."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def make_request(
    rid: str, prompt_len: int, max_tokens: int = 4, first_token: int = 1, **params: object
) -> Request:
    prompt = [first_token + i for i in range(prompt_len)]
    sp = SamplingParams(max_tokens=max_tokens, **params)  # type: ignore[arg-type]
    return Request(RequestId(rid), prompt, sp, (EOS,), block_size=4, max_model_len=256)


def make_scheduler(
    num_blocks: int = 64,
    budget: int = 32,
    max_num_seqs: int = 8,
    chunked: bool = True,
    caching: bool = True,
    transfer: KVTransferBookkeeping | None = None,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs, budget, chunked, max_model_len=256),
        CacheConfig(4, caching, num_blocks, None, 0.9),
        num_blocks,
        transfer,
    )


def fake_run(sched: Scheduler, out: SchedulerOutput, token: int = 7) -> ModelRunnerOutput:
    """What a model runner would report for the step just scheduled: a token for every request
    the step computes up to its end (the scheduler counted it as a placeholder)."""
    ids = [r.req_id for r in out.new_reqs] + [r.req_id for r in out.cached_reqs]
    sampled = []
    for rid in ids:
        req = sched.requests[RequestId(rid)]
        samples = req.num_computed_tokens == req.num_tokens_with_placeholders - 1
        sampled.append([token] if req.num_output_placeholders and samples else [])
    return ModelRunnerOutput(ids, sampled, [None] * len(ids))


# ---- the global scheduler ---------------------------------------------------------------------


def worker(name: str, role: str = "both", running: int = 0, kv: float = 0.0,
           draining: bool = False) -> WorkerState:  # fmt: skip
    w = WorkerState(WorkerId(name), "i", role, f"{name}:1", "m", 1024, 16, 100)
    w.load = WorkerLoad(num_running=running, kv_usage=kv, draining=draining)
    return w


def held(matches: "dict[WorkerId, Match]") -> dict[WorkerId, int]:
    """Confirmed leading blocks per worker, where nothing is pending."""
    assert all(m.pending == 0 for m in matches.values()), matches
    return {w: m.confirmed for w, m in matches.items()}


# ---- disaggregated prefill/decode between two engines of this process -------------------------


def disaggregated(
    prefill: "LLM", decode: "LLM", ids: list[int], params: SamplingParams
) -> "tuple[RequestOutput, RequestOutput]":
    first = prefill.generate(
        [{"prompt_token_ids": ids, "kv_transfer": KVTransferParams(do_remote_decode=True)}],
        params.clone(max_tokens=1, min_tokens=0),
    )[0]
    handle = first.kv_handle
    assert handle is not None and handle.num_tokens == len(ids)
    token = first.outputs[0].token_ids[0]
    leg = KVTransferParams(remote=handle, first_token_id=token)
    rest = decode.generate([{"prompt_token_ids": ids, "kv_transfer": leg}], params)[0]
    return first, rest


def refused_peer(prefill_model: Path, decode_model: Path, ids: list[int],
                 caplog: "pytest.LogCaptureFixture", **kw: Any) -> str:  # fmt: skip
    """A prefill on ``prefill_model`` handed to a decode engine on ``decode_model`` whose KV
    handshake must refuse it: nothing is pulled, the decode engine recomputes the prompt after
    the handed-over token; returns what it logged (the refusal names both caches)."""
    import logging

    from baton import LLM

    prefill = LLM(model=str(prefill_model), multiprocess=True, kv_transfer=True, **kw)
    decode = LLM(model=str(decode_model), kv_transfer=True, **kw)
    try:
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        with caplog.at_level(logging.ERROR):
            _, out = disaggregated(prefill, decode, ids, params)
        stats = decode.get_stats()
    finally:
        prefill.shutdown()
        decode.shutdown()
    assert stats.kv_pulls == 0 and stats.kv_pull_failures == 1 and stats.kv_pull_bytes == 0
    assert len(out.outputs[0].token_ids) == 3  # recomputed after the first (handed-over) token
    return "\n".join(r.getMessage() for r in caplog.records)


def disaggregated_equals_colocated(
    model: Path, ids: list[int], atol: float, **kw: Any
) -> "tuple[RequestOutput, Any]":
    """``ids`` greedily (10 tokens, logprobs) through prefill and decode engines over NIXL
    (``disaggregated``), equal in tokens and logprobs (within ``atol``) to a colocated engine;
    the prefill leg's output (its KV handle) and the decode engine's stats once the lease ended."""
    from baton import LLM

    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1)
    ref = LLM(model=str(model), **kw)
    prefill = LLM(model=str(model), multiprocess=True, kv_transfer=True, **kw)
    decode = LLM(model=str(model), multiprocess=True, kv_transfer=True, **kw)
    try:
        want = ref.generate([{"prompt_token_ids": ids}], params)[0].outputs[0]
        first, rest = disaggregated(prefill, decode, ids, params)
        wait_all_free(prefill)
        stats = decode.get_stats()
    finally:
        for engine in (ref, prefill, decode):
            engine.shutdown()
    assert first.outputs[0].token_ids + rest.outputs[0].token_ids == want.token_ids
    lps = (first.outputs[0].logprobs or []) + (rest.outputs[0].logprobs or [])
    for a, b in zip(lps, want.logprobs or [], strict=True):
        assert all(abs(a[t].logprob - b[t].logprob) <= atol for t in b)
    return first, stats


def wait_all_free(llm: "LLM", timeout_s: float = 5.0) -> float:
    start = time.monotonic()
    while llm.get_stats().num_free_blocks != llm.get_stats().num_blocks:
        assert time.monotonic() - start < timeout_s, "the lease was not released"
        time.sleep(0.02)
    return time.monotonic() - start


# ---- the Helm chart, rendered with each value set of charts/baton/ci --------------------------

CHART = ROOT / "charts" / "baton"
SETS = sorted(p.name.removesuffix("-values.yaml") for p in (CHART / "ci").glob("*-values.yaml"))
TOKEN = "golden-token-0123456789"  # the internal token is random otherwise


def helm() -> str:
    found = shutil.which("helm", path=str(Path(sys.executable).parent)) or shutil.which("helm")
    if found is None:
        pytest.fail("helm is missing: `make install` puts it in .venv/bin")
    return found


def extra_args(name: str) -> list[str]:
    with_operator = name in ("monitoring", "production")
    return ["--api-versions", "monitoring.coreos.com/v1"] if with_operator else []


@functools.cache
def rendered(name: str) -> str:
    cmd = [helm(), "template", "rel", str(CHART), "--namespace", "serving",
           "-f", str(CHART / "ci" / f"{name}-values.yaml"),
           "--set", f"internalToken.value={TOKEN}", *extra_args(name)]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def objects(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(rendered(name)) if d]


# the FP8 checkpoints against their dequantizing reference (baton/tiny_fp8), on CPU and GPU
FP8_TIE = 0.05  # nats: a near-tie the engine may break the other way
FP8_LOGPROB_ATOL = 0.2  # one flipped e4m3 rounding moves a logprob this far at most (seen: 0.05)
# On a GPU the FP8 products of more than a few rows are summed by the tensor cores, whose
# accumulator keeps fewer bits than float32, so the median step is not the reference's
# arithmetic to 1e-3 as on CPU. By checkpoint format: the H100's medians were 0.0026 (per
# channel) and 0.0085 (blocks) for the tiny MoE checkpoints, and the reference with 13-16-bit
# sums in those rows moves by 0.0034-0.0049 and 0.0051-0.0086 (docs/results/cpu-2026-12-06).
FP8_GPU_MEDIAN_ATOL = {"fp8-tensor": 1e-2, "fp8-channel": 1e-2, "fp8-block": 2e-2}
# ... and of the tokens, how many must be the reference's argmax (every other one is checked to
# be a near-tie within FP8_TIE): the MoE block checkpoint's logprobs move 2.6 times as far as
# per channel's (medians), so more near-ties flip. On an H100: 57 of 64 in every setting of
# ``fp8_accuracy.py --parity`` (its experts in PyTorch, its attention eager alike: consistent
# with the dense layers' block GEMMs), per channel 60 (docs/results/h100-2026-12-06). No dense
# block checkpoint's share was measured (the dense GPU test's are per tensor and channel)
FP8_GPU_EXACT = {"fp8-tensor": 0.9, "fp8-channel": 0.9, "fp8-block": 0.85}
FP8_PROMPTS = tiny_fp8.PROMPTS
FP8_GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)


def fp8_generate(path: Path, **kw: Any) -> list[Any]:
    """The engine's greedy outputs of ``FP8_PROMPTS`` on the FP8 checkpoint at ``path``
    (``kw``: engine arguments), checked to run quantized."""
    from baton import LLM

    llm = LLM(model=str(path), show_progress=False, **kw)
    try:
        assert llm.config.model.quantization is not None
        return llm.generate(FP8_PROMPTS, FP8_GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()


def check_against_fp8_reference(
    path: Path, outs: list[Any], median_atol: float = 1e-3, tie: float = FP8_TIE
) -> int:
    """Every engine token is the reference's argmax or a near-tie (within ``tie`` nats), its
    logprob the reference's (most of them to ``median_atol``); returns how many tokens are the
    reference's exact argmax."""
    from baton.tiny_fp8 import reference_gaps

    rows = reference_gaps(path, FP8_PROMPTS, outs)
    for r in rows:
        assert r["margin"] <= tie, (r["prompt"], r["step"], r["margin"])
    exact = sum(r["argmax"] for r in rows)
    diffs = [r["gap"] for r in rows]
    assert max(diffs) <= FP8_LOGPROB_ATOL, max(diffs)
    median = sorted(diffs)[len(diffs) // 2]
    assert median <= median_atol, median  # most steps are the same arithmetic
    return exact


def copy_checkpoint(src: Path, dst: Path) -> Path:
    """A copy of a checkpoint directory's files (to edit its config or tensors)."""
    dst.mkdir()
    for f in src.iterdir():
        if f.is_file():
            (dst / f.name).write_bytes(f.read_bytes())
    return dst


def hf_continue(model: Any, ids: Any, max_new: int, **kw: Any) -> Any:
    """Hugging Face's greedy ``generate`` of ``max_new`` tokens after ``ids`` with EOS an
    ordinary token, as the engine's ``ignore_eos`` has it: no stop at EOS, and no ban on it
    either (``min_new_tokens`` would mask EOS until the last token, so where EOS is the
    argmax Hugging Face would continue with the runner-up: seen on a GPU, tiny Mixtral)."""
    model.generation_config.eos_token_id = None
    return model.generate(ids, max_new_tokens=max_new, do_sample=False, **kw)


def hf_greedy(path: Path, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """Hugging Face's greedy tokens of the checkpoint at ``path``, float32 on the CPU,
    ``max_new`` of them for each prompt (EOS or not)."""
    import torch
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    out = []
    for ids in prompts:
        seq = hf_continue(model, torch.tensor([ids]), max_new)
        out.append(seq[0, len(ids) :].tolist())
    return out


def hf_greedy_with_rows(
    model: Any, prompts: list[list[int]], max_new: int
) -> tuple[list[list[int]], list[list[list[float]]]]:
    """A Hugging Face model's greedy tokens for each prompt (``max_new`` of them, EOS or not)
    and the log-softmax row of every step: the reference ``assert_matches_reference`` takes."""
    import torch

    tokens, rows = [], []
    for ids in prompts:
        out = hf_continue(model, torch.tensor([ids]), max_new, output_logits=True,
                          return_dict_in_generate=True)  # fmt: skip
        tokens.append(out.sequences[0, len(ids) :].tolist())
        rows.append([step[0].float().log_softmax(-1).tolist() for step in out.logits])
    return tokens, rows


def generate_in_three_batches(
    llm: "LLM", prompts: list[list[int]], params: SamplingParams
) -> list[Any]:
    """The first two prompts, then the next two, then the rest (by then the earlier ones'
    prefixes are cached, so the later ones' prompts hit them): each request's output."""
    asks = [{"prompt_token_ids": p} for p in prompts]
    outs = [o for part in (asks[:2], asks[2:4], asks[4:])
            for o in llm.generate(part, params, use_tqdm=False)]  # fmt: skip
    return [o.outputs[0] for o in outs]


def assert_matches_reference(
    outs: list[Any], tokens: list[list[int]], rows: list[list[list[float]]], atol: float
) -> None:
    """Greedy outputs equal a reference's tokens, and every logprob they carry is within
    ``atol`` of the reference's log-softmax row at that step."""
    assert [o.token_ids for o in outs] == tokens
    for out, steps in zip(outs, rows, strict=True):
        for position, row in zip(out.logprobs, steps, strict=True):
            for token_id, lp in position.items():
                assert abs(lp.logprob - row[token_id]) < atol


def experts_chosen(path: Path, ids: list[int]) -> dict[int, set[int]]:
    """Hugging Face's model at ``path`` (float32) run over ``ids``: the experts each MoE layer's
    router chose for any of them, by layer index (a router returns (logits, weights, ids))."""
    import torch
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    used: dict[int, set[int]] = {}
    for i, layer in enumerate(model.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None:
            gate.register_forward_hook(lambda mod, args, out, i=i: used.setdefault(i, set())
                                       .update(out[2].flatten().tolist()))  # fmt: skip
    with torch.no_grad():
        model(torch.tensor([ids]))
    return used


def add_draft_layer(path: Path, num_layers: int) -> None:
    """A multi-token-prediction module as DeepSeek-V3's and GLM-4.5's checkpoints keep it:
    ``model.layers.<num_layers>.*``, past the decoder's layers (a copy of the last layer's
    tensors and an ``eh_proj``), which the engine must skip."""
    import torch
    from safetensors.torch import load_file, save_file

    file = path / "model.safetensors"
    tensors = load_file(file)
    last, draft = f"model.layers.{num_layers - 1}.", f"model.layers.{num_layers}."
    for name in [n for n in tensors if n.startswith(last)]:
        tensors[name.replace(last, draft)] = tensors[name].clone()
    tensors[f"{draft}eh_proj.weight"] = torch.zeros(64, 128)
    save_file(tensors, str(file), metadata={"format": "pt"})
