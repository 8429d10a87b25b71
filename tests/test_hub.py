"""nats.hub: save_pretrained / from_pretrained (config.json + model.safetensors, or pytorch_model.bin without
safetensors) give the identical model, a NAtS model with its scorers and attention config; export of a nats-train
checkpoint to that folder; clear errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import compose
from nats import hub
from nats.hub import (
    CONFIG_NAME,
    SAFETENSORS_NAME,
    TORCH_NAME,
    PretrainedGPT,
    config_from_dict,
    export_checkpoint,
    from_pretrained,
    load_checkpoint,
    load_model,
    save_pretrained,
)
from nats.models.gpt import GPT, GPTConfig

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

# a tiny model trained a few steps by nats-train's own build (data: the Gutenberg cache)
TINY_RUN = [
    "model.block_size=64",
    "model.n_layer=2",
    "model.n_embd=32",
    "model.n_head=4",
    "model.n_kv_head=2",
    "data.micro_batch_size=4",
    "global_batch_size=4",
    "trainer.max_steps=4",
    "eval_every=4",
    "data.max_eval_windows=2",
    "optim.lr=1e-2",
    "optim.warmup_steps=1",
    "callbacks=none",
    "logger=none",
    "trainer.enable_progress_bar=false",
]


def train_checkpoint(run_dir: Path, attention: list[str]) -> Path:
    """Train TINY_RUN + attention overrides in-process and save the Lightning checkpoint as nats-train does."""
    from nats.train import build

    cfg = compose([*TINY_RUN, *attention], run_dir)
    datamodule, module, trainer = build(cfg)
    trainer.fit(module, datamodule=datamodule)
    assert trainer.global_step == 4
    path = run_dir / "last.ckpt"
    trainer.save_checkpoint(path)
    return path


@pytest.fixture(scope="module")
def nats_ckpt(tmp_path_factory) -> Path:
    return train_checkpoint(tmp_path_factory.mktemp("nats_run"), ["model/attention=nats", "model.attention.window=8"])


def tokens(n: int = 48, batch: int = 2, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50257, (batch, n), generator=g)


def assert_same_model(a: GPT, b: GPT) -> None:
    assert a.config.to_dict() == b.config.to_dict()
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    a.eval(), b.eval()
    x = tokens()
    with torch.no_grad():
        oa, ob = a(x), b(x)
    assert torch.equal(oa.logits, ob.logits)
    assert oa.stats.keys() == ob.stats.keys()
    for k in oa.stats:
        assert torch.equal(oa.stats[k], ob.stats[k]), k


def test_round_trip_nats_model(nats_ckpt, tmp_path):
    model = load_checkpoint(nats_ckpt)
    assert isinstance(model, PretrainedGPT) and not model.training
    out = model.save_pretrained(tmp_path / "m")
    assert out is None  # the mixin's return (a URL only when pushing)
    files = {p.name for p in (tmp_path / "m").iterdir()}
    assert files == {CONFIG_NAME, SAFETENSORS_NAME, "README.md"}
    saved = json.loads((tmp_path / "m" / CONFIG_NAME).read_text())
    assert saved["model_type"] == "nats-gpt"
    assert saved["attention"]["name"] == "nats" and saved["attention"]["window"] == 8
    loaded = PretrainedGPT.from_pretrained(tmp_path / "m")
    assert not loaded.training
    assert_same_model(model, loaded)
    # the NAtS model keeps its scorers (trained, not re-initialised) and its window/type config
    for b_old, b_new in zip(model.blocks, loaded.blocks):
        assert b_new.attn.core.name == "nats" and b_new.attn.core.window == 8
        assert torch.equal(b_old.attn.core.scorer.weight, b_new.attn.core.scorer.weight)
    assert loaded.config.attention == model.config.attention
    assert loaded.lm_head.weight is loaded.wte.weight  # tied again, stored once


def test_checkpoint_export_equals_the_trained_module(nats_ckpt, tmp_path):
    """export_checkpoint writes what LitGPT trained: the same logits as the module's own model."""
    from nats.lit import LitGPT

    ckpt = torch.load(nats_ckpt, map_location="cpu", weights_only=True)
    lit = LitGPT(**ckpt["hyper_parameters"])
    lit.load_state_dict(ckpt["state_dict"])
    folder = export_checkpoint(nats_ckpt, tmp_path / "exported")
    assert (folder / SAFETENSORS_NAME).is_file()
    assert_same_model(lit.model, from_pretrained(folder))
    assert_same_model(lit.model, load_model(nats_ckpt))  # a .ckpt file, read directly
    assert_same_model(lit.model, load_model(folder))


