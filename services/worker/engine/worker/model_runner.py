"""``ModelRunner.submit(scheduler_output)``: update per-request state, build the
flattened batch, run the model (by replaying a CUDA graph for decode batches, piecewise CUDA
graphs for other steps when they are on, or eagerly), sample, and report the new tokens.

One step, for requests A (3-token prefill chunk that completes its prompt), B (decode):

    input_ids:   [a5 a6 a7 | b40]        positions: [5 6 7 | 40]
    slot_mapping: slot of each token = block_ids[pos // bs] * bs + pos % bs
    logits rows:  last token of every request whose tokens are now all computed → [2, 3]
"""

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from services.worker.engine.attention.registry import get_backend
from services.worker.engine.config import EngineConfig
from services.worker.engine.distributed.parallel_state import get_tp_group
from services.worker.engine.kv_cache.groups import KVCacheGroups
from services.worker.engine.kv_cache.layout import KVCacheLayout, layer_views
from services.worker.engine.messages import ModelInfo, SampleLogprobs
from services.worker.engine.models.context import ModelContext
from services.worker.engine.models.layers.gated_delta_net import GatedDeltaNet
from services.worker.engine.models.loader import keep_float, load_dummy, load_gguf, load_safetensors
from services.worker.engine.models.registry import resolve_model_class
from services.worker.engine.models.weights import ReadCounter
from services.worker.engine.ops.gumbel import greedy_argmax
from services.worker.engine.params import SamplingParams
from services.worker.engine.sample.sampler import Sampler, SamplerOutput, token_logprobs
from services.worker.engine.sched.output import (
    CachedRequestData,
    ModelRunnerOutput,
    PromptLogprobsChunk,
    SchedulerOutput,
)
from services.worker.engine.structured.bitmask import GrammarBitmask, apply_bitmask
from services.worker.engine.worker.cuda_graphs import CudaGraphRunner
from services.worker.engine.worker.input_batch import (
    CachedRequestState,
    InFlightTokens,
    build_sampling_metadata,
    to_device,
)
from services.worker.engine.worker.model_info import describe_model
from services.worker.engine.worker.piecewise_graphs import PiecewiseGraphRunner
from services.worker.engine.worker.step_inputs import StepInputs, TokenFill, build_step_inputs

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class PromptSpan:
    """Prompt tokens of one request in this step whose logprobs it asked for: hidden rows
    ``first ..`` predict ``targets``, the prompt tokens after position ``start``."""

    req_id: str
    start: int
    first: int
    targets: list[int]
    top_n: int


@dataclass
class PromptLogprobs:
    """A step's prompt logprobs, every span's rows one after another (on the device, then on the
    host)."""

    spans: list[PromptSpan]
    values: SamplerOutput

    def chunks(self) -> dict[str, PromptLogprobsChunk]:
        lp = _logprobs_to_host(self.values)
        assert lp is not None
        top_ids, top_lps, chosen, ranks = lp
        out, row = {}, 0
        for span in self.spans:
            n = span.top_n
            entries = []
            for target in span.targets:
                entries.append(
                    SampleLogprobs(
                        token_ids=[target, *top_ids[row][:n]],
                        logprobs=[chosen[row], *top_lps[row][:n]],
                        sampled_rank=ranks[row],
                    )
                )
                row += 1
            out[span.req_id] = PromptLogprobsChunk(span.start, entries)
        return out


def _concat_outputs(parts: list[SamplerOutput]) -> SamplerOutput:
    def cat(ts: list[torch.Tensor | None]) -> torch.Tensor | None:
        return torch.cat(ts) if ts and ts[0] is not None else None  # type: ignore[arg-type]

    return SamplerOutput(
        sampled=torch.cat([p.sampled for p in parts]),
        top_ids=cat([p.top_ids for p in parts]),
        top_logprobs=cat([p.top_logprobs for p in parts]),
        sampled_logprobs=cat([p.sampled_logprobs for p in parts]),
        sampled_ranks=cat([p.sampled_ranks for p in parts]),
    )


