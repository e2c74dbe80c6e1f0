"""``ModelRunner.execute_model(scheduler_output)``: update per-request state, build the
flattened batch and attention metadata, run the model, sample, and report the new tokens.

One step, for requests A (3-token prefill chunk that completes its prompt), B (decode):

    input_ids:   [a5 a6 a7 | b40]        positions: [5 6 7 | 40]
    slot_mapping: slot of each token = block_ids[pos // bs] * bs + pos % bs
    logits rows:  last token of every request whose tokens are now all computed → [2, 3]
"""

import itertools

import numpy as np
import torch

from services.worker.engine.attention.backend import AttentionMetadata
from services.worker.engine.attention.registry import get_backend
from services.worker.engine.config import EngineConfig
from services.worker.engine.kv_cache.layout import KVCacheLayout, layer_views
from services.worker.engine.messages import ModelInfo, SampleLogprobs
from services.worker.engine.models.loader import load_dummy, load_safetensors
from services.worker.engine.models.registry import resolve_model_class
from services.worker.engine.sample.sampler import Sampler, SamplerOutput
from services.worker.engine.sched.output import ModelRunnerOutput, SchedulerOutput
from services.worker.engine.worker.input_batch import (
    CachedRequestState,
    build_sampling_metadata,
    make_generator,
)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class ModelRunner:
    def __init__(self, config: EngineConfig, device: torch.device):
        self.config = config
        self.device = device
        self.dtype = _DTYPES[config.model.dtype]
        self.block_size = config.cache.block_size
        arch = config.model.arch
        self.layout = KVCacheLayout(
            arch.num_layers, arch.num_kv_heads, arch.head_dim, self.block_size, self.dtype
        )
        self.requests: dict[str, CachedRequestState] = {}
        self.sampler = Sampler()
        self.kv_cache: torch.Tensor | None = None

    def load_model(self, show_progress: bool = True) -> None:
        cfg = self.config.model
        cls = resolve_model_class(cfg.arch.architecture)
        backend = get_backend(self.config.attention.backend)
        with torch.device(self.device), _default_dtype(self.dtype):
            self.model = cls(cfg.arch, cfg.max_model_len, backend)
        if cfg.load_format == "dummy":
            load_dummy(self.model, cfg.seed)
        else:
            load_safetensors(self.model, cfg.model, show_progress)
        self.model.eval()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.kv_cache = self.layout.allocate(num_blocks, self.device)
        for i, attn in enumerate(self.model.attention_layers()):
            attn.kv_cache = layer_views(self.kv_cache, i)

    def model_info(self) -> ModelInfo:
        params = list(self.model.parameters())  # tied weights appear once
        return ModelInfo(
            num_params=sum(p.numel() for p in params),
            weight_bytes=sum(p.numel() * p.element_size() for p in params),
            kv_bytes_per_token=self.layout.bytes_per_block // self.block_size,
            device=str(self.device),
            dtype=self.config.model.dtype,
        )

    def release(self) -> None:
        """Drop the KV cache and per-request state (device memory goes back to the allocator)."""
        for attn in self.model.attention_layers():
            attn.kv_cache = None
        self.kv_cache = None
        self.requests.clear()

    # ---- one step ------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(sched)
        if sched.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput()
        req_ids, sample_rows, inputs = self._prepare_inputs(sched)
        input_ids, positions, meta, logits_indices = inputs
        hidden = self.model(input_ids, positions, meta)
        out = ModelRunnerOutput(
            req_ids=req_ids,
            sampled_token_ids=[[] for _ in req_ids],
            logprobs=[None for _ in req_ids],
        )
        if not sample_rows:
            return out
        states = [self.requests[req_ids[r]] for r in sample_rows]
        logits = self.model.compute_logits(hidden[logits_indices])
        meta_s = build_sampling_metadata(states, self.config.model.arch.vocab_size, self.device)
        result = self.sampler(logits, meta_s)
        self._record(result, states, sample_rows, out)
        return out

    def _update_states(self, sched: SchedulerOutput) -> None:
        for rid in sched.finished_req_ids:
            self.requests.pop(rid, None)
        for new in sched.new_reqs:
            self.requests[new.req_id] = CachedRequestState(
                req_id=new.req_id,
                token_ids=list(new.token_ids),
                num_prompt_tokens=new.num_prompt_tokens,
                params=new.params,
                eos_token_ids=new.eos_token_ids,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                generator=make_generator(new.params, self.device),
            )
        for cached in sched.cached_reqs:
            state = self.requests[cached.req_id]
            if cached.resumed_from_preemption:
                state.block_ids = list(cached.new_block_ids)
            else:
                state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    def _prepare_inputs(
        self, sched: SchedulerOutput
    ) -> tuple[
        list[str], list[int], tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]
    ]:
        req_ids = [r.req_id for r in sched.new_reqs] + [r.req_id for r in sched.cached_reqs]
        bs = self.block_size
        ids, pos, slots, seq_lens, qsl, sample_rows, logits_idx = [], [], [], [], [0], [], []
        tables = []
        for row, rid in enumerate(req_ids):
            state = self.requests[rid]
            n = sched.num_scheduled_tokens[rid]
            start = state.num_computed_tokens
            p = np.arange(start, start + n)
            ids.append(np.asarray(state.token_ids[start : start + n]))
            pos.append(p)
            block_ids = np.asarray(state.block_ids, dtype=np.int64)
            slots.append(block_ids[p // bs] * bs + p % bs)
            seq_lens.append(start + n)
            qsl.append(qsl[-1] + n)
            tables.append(state.block_ids)
            if start + n == len(state.token_ids):  # every known token computed: sample next
                sample_rows.append(row)
                logits_idx.append(qsl[-1] - 1)
        width = max(len(t) for t in tables)
        table = np.zeros((len(tables), width), dtype=np.int32)
        for i, t in enumerate(tables):
            table[i, : len(t)] = t
        dev = self.device
        meta = AttentionMetadata(
            num_tokens=qsl[-1],
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.from_numpy(table).to(dev),
            slot_mapping=torch.from_numpy(np.concatenate(slots)).to(dev),
            query_start_loc_cpu=qsl,
            seq_lens_cpu=seq_lens,
            max_query_len=max(b - a for a, b in itertools.pairwise(qsl)),
            max_seq_len=max(seq_lens),
        )
        input_ids = torch.from_numpy(np.concatenate(ids).astype(np.int64)).to(dev)
        positions = torch.from_numpy(np.concatenate(pos).astype(np.int64)).to(dev)
        logits_indices = torch.tensor(logits_idx, dtype=torch.int64, device=dev)
        return req_ids, sample_rows, (input_ids, positions, meta, logits_indices)

    def _record(
        self,
        result: SamplerOutput,
        states: list[CachedRequestState],
        rows: list[int],
        out: ModelRunnerOutput,
    ) -> None:
        sampled = result.sampled.tolist()  # the one host sync of the step
        lp = _logprobs_to_host(result)
        for i, (state, row) in enumerate(zip(states, rows, strict=True)):
            state.token_ids.append(sampled[i])
            out.sampled_token_ids[row] = [sampled[i]]
            if lp is not None and state.params.logprobs is not None:
                top_ids, top_lps, chosen, ranks = lp
                n = state.params.logprobs
                out.logprobs[row] = SampleLogprobs(
                    token_ids=[sampled[i], *top_ids[i][:n]],
                    logprobs=[chosen[i], *top_lps[i][:n]],
                    sampled_rank=ranks[i],
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
