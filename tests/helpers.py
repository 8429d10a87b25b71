"""What several test files share besides conftest's fixtures: `nats-train` run as a user runs it, the overrides of
the tiny GPT those runs train, the config of a quick `nats-eval-hf` run and the scorers of a fine-tuning run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

NATS_TRAIN = str(Path(sys.executable).parent / "nats-train")
# the tiny GPT of the command-line runs: overrides of the model's sizes
TINY_GPT = ["model.block_size=32", "model.n_layer=2", "model.n_head=2", "model.n_embd=32"]


def nats_train(args: list[str], root: Path, check: bool = True, timeout: int = 600) -> subprocess.CompletedProcess:
    """`nats-train *args` in a subprocess run in `root`, which is also its PROJECT_ROOT (logs/ go there), on one
    thread; the exit status must be 0 unless `check` is False (the output's end is the assertion's message)."""
    env = dict(os.environ, PROJECT_ROOT=str(root), OMP_NUM_THREADS="1")
    res = subprocess.run([NATS_TRAIN, *args], env=env, capture_output=True, text=True, timeout=timeout, cwd=root)
    if check:
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res


def eval_hf_config(pretrained: Path, out: Path, *overrides: str):
    """The config of a quick `nats-eval-hf` run of the tiny model saved in `pretrained`
    (`nats.hf.pretrained.save_tiny_random_llama`), writing into `out`: one example of 300-320 tokens per task, no
    PG-19 filler, the torch backend on the CPU, no progress bar; then `overrides` (methods, budgets, tasks, ...)."""
    from nats.train import compose_config

    common = [f"paths.output_dir={out}", f"paths.log_dir={out}/logs", f"paths.data_dir={pretrained}/data"]
    model = [f"hf_model.name_or_path={pretrained}", "hf_model.max_context=512"]
    data = ["data.num_examples=1", "data.max_length=320", "data.min_length=300", "data.pg19_path=null"]
    run = ["answer_margin=2", "device=cpu", "backend=torch", "progress=false"]
    return compose_config([*common, *model, *data, *run, *overrides], "eval_hf")


def interrupt_text_dir_prepare(monkeypatch, split: str = "test"):
    """The text_dir source interrupted (KeyboardInterrupt, as Ctrl-C) when a prepare asks for the documents of
    `split`; the real `TextDirSource.documents` is returned, to put back with monkeypatch.setattr."""
    from nats.data import sources as S

    real = S.TextDirSource.documents

    def failing(self, name):
        if name == split:
            raise KeyboardInterrupt
        return real(self, name)

    monkeypatch.setattr(S.TextDirSource, "documents", failing)
    return real


def tiny_model_and_scorers(root: Path, window: int, **model: Any) -> Path:
    """The tiny random Llama in the transformers layout in ``root`` (`nats.hf.pretrained.save_tiny_random_llama`,
    ``model`` its options) and a "fine-tuning run" beside it (``root/finetune_run``): random NAtS scorers
    (``scorers.pt``, std 0.5, so that the types vary) and its ``nats_stats.json`` naming the window, as nats-eval-hf's
    ``scorers=`` reads them (a ``.hydra`` folder too, as nats-train leaves it). Returns ``root``."""
    import json

    import torch
    import transformers

    from nats.hf import attach_nats, nats_state_dict
    from nats.hf.pretrained import save_tiny_random_llama

    save_tiny_random_llama(root, **model)
    run = root / "finetune_run"
    (run / ".hydra").mkdir(parents=True)
    scored = attach_nats(transformers.AutoModelForCausalLM.from_pretrained(root), window=window, init_std=0.5)
    torch.save(nats_state_dict(scored), run / "scorers.pt")
    (run / "nats_stats.json").write_text(json.dumps({"window": window}))
    return root
