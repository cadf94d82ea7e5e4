"""Compile time: model weights (HF dir or GGUF) -> engine directory (ONNX graph, tokenizer, manifest)."""
