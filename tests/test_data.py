"""The data layer: sources, the .bin token cache, the samplers and TokenDataModule.

The Gutenberg corpus is downloaded (pip, ~5 MB) and tokenised (~2 s) at most once: a fixture shared by the whole
test run prepares it into the repository's ``data/`` folder (the same cache `nats-train` uses, gitignored; set
``NATS_TEST_DATA_DIR`` to use another folder), and later test runs reuse it. Everything else runs on tiny
folders under pytest's tmp_path. No Hugging Face hub access.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from helpers import interrupt_text_dir_prepare
from nats.data import datamodule as D
from nats.data import sources as S
from nats.data import token_cache as TC
from nats.data import token_file as TF
from nats.data import windows as W
from nats.data.tokenizer import EOT, get_tokenizer

REPO = Path(__file__).resolve().parents[1]
DATA_DIR = Path(os.environ.get("NATS_TEST_DATA_DIR", REPO / "data"))


# ----------------------------------------------------------------------------------------------------
# fixtures
# ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def gutenberg() -> D.TokenDataModule:
    dm = D.TokenDataModule("gutenberg", str(DATA_DIR), block_size=256, micro_batch_size=4)
    dm.prepare_data()
    dm.setup()
    return dm


BOOKS = {
    "train": {"b_second.txt": "The second book.\r\nIt has two lines.", "a_first.txt": "First book, Café."},
    "validation": {"v.txt": "A validation book " * 40},
    "test": {"sub/t.txt": "A test book " * 40},
}


def write_books(root: Path, books: dict = BOOKS) -> Path:
    for split, files in books.items():
        (root / split).mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (root / split / name).parent.mkdir(parents=True, exist_ok=True)
            (root / split / name).write_bytes(text.encode())
    return root


def fake_trainer(global_step=0, accumulate=1, world=1, rank=0, max_steps=10) -> SimpleNamespace:
    return SimpleNamespace(global_step=global_step, accumulate_grad_batches=accumulate, world_size=world,
                           global_rank=rank, max_steps=max_steps)  # fmt: skip


# ----------------------------------------------------------------------------------------------------
# gutenberg
# ----------------------------------------------------------------------------------------------------
def test_gutenberg_works_and_split(gutenberg):
    src = gutenberg.text_source
    works = src.works()
    assert len(works) == 49 and not any(name.endswith("_f") for name in works)
    names = {split: [d.name for d in src.documents(split)] for split in S.SPLITS}
    assert sorted(names["validation"]) == sorted(S.GUTENBERG_VALIDATION)
    assert sorted(names["test"]) == sorted(S.GUTENBERG_TEST)
    assert len(names["train"]) == 43 and all(names.values())
    all_names = [n for split in S.SPLITS for n in names[split]]
    assert len(all_names) == len(set(all_names)) == 49  # no work in two splits
    # deterministic: a fresh source (reading the tarball again) gives the same split and order
    again = S.get_source("gutenberg", cache_dir=DATA_DIR)
    assert {split: [d.name for d in again.documents(split)] for split in S.SPLITS} == names
    meta = json.loads((gutenberg.cache_path / "meta.json").read_text())
    assert meta["documents"] == names
    assert all("Project Gutenberg" not in t[:3000] for t in works.values())


def test_gutenberg_token_counts(gutenberg):
    counts = gutenberg.token_counts
    total = sum(counts.values())
    assert 1_500_000 < total < 2_500_000, counts
    assert counts["validation"] > 50_000 and counts["test"] > 50_000
    assert 0.03 < counts["validation"] / total < 0.08 and 0.03 < counts["test"] / total < 0.08
    toks = gutenberg._file("validation").tokens
    assert toks[-1] == EOT and int((toks == EOT).sum()) == 3  # one EOT after each of the 3 works


def test_gutenberg_cache_reused(gutenberg):
    bins = [gutenberg.cache_path / f"{s}.bin" for s in S.SPLITS]
    before = [p.stat().st_mtime_ns for p in bins]
    dm = D.TokenDataModule("gutenberg", str(DATA_DIR), block_size=256)
    dm.prepare_data()
    assert dm.cache_path == gutenberg.cache_path
    assert [p.stat().st_mtime_ns for p in bins] == before


def test_strip_boilerplate():
    text = (
        "The Project Gutenberg EBook of X\nlicence...\n*** START OF THIS PROJECT GUTENBERG EBOOK X ***\n\n"
        "Body line.\n\nEnd of the Project Gutenberg EBook of X\nmore licence\n"
    )
    assert S.strip_gutenberg_boilerplate(text) == "Body line.\n"
    assert S.strip_gutenberg_boilerplate("\n\nplain text\n\n") == "plain text\n"


def test_gutenberg_bad_sdist_path(tmp_path):
    with pytest.raises(S.SourceUnavailableError, match="sdist_path"):
        S.GutenbergSource(tmp_path, sdist_path=tmp_path / "missing.tar.gz").prepare()


# ----------------------------------------------------------------------------------------------------
# .bin format
# ----------------------------------------------------------------------------------------------------
def test_bin_round_trip(tmp_path):
    path = tmp_path / "x.bin"
    chunks = [np.array([1, 2, 3]), np.array([], dtype=np.int64), np.array([50255, EOT])]
    assert TF.write_token_bin(path, chunks) == 5
    header = TF.read_bin_header(path, "gpt2")
    assert (header.version, header.num_tokens, header.vocab_size, header.tokenizer) == (1, 5, 50257, "gpt2")
    assert header.dtype == np.uint16
    assert path.stat().st_size == TF.HEADER_SIZE + 5 * 2
    assert path.read_bytes()[:8] == TF.MAGIC
    np.testing.assert_array_equal(TF.open_token_bin(path), [1, 2, 3, 50255, EOT])
    with pytest.raises(ValueError, match="outside"):
        TF.write_token_bin(tmp_path / "y.bin", [np.array([70000])])


def test_bin_errors(tmp_path):
    path = tmp_path / "train.bin"
    TF.write_token_bin(path, [np.arange(100)])
    with pytest.raises(TF.TokenCacheError, match="tokenised with 'gpt2'.*delete it and rerun `nats-prepare`"):
        TF.read_bin_header(path, "other")
    with open(path, "r+b") as f:
        f.truncate(TF.HEADER_SIZE + 150)
    with pytest.raises(TF.TokenCacheError, match=r"train\.bin is truncated.*delete it and rerun `nats-prepare`"):
        TF.open_token_bin(path)
    path.write_bytes(b"\x00" * 300)
    with pytest.raises(TF.TokenCacheError, match=r"train\.bin is not a nats token file.*delete it"):
        TF.open_token_bin(path)


def test_bin_write_is_atomic(tmp_path):
    def interrupted():
        yield np.arange(10)
        raise KeyboardInterrupt  # e.g. Ctrl-C mid-write

    path = tmp_path / "train.bin"
    with pytest.raises(KeyboardInterrupt):
        TF.write_token_bin(path, interrupted())
    assert list(tmp_path.iterdir()) == []  # neither the final file nor a temporary one
    TF.write_token_bin(path, [np.arange(7)])
    with pytest.raises(KeyboardInterrupt):
        TF.write_token_bin(path, interrupted())
    assert [p.name for p in tmp_path.iterdir()] == ["train.bin"]  # the old complete file is untouched
    assert TF.read_bin_header(path).num_tokens == 7


# ----------------------------------------------------------------------------------------------------
# local folders: text_dir and pg19
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("source", ["text_dir", "pg19"])
def test_local_folder_sources(tmp_path, source):
    root = write_books(tmp_path / "corpus")
    dm = D.TokenDataModule(source, str(tmp_path / "cache"), block_size=4, micro_batch_size=2, path=str(root))
    dm.prepare_data()
    dm.setup()
    assert dm.cache_path.name.startswith(f"{source}-") and dm.cache_path.name.endswith("-gpt2")
    enc = get_tokenizer()
    # sorted by path; CRLF normalised; EOT after every book, the last included
    expected = enc.encode_ordinary("First book, Café.") + [EOT]
    expected += enc.encode_ordinary("The second book.\nIt has two lines.") + [EOT]
    np.testing.assert_array_equal(dm._file("train").tokens, expected)
    for split in ("validation", "test"):
        toks = dm._file(split).tokens
        assert toks[-1] == EOT and (toks == EOT).sum() == 1 and len(toks) > 40
    meta = json.loads((dm.cache_path / "meta.json").read_text())
    assert meta["documents"]["train"] == ["a_first.txt", "b_second.txt"]
    assert meta["documents"]["test"] == ["sub/t.txt"]
    assert dm.hparams["path"] == str(root)


def test_interrupted_prepare_resumes(tmp_path, monkeypatch):
    root = write_books(tmp_path / "corpus")
    dm = D.TokenDataModule("text_dir", str(tmp_path / "cache"), block_size=4, path=str(root))
    real = interrupt_text_dir_prepare(monkeypatch, "test")
    with pytest.raises(KeyboardInterrupt):
        dm.prepare_data()
    # the finished splits, and the fingerprint of the prepare in progress (checked when it resumes)
    assert sorted(p.name for p in dm.cache_path.iterdir()) == [".partial.json", "train.bin", "validation.bin"]
    kept = (dm.cache_path / "train.bin").stat().st_mtime_ns
    monkeypatch.setattr(S.TextDirSource, "documents", real)
    dm.prepare_data()
    assert sorted(p.name for p in dm.cache_path.iterdir()) == ["meta.json", "test.bin", "train.bin", "validation.bin"]
    assert (dm.cache_path / "train.bin").stat().st_mtime_ns == kept  # not tokenised again


def test_cache_key_is_the_config_and_the_fingerprint_the_content(tmp_path):
    """The folder name comes from the configuration (source, path basename), so it is found without the raw
    data; the content fingerprint (listing) lives in meta.json and changes with the books."""
    root = write_books(tmp_path / "corpus")
    src = S.get_source("text_dir", tmp_path, path=root)
    before, fp = TC.cache_folder(tmp_path, src), src.fingerprint()
    assert before == TC.cache_folder(tmp_path, S.get_source("text_dir", tmp_path, path=root))
    assert before != TC.cache_folder(tmp_path, S.get_source("pg19", tmp_path, path=root))
    assert TC.cache_folder(tmp_path, src, name="my-corpus").name == "my-corpus-" + before.name.split("-", 1)[1]
    (root / "train" / "c.txt").write_text("a new book")
    again = S.get_source("text_dir", tmp_path, path=root)
    assert TC.cache_folder(tmp_path, again) == before and again.fingerprint() != fp
    # the same books elsewhere: same fingerprint (the location is not content)
    other = write_books(tmp_path / "elsewhere" / "corpus")
    (other / "train" / "c.txt").write_text("a new book")
    assert S.get_source("text_dir", tmp_path, path=other).fingerprint() == again.fingerprint()


def test_folder_errors(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=f"{missing}.*does not exist.*data.path"):
        D.TokenDataModule("text_dir", str(tmp_path), path=str(missing)).prepare_data()
    root = write_books(tmp_path / "corpus", {"train": {"a.txt": "x"}, "validation": {"v.txt": "y"}})
    with pytest.raises(FileNotFoundError, match=f"{root / 'test'} does not exist"):
        D.TokenDataModule("pg19", str(tmp_path), path=str(root)).prepare_data()
    (root / "test").mkdir()
    with pytest.raises(ValueError, match=f"{root / 'test'} contains no .txt files"):
        D.TokenDataModule("text_dir", str(tmp_path), path=str(root)).prepare_data()
    assert not list(tmp_path.glob("text_dir-*"))  # failed before tokenising anything
    with pytest.raises(ValueError, match="data.path"):
        D.TokenDataModule("text_dir", str(tmp_path)).prepare_data()
    with pytest.raises(ValueError, match="exactly one of data.path.*data.hf_name"):
        D.TokenDataModule("pg19", str(tmp_path)).prepare_data()  # neither: an error once the data is needed
    with pytest.raises(ValueError, match="exactly one of data.path.*data.hf_name"):
        D.TokenDataModule("pg19", str(tmp_path), path=str(root), hf_name="emozilla/pg19")  # both: at once


def test_datamodule_argument_errors(tmp_path):
    msg = r"unknown data source 'wikitext': choose one of \['gutenberg', 'pg19', 'text_dir'\]"
    with pytest.raises(ValueError, match=msg):
        D.TokenDataModule("wikitext", str(tmp_path))
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        D.TokenDataModule("gutenberg", str(tmp_path), block_size=0)
    with pytest.raises(ValueError, match="micro_batch_size must be >= 1"):
        D.TokenDataModule("gutenberg", str(tmp_path), micro_batch_size=0)
    with pytest.raises(ValueError, match="does not take option"):
        D.TokenDataModule("gutenberg", str(tmp_path), path="/x")
    D.TokenDataModule("gutenberg", str(tmp_path), path=None)  # None-valued foreign options are ignored
    root = write_books(tmp_path / "corpus")
    with pytest.raises(FileNotFoundError, match=r"train\.bin does not exist: run `nats-prepare"):
        D.TokenDataModule("text_dir", str(tmp_path), path=str(root)).setup()  # setup before prepare_data


def test_split_shorter_than_a_window(tmp_path):
    root = write_books(tmp_path / "corpus")
    dm = D.TokenDataModule("text_dir", str(tmp_path / "cache"), block_size=64, path=str(root))
    dm.prepare_data()
    with pytest.raises(ValueError, match=r"train\.bin holds \d+ tokens, fewer than block_size \+ 1 = 65"):
        dm.train_dataloader()


# ----------------------------------------------------------------------------------------------------
# training sampler
# ----------------------------------------------------------------------------------------------------
def test_train_windows_are_a_function_of_seed_and_s(gutenberg):
    file = gutenberg._file("train")
    a, b = W.TrainWindows(file, 256, seed=7, length=10), W.TrainWindows(file, 256, seed=7, length=10)
    for s in [0, 1, 12345, 10**12]:
        xa, ya = a[s]
        xb, yb = b[s]
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
        assert xa.shape == ya.shape == (256,) and xa.dtype == torch.int64
        assert torch.equal(xa[1:], ya[:-1])
        i = a.offset(s)
        np.testing.assert_array_equal(xa.numpy(), file.tokens[i : i + 256])
    offsets = [a.offset(s) for s in range(200)]
    assert len(set(offsets)) > 190 and max(offsets) <= file.num_tokens - 257
    assert offsets != [W.TrainWindows(file, 256, seed=8, length=10).offset(s) for s in range(200)]


def test_resumable_sampler_ranks_and_start():
    world, n = 3, 8
    per_rank = [list(W.ResumableSampler(n, r, world)) for r in range(world)]
    flat = sorted(s for r in per_rank for s in r)
    assert flat == list(range(n * world))  # disjoint, covering
    # resuming at start=k*world reproduces the tail of the uninterrupted stream on every rank
    for r in range(world):
        tail = list(W.ResumableSampler(n, r, world, start=lambda: 5 * world))[: n - 5]
        assert tail == per_rank[r][5:]


def test_train_dataloader_resume_with_trainer(gutenberg):
    """Rank r of 2 with accumulation 2: resuming at global_step 3 continues the uninterrupted batches."""
    dm = gutenberg
    full = {}
    for rank in range(2):
        dm.trainer = fake_trainer(global_step=0, accumulate=2, world=2, rank=rank, max_steps=5)
        loader = dm.train_dataloader()
        assert len(loader) == 5 * 2  # micro-batches per rank for max_steps
        full[rank] = [x for x, _ in loader]
    for rank in range(2):
        dm.trainer = fake_trainer(global_step=3, accumulate=2, world=2, rank=rank, max_steps=5)
        resumed = [x for x, _ in dm.train_dataloader()]
        assert all(torch.equal(a, b) for a, b in zip(resumed, full[rank][3 * 2 :]))
    # the two ranks never see the same sample
    a, b = torch.cat(full[0]), torch.cat(full[1])
    assert not any(torch.equal(a[i], b[j]) for i in range(len(a)) for j in range(len(b)))
    dm.trainer = None
    assert dm.consumed_samples() == 0


# ----------------------------------------------------------------------------------------------------
# validation / test windows and the unigram baseline
# ----------------------------------------------------------------------------------------------------
def test_eval_windows_cover_without_overlap(gutenberg):
    dm, n = gutenberg, 256
    toks = dm._file("validation").tokens
    ds = dm.eval_dataset("validation")
    assert len(ds) == (len(toks) - 1) // n
    ys = torch.cat([ds[k][1] for k in range(len(ds))]).numpy()
    np.testing.assert_array_equal(ys, toks[1 : 1 + len(ds) * n])  # every predicted token exactly once, in order
    x0, y0 = ds[1]
    assert x0[0] == toks[n] and y0[-1] == toks[2 * n]
    # two ranks: disjoint, same length, together the first windows
    idx = [list(W.StridedSampler(len(ds), r, 2)) for r in range(2)]
    assert len(idx[0]) == len(idx[1]) and sorted(idx[0] + idx[1]) == list(range(len(ds) - len(ds) % 2))
    loader = dm.val_dataloader()
    x, y = next(iter(loader))
    assert x.shape == y.shape == (4, n) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[0], ds[0][0])


def test_max_eval_windows(tmp_path, gutenberg):
    dm = D.TokenDataModule("gutenberg", str(DATA_DIR), block_size=256, max_eval_windows=5, eval_batch_size=2)
    dm.setup()
    assert len(dm.eval_dataset("test")) == 5 and len(dm.test_dataloader()) == 3


def test_unigram_perplexity(gutenberg, tmp_path):
    ppl = gutenberg.unigram_perplexity("validation")
    assert math.isfinite(ppl) and 100 < ppl < 5000
    assert math.isfinite(gutenberg.unigram_perplexity("test"))
    # exact value on a tiny corpus
    root = write_books(tmp_path / "corpus")
    dm = D.TokenDataModule("text_dir", str(tmp_path / "cache"), block_size=4, path=str(root))
    dm.prepare_data()
    train, val = dm._file("train").tokens, dm._file("validation").tokens
    counts = np.bincount(train, minlength=50257) + 1.0
    targets = val[1 : 1 + ((len(val) - 1) // 4) * 4]
    expected = math.exp(-np.log(counts[targets] / counts.sum()).mean())
    assert dm.unigram_perplexity() == pytest.approx(expected, rel=1e-9)
    assert dm.unigram_perplexity() > 1


def test_vocab_and_eot(gutenberg):
    assert gutenberg.vocab_size == 50257 and gutenberg.eot == EOT


# ----------------------------------------------------------------------------------------------------
# configs
# ----------------------------------------------------------------------------------------------------
def test_prepare_config_composes(tmp_path):
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    root = write_books(tmp_path / "corpus")
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("prepare", overrides=["data=text_dir", f"data.path={root}", f"paths.data_dir={tmp_path}/c"])
        dm = instantiate(cfg.data)
        assert dm.block_size == 1024 and dm.seed == 1337 and dm.cache_dir == tmp_path / "c"
        for name in ("gutenberg", "pg19"):
            data = compose("prepare", overrides=[f"data={name}"]).data
            assert data.source == name and data._target_ == "nats.data.datamodule.TokenDataModule"


# ----------------------------------------------------------------------------------------------------
# with a real Lightning Trainer: resuming mid-run from a checkpoint replays the same batches
# ----------------------------------------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore:.*LeafSpec", "ignore:Be aware that when using `ckpt_path`")
def test_lightning_resume_is_exact(tmp_path, gutenberg):
    import lightning as L

    class Recorder(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))
            self.seen: list[tuple[int, torch.Tensor]] = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            self.seen.append((self.global_step, x.clone()))
            return self.w.sum() * x.float().mean()

        def validation_step(self, batch, batch_idx):
            self.log("val", batch[0].float().mean())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    def fit(ckpt_path=None):
        dm = D.TokenDataModule("gutenberg", str(DATA_DIR), block_size=16, micro_batch_size=2)
        ckpt = L.pytorch.callbacks.ModelCheckpoint(tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
        trainer = L.Trainer(
            max_steps=6, accumulate_grad_batches=2, use_distributed_sampler=False, accelerator="cpu", logger=False,
            enable_progress_bar=False, enable_model_summary=False, val_check_interval=4, limit_val_batches=2,
            callbacks=[ckpt] if ckpt_path is None else [], enable_checkpointing=ckpt_path is None,
            default_root_dir=tmp_path,
        )  # fmt: skip
        module = Recorder()
        trainer.fit(module, datamodule=dm, ckpt_path=ckpt_path)
        return module.seen

    full = fit()
    assert [step for step, _ in full] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    (mid,) = (tmp_path / "ckpt").glob("*step=3.ckpt")
    resumed = fit(ckpt_path=str(mid))  # restarts mid-epoch at global_step 3
    assert [step for step, _ in resumed] == [3, 3, 4, 4, 5, 5]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(resumed, full[6:]))


def _batches_in_a_worker_process(num_workers: int):
    """Sum of a DataLoader's batches with `num_workers` workers, and the context chosen, inside a joblib job."""
    from nats.data.windows import worker_context

    ctx = worker_context(num_workers)
    dl = torch.utils.data.DataLoader(list(range(8)), batch_size=2, num_workers=num_workers, multiprocessing_context=ctx)
    return ctx, sum(int(b.sum()) for b in dl)


