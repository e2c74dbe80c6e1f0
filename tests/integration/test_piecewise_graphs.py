"""Piecewise CUDA graphs (``worker/piecewise_graphs.py``): a step that the decode graphs do not
take runs padded to a captured token count, its forward split at each layer's attention call,
the attention run between the pieces on the step's metadata over static q/k/v/out buffers.

On CPU there are no CUDA graphs; the runner's inline mode runs the same split forward (the
static buffers, the padding rows and their KV slots, the step's metadata over the padded slot
mapping, the attention's ``out=``) that replay runs between the pieces. It must equal the eager
engine token for token, and leave the same KV cache: chunked prefill over cached prefixes,
mixed steps of prefill chunks and decode rows, preemption. The captured pieces are checked on
the GPU (``tests/gpu/test_gpu_engine.py``)."""

import dataclasses
import itertools
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from baton import LLM, SamplingParams
from services.worker.engine.config import EngineArgs, piecewise_sizes
from services.worker.engine.outputs import CompletionOutput
from services.worker.engine.worker import piecewise_graphs
from services.worker.engine.worker.step_inputs import StepInputs, TokenFill

SIZES = (16, 32, 48)  # 48: the step's token budget, so every step runs split

VARIANTS: dict[str, dict[str, Any]] = {
    "torch": {},
    # the GPU's code path (Triton attention and fused kernels) in Triton's interpreter
    "triton": {"attention_backend": "triton", "fused_ops": True},
    # FP8 weights (activations as codes from the norms) and an e4m3 KV cache
    "fp8": {"quantization": "fp8", "kv_cache_dtype": "fp8"},
}


def _prompts() -> list[list[int]]:
    """Long enough to be chunked (budget 48), some sharing 32 tokens (two full blocks)."""
    shared = [(7 * i) % 200 + 3 for i in range(32)]
    return [
        [(5 * i) % 190 + 2 for i in range(70)],
        [*shared, 11, 12, 13],
        [(3 * i) % 170 + 9 for i in range(23)],
        shared + [(i * 13) % 150 + 1 for i in range(40)],
        [42, 43, 44, 45, 46],
    ]


def _engine(path: Path, variant: str) -> LLM:
    # 9 blocks of 16 tokens for five prompts of up to 72 tokens plus 20 new ones each:
    # requests are preempted and resumed
    return LLM(model=str(path), show_progress=False, dtype="float32", max_num_batched_tokens=48,
               max_num_seqs=4, num_kv_blocks=9, max_model_len=128,
               **VARIANTS[variant])  # fmt: skip


def _generate(llm: LLM, max_tokens: int) -> list[CompletionOutput]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    prompts = [{"prompt_token_ids": p} for p in _prompts()]
    first = llm.generate(prompts[:3], params, use_tqdm=False)  # cached prefixes for the rest
    rest = llm.generate(prompts[3:] + prompts[:1], params, use_tqdm=False)
    return [o.outputs[0] for o in first + rest]


def _same_or_a_near_tie(ours: CompletionOutput, theirs: CompletionOutput) -> None:
    """Logprobs within 0.06 and equal tokens, up to a step (if any) where both engines' two
    best were within 0.05 of each other: FP8 rounds each activation to 3 mantissa bits, and a
    last-bit difference of a padded (more rows) float product can move a value across a
    rounding boundary, by 1/16 to 1/8 of itself. On the tiny random model that moved logprobs
    by up to 0.03 here, and swapped tokens whose logprobs were 0.007-0.010 apart."""
    a, b = ours.token_ids, theirs.token_ids
    diverge = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
    assert ours.logprobs is not None and theirs.logprobs is not None
    for x, y in zip(ours.logprobs[:diverge], theirs.logprobs[:diverge], strict=True):
        assert all(abs(x[t].logprob - y[t].logprob) < 0.06 for t in x.keys() & y.keys())
    if diverge == len(a):
        return
    for lps in (ours.logprobs, theirs.logprobs):
        top = sorted(lp.logprob for lp in lps[diverge].values())[-2:]
        assert top[1] - top[0] < 0.05, f"diverged at token {diverge} on no near-tie: {top}"


