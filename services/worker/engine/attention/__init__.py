"""Attention backends over the paged KV cache, chosen by name from ``registry``."""
