"""The benchmarks' bounds are only as honest as what they count: the bytes a step reads, the
FLOPs it runs, and, in the step trace, every step the engine took."""

import argparse
from pathlib import Path

import pytest
import torch

from baton import LLM, SamplingParams
from benchmarks.roofline import ModelCost
from benchmarks.throughput import StepTrace, run_baton


@pytest.mark.parametrize("name", ["llama", "llama3-tied"])
def test_model_cost_counts_the_embedding_table_once_and_only_where_it_is_read(
    tiny_models: dict[str, Path], name: str
) -> None:
    llm = LLM(model=str(tiny_models[name]), show_progress=False)
    info, arch = llm.get_model_info(), llm.config.model.arch
    llm.shutdown()
    table = arch.vocab_size * arch.hidden_size
    tied = arch.tie_word_embeddings
    assert info.lm_head_params == table
    assert info.untied_embedding_params == (0 if tied else table)
    cost = ModelCost(info, arch)
    elsize = info.weight_bytes // info.num_params
    # a tied table is the LM head, read in full every step; an untied input table is not
    assert info.weight_bytes - cost.read_weight_bytes == (0 if tied else table * elsize)
    # the decoder body: everything but the embedding table(s)
    assert cost.body_params == info.num_params - table * (1 if tied else 2)
    one_token = cost.flops(1, 1, 1)
    assert one_token == 2 * (cost.body_params + table) + 4 * arch.num_layers * arch.num_heads * (
        arch.head_dim
    )


def test_serial_bound_adds_attention_to_the_linear_layers(tiny_model: Path) -> None:
    llm = LLM(model=str(tiny_model), show_progress=False)
    cost = ModelCost(llm.get_model_info(), llm.config.model.arch)
    llm.shutdown()
    bw = 1e12
    weights_s = cost.read_weight_bytes / bw
    # a peak so low that the linear layers of 64 rows are compute-bound, attention not
    rows, context = 64, 64 * 500
    peak = cost.linear_flops(rows, rows) / (2 * weights_s)
    kv_s = context * cost.kv_bytes_per_token / bw
    serial = cost.serial_seconds(rows, rows, context, rows, bw, peak)
    assert serial == pytest.approx(2 * weights_s + kv_s)
    roofline = max(cost.read_bytes(context) / bw, cost.flops(rows, rows, rows) / peak)
    assert serial > roofline  # the step-wide max lets attention hide under the GEMMs
    # memory-bound everywhere (batch 1), the two bounds agree
    one = cost.serial_seconds(1, 1, 500, 1, bw, 1e18)
    assert one == pytest.approx(cost.read_bytes(500) / bw)


def test_step_trace_accounts_for_every_step_token_and_query_key_pair(tiny_model: Path) -> None:
    llm = LLM(model=str(tiny_model), max_num_batched_tokens=16, max_num_seqs=4, show_progress=False)
    trace = StepTrace(llm.client.core.scheduler)  # type: ignore[attr-defined]
    before = llm.get_stats()
    prompt, new = list(range(5, 45)), 6  # 40 prompt tokens: chunks of 16, 16, 8
    llm.generate(
        {"prompt_token_ids": prompt},
        SamplingParams(temperature=0, max_tokens=new, ignore_eos=True),
        use_tqdm=False,
    )
    after = llm.get_stats()
    llm.shutdown()
    steps = trace.steps
    assert len(steps) == after.num_steps - before.num_steps == 3 + new - 1
    assert sum(s[2] for s in steps) == after.computed_tokens - before.computed_tokens
    assert [s[2] for s in steps] == [16, 16, 8] + [1] * (new - 1)
    assert [s[6] for s in steps] == [True] * 3 + [False] * (new - 1)  # prefill steps
    assert [s[3] for s in steps] == [0, 0, 1] + [1] * (new - 1)  # sampled rows
    # causal attention: token at position p sees p + 1 keys
    total = len(prompt) + new - 1  # the last sampled token is never fed back
    assert sum(s[5] for s in steps) == sum(p + 1 for p in range(total))
    assert sum(s[4] for s in steps) == after.context_tokens_read - before.context_tokens_read


def test_throughput_step_trace_reports_each_kind_of_step(tiny_model: Path) -> None:
    args = argparse.Namespace(
        model=str(tiny_model), load_format="auto", dtype="auto", device="cpu", num_prompts=6,
        min_len=20, max_len=40, max_num_seqs=4, seed=0, inproc=True, step_trace=True,
    )  # fmt: skip
    result, _, _ = run_baton(args)
    # the result says what ran: a float model, its KV cache in the model's dtype
    assert result["quantization"] == "" and result["kv_cache_dtype"] == "float32"
    trace = result["step_trace"]
    assert trace["all"]["steps"] == result["steps"]
    kinds = [k for k in trace if k not in ("all", "copy_bandwidth_GBps", "matmul_peak_TFLOPs")]
    assert "prefill or mixed" in kinds and any(k.startswith("decode") for k in kinds)
    assert sum(trace[k]["steps"] for k in kinds) == trace["all"]["steps"]
    for k in [*kinds, "all"]:
        # the machine's bounds can't be beaten, whatever the kind of step
        assert trace[k]["memory_bound_fraction"] > 0
        assert 0 < trace[k]["roofline_fraction"] <= 1
        # serial ≥ step-wide roofline, so its fraction is at least the roofline's
        assert trace[k]["roofline_fraction"] <= trace[k]["serial_bound_fraction"] <= 1
        assert trace[k]["memory_bound_fraction_at_serial_bound"] > 0


