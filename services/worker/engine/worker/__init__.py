"""The device side of the engine: Worker (device, cache) → ModelRunner (inputs, model, sampler)."""
