"""Split archives (``<split>.tar.xz`` read unextracted), the PG-19 subset config, and training from a token cache
alone (the raw data absent, as on a GPU node that received only ``data/<cache>/``).

Everything runs on tiny synthetic corpora under tmp_path (CPU, seconds), one of them in the PG-19 subset's own format;
the same checks run on the real subset too where this machine has it (``../shared/data/pg19-subset``), and the one
that tokenises a split is marked ``slow``.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import os
import random
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO, compose
from helpers import interrupt_text_dir_prepare
from nats.data import datamodule as D
from nats.data import sources as S
from nats.data import token_cache as TC
from nats.data import token_file as TF
from nats.data.sources import text_dir as TD

BOOKS = {
    "train": {
        "b_second.txt": "The second book.\r\nIt has two lines.",
        "a_first.txt": "First book, Café.",
        "a-b/c.txt": "In a folder whose name sorts before 'a/' as a string, after it by path. " * 3,
        "a/z.txt": "A nested book. " * 5,
        "10.txt": "Ebook ten. " * 4,
        "9.txt": "Ebook nine. " * 4,
    },
    "validation": {"v.txt": "A validation book " * 40, "w.txt": "Another validation book " * 30},
    "test": {"sub/t.txt": "A test book " * 40},
}
SUBSET = Path(os.environ.get("NATS_PG19_SUBSET", REPO.parent / "shared" / "data" / "pg19-subset"))


def write_folder(root: Path, books: dict = BOOKS) -> Path:
    for split, files in books.items():
        for name, text in files.items():
            (root / split / name).parent.mkdir(parents=True, exist_ok=True)
            (root / split / name).write_bytes(text.encode())
    return root


def write_archives(
    root: Path, books: dict = BOOKS, suffix: str = ".tar.xz", prefix: str = "{split}/", seed: int = 0, junk: bool = True
) -> Path:
    """One archive per split, members in a shuffled (not sorted) order, plus a directory entry and a non-.txt
    file that must be skipped."""
    mode = {".tar.xz": "w:xz", ".txz": "w:xz", ".tar.gz": "w:gz", ".tgz": "w:gz", ".tar.bz2": "w:bz2", ".tar": "w"}
    root.mkdir(parents=True, exist_ok=True)
    for split, files in books.items():
        items = list(files.items())
        random.Random(seed).shuffle(items)
        with tarfile.open(root / f"{split}{suffix}", mode[suffix]) as tar:
            first = prefix.format(split=split)
            if junk:  # a directory entry and a file that is not a book, both skipped
                folder = tarfile.TarInfo(first.rstrip("/") or ".")
                folder.type = tarfile.DIRTYPE
                tar.addfile(folder)
                items.insert(1, ("README.md", "not a book"))
            for name, text in items:
                data = text.encode()
                info = tarfile.TarInfo(first + name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return root


def docs(source: S.TextSource) -> dict[str, list[tuple[str, str]]]:
    return {split: [(d.name, d.text) for d in source.documents(split)] for split in S.SPLITS}


def tokens(dm: D.TokenDataModule) -> dict[str, np.ndarray]:
    return {split: np.array(dm._file(split).tokens) for split in S.SPLITS}


# ----------------------------------------------------------------------------------------------------
# reading archives
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("suffix,prefix", [(".tar.xz", "{split}/"), (".tar.gz", "{split}/"), (".tar", "./{split}/"),
                                           (".tgz", ""), (".tar.bz2", "")])  # fmt: skip
def test_archive_documents_equal_the_folders(tmp_path, suffix, prefix):
    folder = S.get_source("pg19", tmp_path, path=write_folder(tmp_path / "folder" / "corpus"))
    archive = S.get_source("pg19", tmp_path, path=write_archives(tmp_path / "archive" / "corpus", suffix=suffix,
                                                                 prefix=prefix))  # fmt: skip
    expected = docs(folder)
    assert [n for n, _ in expected["train"]] == ["10.txt", "9.txt", "a/z.txt", "a-b/c.txt", "a_first.txt",
                                                 "b_second.txt"]  # fmt: skip
    assert docs(archive) == expected  # names, texts (CRLF normalised) and the sorted order
    assert archive.fingerprint() == folder.fingerprint()  # same books -> same content key, wherever they lie
    assert archive.cache_key() == folder.cache_key()  # same basename "corpus"
    assert [archive.num_documents(s) for s in S.SPLITS] == [6, 2, 1]
    assert archive.locate("train").name == f"train{suffix}"


def test_archive_and_folder_give_the_same_tokens(tmp_path):
    a = D.TokenDataModule("text_dir", str(tmp_path / "c1"), block_size=4, path=str(write_folder(tmp_path / "f")))
    b = D.TokenDataModule("text_dir", str(tmp_path / "c2"), block_size=4, path=str(write_archives(tmp_path / "a")))
    for dm in (a, b):
        dm.prepare_data()
        dm.setup()
    ta, tb = tokens(a), tokens(b)
    assert all(np.array_equal(ta[s], tb[s]) for s in S.SPLITS)
    meta = json.loads((b.cache_path / "meta.json").read_text())
    assert meta["documents"]["validation"] == ["v.txt", "w.txt"] and meta["options"] == {"path": str(tmp_path / "a")}


def test_fingerprint_is_stable_and_follows_the_listing(tmp_path):
    root = write_archives(tmp_path / "corpus", suffix=".tar.gz")
    fp = S.get_source("text_dir", tmp_path, path=root).fingerprint()
    # rewritten with another member order, compression and mtime: the same books, the same fingerprint
    shutil.rmtree(root)
    write_archives(root, suffix=".tar.xz", seed=5)
    os.utime(root / "train.tar.xz", (1, 1))
    assert S.get_source("text_dir", tmp_path, path=root).fingerprint() == fp
    # a book more (or a changed size) changes it
    books = {**BOOKS, "test": {**BOOKS["test"], "u.txt": "one more"}}
    write_archives(root, books, suffix=".tar.xz")
    assert S.get_source("text_dir", tmp_path, path=root).fingerprint() != fp


@pytest.mark.parametrize("budget", [0, 60, 10**9])
def test_sorted_order_with_a_bounded_buffer(tmp_path, monkeypatch, budget):
    """Members stored out of order: held in memory up to the budget, otherwise read in further passes; the
    documents are the same sorted sequence either way."""
    root = write_archives(tmp_path / "corpus", seed=3)
    expected = docs(S.get_source("text_dir", tmp_path, path=write_folder(tmp_path / "folder")))
    passes = []
    real = TD._archive_books

    def counting(archive, split):
        passes.append(split)
        return real(archive, split)

    monkeypatch.setattr(TD, "ARCHIVE_BUFFER_BYTES", budget)
    monkeypatch.setattr(TD, "_archive_books", counting)
    src = S.get_source("text_dir", tmp_path, path=root)
    src.prepare()  # the index: one pass per split
    assert passes == list(S.SPLITS)
    passes.clear()
    got = [(d.name, d.text) for d in src.documents("train")]
    assert got == expected["train"]
    assert (len(passes) == 1) if budget == 10**9 else (1 < len(passes) <= len(got))


def test_folder_wins_over_archive(tmp_path):
    root = write_archives(tmp_path / "corpus")
    (root / "train").mkdir()
    (root / "train" / "only.txt").write_text("the folder's book")
    src = S.get_source("pg19", tmp_path, path=root)
    assert src.locate("train") == root / "train" and src.locate("validation") == root / "validation.tar.xz"
    assert docs(src)["train"] == [("only.txt", "the folder's book")]
    assert [n for n, _ in docs(src)["validation"]] == ["v.txt", "w.txt"]


def test_archive_errors(tmp_path):
    root = write_archives(tmp_path / "corpus", {"train": BOOKS["train"], "validation": BOOKS["validation"]})
    with pytest.raises(FileNotFoundError) as err:
        D.TokenDataModule("pg19", str(tmp_path / "cache"), path=str(root)).prepare_data()
    message = str(err.value)
    for part in (f"{root / 'test'} does not exist", "test.tar.xz", "test.tar.gz", "test.tar", "<split>.tar.xz"):
        assert part in message, message
    assert not list((tmp_path / "cache").glob("*/*.bin"))  # failed before tokenising anything
    # two archives for one split
    shutil.copy(root / "train.tar.xz", root / "test.tar.xz")
    shutil.copy(root / "train.tar.xz", root / "test.tar.gz")
    with pytest.raises(ValueError, match=r"several archives \['test.tar.xz', 'test.tar.gz'\]"):
        S.get_source("text_dir", tmp_path, path=root).prepare()
    (root / "test.tar.gz").unlink()
    # an archive holding another split's books (here: train's archive copied as test)
    with pytest.raises(ValueError, match=r"test.tar.xz holds 'train/.*a book of split 'train'"):
        S.get_source("text_dir", tmp_path, path=root).prepare()
    # a truncated archive
    data = (write_archives(tmp_path / "good", {"test": BOOKS["test"]}) / "test.tar.xz").read_bytes()
    (root / "test.tar.xz").write_bytes(data[: len(data) // 2])
    with pytest.raises(S.SourceUnavailableError, match=r"could not read the archive .*test.tar.xz.*truncated"):
        S.get_source("text_dir", tmp_path, path=root).prepare()
    # an archive without books
    with tarfile.open(root / "test.tar.xz", "w:xz"):
        pass
    with pytest.raises(ValueError, match=r"archive .*test.tar.xz holds no .txt members"):
        S.get_source("text_dir", tmp_path, path=root).prepare()


# ----------------------------------------------------------------------------------------------------
# training from a token cache alone
# ----------------------------------------------------------------------------------------------------
def make(root: Path, cache_dir: Path, **kw) -> D.TokenDataModule:
    return D.TokenDataModule("pg19", str(cache_dir), block_size=8, micro_batch_size=2, path=str(root),
                             cache_name="pg19-subset", **kw)  # fmt: skip


def test_cache_alone_trains_without_the_raw_data(tmp_path, caplog):
    root = write_archives(tmp_path / "raw" / "pg19-subset")
    dm = make(root, tmp_path / "data")
    dm.prepare_data()
    dm.setup()
    expected = tokens(dm)
    assert dm.cache_path.parent == tmp_path / "data" and dm.cache_path.name.startswith("pg19-subset-")
    # "the GPU node": only the cache folder, copied into another data folder; the raw path does not exist there
    node = tmp_path / "node" / "data"
    shutil.copytree(dm.cache_path, node / dm.cache_path.name)
    shutil.rmtree(tmp_path / "raw")
    again = make(root, node)
    with caplog.at_level(logging.INFO, logger="nats.data.token_cache"):
        again.prepare_data()
    assert f"using the token cache {node / dm.cache_path.name}" in caplog.text and "not present here" in caplog.text
    again.setup()
    assert again.cache_path == node / dm.cache_path.name
    assert all(np.array_equal(tokens(again)[s], expected[s]) for s in S.SPLITS)
    x, y = next(iter(again.train_dataloader()))
    assert x.shape == y.shape == (2, 8)
    # an explicit cache_path works from anywhere, even with no data.path at all
    copied = str(node / dm.cache_path.name)
    explicit = D.TokenDataModule("pg19", str(tmp_path / "empty"), block_size=8, cache_path=copied)
    explicit.prepare_data()
    explicit.setup()
    assert all(np.array_equal(tokens(explicit)[s], expected[s]) for s in S.SPLITS)
    assert not (tmp_path / "empty").exists()  # nothing written


def test_no_raw_data_and_no_cache(tmp_path):
    root = write_archives(tmp_path / "raw" / "pg19-subset")
    dm = make(root, tmp_path / "data")
    dm.prepare_data()
    shutil.rmtree(tmp_path / "raw")
    # another basename: its cache is not there; the error names the data, the expected folder and the one found
    other = D.TokenDataModule("pg19", str(tmp_path / "data"), path=str(tmp_path / "raw" / "pg19-other"))
    with pytest.raises(FileNotFoundError) as err:
        other.prepare_data()
    message = str(err.value)
    assert "pg19-other does not exist" in message and f"No complete token cache {other.cache_path}" in message
    assert "data.cache_path=" in message and str(dm.cache_path) in message and "pg19-subset" in message
    with pytest.raises(FileNotFoundError, match=r"data.cache_path=.*is not a complete token cache.*meta.json"):
        D.TokenDataModule("pg19", str(tmp_path), cache_path=str(tmp_path / "nowhere")).prepare_data()


def test_cache_checked_against_the_raw_data(tmp_path):
    root = write_archives(tmp_path / "pg19-subset")
    dm = make(root, tmp_path / "data")
    dm.prepare_data()
    mtimes = [p.stat().st_mtime_ns for p in dm.cache_path.iterdir()]
    make(root, tmp_path / "data").prepare_data()  # the same data: reused as it is
    assert [p.stat().st_mtime_ns for p in dm.cache_path.iterdir()] == mtimes
    # the same books extracted into folders: same fingerprint, the cache still matches
    shutil.rmtree(root)
    write_folder(root)
    make(root, tmp_path / "data").prepare_data()
    # a book more: the key (folder name) is the same, the content is not -> a clear error, nothing rewritten
    (root / "train" / "new.txt").write_text("a new book")
    mismatch = rf"{dm.cache_path} was tokenised from other data.*Delete {dm.cache_path} and rerun `nats-prepare`"
    with pytest.raises(TF.TokenCacheError, match=mismatch):
        make(root, tmp_path / "data").prepare_data()
    with pytest.raises(TF.TokenCacheError, match="tokenised from other data"):  # via cache_path too
        D.TokenDataModule("pg19", str(tmp_path), path=str(root), cache_path=str(dm.cache_path)).prepare_data()
    assert [p.stat().st_mtime_ns for p in dm.cache_path.iterdir()] == mtimes
    # deleting the cache and preparing again (the fix the message gives) works
    shutil.rmtree(dm.cache_path)
    make(root, tmp_path / "data").prepare_data()
    assert "new.txt" in json.loads((dm.cache_path / "meta.json").read_text())["documents"]["train"]
    # a cache of another source
    with pytest.raises(TF.TokenCacheError, match="cache of source 'pg19'.*reads source 'text_dir'"):
        D.TokenDataModule("text_dir", str(tmp_path), cache_path=str(dm.cache_path)).prepare_data()


def test_interrupted_prepare_of_changed_data_starts_over(tmp_path, monkeypatch):
    root = write_folder(tmp_path / "corpus")
    real = interrupt_text_dir_prepare(monkeypatch, "test")
    dm = D.TokenDataModule("text_dir", str(tmp_path / "cache"), block_size=4, path=str(root))
    with pytest.raises(KeyboardInterrupt):
        dm.prepare_data()
    monkeypatch.setattr(S.TextDirSource, "documents", real)
    (root / "train" / "a_first.txt").write_text("Edited: another length.")
    dm = D.TokenDataModule("text_dir", str(tmp_path / "cache"), block_size=4, path=str(root))
    dm.prepare_data()
    fresh = D.TokenDataModule("text_dir", str(tmp_path / "fresh"), block_size=4, path=str(root))
    fresh.prepare_data()
    assert all(np.array_equal(tokens(dm)[s], tokens(fresh)[s]) for s in S.SPLITS)
    assert not (dm.cache_path / ".partial.json").exists()


# ----------------------------------------------------------------------------------------------------
# configs
# ----------------------------------------------------------------------------------------------------
def test_pg19_subset_config(tmp_path, monkeypatch):
    monkeypatch.delenv("NATS_PG19_SUBSET", raising=False)
    cfg = compose(["data=pg19_subset"], tmp_path, "prepare")
    assert cfg.data.source == "pg19" and cfg.data.cache_name == "pg19-subset" and cfg.data.hf_name is None
    assert Path(cfg.data.path).resolve() == (Path(cfg.paths.root_dir) / ".." / "shared/data/pg19-subset").resolve()
    monkeypatch.setenv("NATS_PG19_SUBSET", str(tmp_path / "elsewhere"))
    assert compose(["data=pg19_subset"], tmp_path, "prepare").data.path == str(tmp_path / "elsewhere")
    for name in ("gutenberg", "pg19", "text_dir", "pg19_subset"):  # data.cache_path=... needs no '+'
        assert compose([f"data={name}", "data.cache_path=/x"], tmp_path, "prepare").data.cache_path == "/x"


def test_train_from_the_cache_alone_through_the_configs(tmp_path, monkeypatch):
    """nats-train data=pg19_subset on a machine that has only the cache folder: one fast_dev_run step."""
    from nats.train import build

    raw = write_archives(tmp_path / "shared" / "pg19-subset", {s: {k: v * 20 for k, v in b.items()}
                                                               for s, b in BOOKS.items()})  # fmt: skip
    monkeypatch.setenv("NATS_PG19_SUBSET", str(raw))
    over = ["data=pg19_subset", "trainer=debug", "model.block_size=32", "data.micro_batch_size=2",
            "global_batch_size=2", "data.num_workers=0", "data.max_eval_windows=2"]  # fmt: skip
    cfg = compose(over + [f"paths.data_dir={tmp_path}/data"], tmp_path / "run1")
    datamodule, module, trainer = build(cfg)
    datamodule.prepare_data()
    shutil.copytree(datamodule.cache_path, tmp_path / "node" / datamodule.cache_path.name)
    shutil.rmtree(raw)
    cfg = compose(over + [f"paths.data_dir={tmp_path}/node"], tmp_path / "run2")
    datamodule, module, trainer = build(cfg)
    trainer.fit(module, datamodule=datamodule)
    assert trainer.global_step == 1 and datamodule.cache_path.parent == tmp_path / "node"


# ----------------------------------------------------------------------------------------------------
# the PG-19 subset's format: a made subset, and the real one where this machine has it
# ----------------------------------------------------------------------------------------------------
REAL = (SUBSET / "validation.tar.xz").is_file()


def made_subset(root: Path) -> Path:
    """A small corpus in the PG-19 subset's format (books.csv: id, split, bytes, year, title; one .tar.xz per split
    holding ``<split>/<id>.txt``), with ids whose names sort as strings, not numbers ("126" < "513" < "93")."""
    ids = {"train": [10, 201, 7], "validation": [126, 513, 848, 93], "test": [293, 41]}
    books = {split: {f"{i}.txt": f"Book {i} of the {split} split. " * (20 + i % 17) for i in bookids}
             for split, bookids in ids.items()}  # fmt: skip
    write_archives(root, books, prefix="{split}/", junk=False)
    with open(root / "books.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["id", "split", "bytes", "year", "title"])
        for split, files in books.items():
            for name, text in files.items():
                w.writerow([name[:-4], split, len(text.encode()), 1900, f"Book {name[:-4]}"])
    return root


@pytest.fixture(params=["made", "real"] if REAL else ["made"])
def subset(request, tmp_path) -> Path:
    """The PG-19 subset's format: a made one always, the real subset too where it is on this machine
    (``../shared/data/pg19-subset`` or NATS_PG19_SUBSET)."""
    return SUBSET if request.param == "real" else made_subset(tmp_path / "pg19-subset")


def test_subset_listing_matches_books_csv(subset):
    with open(subset / "books.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["split"] == "validation"]
    src = S.get_source("pg19", REPO / "data", path=subset)
    entries = src.entries("validation")
    assert len(entries) == len(rows) == (50 if subset == SUBSET else 4)
    assert {e.name: e.size for e in entries} == {f"{r['id']}.txt": int(r["bytes"]) for r in rows}
    assert [e.name for e in entries] == sorted(e.name for e in entries)  # "1xx.txt" < "5xx.txt" < "9x.txt"


@pytest.mark.slow
def test_subset_validation_tokens(subset, tmp_path):
    """Tokenise the validation split (the real one: ~3.9M tokens, ~5 s on 2 cores): every book, in the listing's
    order; compared with the prepared cache in data/ when there is one."""
    src = S.get_source("pg19", tmp_path, path=subset)
    names: list[str] = []
    n = TF.write_token_bin(tmp_path / "validation.bin",
                          TC._tokenize(src.documents("validation"), "gpt2", names, TC.tqdm(disable=True)))  # fmt: skip
    assert names == [e.name for e in src.entries("validation")]
    assert 3_000_000 < n < 5_000_000 if subset == SUBSET else n > 4 * 20
    cache = TC.cache_folder(REPO / "data", src, "gpt2", "pg19-subset")
    if subset == SUBSET and TC.is_complete_cache(cache):
        made, cached = TF.open_token_bin(tmp_path / "validation.bin"), TF.open_token_bin(cache / "validation.bin")
        assert np.array_equal(made, cached)
        assert json.loads((cache / "meta.json").read_text())["documents"]["validation"] == names
