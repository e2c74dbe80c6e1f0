"""The machine's physical limits, measured in the same run as the benchmark that uses them.

- copy bandwidth: a large device-to-device (or DRAM-to-DRAM) copy, counted as bytes read plus
  bytes written per second — the usual "copy bandwidth" (4.3 TB/s on an H200).
- matmul peak: an n×n×n matrix product in the benchmark's dtype (≈ 790 TFLOP/s bf16 on an H200).
"""

import time
from typing import Any

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _times(fn, device: torch.device, reps: int) -> list[float]:  # type: ignore[no-untyped-def]
    """Seconds per call after a warm-up: CUDA events on a GPU, a host clock on CPU."""
    fn()
    _sync(device)
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return times


def copy_bandwidth(device: torch.device, nbytes: int | None = None, reps: int = 10) -> float:
    """Bytes/s, read + written, of one large copy (4 GiB each way on a GPU, as KINDS.md did)."""
    nbytes = nbytes or (4 << 30 if device.type == "cuda" else 256 << 20)
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    # a ceiling: the best of the runs (medians of one size varied 10% between processes)
    seconds = min(_times(lambda: dst.copy_(src), device, reps))
    return 2 * nbytes / seconds


def matmul_peak(
    device: torch.device, dtype: torch.dtype, n: int | None = None, reps: int = 10
) -> float:
    """FLOP/s of a square matrix product."""
    n = n or (8192 if device.type == "cuda" else 1024)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    seconds = min(_times(lambda: a @ b, device, reps))
    return 2 * n**3 / seconds


def fp8_matmul_peak(
    device: torch.device, n: int = 8192, reps: int = 10, fast_accumulation: bool = False
) -> float:
    """FLOP/s of a square e4m3 product on the FP8 tensor cores (bf16 out, per-tensor scales):
    what the FP8 linear layers' prefill is measured against; ``fast_accumulation``: without
    promoting the partial sums to float32 (cuBLASLt's fast-accumulation mode)."""
    a = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device=device).to(torch.float8_e4m3fn).t()  # column-major
    one = torch.ones((), device=device)
    mm = lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16,  # noqa: E731
                                  use_fast_accum=fast_accumulation)  # fmt: skip
    return 2 * n**3 / min(_times(mm, device, reps))


_seen: dict[tuple[str, str], list[tuple[float, float]]] = {}


def limits(device: torch.device, dtype: torch.dtype) -> tuple[float, float]:
    """(copy bandwidth, matmul peak) of ``device``: measured now, and the best of every
    measurement of this process. A measurement taken while another process still holds the
    GPU reads low: after a multi-process engine shut down, one H200 copied at 3.83 TB/s, where
    the same machine measured 4.27 before and after. So a benchmark measures once before its
    engine starts and once at the end, and reports against the best, the machine's limit."""
    seen = _seen.setdefault(_key(device, dtype), [])
    seen.append((copy_bandwidth(device), matmul_peak(device, dtype)))
    if device.type == "cuda":
        # the copy's 8 GiB back to the driver: an engine core started next in its own process
        # would otherwise find them held here (seen on one H100: 8.57 GiB less for its KV cache)
        torch.cuda.empty_cache()
    return max(b for b, _ in seen), max(p for _, p in seen)


def forget_limits() -> None:
    """Forget every measurement ``limits`` kept (a test's fake readings)."""
    _seen.clear()


def limits_seen(device: torch.device, dtype: torch.dtype) -> list[tuple[float, float]]:
    """Every (copy bandwidth, matmul peak) ``limits`` measured, in order: for the record."""
    return list(_seen.get(_key(device, dtype), []))


def _key(device: torch.device, dtype: torch.dtype) -> tuple[str, str]:
    """ "cuda" and "cuda:0" are one device (the engine reports the latter)."""
    index = device.index if device.index is not None else 0
    return (f"{device.type}:{index}", str(dtype))


