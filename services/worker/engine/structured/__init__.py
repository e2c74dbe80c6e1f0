"""Grammar-constrained decoding (vLLM's structured outputs) with xgrammar.

    manager.py   the engine core's side: grammars compiled off the step loop (a thread pool,
                 a bounded cache), one matcher per request, the allowed-token bitmask of a
                 step's constrained rows filled on the host
    bitmask.py   the runner's side: that bitmask applied to the logits in one kernel before
                 sampling (Triton on a GPU, torch on CPU)

``engine/core.py`` says when a step's bitmask is filled: with async scheduling, while the
device runs the step's forward pass, once the previous step's tokens are known.
"""
