"""nats-generate: decoding through a KV-cache policy equals greedy decoding of the model's parallel forward (full
on a dense model, nats on a NAtS model), sampling is seeded, the cache statistics are the policy's, the CLI runs
end to end, and mistakes get clear errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_hub import train_checkpoint

from conftest import DATA_DIR, compose, local_corpus
from nats.cache.budget import resolve_budget
from nats.cache.decode import generate as decode_generate
from nats.data.tokenizer import VOCAB_SIZE, get_tokenizer
from nats.generate import cache_stats, run
from nats.hub import export_checkpoint, load_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

PROMPT = "To be, or not to be, that is the question:"
NEW = 20


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    """Tiny models trained 4 steps by nats-train's build: NAtS (window 8) and dense."""
    root = tmp_path_factory.mktemp("generate_runs")
    return {
        "nats": train_checkpoint(root / "nats", ["model/attention=nats", "model.attention.window=8"]),
        "dense": train_checkpoint(root / "dense", ["model/attention=dense"]),
    }


def prompt_ids(batch: int = 1) -> torch.Tensor:
    return torch.tensor([get_tokenizer().encode_ordinary(PROMPT)] * batch)


def greedy_parallel(model, idx: torch.Tensor, new: int) -> torch.Tensor:
    """Greedy decoding by the model's own parallel forward over the whole sequence at every step."""
    model.eval()
    with torch.no_grad():
        for _ in range(new):
            logits = model(idx).logits[:, -1, :VOCAB_SIZE]
            idx = torch.cat([idx, logits.argmax(-1, keepdim=True)], dim=1)
    return idx


def gen_cfg(tmp_path: Path, overrides=()):
    return compose([f"prompt='{PROMPT}'", f"max_new_tokens={NEW}", *overrides], tmp_path, config_name="generate")


@pytest.mark.parametrize("kind,policy", [("dense", "full"), ("nats", "nats")])
def test_policy_equals_greedy_parallel_forward(ckpts, kind, policy):
    model = load_checkpoint(ckpts[kind])
    idx = prompt_ids(2)
    ref = greedy_parallel(model, idx, NEW)
    out, caches = decode_generate(model, idx, NEW, policy, vocab_limit=VOCAB_SIZE, return_caches=True)
    assert out.shape == (2, idx.shape[1] + NEW)
    assert torch.equal(out, ref), (out[0, idx.shape[1] :].tolist(), ref[0, idx.shape[1] :].tolist())
    assert len(caches) == model.config.n_layer and caches.t == caches.layers[0].t == idx.shape[1] + NEW - 1
    # without the vocabulary limit it is nats.cache.decode.generate's loop (same tokens when none is padding)
    plain, _ = decode_generate(model, idx, NEW, policy, return_caches=True)
    assert torch.equal(plain, decode_generate(model, idx, NEW, policy))


def test_run_prints_text_and_stats(ckpts, tmp_path, caplog):
    """`run` with the default (full, greedy) on a checkpoint and on its exported folder: the same text."""
    caplog.set_level("INFO", logger="nats.generate")
    a = run(gen_cfg(tmp_path / "a", [f"ckpt_path={ckpts['dense']}"]))
    model = load_checkpoint(ckpts["dense"])
    ref = greedy_parallel(model, prompt_ids(), NEW)[0].tolist()
    assert a["tokens"] == [ref] and a["texts"] == [get_tokenizer().decode(ref)]
    assert a["texts"][0].startswith(PROMPT) and a["continuations"][0] == get_tokenizer().decode(ref[-NEW:])
    s = a["stats"]
    n = len(ref) - 1  # the last token is chosen, not fed
    assert s["processed"] == n and s["kept"] == n and s["kv_fraction"] == 1.0 and s["area"] == 1.0
    assert s["kept_bytes"] == s["full_bytes"] > 0
    assert json.loads((tmp_path / "a" / "generation.json").read_text())["tokens"] == [ref]
    assert PROMPT in caplog.text and "kept KV entries per layer and KV head" in caplog.text
    # the default decode path: CUDA-graph replays on CUDA, eager here on the CPU
    assert gen_cfg(tmp_path / "c").graph == "auto" and a["decode"] == "eager" and "(eager decoding)" in caplog.text
    with pytest.raises(ValueError, match="CUDA-graph decoding needs"):
        run(gen_cfg(tmp_path / "g", [f"ckpt_path={ckpts['dense']}", "graph=true", "max_new_tokens=2"]))
    folder = export_checkpoint(ckpts["dense"], tmp_path / "exported")
    b = run(gen_cfg(tmp_path / "b", [f"model_dir={folder}"]))
    assert b["tokens"] == a["tokens"]


