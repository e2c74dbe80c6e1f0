"""Token sampling: logits processors, temperature, top-k/top-p/min-p, seeds, logprobs."""
