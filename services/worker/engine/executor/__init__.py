"""Executors: how the engine core reaches its workers (one in-process worker at tp=1)."""