def test_budgeted_policies_and_their_stats(ckpts, tmp_path):
    ckpt = f"ckpt_path={ckpts['nats']}"
    total = prompt_ids().shape[1] + NEW
    for policy, budget, expect in [("h2o", "8", 8), ("streaming_llm", "0.25", round(0.25 * total))]:
        r = run(gen_cfg(tmp_path / policy, [ckpt, f"policy={policy}", f"budget={budget}"]))
        s = r["stats"]
        assert r["budget"] == expect and s["kept_max"] <= expect and s["kept"] == expect
        assert s["kv_fraction"] == pytest.approx(expect / (total - 1))
        assert 0 < s["area"] < 1 and s["peak"] == pytest.approx(expect / (total - 1))
        assert s["kept_bytes"] < s["full_bytes"]
    r = run(gen_cfg(tmp_path / "nats", [ckpt, "policy=nats"]))
    assert set(r["stats"]["type_fractions"]) == {"global", "local", "sliding"}
    assert sum(r["stats"]["type_fractions"].values()) == pytest.approx(1.0)
    assert 0 < r["stats"]["kv_fraction"] <= 1
    # a budget as large as the sequence keeps everything: the same tokens as full
    model = load_checkpoint(ckpts["dense"])
    full, _ = decode_generate(model, prompt_ids(), NEW, "full", vocab_limit=VOCAB_SIZE, return_caches=True)
    h2o, caches = decode_generate(
        model, prompt_ids(), NEW, "h2o", budget=total, vocab_limit=VOCAB_SIZE, return_caches=True
    )
    assert torch.equal(full, h2o) and cache_stats(caches)["kv_fraction"] == 1.0


def test_sampling_is_seeded(ckpts, tmp_path):
    base = [f"ckpt_path={ckpts['dense']}", "temperature=1.5", "num_samples=3", "max_new_tokens=12"]
    a = run(gen_cfg(tmp_path / "a", [*base, "seed=1"]))
    b = run(gen_cfg(tmp_path / "b", [*base, "seed=1"]))
    c = run(gen_cfg(tmp_path / "c", [*base, "seed=2"]))
    assert a["tokens"] == b["tokens"] and a["tokens"] != c["tokens"]
    assert len({tuple(t) for t in a["tokens"]}) > 1  # the samples of one batch differ
    assert all(t < VOCAB_SIZE for row in c["tokens"] for t in row)  # never the padded ids
    greedy = run(gen_cfg(tmp_path / "g", [f"ckpt_path={ckpts['dense']}", "max_new_tokens=12"]))
    top1 = run(gen_cfg(tmp_path / "k", [*base, "top_k=1"]))
    assert top1["tokens"] == greedy["tokens"] * 3


def test_empty_prompt_starts_from_endoftext(ckpts, tmp_path):
    r = run(gen_cfg(tmp_path, [f"ckpt_path={ckpts['dense']}", "prompt=''", "max_new_tokens=4"]))
    assert r["prompt_tokens"] == 1 and r["tokens"][0][0] == 50256 and len(r["tokens"][0]) == 5
    (tmp_path / "prompt.txt").write_text(PROMPT)
    r = run(gen_cfg(tmp_path, [f"ckpt_path={ckpts['dense']}", "prompt=''", f"prompt_file={tmp_path}/prompt.txt"]))
    assert r["texts"][0].startswith(PROMPT)


def test_resolve_budget():
    assert resolve_budget(None, 40) is None and resolve_budget(8, 40) == 8 and resolve_budget(0.25, 40) == 10
    assert resolve_budget(0.001, 40) == 1 and resolve_budget(8.0, 40) == 8
    for bad in (0, -3, 2.5, "many", True):
        with pytest.raises(ValueError, match="budget"):
            resolve_budget(bad, 40)


