"""The engine core: questions and their answers, the prompt, the packed tree, the engine (state cache, passes,
read-out), the manifest, the wire format and the typed errors. Imports numpy, tokenizers and the backend layer
(``onepass.runtime.backends``), never the serving or tools rooms, never torch."""
