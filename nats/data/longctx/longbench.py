"""LongBench (v1, English datasets) from files the user supplies: prompts and scoring as LongBench's.

LongBench (Bai et al., 2023; THUDM/LongBench) is on the Hugging Face hub only, so the user brings its files: the
folder of ``<dataset>.jsonl`` (``<dataset>_e.jsonl`` for LongBench-E) from the hub dataset ``THUDM/LongBench``
(``data.zip``; docs/hf_eval.md). Each line holds ``input``, ``context``, ``answers`` (a list), ``length``,
``dataset``, ``language``, ``all_classes`` and ``_id``.

Written from LongBench's repository (no network here; checked against copies of its files): the prompt templates
(``config/dataset2prompt.json``, typos such as "asconcisely" kept), the generation lengths
(``config/dataset2maxlen.json``), the metric of each dataset (``eval.py``'s ``dataset2metric``) and the metrics
(``metrics.py``), with two substitutes for its dependencies, which behave the same (see the functions):

* ``rouge_score``: the ``rouge`` package's (1.0.1) ROUGE-L F, re-implemented: summary-level union LCS over the
  sentences split at ``.``, counted as sets of distinct words (that package's default ``exclusive=True``);
* ``code_sim_score``: ``fuzzywuzzy.fuzz.ratio``, which without ``python-Levenshtein`` (not in LongBench's
  requirements) is ``round(100 * difflib.SequenceMatcher(None, a, b).ratio())``.

As LongBench's ``pred.py``: a prompt longer than its budget (``max_length`` minus the dataset's generation length)
keeps its first and last halves (the instructions sit at both ends); then, for chat models, it is wrapped in the
tokenizer's chat template except for the few-shot and code datasets (trec, triviaqa, samsum, lsht, lcc,
repobench-p). As its ``eval.py``: an answer's score is the best over the reference answers, and for trec, triviaqa,
samsum and lsht only the first line of the answer is scored.
"""

from __future__ import annotations

import hashlib
import json
import re
import string
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict
from difflib import SequenceMatcher
from pathlib import Path
from typing import Any

from nats.data.longctx.examples import LongContextExample, encode_fn

__all__ = [
    "DATASETS",
    "PROMPTS",
    "MAX_NEW",
    "METRIC",
    "load_longbench",
    "middle_truncate",
    "score_longbench",
    "fingerprint",
]

