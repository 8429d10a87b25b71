"""nats.data.longctx: long-context examples (PG-19 continuation, passkey, needle-in-a-haystack, variable tracking),
deterministic, within the length limit, answers where they belong, and cached on disk. The tokenizer is GPT-2
(tiktoken, offline) through TiktokenAdapter: fast, and not the GGUF one."""

from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path

import pytest

from nats.data.longctx import tasks as D
from nats.data.tokenizer import get_tokenizer

REPO = Path(__file__).resolve().parents[1]
SYNTHETIC = ["passkey", "niah", "variable_tracking"]


@pytest.fixture(scope="module")
def tok():
    return D.TiktokenAdapter(get_tokenizer("gpt2"))


@pytest.fixture(scope="module")
def pg19(tmp_path_factory):
    """A PG-19-style copy: validation.tar.xz holding validation/<n>.txt books of a few thousand tokens each."""
    root = tmp_path_factory.mktemp("pg19")
    with tarfile.open(root / "validation.tar.xz", "w:xz") as tar:
        for b in range(3):
            lines = [f"Chapter {c}. Book {b} tells of the valley number {c * 7 + b}. It rained." for c in range(400)]
            raw = "\n".join(lines).encode()
            info = tarfile.TarInfo(f"validation/{1000 + b}.txt")
            info.size = len(raw)
            tar.addfile(info, io.BytesIO(raw))
    return root


def _text(tok, ids):
    return tok.decode(ids)


def test_synthetic_deterministic_and_within_length(tok):
    kw = dict(tasks=SYNTHETIC, num_examples=4, max_length=600, min_length=200, seed=3)
    a, b = D.build_examples(tok, **kw), D.build_examples(tok, **kw)
    assert [x.input_ids for x in a] == [x.input_ids for x in b] and len(a) == 12
    other = D.build_examples(tok, **{**kw, "seed": 4})
    assert [x.input_ids for x in a] != [x.input_ids for x in other]
    more = D.build_examples(tok, **{**kw, "num_examples": 5})  # more examples keep the first ones
    assert [x.input_ids for x in more if x.meta["index"] < 4] == [x.input_ids for x in a]
    for ex in a:
        assert ex.task in SYNTHETIC and ex.answer_ids and ex.prompt_ids
        assert len(ex) <= ex.meta["length"] <= 600 and ex.meta["length"] >= 200
        assert len(ex) >= ex.meta["length"] - 12, "the prompt fills its budget to within a filler sentence"
        assert ex.input_ids == ex.prompt_ids + ex.answer_ids


def test_answers_are_where_they_belong(tok):
    for ex in D.build_examples(tok, tasks=SYNTHETIC, num_examples=3, max_length=500, seed=1):
        prompt, answer = _text(tok, ex.prompt_ids), _text(tok, ex.answer_ids)
        if ex.task == "passkey":
            key = ex.meta["passkey"]
            assert answer == f" {key}" and prompt.count(f"The pass key is {key}.") == 1
            assert prompt.endswith("The pass key is")
            pos = prompt.index(key) / len(prompt)
            assert abs(pos - ex.meta["depth"]) < 0.25  # hidden at about its depth
        elif ex.task == "niah":
            assert answer == " " + ex.meta["value"]
            assert f"special magic numbers for {ex.meta['key']} is: {ex.meta['value']}." in prompt
            assert prompt.count("One of the special magic numbers for") == ex.meta["needles"] == 4
        else:
            names = ex.meta["variables"]
            assert answer == " " + " ".join(names)
            assert f"VAR {names[0]} = {ex.meta['value']}." in prompt
            positions = [prompt.index(f"VAR {b} = VAR {a}.") for a, b in zip(names, names[1:])]
            assert positions == sorted(positions) and prompt.index(f"VAR {names[0]} =") < positions[0]


def test_pg19_continuation_and_haystack(tok, pg19):
    exs = D.build_examples(
        tok,
        tasks=["pg19_continuation", "niah"],
        num_examples=3,
        max_length=700,
        pg19_path=pg19,
        split="validation",
        answer_tokens=16,
        seed=0,
    )
    books = {f"{1000 + b}.txt": _book(pg19, b) for b in range(3)}
    for ex in exs:
        assert len(ex) <= 700
        if ex.task == "pg19_continuation":
            assert len(ex.answer_ids) == 16 and len(ex) == ex.meta["length"]
            text = _text(tok, ex.input_ids)  # the answer is the text that follows the prompt in the book
            assert text in books[ex.meta["book"]]
            assert ex.meta["char_offset"] == 0 or books[ex.meta["book"]][ex.meta["char_offset"] - 1] == "\n"
        else:
            assert ex.meta["haystack"] in books and "valley number" in _text(tok, ex.prompt_ids)


