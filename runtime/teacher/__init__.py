"""The teacher: a larger model, over System One or an OpenAI-compatible API, that answers what this engine is unsure
of (the server's gate and shadow mode) and teaches it (`onepass distill`). The client only: it may import the core,
and the server and calibration import it."""
