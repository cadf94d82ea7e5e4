"""Inference backends. Each is one module, imported lazily by the engine."""