class ModelCost:
    """What one step of a model must read and compute, from the engine's ``ModelInfo`` and the
    architecture: the terms of a per-step roofline, max(bytes / bandwidth, FLOPs / peak)."""

    def __init__(self, info: Any, arch: Any) -> None:
        # the embedding table's element size: the model's dtype (FP8 models keep it, and their
        # weight bytes mix one-byte linear weights with it)
        elsize = torch.empty((), dtype=getattr(torch, info.dtype)).element_size()
        self.weight_bytes = info.weight_bytes  # every parameter: the issues' "weight bytes"
        # what a step reads: an untied input-embedding table only by the rows of its tokens
        # and of a mixture of experts' routed experts, the ones a token chose (top_k of them:
        # a batch-1 step's reads; batches of many tokens read more of them)
        self.active_expert_fraction = getattr(info, "active_expert_fraction", 1.0)
        self.routed_expert_bytes = int(getattr(info, "routed_expert_bytes", 0))
        idle = 1.0 - self.active_expert_fraction
        idle_bytes = int(self.routed_expert_bytes * idle)
        self.read_weight_bytes = info.weight_bytes - info.untied_embedding_params * elsize
        self.read_weight_bytes -= idle_bytes
        self.kv_bytes_per_token = info.kv_bytes_per_token
        # a hybrid model's recurrent layers: a decode step reads each request's state and
        # writes it back (the attention terms below count only its attention layers)
        self.state_bytes = 2 * getattr(info, "recurrent_state_bytes", 0)
        attention_layers = sum(1 for k in arch.layer_cache_kinds() if k != "recurrent")
        # parameters that multiply every token (of the routed experts, the chosen ones); the
        # LM head multiplies only sampled rows
        self.body_params = info.num_params - info.lm_head_params - info.untied_embedding_params
        self.body_params -= int(getattr(info, "routed_expert_params", 0) * idle)
        self.lm_head_params = info.lm_head_params
        # QKᵀ and PV: 2 FLOPs per multiply-add, each over head_dim, per head and layer (MLA's
        # prefill: the decompressed keys' qk_head_dim and values' v_head_dim)
        mla = getattr(arch, "mla", None)
        per_head = 2 * arch.head_dim if mla is None else mla.qk_head_dim + mla.v_head_dim
        self.flops_per_pair = 2 * attention_layers * arch.num_heads * per_head

    def expert_fraction(self, tokens: int) -> float:
        """The expected share of the routed experts that ``tokens`` tokens choose between
        them, each token top_k of E at random: 1 - (1 - top_k/E)^tokens (top_k/E at one
        token). Dummy weights route about uniformly; a trained router's favourites would
        cover less."""
        return 1.0 - (1.0 - self.active_expert_fraction) ** max(tokens, 1)

    def weight_read_bytes(self, tokens: int = 1) -> int:
        """The weight bytes a step of ``tokens`` tokens reads: ``read_weight_bytes`` (one
        token's experts) and the further experts the other tokens choose."""
        more = self.expert_fraction(tokens) - self.active_expert_fraction
        return self.read_weight_bytes + int(self.routed_expert_bytes * more)

    def flops(self, tokens: int, sampled_rows: int, query_key_pairs: int) -> int:
        return self.linear_flops(tokens, sampled_rows) + self.flops_per_pair * query_key_pairs

    def linear_flops(self, tokens: int, sampled_rows: int) -> int:
        """The weight matrices' products: the decoder body for every token, the LM head for
        the sampled rows."""
        return 2 * self.body_params * tokens + 2 * self.lm_head_params * sampled_rows

    def serial_seconds(
        self,
        tokens: int,
        sampled_rows: int,
        context_tokens: int,
        query_key_pairs: int,
        bandwidth: float,
        peak: float,
    ) -> float:
        """A step's bound when its operations run one after another, as a layer's do: the
        linear layers at their own roofline (the weights read, or their FLOPs), then attention
        at its own (the context's KV read, or its FLOPs). The per-step roofline takes one max
        over the whole step, as if attention's reads could hide under the GEMMs' compute;
        within one batch they can't (attention needs the q projection, the o projection needs
        attention), and splitting the batch to overlap them reads the weights once per part."""
        linear = max(
            self.weight_read_bytes(tokens) / bandwidth,
            self.linear_flops(tokens, sampled_rows) / peak,
        )
        attention = max(
            context_tokens * self.kv_bytes_per_token / bandwidth,
            self.flops_per_pair * query_key_pairs / peak,
        )
        return linear + attention

    def must_read_bytes(self, context_tokens: int, requests: int = 1) -> int:
        """The issues' bound for a step: every weight, and the KV of its context (and its
        ``requests``' recurrent states, read and written)."""
        kv = context_tokens * self.kv_bytes_per_token + requests * self.state_bytes
        return self.weight_bytes + kv

    def read_bytes(self, context_tokens: int, requests: int = 1, tokens: int | None = None) -> int:
        """What a step does read: the input-embedding table only by its tokens' rows, the
        routed experts its ``tokens`` (default: one a request, a decode step) choose."""
        kv = context_tokens * self.kv_bytes_per_token + requests * self.state_bytes
        return self.weight_read_bytes(requests if tokens is None else tokens) + kv
