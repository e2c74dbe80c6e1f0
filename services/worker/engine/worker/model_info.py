"""What a loaded model is (``ModelInfo``): its parameters and bytes, the share of them a token
reads (a mixture of experts' active experts), and its KV cache (bytes a token, the groups, what
one request of ``max_model_len`` holds). The roofline of the benchmarks and the worker's
metrics read it."""

from typing import TYPE_CHECKING

from services.worker.engine.messages import ModelInfo
from services.worker.engine.quantization.config import describe

if TYPE_CHECKING:
    from services.worker.engine.worker.model_runner import ModelRunner


def describe_model(runner: "ModelRunner") -> ModelInfo:
    model, config = runner.model, runner.config.model
    params = list(model.parameters())  # tied weights appear once
    embed = model.model.embed_tokens.weight
    lm_head = model.lm_head.weight
    moe = config.arch.moe
    experts = [p for n, p in model.named_parameters() if ".experts." in n]
    groups, max_len, bs = runner.kv_groups, config.max_model_len, runner.block_size
    block_bytes = runner.layout.bytes_per_block
    return ModelInfo(
        routed_expert_params=sum(p.numel() for p in experts),
        routed_expert_bytes=sum(p.numel() * p.element_size() for p in experts),
        active_expert_fraction=moe.top_k / moe.num_experts if moe else 1.0,
        lm_head_params=lm_head.numel(),
        untied_embedding_params=0 if embed is lm_head else embed.numel(),
        num_params=sum(p.numel() for p in params),
        weight_bytes=sum(p.numel() * p.element_size() for p in params),
        # every attention layer's K and V of one token (a windowed layer holds W tokens' at
        # most; a recurrent layer keeps a state instead, ``recurrent_state_bytes``)
        kv_bytes_per_token=groups.kv_bytes_per_token(bs, block_bytes),
        recurrent_state_bytes=groups.state_bytes(block_bytes),
        kv_cache_groups=groups.describe(),
        kv_request_bytes=groups.request_bytes(max_len, bs, block_bytes),
        kv_full_attention_request_bytes=groups.full_attention_bytes(max_len, bs, block_bytes),
        device=str(runner.device),
        dtype=config.dtype,
        quantization=describe(config.quantization),
        kv_cache_dtype=str(runner.layout.dtype).removeprefix("torch."),
    )