def test_limits_are_the_best_of_every_measurement_of_one_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A measurement taken while another process holds the GPU reads low; the bound must use
    the machine's limit. "cuda" and "cuda:0" (what the engine reports) are one device."""
    from benchmarks import roofline

    readings = iter([4.2e12, 3.8e12])
    roofline.forget_limits()
    monkeypatch.setattr(roofline, "copy_bandwidth", lambda device: next(readings))
    monkeypatch.setattr(roofline, "matmul_peak", lambda device, dtype: 7.9e14)
    bf16 = torch.bfloat16
    try:
        assert roofline.limits(torch.device("cuda"), bf16) == (4.2e12, 7.9e14)  # before
        assert roofline.limits(torch.device("cuda:0"), bf16) == (4.2e12, 7.9e14)  # after: lower
        seen = roofline.limits_seen(torch.device("cuda", 0), bf16)
        assert [b for b, _ in seen] == [4.2e12, 3.8e12]
    finally:
        roofline.forget_limits()  # (the fake readings are no machine's)


def test_the_split_tune_times_each_case_with_the_launch_the_engine_gives_it() -> None:
    """``attention_sweep.py --tune-split-decode`` scores a candidate split launch only on the
    cases whose context is longer than ``long_context``: shorter ones run the one-range launch
    in the engine, whatever the split launch is, so the sweep's times of a candidate there
    must not pick it (here the deep launch is the fastest alone at the short case, and loses
    at the long one)."""
    from benchmarks.kernels.attention_sweep import SplitChoice

    one, deep, mid = (64, 4, 2), (128, 8, 4), (128, 4, 3)
    cases = [(1, 32768), (1, 2048)]
    # seconds by case and split count; 8 SMs, 8 kv heads, rule (waves 2, ≤ 2 splits, 32 tokens):
    # both cases take 2 splits
    times = {
        one: [{1: 9.0, 2: 8.0}, {1: 3.0, 2: 2.0}],
        deep: [{1: 9.0, 2: 5.0}, {1: 3.0, 2: 1.0}],
        mid: [{1: 9.0, 2: 4.0}, {1: 3.0, 2: 1.8}],
    }
    rule = (2, 2, 32)
    engine = SplitChoice(times, cases, kv_heads=8, sms=8, one=one, long_context=16384)
    assert engine.best == [4.0, 2.0]  # the short case: only the one-range launch counts
    assert engine.time(deep, rule, 1) == 2.0 and engine.time(deep, rule, 0) == 5.0
    assert engine.pick([rule], rule) == (mid, rule)
    alone = SplitChoice(times, cases, kv_heads=8, sms=8, one=one, long_context=None)
    assert alone.best == [4.0, 1.0]
    # without long_context every case takes the candidate: deep's 1.0 at the short case wins
    assert alone.pick([rule], rule) == (deep, rule)
    # a rule whose split count was not measured is never chosen
    assert engine.time(mid, (4, 4, 32), 0) == float("inf")  # 4 splits


def test_a_batch_reads_the_experts_its_tokens_choose_between_them(tmp_path: Path) -> None:
    """One token reads top_k of E routed experts; t tokens choosing at random cover
    1 - (1 - top_k/E)^t of them in expectation (against a simulation of such choices), and
    a long batch reads them all: every weight but an untied input table."""
    from baton.tiny_model import make_tiny_model

    path = make_tiny_model(tmp_path / "moe", arch="qwen3_moe", num_layers=2)
    with LLM(model=str(path), show_progress=False) as llm:
        info, arch = llm.get_model_info(), llm.config.model.arch
    cost = ModelCost(info, arch)
    k, experts = arch.moe.top_k, arch.moe.num_experts
    assert cost.active_expert_fraction == k / experts < 1 and cost.routed_expert_bytes > 0
    assert cost.read_bytes(100, 1) == cost.read_weight_bytes + 100 * cost.kv_bytes_per_token
    g = torch.Generator().manual_seed(0)
    for t in (2, 3, 8):
        picks = torch.rand(20000, t, experts, generator=g).topk(k, -1).indices.flatten(1)
        simulated = torch.zeros(20000, experts).scatter_(1, picks, 1.0).mean().item()
        assert cost.expert_fraction(t) == pytest.approx(simulated, abs=0.005)
        more = cost.routed_expert_bytes * (cost.expert_fraction(t) - k / experts)
        assert cost.read_bytes(0, t) - cost.read_bytes(0, 1) == pytest.approx(more, abs=1)
    elsize = torch.empty((), dtype=getattr(torch, info.dtype)).element_size()
    every_weight = info.weight_bytes - info.untied_embedding_params * elsize
    assert cost.weight_read_bytes(10**4) == pytest.approx(every_weight, abs=2)
