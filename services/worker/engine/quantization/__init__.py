"""Quantization: how a layer keeps and multiplies its weights, chosen once per model.

Each quantizable layer kind has a *method* object, as vLLM's ``QuantizeMethodBase`` is: it
creates the layer's parameters, loads and post-processes them (scales, transposes, padding),
and applies the product. The layers themselves keep only what every method shares (for the
linear layers: tensor-parallel sharding). ``registry.py`` picks the methods from the model's
quantization config; adding a method is a class here and a line in its table, and touches no
model file.

    config.py        what a checkpoint's ``quantization_config`` (or ``EngineArgs.quantization``)
                     asks for: ``QuantConfig``, ``parse_quantization`` (torch-free)
    base.py          ``LinearMethod``, ``MoEMethod``, ``KVCacheMethod``: the seams
    unquantized.py   the model's dtype: ``F.linear``, or the Triton GEMV for one token
    fp8.py           FP8 linear layers (per-tensor, per-channel, 128×128 blocks; quantized at
                     load) and a checkpoint's FP8 KV cache scales
    moe.py           mixture-of-experts layers' experts: the model's dtype, FP8 (per channel,
                     128×128 blocks); ``ops/fused_moe.py`` on a GPU
    fp8_math.py      the e4m3 arithmetic in plain PyTorch, the kernels' reference
    registry.py      ``linear_method(quant, kernels)``, ``moe_method(quant, kernels)``,
                     ``kv_cache_method(quant)``

FP8, as Baton runs it:

    weights      float8_e4m3fn, with a float32 scale per tensor, per output channel, or per
                 128×128 block (``w ≈ w_fp8 · scale``); the layer keeps the scale as one column
                 per output row ([out, 1]) or one per block column ([out, in/128])
    activations  quantized at each linear input: dynamic per token, dynamic per token and
                 128-column group (block checkpoints), or a static per-tensor scale
    kept bf16    embeddings, norms, the LM head and the MoE routers (those in float32), and
                 any layer the checkpoint stores float (its ignore list: models/loader.py's
                 ``keep_float`` gives it ``LinearMethod.float_method``)

Formats read (``config.parse_quantization``):
    compressed-tensors  ``format: float-quantized`` (``weight_scale``, and ``input_scale`` when
                        activations are static; ``kv_cache_scheme``: a key and a value scale
                        per layer)
    fp8                 ``weight_block_size: [128, 128]`` (``weight_scale_inv``: the multiplier)
    online              ``EngineArgs(quantization="fp8")`` on a float checkpoint: per-channel
                        scales computed at load, activations dynamic per token

This ``__init__`` imports nothing, so that configuration (and the CLI) can read ``config.py``
without torch.
"""