class ModelRunner:
    def __init__(self, config: EngineConfig, device: torch.device):
        self.config = config
        self.device = device
        self.dtype = _DTYPES[config.model.dtype]
        self.block_size = config.cache.block_size
        arch = config.model.arch
        self.tp = get_tp_group()  # this rank's group (a world of one without tensor parallelism)
        fp8_kv = config.cache.kv_cache_dtype == "fp8"  # e4m3 with unit scales
        parts, heads, dim = arch.kv_cache_entry()
        # the layers by the state they keep; a block holds one group's layers (a "page")
        self.kv_groups = KVCacheGroups.plan(arch.layer_cache_kinds())
        self.layout = KVCacheLayout(
            self.kv_groups.page_layers, kv_heads_per_rank(heads, self.tp.world_size), dim,
            self.block_size, torch.float8_e4m3fn if fp8_kv else self.dtype, parts,
        )  # fmt: skip
        self.requests: dict[str, CachedRequestState] = {}
        self.sampler = Sampler()
        self.kv_cache: torch.Tensor | None = None
        self.graphs: CudaGraphRunner | None = None
        self.pad_block = 0  # the spare block past the real cache that padding rows write to
        self.pieces: PiecewiseGraphRunner | None = None  # the steps decode graphs do not take
        self.last_step: StepHandle | None = None  # the latest sampling step not yet taken
        # a submitted step whose sampling waits for its grammar bitmask (``sample``)
        self._unsampled: tuple[StepHandle, torch.Tensor] | None = None
        self._prompt_logprob_reqs: set[str] = set()  # requests that asked for prompt logprobs
        # the seeds of unseeded rows: per engine unless the user gave one (ModelConfig)
        self._rng = np.random.default_rng(config.model.sampling_seed)
        self.read = ReadCounter()  # what loading read from the checkpoint (this rank's slices)

    def load_model(self, show_progress: bool = True) -> None:
        cfg = self.config.model
        cls = resolve_model_class(cfg.arch.architecture)
        self.backend = get_backend(self.config.attention.backend)
        with torch.device(self.device), _default_dtype(self.dtype):
            ctx = ModelContext.build(
                cfg.max_model_len, self.backend, cfg.fused_ops, cfg.quantization,
                expert_parallel=self.config.parallel.enable_expert_parallel,
            )  # fmt: skip
            self.model = cls(cfg.arch, ctx)
            if cfg.load_format not in ("dummy", "gguf"):
                kept = keep_float(self.model, cfg.model)  # (new weights: this device, dtype)
                if kept:
                    logger.info("%d layers the checkpoint keeps in %s, not FP8, e.g. %s",
                                len(kept), self.dtype, kept[0])  # fmt: skip
        if cfg.load_format == "dummy":
            load_dummy(self.model, cfg.seed)
        elif cfg.load_format == "gguf":
            self.read = load_gguf(self.model, cfg.model, show_progress)
        else:
            self.read = load_safetensors(self.model, cfg.model, show_progress)
        for module in self.model.modules():  # what a layer derives from its loaded weights
            after_load = getattr(module, "after_load", None)
            if after_load is not None:
                after_load()
        self.model.train(False)  # inference mode for every submodule

    def _bind_kv_cache(self, num_blocks: int) -> None:
        self.kv_cache = self.layout.allocate(num_blocks, self.device)
        for i, layer in enumerate(self.model.cache_layers()):
            layer.kv_group, slot = self.kv_groups.place(i)
            if isinstance(layer, GatedDeltaNet):  # a recurrent state in its page slot
                layer.bind_state(self.kv_cache, slot)
                continue
            attn = layer
            view = layer_views(self.kv_cache, slot)
            view.holds_states = self.kv_groups.has_recurrent
            if view.is_fp8:  # the checkpoint's KV cache scales, or 1
                view.k_scale, view.v_scale = attn.kv_scales()
            attn.kv_cache = view

    def kv_scales(self) -> list[tuple[float, float]]:
        """Each layer's (key, value) scales of an FP8 cache (1.0 without the checkpoint's)."""
        return [attn.kv_scales() for attn in self.model.attention_layers()]

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate ``num_blocks`` blocks plus one spare that padded graph rows write into."""
        self._bind_kv_cache(num_blocks + 1)
        self.pad_block = num_blocks
        sizes = self.config.device.cuda_graph_batch_sizes
        if sizes and getattr(self.backend, "supports_cuda_graphs", False):
            max_len = self.config.model.max_model_len
            # every layer's bounds (a hybrid model's windowed and full layers launch apart)
            attns, dev = [layer.attn for layer in self.model.attention_layers()], self.device
            bounds = {s: tuple(sorted({c for a in attns for c in a.decode_graph_contexts(
                s, max_len, dev)})) for s in sizes}  # fmt: skip
            self.graphs = CudaGraphRunner(
                self.model, sizes, max_len, self.block_size, pad_block=self.pad_block,
                device=self.device, contexts=bounds, num_groups=self.kv_groups.num_groups,
            )  # fmt: skip
            self.graphs.capture()
        if self.config.device.piecewise_graph_sizes:
            self.start_piecewise_graphs(self.config.device.piecewise_graph_sizes)

    def start_piecewise_graphs(self, sizes: tuple[int, ...], capture: bool = True) -> None:
        """Steps of up to ``max(sizes)`` tokens that the decode graphs do not take run in
        piecewise graphs from now on; ``capture=False`` runs their split forward inline (on
        CPU, for the tests). The attention runs eagerly between the pieces: any backend will
        do."""
        self.pieces = PiecewiseGraphRunner(
            self.model, sizes, self.block_size, pad_block=self.pad_block, dtype=self.dtype,
            device=self.device, capture=capture, num_groups=self.kv_groups.num_groups,
        )  # fmt: skip
        if capture:
            start, held = time.perf_counter(), torch.cuda.memory_reserved(self.device)
            self.pieces.capture()
            logger.info(
                "piecewise CUDA graphs: %d sizes up to %d tokens captured in %.1f s (%.0f MiB)",
                len(sizes), max(sizes), time.perf_counter() - start,
                (torch.cuda.memory_reserved(self.device) - held) / (1 << 20),
            )  # fmt: skip

    def piecewise_reserve_bytes(self, step_peak_bytes: int) -> int:
        """Memory the piecewise graphs will hold beside the KV cache: their static buffers and
        their pool, which holds the activations of one forward of the largest size, counted as
        that share of a full step's profiled peak (``profile_peak_bytes``)."""
        sizes = self.config.device.piecewise_graph_sizes
        if not sizes:
            return 0
        budget, top = self.config.scheduler.max_num_batched_tokens, max(sizes)
        buffers = PiecewiseGraphRunner.static_bytes(self.model, top, self.dtype)
        return -(-step_peak_bytes * top // budget) + buffers

    @torch.inference_mode()
    def profile_peak_bytes(self) -> int:
        """Peak device memory of the largest step — a full token budget of prefill, then logits
        and top-k/top-p sampling for max_num_seqs rows — beyond the weights, measured with a
        temporary KV cache whose own bytes are not counted."""
        sched, cfg = self.config.scheduler, self.config.model
        budget = sched.max_num_batched_tokens
        per_seq = min(cfg.max_model_len - 1, budget)
        lens = [per_seq] * (budget // per_seq) + ([budget % per_seq] if budget % per_seq else [])
        params = SamplingParams(top_k=50, top_p=0.9)
        states, first = {}, 0
        for i, n in enumerate(lens):
            blocks = []
            for _ in self.kv_groups.groups:  # (every group's own blocks)
                blocks.append(list(range(first, first + -(-n // self.block_size))))
                first += len(blocks[-1])
            ids = np.random.randint(0, cfg.arch.vocab_size, size=n).tolist()
            states[str(i)] = CachedRequestState(str(i), ids, n, params, (), blocks, 0)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        self._bind_kv_cache(first)
        kv_bytes = torch.cuda.memory_allocated(self.device) - base
        step = SchedulerOutput(
            cached_reqs=[CachedRequestData(k, (), 0, False) for k in states],
            num_scheduled_tokens={k: len(s.token_ids) for k, s in states.items()},
        )
        ids, pos, meta, _ = build_step_inputs(step, states, self.block_size).to_device(self.device)
        hidden = self.model(ids, pos, meta)
        rows = hidden[-1:].expand(sched.max_num_seqs, -1)
        worst = [CachedRequestState("p", [0], 1, params, (), [], 0)] * sched.max_num_seqs
        meta_s = build_sampling_metadata(worst, cfg.arch.vocab_size, self.device)
        logits = self.model.compute_logits(rows)
        if self.tp.is_driver:  # only rank 0 holds logits and samples
            self.sampler(logits, meta_s)
            # The one-pass sampler's other variant (logits in the model's dtype: no truncation),
            # so the first plain-temperature request compiles nothing (the top-k/top-p pass
            # above gave it float32).
            plain = [CachedRequestState("p", [0], 1, SamplingParams(temperature=1.0), (), [], 0)]
            plain_meta = build_sampling_metadata(plain, cfg.arch.vocab_size, self.device)
            self.sampler(logits[:1], plain_meta)
            # greedy steps' argmax: over the model's dtype, and over float32 (penalties, bans)
            greedy_argmax(logits[:1])
            greedy_argmax(logits[:1].float())
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base - kv_bytes
        self.release()
        torch.cuda.empty_cache()
        return peak

    def model_info(self) -> ModelInfo:
        return describe_model(self)

    def release(self) -> None:
        """Drop the KV cache, graphs and per-request state (memory back to the allocator)."""
        for layer in self.model.cache_layers():
            if isinstance(layer, GatedDeltaNet):
                layer.bind_state(None)
            else:
                layer.kv_cache = None
        self.kv_cache = None
        self.graphs = None
        self.pieces = None
        self.requests.clear()
        self._prompt_logprob_reqs.clear()
        self.last_step = None
        self._unsampled = None

    # ---- one step ------------------------------------------------------------------------
    @torch.inference_mode()
    def submit(self, sched: SchedulerOutput) -> "StepHandle":
        """Queue one step's device work and start copying its sampled ids to the host; nothing
        here waits for the device (a step already running on it keeps running), so the host can
        prepare the next step meanwhile. ``StepHandle.result()`` waits."""
        self._update_states(sched)
        if sched.total_num_scheduled_tokens == 0:
            return StepHandle.empty(self)
        inputs = build_step_inputs(sched, self.requests, self.block_size)
        spans = self._prompt_spans(inputs)
        logits, hidden = self._run_model(inputs, self._token_fill(inputs), eager=bool(spans))
        prompt = self._prompt_logprobs(spans, hidden) if spans else None
        if logits is None:
            return StepHandle(self, inputs.req_ids, [], [], prompt)
        states = [self.requests[inputs.req_ids[r]] for r in inputs.sample_rows]
        handle = StepHandle(self, inputs.req_ids, states, inputs.sample_rows, prompt)
        if sched.structured_req_ids:  # its rows' bitmask comes with ``sample``
            self._unsampled = (handle, logits)
        else:
            handle.sampled(self._sample(logits, states))
        return handle

    @torch.inference_mode()
    def sample(self, grammar: GrammarBitmask | None) -> None:
        """Sample the step submitted last, which waited for its grammar bitmask (rank 0's;
        None elsewhere). Nothing here waits for the device either."""
        assert self._unsampled is not None, "no submitted step waits for its bitmask"
        (handle, logits), self._unsampled = self._unsampled, None
        handle.sampled(self._sample(logits, handle.states, grammar))

    def _prompt_spans(self, inputs: StepInputs) -> list[PromptSpan]:
        """The prompt tokens this step runs whose next token is a prompt token too, for the
        requests that asked for prompt logprobs."""
        spans: list[PromptSpan] = []
        if not self._prompt_logprob_reqs:  # the usual step: no per-row work
            return spans
        for row, rid in enumerate(inputs.req_ids):
            if rid not in self._prompt_logprob_reqs:
                continue
            state = self.requests[rid]
            top_n = state.params.prompt_logprobs
            assert top_n is not None  # (how it joined the set)
            start = state.num_computed_tokens
            end = min(start + inputs.query_start_loc[row + 1] - inputs.query_start_loc[row],
                      state.num_prompt_tokens - 1)  # fmt: skip
            if end > start:
                targets = state.token_ids[start + 1 : end + 1]
                first = inputs.query_start_loc[row]
                spans.append(PromptSpan(rid, start, first, targets, top_n))
        return spans

    def _prompt_logprobs(
        self, spans: list[PromptSpan], hidden: torch.Tensor | None
    ) -> PromptLogprobs | None:
        """Logprobs of the spans' next prompt tokens from this step's hidden states, a slice of
        rows at a time: as many as a step samples at most, whose logits and sampling the memory
        profile made room for (``profile_peak_bytes``); a long prompt's would not fit at once.
        Every rank computes the logits (a tensor-parallel LM head gathers them); rank 0 alone
        keeps the logprobs."""
        assert hidden is not None
        index = to_device(
            [s.first + i for s in spans for i in range(len(s.targets))], torch.int64, self.device
        )
        targets = to_device([t for s in spans for t in s.targets], torch.int64, self.device)
        top_n = max(s.top_n for s in spans)
        parts, step = [], self.config.scheduler.max_num_seqs
        for lo in range(0, index.shape[0], step):
            rows = slice(lo, lo + step)
            logits = self.model.compute_logits(hidden[index[rows]])
            if self.tp.is_driver:
                raw = logits.float().log_softmax(-1)
                parts.append(token_logprobs(targets[rows], raw, top_n))
        if not self.tp.is_driver:
            return None
        return PromptLogprobs(spans, _concat_outputs(parts))

    def _sample(
        self,
        logits: torch.Tensor,
        states: list[CachedRequestState],
        grammar: GrammarBitmask | None = None,
    ) -> SamplerOutput:
        """Rank 0 samples; with tensor parallelism it broadcasts the sampled ids, so every rank
        feeds the same tokens to the next step (the other ranks hold no logits: [rows, 0]).
        Rows under a grammar are masked first: the sampler, logprobs included, sees only what
        the grammar allows (vLLM's order)."""
        if self.tp.is_driver:
            if grammar is not None:
                row_of = {s.req_id: i for i, s in enumerate(states)}
                rows = [row_of[rid] for rid in grammar.req_ids]
                apply_bitmask(logits, grammar, rows, self.config.model.arch.vocab_size)
            in_flight = self.last_step.in_flight if self.last_step is not None else None
            base = int(self._rng.integers(1 << 62))  # the seed of this step's unseeded rows
            meta = build_sampling_metadata(
                states, self.config.model.arch.vocab_size, self.device, in_flight, base
            )
            result = self.sampler(logits, meta)
        else:
            sampled = torch.empty(len(states), dtype=torch.int64, device=self.device)
            result = SamplerOutput(sampled, None, None, None, None)
        self.tp.broadcast(result.sampled)
        return result

    def _token_fill(self, inputs: StepInputs) -> TokenFill | None:
        """Where this step's inputs need the tokens the previous step sampled on the device."""
        if not inputs.pending_rows:
            return None
        assert self.last_step is not None and self.last_step.in_flight is not None
        rows = inputs.pending_rows
        return TokenFill(
            to_device([inputs.query_start_loc[r] for r in rows], torch.int64, self.device),
            self.last_step.in_flight.tokens_of([inputs.req_ids[r] for r in rows]),
        )

    def _run_model(
        self, inputs: StepInputs, fill: TokenFill | None, eager: bool = False
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(the logits of the rows to sample, or None when no request samples this step; every
        token's hidden state, or None from a decode graph). ``eager``: no CUDA graph (a step
        that needs the hidden states of all its tokens)."""
        if not eager and self.graphs is not None and self.graphs.can_run(inputs):
            logits = self.graphs.run(inputs, fill)  # one row per request
            if len(inputs.sample_rows) == len(inputs.req_ids):
                return logits, None
            # a one-token prefill chunk has one query too, but samples nothing yet
            if not inputs.sample_rows:
                return None, None
            return logits[to_device(inputs.sample_rows, torch.int64, self.device)], None
        if not eager and self.pieces is not None and self.pieces.can_run(inputs):
            hidden, logits_indices = self.pieces.run(inputs, fill)  # (padding rows at the end)
        else:
            input_ids, positions, meta, logits_indices = inputs.to_device(self.device)
            if fill is not None:
                fill.apply(input_ids)
            hidden = self.model(input_ids, positions, meta)
        if not inputs.sample_rows:
            return None, hidden
        return self.model.compute_logits(hidden[logits_indices]), hidden

    def _update_states(self, sched: SchedulerOutput) -> None:
        for rid in sched.finished_req_ids:
            self.requests.pop(rid, None)
            self._prompt_logprob_reqs.discard(rid)
        for new in sched.new_reqs:
            if new.params.prompt_logprobs is not None:
                self._prompt_logprob_reqs.add(new.req_id)
            self.requests[new.req_id] = CachedRequestState(
                req_id=new.req_id,
                token_ids=list(new.token_ids),
                num_prompt_tokens=new.num_prompt_tokens,
                params=new.params,
                eos_token_ids=new.eos_token_ids,
                block_ids=[list(ids) for ids in new.block_ids],
                num_computed_tokens=new.num_computed_tokens,
            )
        for cached in sched.cached_reqs:
            state = self.requests[cached.req_id]
            if cached.resumed_from_preemption:
                state.block_ids = [list(ids) for ids in cached.new_block_ids]
            else:
                for table, ids in zip(state.block_ids, cached.new_block_ids, strict=True):
                    table.extend(ids)
            state.num_computed_tokens = cached.num_computed_tokens


def kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    """KV heads each rank holds: its share, or one replicated head when there are more ranks
    than heads (consecutive ranks then share one; ``EngineArgs`` checks the sizes divide)."""
    return max(1, num_kv_heads // tp_size)


class StepHandle:
    """A submitted step. Its sampled ids (and logprobs) are copied to pinned host memory behind
    the step's kernels; ``result()`` waits for that copy alone, then records the tokens in the
    runner's request state and builds the ``ModelRunnerOutput``. Results are taken in the
    order steps were submitted; taking one twice returns the same output. A step whose
    sampling waits for a grammar bitmask is complete once ``sampled`` gave it its tokens."""

    def __init__(
        self,
        runner: ModelRunner,
        req_ids: list[str],
        states: list[CachedRequestState],
        rows: list[int],
        prompt: PromptLogprobs | None = None,
    ):
        self.runner = runner
        self.states = states
        self.rows = rows
        self.in_flight: InFlightTokens | None = None  # its sampled ids, still on the device
        self.output = ModelRunnerOutput(
            req_ids=req_ids,
            sampled_token_ids=[[] for _ in req_ids],
            logprobs=[None for _ in req_ids],
        )
        self._host: SamplerOutput | None = None
        self._prompt: PromptLogprobs | None = None
        self._ready: torch.cuda.Event | None = None
        self._done = not states and prompt is None
        if prompt is not None:
            self._prompt = PromptLogprobs(prompt.spans, _map_tensors(prompt.values, self._to_host))
        if not states and not self._done:  # prompt chunks only: nothing to sample
            self._record()

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        return t.to("cpu", non_blocking=True) if self.runner.device.type == "cuda" else t

    def _record(self) -> None:
        if self.runner.device.type == "cuda":
            self._ready = torch.cuda.Event()
            self._ready.record()

    def sampled(self, result: SamplerOutput) -> None:
        """Its sampled ids (on the device): fed to the next step, copied to the host."""
        for state in self.states:
            state.num_pending += 1
        self.in_flight = InFlightTokens(
            result.sampled, {s.req_id: i for i, s in enumerate(self.states)}
        )
        self._host = _map_tensors(result, self._to_host)
        self._record()
        self.runner.last_step = self

    @classmethod
    def empty(cls, runner: ModelRunner) -> "StepHandle":
        return cls(runner, [], [], [])

    def wait(self) -> None:
        """Until the step's device work is done (its KV writes included)."""
        if self._ready is not None:
            self._ready.synchronize()

    def result(self) -> ModelRunnerOutput:
        if self._done:
            return self.output
        self._done = True
        self.wait()
        if self._prompt is not None:
            self.output.prompt_logprobs = self._prompt.chunks()
        host = self._host
        if host is None:  # a step of prompt chunks only
            if self.states:
                raise RuntimeError("a step's tokens were asked for before it sampled")
            return self.output
        sampled = host.sampled.tolist()
        lp = _logprobs_to_host(host)
        live = self.runner.requests
        for i, (state, row) in enumerate(zip(self.states, self.rows, strict=True)):
            if live.get(state.req_id) is state:  # not finished or aborted meanwhile
                state.token_ids.append(sampled[i])
                state.num_pending -= 1
            self.output.sampled_token_ids[row] = [sampled[i]]
            if lp is not None and state.params.logprobs is not None:
                top_ids, top_lps, chosen, ranks = lp
                n = state.params.logprobs
                self.output.logprobs[row] = SampleLogprobs(
                    token_ids=[sampled[i], *top_ids[i][:n]],
                    logprobs=[chosen[i], *top_lps[i][:n]],
                    sampled_rank=ranks[i],
                )
        if self.runner.last_step is self:
            self.runner.last_step = None
        return self.output


def _map_tensors(r: SamplerOutput, f: Callable[[torch.Tensor], torch.Tensor]) -> SamplerOutput:
    def opt(t: torch.Tensor | None) -> torch.Tensor | None:
        return f(t) if t is not None else None

    return SamplerOutput(
        sampled=f(r.sampled),
        top_ids=opt(r.top_ids),
        top_logprobs=opt(r.top_logprobs),
        sampled_logprobs=opt(r.sampled_logprobs),
        sampled_ranks=opt(r.sampled_ranks),
    )


def _logprobs_to_host(
    r: SamplerOutput,
) -> tuple[list[list[int]], list[list[float]], list[float], list[int]] | None:
    if r.sampled_logprobs is None or r.sampled_ranks is None:
        return None
    rows = r.sampled.shape[0]
    top_ids = r.top_ids.tolist() if r.top_ids is not None else [[] for _ in range(rows)]
    top_lps = r.top_logprobs.tolist() if r.top_logprobs is not None else [[] for _ in range(rows)]
    return top_ids, top_lps, r.sampled_logprobs.tolist(), r.sampled_ranks.tolist()


class _default_dtype:
    def __init__(self, dtype: torch.dtype):
        self.dtype, self.saved = dtype, torch.get_default_dtype()

    def __enter__(self) -> None:
        torch.set_default_dtype(self.dtype)

    def __exit__(self, *exc: object) -> None:
        torch.set_default_dtype(self.saved)