def test_card_states_what_the_run_kept_and_its_evaluation(nats_ckpt, tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    ckpt = run / "checkpoints" / "last.ckpt"
    shutil.copy(nats_ckpt, ckpt)
    plain = (export_checkpoint(ckpt, tmp_path / "plain") / "README.md").read_text()
    assert "What it keeps" not in plain and "## Evaluation" not in plain  # the run recorded neither
    metrics = {"val/loss": 5.0, "val/ppl": 148.41, "val/density": 0.0785, "val/peak": 0.0662}
    (run / "metrics.json").write_text(json.dumps({"metrics": metrics, "global_step": 4, "tokens_seen": 2048}))
    (run / "eval_test").mkdir()
    rows = [{"method": "nats", "label": "NAtS cache", "ppl": 150.123, "area": 0.0791, "peak": 0.0671, "per_head": {}}]
    (run / "eval_test" / "results.json").write_text(json.dumps({"results": rows}))
    card = (export_checkpoint(ckpt, tmp_path / "card") / "README.md").read_text()
    assert "Trained 4 steps (2,048 tokens); validation perplexity 148.410; KV kept 0.0785" in card
    assert "(area, peak 0.0662)" in card
    assert "| test | NAtS cache | 150.123 | 0.0791 | 0.0671 |" in card and "eval_test/results.json" in card
    assert_same_model(from_pretrained(tmp_path / "card"), from_pretrained(tmp_path / "plain"))


def test_export_cli(nats_ckpt, tmp_path, capsys):
    hub.main([str(nats_ckpt), str(tmp_path / "cli"), "--torch"])
    assert "exported" in capsys.readouterr().out
    assert {p.name for p in (tmp_path / "cli").iterdir()} == {CONFIG_NAME, TORCH_NAME, "README.md"}
    with pytest.raises(SystemExit) as err:
        hub.main([str(tmp_path / "nope.ckpt"), str(tmp_path / "x")])
    assert err.value.code == 2 and "does not exist" in capsys.readouterr().err


def test_without_safetensors_torch_weights(tmp_path, monkeypatch):
    """No safetensors package: pytorch_model.bin; saving again with it replaces the stale file."""
    torch.manual_seed(0)
    # untied head, learned positions, biases, GQA and an output gate: every kind of weight
    attention = {"name": "dense", "output_gate": "headwise"}
    cfg = GPTConfig.tiny(vocab_size=50304, pos_emb="learned", tie_embeddings=False, bias=True, attention=attention)
    model = GPT(cfg)
    monkeypatch.setattr(hub, "_has_safetensors", lambda: False)
    save_pretrained(model, tmp_path / "m")
    assert {p.name for p in (tmp_path / "m").iterdir()} == {CONFIG_NAME, TORCH_NAME, "README.md"}
    loaded = from_pretrained(tmp_path / "m")
    assert loaded.lm_head.weight is not loaded.wte.weight
    assert_same_model(model, loaded)
    monkeypatch.undo()
    loaded.save_pretrained(tmp_path / "m")
    assert {p.name for p in (tmp_path / "m").iterdir()} == {CONFIG_NAME, SAFETENSORS_NAME, "README.md"}
    assert_same_model(model, from_pretrained(tmp_path / "m"))


def test_wrap_keeps_dtype_and_loads_to_device(tmp_path):
    model = GPT(GPTConfig(vocab_size=128, block_size=16, n_layer=1, n_head=2, n_embd=16)).to(torch.bfloat16)
    wrapped = PretrainedGPT.wrap(model)
    assert wrapped.wte.weight.dtype == torch.bfloat16
    wrapped.save_pretrained(tmp_path / "bf16")
    loaded = from_pretrained(tmp_path / "bf16", map_location="cpu")
    assert loaded.wte.weight.dtype == torch.bfloat16  # stored in the model's dtype
    assert torch.equal(loaded.wte.weight, model.wte.weight)
    assert from_pretrained(tmp_path / "bf16", dtype="float32").wte.weight.dtype == torch.float32


def test_config_from_dict():
    base = GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16).to_dict()
    assert config_from_dict({**base, "model_type": "nats-gpt"}).to_dict() == base
    # a retired key is one line naming it and its replacement, whatever its value
    with pytest.raises(ValueError) as err:
        config_from_dict({**base, "lse_cross_entropy": False}, "old.json")
    assert "\n" not in str(err.value)
    assert str(err.value).startswith(
        "old.json: not a nats GPT config (retired model config keys: model.lse_cross_entropy (now "
        "model.fused_cross_entropy); delete them"
    )
    with pytest.raises(ValueError, match="where.json: not a nats GPT config.*unknown model config keys"):
        config_from_dict({**base, "n_layers": 3}, "where.json")


