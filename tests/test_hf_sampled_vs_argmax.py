"""experiments/hf_sampled_vs_argmax.py on a one-layer tiny Llama: with one layer the argmax types of a training
forward are the eval forward's, so `train argmax` must equal `eval` exactly, while the sampled types differ."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from nats.hf import attach_nats, nats_state_dict  # noqa: E402
from nats.hf.pretrained import load_pretrained, save_tiny_random_llama  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("hf_sampled_vs_argmax", REPO / "experiments" / "hf_sampled_vs_argmax.py")
sva = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sva)


def test_sampled_and_argmax_areas_on_a_one_layer_model(tmp_path, capsys):
    folder = save_tiny_random_llama(tmp_path / "tiny", n_layer=1)
    model, _ = load_pretrained(folder)
    attach_nats(model, window=4, init_std=0.05)  # small logits: the samples often differ from the argmax
    torch.save(nats_state_dict(model), tmp_path / "scorers.pt")
    gen = torch.Generator().manual_seed(0)
    rows = [{"settings": {"format_version": 1}, "count": 4}]
    rows += [
        {"task": task, "prompt_ids": torch.randint(0, 1024, (80,), generator=gen).tolist(), "answer_ids": []}
        for task in ("passkey", "niah", "passkey", "niah")
    ]
    examples = tmp_path / "examples.jsonl"
    examples.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    scorers = str(tmp_path / "scorers.pt")
    out = sva.main([scorers, "--model", str(folder), "--examples", str(examples), "--tokens", "64", "--window", "4"])
    m = out[scorers]
    assert m["train argmax"]["area"] == pytest.approx(m["eval"]["area"], abs=1e-6)
    assert m["train"]["area"] != pytest.approx(m["eval"]["area"], abs=1e-3)
    for mode in ("eval", "train"):
        assert sum(m[mode][k] for k in ("global", "local", "sliding")) == pytest.approx(1.0, abs=1e-5)
    text = capsys.readouterr().out
    assert "2 examples (passkey, niah), 64 tokens, W = 4" in text and f"| {scorers} | train argmax |" in text
    with pytest.raises(SystemExit, match="not a long-context examples file"):
        sva.read_examples(_bad(tmp_path), 1, 64)


def _bad(tmp_path: Path) -> Path:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"task": "passkey"}) + "\n")
    return bad
