"""Export from a local Hugging Face folder (here a tiny random Qwen3 with the SmolLM2 tokenizer)."""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from onepass import Choice, Engine, Noul  # noqa: E402
from onepass.export.build import export_engine  # noqa: E402
from onepass.runtime.backends.torch_decoder import DecoderDims  # noqa: E402
from onepass.export.model_source import default_gguf, default_tokenizer, load_model  # noqa: E402
from onepass.runtime.core.errors import ModelSourceError  # noqa: E402
from reference import option_logprobs_alone  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3-tiny")
    tokenizer = default_tokenizer()
    torch.manual_seed(0)
    config = transformers.Qwen3Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      head_dim=16, max_position_embeddings=2048, tie_word_embeddings=False)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_export_from_hf_folder_matches_transformers(qwen3_dir, tmp_path):
    out = export_engine(tmp_path / "engine", str(qwen3_dir))
    engine = Engine.load(out)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["model"]["architecture"] == "qwen3" and manifest["source"]["format"] == "hf"
    questions = {"a": Noul("Is it raining?"), "b": Choice("Which?", {"red": None, "green": "a colour"})}
    state = engine.state("The sky is grey and the streets are wet.")
    encoded = engine.encode_questions(questions)
    packed = engine.option_logprobs(state, encoded)
    hf = load_model(qwen3_dir).model
    for q, lp in zip(encoded, packed):
        want = option_logprobs_alone(hf, state.ids, q)
        np.testing.assert_allclose(lp, want, rtol=0, atol=5e-4, err_msg=f"max {np.abs(lp - want).max()}")
    # a fresh model's norms are all ones: the ONNX optimizer merged them into one initializer. The manifest's weight
    # map (matched by content) names that one initializer for each of them, so the PyTorch backend rebuilds the
    # decoder and answers as ONNX Runtime does; an engine without the map (exported before it) is refused clearly,
    # not with a NoneType error deep inside (found by the one-call GPU check's random-weight model)
    import dataclasses

    from onepass.runtime.backends import factory
    from onepass.runtime.backends.torch_backend import TorchBackend
    from onepass.runtime.core.errors import EngineFileError

    merged = Engine.load(out, backend=factory("torch-cpu"), verify=False)
    for a, b in zip(merged.option_logprobs("The sky is grey and the streets are wet.", encoded), packed):
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-4)
    manifest = engine.manifest
    without = dataclasses.replace(manifest, source={k: v for k, v in manifest.source.items() if k != "weights"})
    with pytest.raises(EngineFileError, match="re-export it"):  # (its untied head, named by the exporter, too)
        TorchBackend(out, without)


def test_unknown_model_sources_are_refused(tmp_path):
    with pytest.raises(ModelSourceError, match="neither a .gguf file nor a Hugging Face model folder"):
        load_model(tmp_path)
    with pytest.raises(ModelSourceError, match="x.gguf not found: give a .gguf file or a Hugging Face model folder"):
        load_model(tmp_path / "x.gguf")
    with pytest.raises(ModelSourceError, match="model_type 'gpt2' is not supported; supported: llama, qwen2, qwen3"):
        DecoderDims.from_hf_config(transformers.GPT2Config())
    assert default_gguf().name == "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_export_refuses_to_finish_unless_onnx_runtime_reproduces_the_golden_file(qwen3_dir, tmp_path, monkeypatch):
    """The README's claim: a golden file the graph does not reproduce (here: PyTorch's log-probs shifted by 0.01,
    50x the tolerance) stops the export with a typed error; nothing is left on disk and an engine already at
    ``--out`` is untouched. Control: the same export without the shift finishes."""
    from onepass.export import build
    from onepass.runtime.core.errors import EngineFileError

    real = build.write_golden

    def shifted(decoder, encoder, path):
        real(decoder, encoder, path)
        data = dict(np.load(path))
        data["target_logprob"] = data["target_logprob"] + 0.01
        np.savez(path, **data)

    out = tmp_path / "engine"
    out.mkdir()
    (out / "keep.txt").write_text("a previous engine")
    monkeypatch.setattr(build, "write_golden", shifted)
    with pytest.raises(EngineFileError, match="does not reproduce its golden file"):
        export_engine(out, str(qwen3_dir))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engine"] and (out / "keep.txt").is_file()
    monkeypatch.setattr(build, "write_golden", real)
    assert (export_engine(out, str(qwen3_dir)) / "manifest.json").is_file()
