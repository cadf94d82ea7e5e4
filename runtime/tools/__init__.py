"""Tools around the engine: `onepass bench` and its load loops, `onepass plan`, requests and states read from
files, and the teacher client (a remote model with an engine's shape). They import the core; the core never imports
them."""