@pytest.mark.parametrize("variant", VARIANTS)
def test_split_forward_equals_eager(tiny_model: Path, variant: str) -> None:
    max_tokens = 8 if variant == "triton" else 20  # (the interpreter is slow)
    eager = _engine(tiny_model, variant)
    want = _generate(eager, max_tokens)

    split = _engine(tiny_model, variant)
    runner = split.client.core.executor.worker.runner  # type: ignore[attr-defined]
    runner.start_piecewise_graphs(SIZES, capture=False)
    steps: list[tuple[int, int, bool]] = []  # (tokens, padded size, mixed)
    run = runner.pieces.run

    def counted(inputs: StepInputs, fill: TokenFill | None = None) -> Any:
        hidden, rows = run(inputs, fill)
        qsl = inputs.query_start_loc
        lens = [b - a for a, b in itertools.pairwise(qsl)]
        steps.append((inputs.num_tokens, hidden.shape[0], 1 in lens and max(lens) > 1))
        return hidden, rows

    runner.pieces.run = counted
    got = _generate(split, max_tokens)
    if variant == "fp8":
        for ours, theirs in zip(got, want, strict=True):
            _same_or_a_near_tie(ours, theirs)
    else:
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        for ours, theirs in zip(got, want, strict=True):
            assert ours.logprobs is not None and theirs.logprobs is not None
            for x, y in zip(ours.logprobs, theirs.logprobs, strict=True):
                assert all(abs(x[t].logprob - y[t].logprob) < 1e-4 for t in x.keys() & y.keys())
    assert steps and all(size in SIZES and size >= n for n, size, _ in steps)
    assert any(size > n for n, size, _ in steps), "no step was padded"
    assert any(mixed for _, _, mixed in steps), "no step mixed a prefill chunk with decode rows"
    assert split.get_stats().num_preemptions > 0, "nothing was preempted"
    # the padding rows wrote only the spare block past the real cache. (Not bit-equal: a
    # padded product has more rows, and the CPU's matmul may then sum in another order; in
    # e4m3 that can move a value by one code, 1/8 of it.)
    if variant != "fp8":  # (after a swapped token the caches differ)
        ours_kv = runner.kv_cache[:-1]
        theirs_kv = eager.client.core.executor.worker.runner.kv_cache[:-1]  # type: ignore[attr-defined]
        torch.testing.assert_close(ours_kv, theirs_kv, rtol=1e-4, atol=1e-5)


def test_piecewise_sizes_cover_the_budget() -> None:
    assert piecewise_sizes(0) == ()
    assert piecewise_sizes(100) == (16, 32, 64, 100)
    sizes = piecewise_sizes(8192)
    assert sizes[:5] == (16, 32, 64, 128, 256) and sizes[-1] == 8192
    for small, big in itertools.pairwise(sizes):  # pads < 1/8 above 1,024
        assert big - small <= max(128, small // 8 + 1)
    # capped at the step's token budget; none on CPU or with enforce_eager
    args = {"piecewise_cuda_graph_tokens": 4096, "max_num_batched_tokens": 2048}
    assert EngineArgs(model="m", **args).piecewise_graph_sizes("cuda", 2048, 1)[-1] == 2048
    assert EngineArgs(model="m", **args).piecewise_graph_sizes("cpu", 2048, 1) == ()
    eager = EngineArgs(model="m", enforce_eager=True, **args)
    assert eager.piecewise_graph_sizes("cuda", 2048, 1) == ()
    with pytest.raises(ValueError, match="piecewise_cuda_graph_tokens must be >= 0"):
        EngineArgs(model="m", piecewise_cuda_graph_tokens=-1).piecewise_graph_sizes("cuda", 2048, 1)
    # by default: on one GPU up to 8,192 tokens (or the budget), none above one rank unless
    # asked for; 0 turns them off
    default = EngineArgs(model="m")
    assert default.piecewise_graph_sizes("cuda", 16384, 1) == piecewise_sizes(8192)
    assert default.piecewise_graph_sizes("cuda", 2048, 1) == piecewise_sizes(2048)
    assert default.piecewise_graph_sizes("cuda", 16384, 2) == ()
    assert EngineArgs(model="m", **args).piecewise_graph_sizes("cuda", 2048, 2)[-1] == 2048
    off = EngineArgs(model="m", piecewise_cuda_graph_tokens=0)
    assert off.piecewise_graph_sizes("cuda", 2048, 1) == ()


class _FakeGraph:
    """Stands in for torch.cuda.CUDAGraph on CPU: records when its capture begins and ends
    and when it is replayed, into one shared log."""

    log: ClassVar[list[str]] = []

    def __init__(self) -> None:
        self.name = f"piece{sum(e.startswith('begin') for e in self.log)}"

    def capture_begin(self, pool: object = None) -> None:
        self.log.append(f"begin {self.name}")

    def capture_end(self) -> None:
        self.log.append(f"end {self.name}")

    def replay(self) -> None:
        self.log.append(f"replay {self.name}")


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """CUDA's graph, stream and synchronisation calls replaced for a capture on CPU; the
    graphs' shared log, emptied."""
    import contextlib

    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: type("S", (), {
        "wait_stream": lambda self, other: None, "synchronize": lambda self: None})())  # fmt: skip
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: torch.cuda.Stream())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    # on CPU no pool holds the pieces' memory: a view that owns nothing would read freed
    # memory at replay, so here the views own theirs (test_unowned_views checks the real one)
    monkeypatch.setattr(piecewise_graphs, "unowned_view", lambda t: t)
    _FakeGraph.log.clear()
    return _FakeGraph.log


