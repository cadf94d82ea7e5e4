"""The GGUF's one-time conversion into the model cache, when several exports ask for it at once."""

import threading
import types
from contextlib import nullcontext
from pathlib import Path

import pytest

from onepass.export import model_source


def _slow_converter(monkeypatch, barrier: threading.Barrier | None):
    """A stand-in for transformers' GGUF loading whose save_pretrained writes two files with a pause between them
    (waiting at ``barrier`` first, so that two conversions are surely in progress together); counts conversions."""
    conversions = []

    def save(folder):
        if barrier is not None:
            barrier.wait(timeout=30)
        (Path(folder) / "model.safetensors").write_bytes(b"w" * 1000)
        threading.Event().wait(0.05)
        (Path(folder) / "config.json").write_text("{}")

    def from_pretrained(folder, **kwargs):
        conversions.append(kwargs["gguf_file"])
        model = types.SimpleNamespace(save_pretrained=save, config=types.SimpleNamespace(), hf_quantizer=object())
        return model, types.SimpleNamespace(save_pretrained=lambda folder: None)

    monkeypatch.setattr(model_source, "_from_pretrained", from_pretrained)
    return conversions


def _convert_twice(gguf: Path, target: Path) -> list:
    errors = []

    def convert():
        try:
            model_source._convert_gguf(gguf, target)
        except OSError as err:
            errors.append(err)

    threads = [threading.Thread(target=convert) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return errors


def test_two_exports_on_a_fresh_cache_convert_the_gguf_once(tmp_path, monkeypatch):
    """Two conversions at once (two exports, or pytest-xdist workers, on a fresh cache): one converts, the other
    waits and finds the folder done; nothing half-written or left over. Control: without the lock both convert at
    the same time and the second one's rename fails (what two concurrent exports hit before the lock)."""
    gguf, target = tmp_path / "model.gguf", tmp_path / "models" / "model-0123"
    gguf.write_bytes(b"GGUF")
    target.parent.mkdir()
    conversions = _slow_converter(monkeypatch, barrier=None)
    assert _convert_twice(gguf, target) == []
    assert conversions == ["model.gguf"] and (target / "config.json").is_file()
    assert sorted(p.name for p in target.parent.iterdir()) == ["model-0123", "model-0123.lock"]

    other = tmp_path / "models" / "model-4567"
    conversions = _slow_converter(monkeypatch, barrier=threading.Barrier(2))
    monkeypatch.setattr("filelock.FileLock", lambda path: nullcontext())
    errors = _convert_twice(gguf, other)
    assert len(conversions) == 2 and len(errors) == 1 and (other / "config.json").is_file()
    assert not list(other.parent.glob("*.partial"))  # the loser's own folder is removed


def test_a_conversion_that_fails_leaves_no_folder_behind(tmp_path, monkeypatch):
    gguf, target = tmp_path / "model.gguf", tmp_path / "model-0123"
    gguf.write_bytes(b"GGUF")

    def from_pretrained(folder, **kwargs):
        def save(out):
            (Path(out) / "model.safetensors").write_bytes(b"half")
            raise OSError("disk full")
        return types.SimpleNamespace(save_pretrained=save, config=types.SimpleNamespace(), hf_quantizer=None), None

    monkeypatch.setattr(model_source, "_from_pretrained", from_pretrained)
    with pytest.raises(OSError, match="disk full"):
        model_source._convert_gguf(gguf, target)
    assert not target.exists() and [p.name for p in tmp_path.iterdir() if p.name != "model.gguf"] == \
        ["model-0123.lock"]


def test_the_default_tokenizer_alone_needs_no_conversion_and_is_the_engines(engine_dir, tmp_path, monkeypatch):
    """On an empty model cache the tokenizer comes straight from the GGUF and nothing is dequantized; it encodes
    like the default engine's own tokenizer.json (written from the converted folder)."""
    from tokenizers import Tokenizer

    monkeypatch.setenv("ONEPASS_CACHE", str(tmp_path / "empty"))
    tokenizer = model_source.default_tokenizer()
    assert not (tmp_path / "empty" / "models").exists()
    engine = Tokenizer.from_file(str(engine_dir / "tokenizer.json"))
    assert tokenizer.get_vocab() == engine.get_vocab()
    for text in ("Hello <|im_end|> world", "积极 fraud review\n<|im_start|>assistant", " billing", "x " * 50):
        want = engine.encode(text, add_special_tokens=False).ids
        assert tokenizer(text, add_special_tokens=False)["input_ids"] == want
