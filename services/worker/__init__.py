"""The worker service and the engine that runs inside it."""
