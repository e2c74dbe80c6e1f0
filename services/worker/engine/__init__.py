"""A vLLM-v1-style engine at nano-vllm's size. See docs/architecture.md for one request's path."""
