"""NAtS scorers as a shareable adapter folder (nats/hf/adapter.py): exported from a fine-tuning run's folder (config,
safetensors, card), loaded in one call onto the base model in a fresh process with the same logits and kept share,
refused for another model in one line, and read by nats-eval-hf as ``scorers=<folder>``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from helpers import eval_hf_config  # noqa: E402
from nats.finetune import evaluate as E  # noqa: E402
from nats.hf import StaticPolicyCache, attach_nats, nats_state_dict  # noqa: E402
from nats.hf.adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, CARD, load_nats_adapter  # noqa: E402
from nats.hf.adapter_export import export_nats_adapter  # noqa: E402
from nats.hf.loop import generate  # noqa: E402
from nats.hf.pretrained import save_tiny_random_llama  # noqa: E402

WINDOW = 8


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A fine-tuning run folder as nats-train leaves it: scorers.pt, nats_stats.json, .hydra/config.yaml."""
    root = tmp_path_factory.mktemp("adapter")
    base = save_tiny_random_llama(root / "base")
    model = attach_nats(transformers.AutoModelForCausalLM.from_pretrained(base), window=WINDOW, init_std=0.5)
    folder = root / "run"
    (folder / ".hydra").mkdir(parents=True)
    torch.save(nats_state_dict(model), folder / "scorers.pt")
    (folder / "nats_stats.json").write_text(
        json.dumps({"step": 4, "window": WINDOW, "mean": {"density": 0.3, "peak": 0.2}})
    )
    (folder / ".hydra" / "config.yaml").write_text(
        f"hf_model:\n  name_or_path: {base}\nmodule:\n  window: {WINDOW}\n  sparsity_lambda: 0.1\n"
        "data:\n  tasks: [passkey, niah]\n  num_examples: 4\n  max_length: 384\ntrainer:\n  max_steps: 4\n"
    )
    return {"root": root, "base": base, "folder": folder, "model": model.eval()}


def outputs(model, ids):
    """The logits and, through the NAtS cache, the tokens and the kept share of a short generation."""
    with torch.no_grad():
        logits = model(ids).logits
    cache = StaticPolicyCache(model, "nats", max_new_tokens=6)
    out = generate(model, ids, cache, 6, compile=False)
    return logits, out, cache.kept().double().mean()


def test_export_writes_the_config_weights_and_card(run, tmp_path):
    out = export_nats_adapter(run["folder"], tmp_path / "adapter")
    meta = json.loads((out / ADAPTER_CONFIG).read_text())
    assert meta["method"] == "nats" and meta["window"] == WINDOW and meta["sparsity_lambda"] == 0.1
    assert meta["base_model"]["name_or_path"] == str(run["base"]) and len(meta["base_model"]["revision"]) == 16
    assert meta["shape"]["num_hidden_layers"] == 2 and meta["kv"] == {"density": 0.3, "peak": 0.2}
    assert meta["trained"] == {"steps": 4, "tasks": ["passkey", "niah"], "examples": 4, "max_length": 384}
    card = (out / CARD).read_text()
    assert "base_model:" in card and "KV kept" in card and "0.300" in card and "load_nats_adapter" in card
    assert (out / ADAPTER_WEIGHTS).stat().st_size > 0


def test_a_fresh_process_loads_it_onto_the_base_model_with_the_same_outputs(run, tmp_path):
    out = export_nats_adapter(run["folder"], tmp_path / "adapter")
    ids = torch.randint(0, 1000, (1, 30), generator=torch.Generator().manual_seed(0))
    torch.save(ids, tmp_path / "ids.pt")
    code = f"""
import torch, transformers
from nats.hf.adapter import load_nats_adapter
from nats.hf import StaticPolicyCache
from nats.hf.loop import generate
model = load_nats_adapter(transformers.AutoModelForCausalLM.from_pretrained({str(run["base"])!r}), {str(out)!r}).eval()
ids = torch.load({str(tmp_path / "ids.pt")!r})
with torch.no_grad():
    logits = model(ids).logits
cache = StaticPolicyCache(model, "nats", max_new_tokens=6)
tokens = generate(model, ids, cache, 6, compile=False)
torch.save((logits, tokens, cache.kept().double().mean()), {str(tmp_path / "got.pt")!r})
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    logits, tokens, kept = torch.load(tmp_path / "got.pt")
    ref_logits, ref_tokens, ref_kept = outputs(run["model"], ids)
    assert torch.equal(logits, ref_logits) and torch.equal(tokens, ref_tokens) and float(kept) == float(ref_kept)


def test_a_folder_for_another_model_is_refused_in_one_line(run, tmp_path):
    out = export_nats_adapter(run["folder"], tmp_path / "adapter")
    other = transformers.AutoModelForCausalLM.from_pretrained(save_tiny_random_llama(tmp_path / "other", n_layer=3))
    with pytest.raises(ValueError, match="was made for .* not this model") as err:
        load_nats_adapter(other, out)
    assert "\n" not in str(err.value)
    with pytest.raises(FileNotFoundError, match="is not a NAtS adapter folder"):
        load_nats_adapter(other, tmp_path)


def test_nats_eval_hf_takes_the_folder_as_scorers(run, tmp_path):
    out = export_nats_adapter(run["folder"], tmp_path / "adapter")
    cfg = eval_hf_config(run["base"], tmp_path / "eval", f"scorers={out}", "methods=[nats]", "data.tasks=[passkey]")
    report = E.run(cfg)
    assert [r["method"] for r in report["rows"]] == ["nats"]
    assert json.loads((tmp_path / "eval" / E.SETTINGS).read_text())["window"] == WINDOW