def _book(root, b):
    with tarfile.open(root / "validation.tar.xz") as tar:
        return tar.extractfile(f"validation/{1000 + b}.txt").read().decode()


def test_cache_is_written_keyed_and_reused(tok, tmp_path, monkeypatch):
    kw = dict(tasks=["passkey"], num_examples=2, max_length=300, seed=0)
    first, path = D.load_or_build_examples(tok, cache_dir=tmp_path, **kw)
    assert path.parent == tmp_path and path.suffix == ".jsonl"
    header = json.loads(path.read_text().splitlines()[0])
    assert header["count"] == 2 and header["settings"]["max_length"] == 300

    def boom(*a, **k):
        raise AssertionError("the cache should have been read")

    monkeypatch.setattr(D, "build_examples", boom)
    again, path2 = D.load_or_build_examples(tok, cache_dir=tmp_path, **kw)
    assert path2 == path and [e.input_ids for e in again] == [e.input_ids for e in first]
    assert again[0].task == "passkey" and again[0].meta == first[0].meta
    monkeypatch.undo()
    _, path3 = D.load_or_build_examples(tok, cache_dir=tmp_path, **{**kw, "seed": 1})
    assert path3 != path  # another setting, another file
    with pytest.raises(TypeError, match="unknown setting"):
        D.load_or_build_examples(tok, cache_dir=tmp_path, max_len=3)


def test_cached_examples_need_no_pg19_copy(tok, pg19, tmp_path):
    import shutil

    copy = tmp_path / "pg19"
    shutil.copytree(pg19, copy)
    kw = dict(tasks=["pg19_continuation"], num_examples=2, max_length=300, seed=0, pg19_path=copy, split="validation")
    first, path = D.load_or_build_examples(tok, cache_dir=tmp_path / "cache", **kw)
    shutil.rmtree(copy)  # e.g. the cache copied to a machine without the books
    again, path2 = D.load_or_build_examples(tok, cache_dir=tmp_path / "cache", **kw)
    assert path2 == path and [e.input_ids for e in again] == [e.input_ids for e in first]
    with pytest.raises(FileNotFoundError, match="data.pg19_path=.* does not exist"):
        D.load_or_build_examples(tok, cache_dir=tmp_path / "cache", **{**kw, "seed": 1})


def test_errors(tok):
    with pytest.raises(ValueError, match="unknown task"):
        D.build_examples(tok, tasks=["passkeys"])
    with pytest.raises(ValueError, match="needs PG-19 books: set data.pg19_path"):
        D.build_examples(tok, tasks=["pg19_continuation"], num_examples=1, max_length=200)
    with pytest.raises(ValueError, match="min_length"):
        D.build_examples(tok, max_length=100, min_length=200)
    with pytest.raises(ValueError, match="fixed text alone"):
        D.build_examples(tok, tasks=["variable_tracking"], num_examples=1, max_length=40)


def test_sentence_splitter_and_fingerprint(tok):
    assert D.split_sentences('He came.  "Yes!" she said. Mr. x went on? 3 more.') == [
        "He came.",
        '"Yes!" she said.',
        "Mr. x went on?",
        "3 more.",
    ]
    assert D.tokenizer_fingerprint(tok) == D.tokenizer_fingerprint(D.TiktokenAdapter(get_tokenizer("gpt2")))


def test_real_pg19_subset_if_present(tok, monkeypatch):
    """The PG-19 subset where the configs look for it (conf/eval_hf.yaml's data.pg19_path: $NATS_PG19_SUBSET, else
    beside the project root), if it is there."""
    from nats.cli import compose

    monkeypatch.setenv("PROJECT_ROOT", os.environ.get("PROJECT_ROOT", str(REPO)))
    path = Path(compose([], "eval_hf").data.pg19_path)
    if not path.is_dir():
        pytest.skip(f"no PG-19 subset at {path} (set NATS_PG19_SUBSET)")
    exs = D.build_examples(
        tok,
        tasks=["pg19_continuation"],
        num_examples=2,
        max_length=1024,
        pg19_path=path,
        split="validation",
        max_books=2,
    )
    assert all(len(e) <= 1024 and len(e.answer_ids) == 64 for e in exs)