_QA = "Answer the question based on the given passages. Only give me the answer and do not output any other words."
_MHQA = f"{_QA}\n\nThe following are given passages.\n{{context}}\n\n{_QA}\n\nQuestion: {{input}}\nAnswer:"
#: LongBench's config/dataset2prompt.json (English datasets)
PROMPTS: dict[str, str] = {
    "narrativeqa": "You are given a story, which can be either a novel or a movie script, and a question. Answer the "
    "question asconcisely as you can, using a single phrase if possible. Do not provide any explanation.\n\n"
    "Story: {context}\n\nNow, answer the question based on the story asconcisely as you can, using a single phrase "
    "if possible. Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:",
    "qasper": "You are given a scientific article and a question. Answer the question as concisely as you can, using "
    "a single phrase or sentence if possible. If the question cannot be answered based on the information in the "
    'article, write "unanswerable". If the question is a yes/no question, answer "yes", "no", or "unanswerable". '
    "Do not provide any explanation.\n\nArticle: {context}\n\n Answer the question based on the above article as "
    "concisely as you can, using a single phrase or sentence if possible. If the question cannot be answered based "
    'on the information in the article, write "unanswerable". If the question is a yes/no question, answer "yes", '
    '"no", or "unanswerable". Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:',
    "multifieldqa_en": "Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following "
    "question based on the above text, only give me the answer and do not output any other words.\n\n"
    "Question: {input}\nAnswer:",
    "hotpotqa": _MHQA,
    "2wikimqa": _MHQA,
    "musique": _MHQA,
    "gov_report": "You are given a report by a government agency. Write a one-page summary of the report.\n\n"
    "Report:\n{context}\n\nNow, write a one-page summary of the report.\n\nSummary:",
    "qmsum": "You are given a meeting transcript and a query containing a question or instruction. Answer the query "
    "in one or more sentences.\n\nTranscript:\n{context}\n\nNow, answer the query based on the above meeting "
    "transcript in one or more sentences.\n\nQuery: {input}\nAnswer:",
    "multi_news": "You are given several news passages. Write a one-page summary of all news. \n\nNews:\n{context}"
    "\n\nNow, write a one-page summary of all the news.\n\nSummary:",
    "trec": "Please determine the type of the question below. Here are some examples of questions.\n\n"
    "{context}\n{input}",
    "triviaqa": "Answer the question based on the given passage. Only give me the answer and do not output any "
    "other words. The following are some examples.\n\n{context}\n\n{input}",
    "samsum": "Summarize the dialogue into a few short sentences. The following are some examples.\n\n"
    "{context}\n\n{input}",
    "passage_count": "There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. Please "
    "carefully read these paragraphs and determine how many unique paragraphs there are after removing duplicates. "
    "In other words, how many non-repeating paragraphs are there in total?\n\n{context}\n\nPlease enter the final "
    "count of unique paragraphs after removing duplicates. The output format should only contain the number, such "
    "as 1, 2, 3, and so on.\n\nThe final answer is: ",
    "passage_retrieval_en": "Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine which "
    "paragraph the abstract is from.\n\n{context}\n\nThe following is an abstract.\n\n{input}\n\nPlease enter the "
    'number of the paragraph that the abstract is from. The answer format must be like "Paragraph 1", "Paragraph '
    '2", etc.\n\nThe answer is: ',
    "lcc": "Please complete the code given below. \n{context}Next line of code:\n",
    "repobench-p": "Please complete the code given below. \n{context}{input}Next line of code:\n",
}
DATASETS: tuple[str, ...] = tuple(PROMPTS)
#: LongBench's config/dataset2maxlen.json: new tokens generated per dataset
MAX_NEW: dict[str, int] = {
    "narrativeqa": 128,
    "qasper": 128,
    "multifieldqa_en": 64,
    "hotpotqa": 32,
    "2wikimqa": 32,
    "musique": 32,
    "gov_report": 512,
    "qmsum": 512,
    "multi_news": 512,
    "trec": 64,
    "triviaqa": 32,
    "samsum": 128,
    "passage_count": 32,
    "passage_retrieval_en": 32,
    "lcc": 64,
    "repobench-p": 64,
}
#: LongBench's eval.py dataset2metric (English datasets)
METRIC: dict[str, str] = {
    **dict.fromkeys(["narrativeqa", "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "musique"], "qa_f1_score"),
    **dict.fromkeys(["gov_report", "qmsum", "multi_news", "samsum"], "rouge_score"),
    "triviaqa": "qa_f1_score",
    "trec": "classification_score",
    "passage_count": "count_score",
    "passage_retrieval_en": "retrieval_score",
    "lcc": "code_sim_score",
    "repobench-p": "code_sim_score",
}
#: pred.py: "chat models are better off without build prompts on these tasks"
NO_CHAT = frozenset({"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"})
#: eval.py: only the first line of the prediction is scored
FIRST_LINE = frozenset({"trec", "triviaqa", "samsum", "lsht"})
GET_LONGBENCH = (
    "LongBench's data is on the Hugging Face hub only: `huggingface-cli download THUDM/LongBench --repo-type dataset "
    "--local-dir <dir>` and unzip <dir>/data.zip (docs/hf_eval.md), then pass longbench.path=<dir>/data, the folder "
    "of its <dataset>.jsonl files (hotpotqa.jsonl, ...; <dataset>_e.jsonl for LongBench-E)"
)
_FIELDS = ("input", "context", "answers")


# ----------------------------------------------------------------------------------------------------------------
# the examples
# ----------------------------------------------------------------------------------------------------------------
def _base(dataset: str) -> str:
    """The LongBench dataset of a file name: ``hotpotqa_e`` (LongBench-E) -> ``hotpotqa``."""
    return dataset.removesuffix("_e")


def _file(path: Path, dataset: str) -> Path:
    if _base(dataset) not in PROMPTS:
        raise ValueError(
            f"unknown LongBench dataset {dataset!r}; the English ones are supported: {', '.join(DATASETS)} "
            "(and their LongBench-E variants <name>_e)"
        )
    for candidate in (path / f"{dataset}.jsonl", path / "data" / f"{dataset}.jsonl"):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"longbench.path={path} has no {dataset}.jsonl (nor data/{dataset}.jsonl). {GET_LONGBENCH}")


def middle_truncate(ids: Sequence[int], budget: int) -> list[int]:
    """`ids` if they fit `budget` tokens, else the first ``budget // 2`` and the last ``budget - budget // 2`` of
    them (LongBench keeps ``budget // 2`` of each end, one token fewer when the budget is odd)."""
    if len(ids) <= budget:
        return list(ids)
    head = budget // 2
    return list(ids[:head]) + list(ids[len(ids) - (budget - head) :])


def _chat_ids(tokenizer: Any, text: str, ids: list[int], budget: int) -> list[int]:
    """The prompt (`text`, tokenized as `ids`) as the user's message of the tokenizer's chat template, the
    assistant's turn opened, within `budget` tokens: a prompt that does not fit is middle-truncated and its two
    halves decoded (as LongBench does), by the template's overhead more where needed."""
    encode, size = encode_fn(tokenizer), budget
    while size > 0:
        if len(ids) > size:
            head = size // 2
            text = tokenizer.decode(ids[:head], skip_special_tokens=True) + tokenizer.decode(
                ids[len(ids) - (size - head) :], skip_special_tokens=True
            )
        messages = [{"role": "user", "content": text}]
        out = encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
        if len(out) <= budget:
            return out
        size = min(size, len(ids)) - (len(out) - budget)
    raise ValueError(f"the chat template alone does not fit a {budget}-token LongBench prompt: raise max_length")


def _use_chat(tokenizer: Any, chat_template: bool | str) -> bool:
    if chat_template == "auto":
        return bool(getattr(tokenizer, "chat_template", None))
    if chat_template and not getattr(tokenizer, "chat_template", None):
        raise ValueError("longbench chat_template=true but the tokenizer has no chat template: use false or auto")
    return bool(chat_template)


def load_longbench(
    path: str | Path,
    datasets: Sequence[str],
    tokenizer: Any,
    max_length: int,
    num_examples: int | None = None,
    chat_template: bool | str = "auto",
) -> list[LongContextExample]:
    """The first `num_examples` (None: all) examples of each LongBench dataset in `datasets`, read from
    ``<path>/<dataset>.jsonl`` (or ``<path>/data/...``), as :class:`LongContextExample` s of task
    ``longbench/<dataset>``.

    The prompt is the dataset's template filled with the line's ``context`` and ``input``, tokenized without special
    tokens and middle-truncated to ``max_length - MAX_NEW[dataset]`` tokens (so prompt + generation fit
    `max_length`); with the chat template (``"auto"``: if the tokenizer has one) it is then wrapped as the user's
    message, except for trec, triviaqa, samsum, lcc and repobench-p. ``answer_ids``: the first answer's tokens.
    ``meta``: ``index`` (the line), ``dataset``, ``answers``, ``all_classes``, ``max_new``, ``metric``,
    ``length`` (LongBench's word count), ``_id``, ``full_tokens`` (the prompt's before truncation), ``truncated``
    and ``chat`` (wrapped)."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"longbench.path={path} is not a folder. {GET_LONGBENCH}")
    if not datasets:
        raise ValueError(f"longbench.datasets is empty: list some of {', '.join(DATASETS)}")
    files = {d: _file(path, d) for d in dict.fromkeys(datasets)}  # every name checked before any work
    encode, chat = encode_fn(tokenizer), _use_chat(tokenizer, chat_template)
    out = []
    for dataset, file in files.items():
        base = _base(dataset)
        budget = int(max_length) - MAX_NEW[base]
        if budget < 1:
            raise ValueError(f"max_length={max_length} leaves no prompt before {dataset}'s {MAX_NEW[base]} new tokens")
        with open(file, encoding="utf-8") as f:
            lines = [line for line in f if line.strip()]
        for i, line in enumerate(lines[:num_examples]):
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{file}, line {i + 1} is not JSON ({err}): not a LongBench file?") from None
            missing = [k for k in _FIELDS if k not in rec]
            if missing or not isinstance(rec["answers"], list) or not rec["answers"]:
                raise ValueError(f"{file}, line {i + 1}: not a LongBench record (needs {_FIELDS}, answers a list)")
            text = PROMPTS[base].format(context=rec["context"], input=rec["input"])
            ids = encode(text)
            use_chat = chat and base not in NO_CHAT
            prompt = _chat_ids(tokenizer, text, ids, budget) if use_chat else middle_truncate(ids, budget)
            meta = {
                "index": i,
                "dataset": dataset,
                "answers": [str(a) for a in rec["answers"]],
                "all_classes": rec.get("all_classes"),
                "max_new": MAX_NEW[base],
                "metric": METRIC[base],
                "length": rec.get("length"),
                "_id": rec.get("_id"),
                "full_tokens": len(ids),
                "truncated": len(ids) > budget,
                "chat": use_chat,
            }
            out.append(LongContextExample(f"longbench/{dataset}", prompt, encode(meta["answers"][0]), meta))
    return out


def fingerprint(examples: Sequence[LongContextExample]) -> str:
    """A short hash of the examples (prompts, answers, meta): what a resumed run must share."""
    blob = json.dumps([asdict(ex) for ex in examples], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


# ----------------------------------------------------------------------------------------------------------------
# the metrics (LongBench's metrics.py), each (prediction, ground truth, all_classes) -> [0, 1]
# ----------------------------------------------------------------------------------------------------------------
def normalize_answer(s: str) -> str:
    """Lower case, no punctuation, no articles (a, an, the), single spaces (SQuAD's normalisation)."""
    s = "".join(ch for ch in s.lower() if ch not in set(string.punctuation))
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", s).split())


def qa_f1_score(prediction: str, ground_truth: str, **_: Any) -> float:
    """Token F1 of the normalised answers (bags of words)."""
    pred, gold = normalize_answer(prediction).split(), normalize_answer(ground_truth).split()
    same = sum((Counter(pred) & Counter(gold)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(gold)
    return 2 * precision * recall / (precision + recall)


def _lcs_words(x: list[str], y: list[str]) -> set[str]:
    """The words of one longest common subsequence of `x` and `y`, traced back as the ``rouge`` package does."""
    n, m = len(x), len(y)
    table = [[0] * (m + 1) for _ in range(n + 1)]
    for i in range(1, n + 1):
        for j in range(1, m + 1):
            table[i][j] = table[i - 1][j - 1] + 1 if x[i - 1] == y[j - 1] else max(table[i - 1][j], table[i][j - 1])
    words, i, j = set(), n, m
    while i and j:
        if x[i - 1] == y[j - 1]:
            words.add(x[i - 1])
            i, j = i - 1, j - 1
        elif table[i - 1][j] > table[i][j - 1]:
            i -= 1
        else:
            j -= 1
    return words


def _sentences(text: str) -> list[str]:
    return [" ".join(s.split()) for s in text.split(".") if len(s) > 0]


def rouge_score(prediction: str, ground_truth: str, **_: Any) -> float:
    """ROUGE-L F as LongBench computes it with the ``rouge`` package (1.0.1, ``Rouge().get_scores``'s
    ``rouge-l`` ``f``): both texts split into sentences at ``.``; the union over reference and predicted sentence
    pairs of their LCS words, counted as a set (``llcs``); R = llcs / distinct reference words, P = llcs / distinct
    predicted words; F = 2PR / (P + R + 1e-8). An empty text scores 0 (the package raises; LongBench returns 0)."""
    hyp, ref = _sentences(prediction), _sentences(ground_truth)
    if not hyp or not ref:
        return 0.0
    union: set[str] = set()
    for r in ref:
        for h in hyp:
            union |= _lcs_words(r.split(" "), h.split(" "))
    n_ref = len({w for s in ref for w in s.split(" ")})
    n_hyp = len({w for s in hyp for w in s.split(" ")})
    r_lcs, p_lcs = len(union) / n_ref, len(union) / n_hyp
    return 2.0 * p_lcs * r_lcs / (p_lcs + r_lcs + 1e-8)


def classification_score(prediction: str, ground_truth: str, all_classes: Sequence[str] = (), **_: Any) -> float:
    """1 / (classes named in the prediction) if the true class is among them, after dropping the named classes
    that are part of the true class's name; else 0."""
    matched = [c for c in all_classes or () if c in prediction]
    for term in matched:  # LongBench removes while iterating (of two adjacent such terms, one stays): kept as is
        if term in ground_truth and term != ground_truth:
            matched.remove(term)
    return 1.0 / len(matched) if ground_truth in matched else 0.0


def _right_numbers(prediction: str, number: str) -> float:
    numbers = re.findall(r"\d+", prediction)
    return sum(n == number for n in numbers) / len(numbers) if numbers else 0.0


def count_score(prediction: str, ground_truth: str, **_: Any) -> float:
    """The fraction of the numbers in the prediction that are the true count."""
    return _right_numbers(prediction, str(ground_truth))


def retrieval_score(prediction: str, ground_truth: str, **_: Any) -> float:
    """The fraction of the numbers in the prediction that are the true paragraph's (``Paragraph <n>``)."""
    return _right_numbers(prediction, re.findall(r"Paragraph (\d+)", ground_truth)[0])


def _fuzz_ratio(a: str, b: str) -> int:
    """``fuzzywuzzy.fuzz.ratio`` (0.18) without ``python-Levenshtein``: equal strings 100, an empty one 0, else
    ``round(100 * difflib.SequenceMatcher(None, a, b).ratio())``."""
    if a == b:
        return 100
    if not a or not b:
        return 0
    return round(100 * SequenceMatcher(None, a, b).ratio())


def code_sim_score(prediction: str, ground_truth: str, **_: Any) -> float:
    """The similarity of the first predicted line that holds no `````, ``#`` or ``//`` to the true next line."""
    line = next((x for x in prediction.lstrip("\n").split("\n") if not any(t in x for t in ("`", "#", "//"))), "")
    return _fuzz_ratio(line, ground_truth) / 100


METRICS = {
    f.__name__: f
    for f in (qa_f1_score, rouge_score, classification_score, count_score, retrieval_score, code_sim_score)
}


def score_longbench(example: LongContextExample, text: str) -> float:
    """An answer's score in [0, 1] as LongBench's eval.py: the dataset's metric, best over the reference answers;
    for trec, triviaqa, samsum (and lsht) only the answer's first line."""
    meta = example.meta
    if _base(meta["dataset"]) in FIRST_LINE:
        text = text.lstrip("\n").split("\n")[0]
    metric = METRICS[meta["metric"]]
    return max(0.0, *(metric(text, a, all_classes=meta.get("all_classes")) for a in meta["answers"]))