def test_errors(nats_ckpt, tmp_path):
    with pytest.raises(FileNotFoundError, match="no such model folder"):
        from_pretrained(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        from_pretrained(tmp_path / "empty")
    with pytest.raises(ValueError, match="is a file.*export_checkpoint"):
        from_pretrained(nats_ckpt)
    # a hub id that is not in the local cache (no network in tests): a clear error, nothing downloaded
    with pytest.raises(FileNotFoundError, match="could not be loaded as a model from the Hugging Face hub"):
        from_pretrained("nats-test-user/no-such-model", local_files_only=True)
    model = load_checkpoint(nats_ckpt)
    folder = tmp_path / "m"
    save_pretrained(model, folder)
    config = json.loads((folder / CONFIG_NAME).read_text())
    (folder / CONFIG_NAME).write_text(json.dumps({**config, "model_type": "bert"}))
    with pytest.raises(ValueError, match="model_type='bert'.*not a nats model"):
        from_pretrained(folder)
    (folder / CONFIG_NAME).write_text(json.dumps({**config, "n_layer": 3}))  # weights of 2 layers
    with pytest.raises(ValueError, match="do not match the model config.*missing"):
        from_pretrained(folder)
    (folder / CONFIG_NAME).write_text(json.dumps(config))
    (folder / SAFETENSORS_NAME).write_bytes(b"not weights")
    with pytest.raises(ValueError, match="not a readable weights file"):
        from_pretrained(folder)
    (folder / SAFETENSORS_NAME).unlink()
    with pytest.raises(FileNotFoundError, match="has neither model.safetensors nor pytorch_model.bin"):
        from_pretrained(folder)
    with pytest.raises(TypeError, match="saves a nats.models.gpt.GPT"):
        save_pretrained(torch.nn.Linear(2, 2), tmp_path / "linear")
    # checkpoints
    with pytest.raises(ValueError, match="no checkpoint given"):
        load_checkpoint(None)
    with pytest.raises(FileNotFoundError, match="does not exist.*last.ckpt"):
        export_checkpoint(tmp_path / "nope.ckpt", tmp_path / "out")
    (tmp_path / "text.ckpt").write_text("hello")
    with pytest.raises(ValueError, match="not a readable nats-train checkpoint"):
        load_checkpoint(tmp_path / "text.ckpt")
    torch.save({"state_dict": {"layer.weight": torch.zeros(2)}}, tmp_path / "other.ckpt")
    with pytest.raises(ValueError, match="is not a nats-train checkpoint.*hyper_parameters"):
        load_checkpoint(tmp_path / "other.ckpt")
    assert not (tmp_path / "out").exists()