def test_capture_ends_a_piece_at_every_attention_call(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch, fake_cuda: list[str]
) -> None:
    """What capture and replay do, in order, with CUDA's graph calls recorded (CPU): one piece
    per layer plus one, each layer's attention between its two pieces at capture (none runs
    then) and at replay (on the step's metadata), every size captured."""

    llm = _engine(tiny_model, "torch")
    runner = llm.client.core.executor.worker.runner  # type: ignore[attr-defined]
    layers = runner.model.attention_layers()
    log = fake_cuda
    backend = type(layers[0].attn)
    calls: list[int] = []
    forward = backend.forward

    def attend(self, q, k, v, kv, meta, out=None, store_kv=True):  # type: ignore[no-untyped-def]
        calls.append(q.shape[0])
        log.append(f"attention {[a.attn for a in layers].index(self)}")
        return forward(self, q, k, v, kv, meta, out, store_kv)

    monkeypatch.setattr(backend, "forward", attend)
    runner.start_piecewise_graphs((16, 32))
    n = len(layers)
    pieces = runner.pieces
    assert sorted(pieces.pieces) == [16, 32] and all(
        len(p) == n + 1 for p in pieces.pieces.values()
    )
    assert all(pieces.order[s] == layers for s in (16, 32))
    # per size: a warm-up forward (n attention calls), then the capture: no attention inside
    want = []
    for _ in (32, 16):
        want += [f"attention {i}" for i in range(n)]
        base = sum(e.startswith("begin") for e in want)
        for i in range(n + 1):
            want += [f"begin piece{base + i}", f"end piece{base + i}"]
    assert log == want
    log.clear()
    calls.clear()
    params = SamplingParams(temperature=0, max_tokens=1)
    llm.generate([{"prompt_token_ids": list(range(3, 23))}], params, use_tqdm=False)  # 20 → 32
    # the size-32 pieces were captured first: piece0 … piece{n}
    assert log == [e for i in range(n) for e in (f"replay piece{i}", f"attention {i}")] + [
        f"replay piece{n}"
    ], "not the 32-token graphs, or not interleaved"
    assert calls == [32] * n


def test_the_kv_budget_leaves_room_for_the_graphs(tiny_model: Path) -> None:
    """What the piecewise graphs will hold is kept out of the KV cache's budget: the largest
    size's share of a full step's activations, and the static buffers (ids, positions, slots;
    the attention's output)."""
    llm = LLM(model=str(tiny_model), show_progress=False, dtype="float32")
    runner = llm.client.core.executor.worker.runner  # type: ignore[attr-defined]
    assert runner.piecewise_reserve_bytes(1 << 20) == 0  # none configured (CPU)
    runner.config = dataclasses.replace(runner.config, device=dataclasses.replace(
        runner.config.device, piecewise_graph_sizes=(16, 32, 1024)))  # fmt: skip
    arch = runner.config.model.arch
    budget = runner.config.scheduler.max_num_batched_tokens
    per_token = 3 * 8 + arch.num_heads * arch.head_dim * 4
    assert runner.piecewise_reserve_bytes(budget * 100) == 1024 * 100 + 1024 * per_token


def test_a_failed_capture_says_what_failed_and_ends_the_capture(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch, fake_cuda: list[str]
) -> None:
    """An operation the capture refuses (here: at layer 1's split, inside the second piece)
    stops start-up with the size, how far it got and what to change, and the piece
    being captured is ended (a stream left capturing would fail every later launch)."""

    llm = _engine(tiny_model, "torch")
    runner = llm.client.core.executor.worker.runner  # type: ignore[attr-defined]
    viewed: list[torch.Tensor] = []

    def refusing(t: torch.Tensor) -> torch.Tensor:  # layer 1's q is the fourth view
        viewed.append(t)
        if len(viewed) == 4:
            raise RuntimeError("operation not permitted when stream is capturing")
        return t

    monkeypatch.setattr(piecewise_graphs, "unowned_view", refusing)
    want = (r"capturing the 32-token forward failed after 1 of its \d+ attention calls "
            r"\(operation not permitted.*piecewise-cuda-graph-tokens")  # fmt: skip
    with pytest.raises(RuntimeError, match=want):
        runner.start_piecewise_graphs((16, 32))
    # piece0 ended at layer 0's split; piece1, open when layer 1's split failed, was ended
    assert fake_cuda == ["begin piece0", "end piece0", "begin piece1", "end piece1"]
    assert all(a.split is None for a in runner.model.attention_layers())


def test_unowned_views_alias_without_holding_the_memory() -> None:
    """What a piece hands its attention: a view of the same memory, offset and strides (a
    column slice of a wider row, as q, k and v of the fused projection are) that adds no
    owner, so the graphs' pool may reuse the memory once the piece's own tensor is gone."""
    base = torch.arange(48.0).view(4, 12)
    q = base[:, 4:8].view(4, 2, 2)
    owners = torch._C._storage_Use_Count(base.untyped_storage()._cdata)
    view = piecewise_graphs.unowned_view(q)
    assert torch._C._storage_Use_Count(base.untyped_storage()._cdata) == owners
    assert (view.shape, view.stride(), view.storage_offset()) == (
        q.shape, q.stride(), q.storage_offset())  # fmt: skip
    assert view.data_ptr() == q.data_ptr() and torch.equal(view, q)
    base.add_(1.0)
    assert torch.equal(view, q)  # one memory: a write through either shows in both
