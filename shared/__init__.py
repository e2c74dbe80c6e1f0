"""Torch-free code that more than one Baton service imports (gateway, scheduler, workers)."""
