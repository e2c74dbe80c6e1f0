"""The engine's GPU kernels (Triton), one file per family, each beside its measured launches.

    attention.py       paged attention: prefill (varlen, causal over a cached prefix), decode
                       (one range or split over ranges), the KV cache's rounding
    fused_ops.py       residual add + RMSNorm, SiLU·mul, rotary (+ the step's K/V store); the
                       first two can write the next FP8 layer's input codes
    gemv.py            the one-token bf16 product of the linear layers
    fp8_linear.py      FP8 linear products: GEMV for one token, tensor cores (cuBLASLt or our
                       GEMM) for more rows, the row quantization
    fp8_block.py       the same for 128×128 block checkpoints (cuBLASLt's block scaling)
    fused_moe.py       mixture of experts: tokens sorted by expert, gate/up with SiLU·mul and
                       down over each expert's tokens, combined with the routing weights (bf16,
                       FP8 per channel or 128×128 blocks)
    moe_gemv.py        the same at a few tokens: two GEMVs, no sorting (moe_common.py: what
                       the two share)
    mla_decode.py      multi-head latent attention's decode over the paged latent cache, the
                       key and value up-projections absorbed (split over the context)
    gumbel.py          sampling: the Gumbel-max race and greedy argmax in slices
    dependent_launch.py  programmatic dependent launch, for every kernel above at one token
    tuned_configs.py, gemv_configs.py, configs/<table>/<GPU>.json   the measured launch tables

The layers call these through plain functions; each has a plain-PyTorch reference beside the
code that calls it, which runs on CPU and is what the tests compare the kernels with.
"""