def test_errors(ckpts, tmp_path):
    dense, nats = f"ckpt_path={ckpts['dense']}", f"ckpt_path={ckpts['nats']}"
    cases = [
        ([dense, "policy=nats"], ValueError, "cache policy 'nats' needs a model with nats attention"),
        ([nats, "policy=h2o", "budget=0"], ValueError, "budget=0 must be a whole number of tokens >= 1"),
        ([nats, "policy=h2o", "budget=-4"], ValueError, "budget=-4 must be a whole number of tokens >= 1"),
        ([nats, "policy=h2o"], ValueError, "needs a budget"),
        ([nats, "policy=full", "budget=8"], ValueError, "takes no budget"),
        ([nats, "policy=h2o_dense", "budget=8"], ValueError, "parallel approximation and cannot decode"),
        ([nats, "policy=streaming_llm", "budget=3"], ValueError, "sinks"),
        ([nats, "policy=lru"], ValueError, "lru"),
        ([nats, "max_new_tokens=200"], ValueError, "exceeds the model's block_size 64"),
        ([nats, "temperature=-1"], ValueError, "temperature must be >= 0"),
        ([nats, "temperature=1", "top_k=0"], ValueError, "top_k must be a whole number >= 1"),
        ([nats, "num_samples=0"], ValueError, "num_samples must be >= 1"),
        ([nats, "precision=int8"], ValueError, "precision='int8'"),
        ([f"ckpt_path={tmp_path}/missing.ckpt"], FileNotFoundError, "does not exist"),
        ([f"model_dir={tmp_path}/missing"], FileNotFoundError, "no such model folder"),
        ([f"model_dir={ckpts['nats']}"], ValueError, "is a checkpoint file: pass it as ckpt_path="),
        ([nats, f"model_dir={tmp_path}"], ValueError, "give one model, not both"),
        ([], ValueError, "no model given: give ckpt_path="),
        ([nats, f"prompt_file={tmp_path}/none.txt"], FileNotFoundError, "prompt_file="),
    ]
    for overrides, err, match in cases:
        with pytest.raises(err, match=match):
            run(gen_cfg(tmp_path / "out", overrides))
    assert not (tmp_path / "out").exists()  # nothing written on an error


def test_model_of_another_vocabulary(tmp_path):
    from nats.hub import PretrainedGPT
    from nats.models.gpt import GPTConfig

    PretrainedGPT(GPTConfig(vocab_size=100, block_size=32, n_layer=1, n_head=2, n_embd=16)).save_pretrained(
        tmp_path / "small_vocab"
    )
    with pytest.raises(ValueError, match="vocab_size=100 is smaller than the 50257 tokens"):
        run(gen_cfg(tmp_path / "out", [f"model_dir={tmp_path}/small_vocab"]))


def test_cli(ckpts, tmp_path):
    """`nats-generate` (the console script) on a NAtS checkpoint with the nats policy; and a clear error."""
    exe = Path(sys.executable).with_name("nats-generate")
    base = [str(exe)] if exe.exists() else [sys.executable, "-m", "nats.generate"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = tmp_path / "run"
    proc = subprocess.run(
        [
            *base,
            f"ckpt_path={ckpts['nats']}",
            "policy=nats",
            f"prompt='{PROMPT}'",
            "max_new_tokens=8",
            f"hydra.run.dir={out}",
            f"paths.data_dir={DATA_DIR}",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert PROMPT in proc.stdout and "policy nats:" in proc.stdout and "KV fraction" in proc.stdout
    assert "token types: global" in proc.stdout
    report = json.loads((out / "generation.json").read_text())
    assert report["policy"] == "nats" and len(report["tokens"][0]) == report["prompt_tokens"] + 8
    assert "KV fraction" in (out / "generate.log").read_text()
    proc = subprocess.run(
        [*base, f"ckpt_path={ckpts['dense']}", "policy=nats", f"hydra.run.dir={tmp_path}/bad", "max_new_tokens=4"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    text = proc.stdout + proc.stderr  # one line on the console (nats.cli), no traceback
    assert proc.returncode == 1 and "nats-generate: cache policy 'nats' needs a model with nats attention" in text
    assert "Traceback" not in text


@pytest.fixture(scope="module")
def local_nats_ckpt(tmp_path_factory) -> Path:
    """A tiny NAtS model trained 4 steps on a corpus of the repository's own docs: no download (a GPU machine
    without network has no Gutenberg corpus)."""
    root = tmp_path_factory.mktemp("local_corpus")
    return train_checkpoint(root / "nats", ["model/attention=nats", "model.attention.window=8", *local_corpus(root)])


@pytest.mark.gpu
def test_cuda_matches_cpu(local_nats_ckpt, tmp_path):
    cpu = run(gen_cfg(tmp_path / "cpu", [f"ckpt_path={local_nats_ckpt}", "policy=nats", "device=cpu"]))
    gpu = run(gen_cfg(tmp_path / "gpu", [f"ckpt_path={local_nats_ckpt}", "policy=nats", "device=cuda"]))
    assert gpu["decode"] == "cuda_graph"  # the default on CUDA
    assert gpu["device"].startswith("cuda") and gpu["stats"]["processed"] == cpu["stats"]["processed"]
    # float32 on both: the same greedy tokens unless two logits tie to within rounding
    same = sum(a == b for a, b in zip(cpu["tokens"][0], gpu["tokens"][0])) / len(cpu["tokens"][0])
    assert same > 0.9
