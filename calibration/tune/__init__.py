"""`onepass tune`: what a run is asked for, LoRA training through the runtime's packed tree, the candidates and the
choice among them, and the one path that writes a tuned engine (or a task into one)."""