def test_dataloader_workers_start_inside_a_joblib_launcher_job():
    """Hydra's joblib launcher runs each job in a loky worker, whose start method ('loky') cannot start a
    DataLoader's worker processes ("'Process' object has no attribute 'env'"); the loaders then take the platform's
    own start method. Outside such a job nothing changes."""
    joblib = pytest.importorskip("joblib")
    from nats.data.windows import worker_context

    got = joblib.Parallel(n_jobs=2, backend="loky")(joblib.delayed(_batches_in_a_worker_process)(n) for n in (0, 1))
    assert got[0] == (None, 28)
    assert got[1][1] == 28 and got[1][0] in __import__("multiprocessing").get_all_start_methods()
    assert worker_context(2) is None and worker_context(0) is None


def test_every_loader_takes_the_shared_worker_options(monkeypatch):
    """The token, task and long-context datamodules build their loaders with `worker_options`: inside a joblib job
    (the process' start method is loky's) each of them starts its workers with the platform's own method."""
    import multiprocessing as mp

    from nats.data.datamodule import TokenDataModule
    from nats.data.tasks import Match2DataModule
    from nats.data.windows import worker_options
    from nats.finetune.datamodule import LongContextDataModule

    own = mp.get_all_start_methods()[0]
    monkeypatch.setattr(mp, "get_start_method", lambda allow_none=False: "loky")
    assert worker_options(2) == {"num_workers": 2, "persistent_workers": True, "multiprocessing_context": own}
    assert worker_options(0) == {"num_workers": 0, "persistent_workers": False, "multiprocessing_context": None}

    tasks = Match2DataModule(n_train=16, n_test=8, micro_batch_size=4, seed=0, num_workers=1)
    loaders = [tasks.train_dataloader(), tasks.val_dataloader()]
    for cls in (TokenDataModule, LongContextDataModule):  # their loader helper alone (no data needed)
        dm = cls.__new__(cls)
        dm.num_workers, dm.micro_batch_size = 1, 2
        args = (list(range(4)), None, 2) if cls is TokenDataModule else (list(range(4)), None)
        loaders.append(dm._loader(*args))
    for loader in loaders:
        ctx = loader.multiprocessing_context
        assert loader.num_workers == 1 and ctx is not None and ctx.get_start_method() == own, loader
