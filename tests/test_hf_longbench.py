"""LongBench from the user's files (nats.data.longctx.longbench): tiny fake LongBench JSONL files in the real
format, read with a byte-level BPE tokenizer trained offline; prompts, middle truncation, the chat-template rule,
the errors, every metric against hand-computed values, and one nats-eval-hf run with longbench.path set on a tiny
random Llama.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from helpers import eval_hf_config  # noqa: E402
from nats.data.longctx import LongContextExample  # noqa: E402
from nats.data.longctx import longbench as L  # noqa: E402
from nats.data.longctx import tasks as D  # noqa: E402
from nats.finetune import evaluate as E  # noqa: E402
from nats.hf.pretrained import save_tiny_random_llama  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

CHAT = (
    "{% for m in messages %}<|user|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
PASSAGE = "The grass is green and the sky is blue over the quiet harbor town. "
CLASSES = ["Animal", "Food", "Description of a person", "person"]


def record(dataset: str, i: int, context: str, inp: str, answers: list[str], classes=None) -> dict:
    """A line of a LongBench file (its real fields)."""
    return {
        "input": inp,
        "context": context,
        "answers": answers,
        "length": len(context.split()),
        "dataset": dataset,
        "language": "en",
        "all_classes": classes,
        "_id": f"{dataset}-{i:04d}",
    }


@pytest.fixture(scope="module")
def longbench_dir(tmp_path_factory) -> Path:
    """hotpotqa (a long and a short example), trec, passage_count and hotpotqa_e, as LongBench's data/ folder."""
    root = tmp_path_factory.mktemp("longbench") / "data"
    root.mkdir()
    files = {
        "hotpotqa": [
            record("hotpotqa", 0, "Passage 1:\nParis\n" + PASSAGE * 60, "Where is the tower?", ["Paris", "in Paris"]),
            record("hotpotqa", 1, "Passage 1:\nOslo\nOslo is cold.", "Which city is cold?", ["Oslo"]),
        ],
        "trec": [
            record(
                "trec",
                0,
                "Question: What is a cat?\nType: Animal\n",
                "Question: Who was Bach?",
                ["Description of a person"],
                CLASSES,
            )
        ],
        "passage_count": [record("passage_count", 0, "Paragraph 1: " + PASSAGE * 30, "", ["7"])],
        "hotpotqa_e": [record("hotpotqa", 0, "Passage 1:\nRome\nRome is old.", "Which city is old?", ["Rome"])],
    }
    for name, rows in files.items():
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory, longbench_dir) -> Path:
    """A random 2-layer Llama and a byte-level BPE tokenizer (no chat template), in the transformers layout."""
    root = tmp_path_factory.mktemp("tiny_llama")
    save_tiny_random_llama(root, texts=[D.FILLER] * 20 + [PASSAGE] * 20 + [inspect.getsource(L)])
    return root


@pytest.fixture
def tok(pretrained):
    return transformers.AutoTokenizer.from_pretrained(pretrained)


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


# ----------------------------------------------------------------------------------------------------------------
# loading
# ----------------------------------------------------------------------------------------------------------------
def test_loads_the_examples_with_their_template_and_meta(longbench_dir, tok):
    got = L.load_longbench(longbench_dir.parent, ["hotpotqa", "trec", "hotpotqa_e"], tok, 100_000, chat_template=False)
    assert [(e.task, e.meta["index"]) for e in got] == [
        ("longbench/hotpotqa", 0),
        ("longbench/hotpotqa", 1),
        ("longbench/trec", 0),
        ("longbench/hotpotqa_e", 0),
    ]  # the data/ folder is found below the given one
    short, trec = got[1], got[2]
    prompt = (
        "Answer the question based on the given passages. Only give me the answer and do not output any other "
        "words.\n\nThe following are given passages.\nPassage 1:\nOslo\nOslo is cold.\n\nAnswer the question based "
        "on the given passages. Only give me the answer and do not output any other words.\n\nQuestion: Which city "
        "is cold?\nAnswer:"
    )
    assert short.prompt_ids == encode(tok, prompt) and short.answer_ids == encode(tok, "Oslo")
    assert short.meta == {
        "index": 1,
        "dataset": "hotpotqa",
        "answers": ["Oslo"],
        "all_classes": None,
        "max_new": 32,
        "metric": "qa_f1_score",
        "length": 6,
        "_id": "hotpotqa-0001",
        "full_tokens": len(short.prompt_ids),
        "truncated": False,
        "chat": False,
    }
    assert tok.decode(trec.prompt_ids).endswith("Type: Animal\n\nQuestion: Who was Bach?")
    assert trec.meta["all_classes"] == CLASSES and trec.meta["max_new"] == 64
    assert trec.meta["metric"] == "classification_score"
    assert got[3].meta["metric"] == "qa_f1_score" and got[3].meta["dataset"] == "hotpotqa_e"
    first = L.load_longbench(longbench_dir, ["hotpotqa"], tok, 100_000, num_examples=1, chat_template=False)
    assert len(first) == 1 and first[0].prompt_ids == got[0].prompt_ids


def test_middle_truncation():
    ids = list(range(10))
    assert L.middle_truncate(ids, 10) == ids and L.middle_truncate(ids, 11) == ids
    assert L.middle_truncate(ids, 9) == [0, 1, 2, 3, 5, 6, 7, 8, 9]
    assert L.middle_truncate(ids, 5) == [0, 1, 7, 8, 9]  # odd: the extra token goes to the end
    assert L.middle_truncate(ids, 4) == [0, 1, 8, 9] and L.middle_truncate(ids, 1) == [9]


@pytest.mark.parametrize("max_length", [32 + 101, 32 + 64, 32 + 1])
def test_a_long_prompt_is_cut_in_the_middle_to_its_budget(longbench_dir, tok, max_length):
    """The budget is max_length minus hotpotqa's 32 new tokens; the prompt keeps its head and its tail."""
    (ex,) = L.load_longbench(longbench_dir, ["hotpotqa"], tok, max_length, num_examples=1, chat_template=False)
    budget = max_length - 32
    rec = json.loads((longbench_dir / "hotpotqa.jsonl").read_text().splitlines()[0])
    full = encode(tok, L.PROMPTS["hotpotqa"].format(context=rec["context"], input=rec["input"]))
    assert len(full) > 500 and ex.meta["full_tokens"] == len(full) and ex.meta["truncated"]
    assert len(ex.prompt_ids) == budget
    head = budget // 2
    assert ex.prompt_ids[:head] == full[:head] and ex.prompt_ids[head:] == full[len(full) - (budget - head) :]
    if budget > 40:  # the instruction and the question survive
        text = tok.decode(ex.prompt_ids)
        assert text.startswith("Answer the question") and text.endswith("Question: Where is the tower?\nAnswer:")


def test_the_chat_template_rule(longbench_dir, tok):
    """Wrapped as the user's message (assistant turn opened), except trec; a long prompt still fits its budget."""
    tok.chat_template = CHAT
    got = L.load_longbench(longbench_dir, ["hotpotqa", "trec"], tok, 32 + 150)  # chat_template="auto"
    long, short, trec = got
    for ex in (long, short):
        text = tok.decode(ex.prompt_ids)
        assert ex.meta["chat"] and text.startswith("<|user|>Answer the question") and text.endswith("<|assistant|>")
        assert "Question: " in text and len(ex.prompt_ids) <= 150
    assert 140 <= len(long.prompt_ids) and "Where is the tower?\nAnswer:<|end|>" in tok.decode(long.prompt_ids)
    prompt = L.PROMPTS["hotpotqa"].format(context="Passage 1:\nOslo\nOslo is cold.", input="Which city is cold?")
    assert short.prompt_ids == encode(tok, f"<|user|>{prompt}<|end|><|assistant|>")
    assert not trec.meta["chat"] and not tok.decode(trec.prompt_ids).startswith("<|user|>")
    plain = L.load_longbench(longbench_dir, ["hotpotqa"], tok, 32 + 150, chat_template=False)
    assert [e.prompt_ids for e in plain] != [e.prompt_ids for e in got[:2]]
    with pytest.raises(ValueError, match="chat template alone does not fit"):
        L.load_longbench(longbench_dir, ["hotpotqa"], tok, 32 + 3)
    tok.chat_template = None
    assert not L.load_longbench(longbench_dir, ["hotpotqa"], tok, 32 + 150)[0].meta["chat"]  # auto: none
    with pytest.raises(ValueError, match="has no chat template"):
        L.load_longbench(longbench_dir, ["hotpotqa"], tok, 32 + 150, chat_template=True)


def test_errors(longbench_dir, tok, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"not a folder\. .*THUDM/LongBench.*data\.zip"):
        L.load_longbench(tmp_path / "nowhere", ["hotpotqa"], tok, 1000)
    with pytest.raises(FileNotFoundError, match=r"has no musique\.jsonl .*THUDM/LongBench"):
        L.load_longbench(longbench_dir, ["hotpotqa", "musique"], tok, 1000)
    with pytest.raises(ValueError, match=r"unknown LongBench dataset 'dureader'.*narrativeqa, qasper"):
        L.load_longbench(longbench_dir, ["dureader"], tok, 1000)
    (tmp_path / "gov_report.jsonl").write_text(json.dumps(record("gov_report", 0, "x", "", ["y"])) + "\n")
    with pytest.raises(ValueError, match="no prompt before gov_report's 512 new tokens"):
        L.load_longbench(tmp_path, ["gov_report"], tok, 512)
    bad = tmp_path / "qmsum.jsonl"
    bad.write_text(json.dumps({"input": "q", "context": "c"}) + "\n")
    with pytest.raises(ValueError, match=r"qmsum\.jsonl, line 1: not a LongBench record"):
        L.load_longbench(tmp_path, ["qmsum"], tok, 1000)
    bad.write_text("{not json\n")
    with pytest.raises(ValueError, match=r"line 1 is not JSON"):
        L.load_longbench(tmp_path, ["qmsum"], tok, 1000)


# ----------------------------------------------------------------------------------------------------------------
# metrics (hand-computed)
# ----------------------------------------------------------------------------------------------------------------
def test_qa_f1():
    # normalised: "eiffel tower in paris" vs "eiffel tower": 2 common, P = 2/4, R = 2/2, F1 = 2/3
    assert L.qa_f1_score("The Eiffel Tower, in Paris.", "Eiffel Tower") == pytest.approx(2 / 3)
    assert L.qa_f1_score("The answer!", "an ANSWER") == 1.0  # case, punctuation, articles
    assert L.qa_f1_score("paris paris", "paris") == pytest.approx(2 / 3)  # counted as bags: P = 1/2, R = 1
    assert L.qa_f1_score("", "paris") == 0.0 and L.qa_f1_score("the", "a") == 0.0


def test_rouge_l_as_the_rouge_package():
    # one sentence each: distinct words 5 and 5, LCS "the cat on the mat" -> {the, cat, on, mat} = 4: F = 0.8
    assert L.rouge_score("the cat sat on the mat", "the cat was on the mat") == pytest.approx(0.8)
    # order matters: LCS 2 of 4 and 6 distinct words: P = 1/2, R = 1/3, F = 0.4 (a bag of words would give 0.8)
    assert L.rouge_score("police killed the gunman", "the gunman was killed by police") == pytest.approx(0.4)
    # sentences split at '.': union of LCS words {The, cat, on, the, mat} + {was} = 6; R = 6/6, P = 6/9: F = 0.8
    # (0.7999999952 from rouge 1.0.1 itself); case-sensitive
    assert L.rouge_score("The cat sat on the mat. It was happy.", "The cat was on the mat.") == pytest.approx(0.8)
    # the LCS words are a set, and which LCS is traced back matters: "a b" ({a, b}: F = 1) or "b b" ({b}: F = 0.5),
    # as rouge 1.0.1 traces it (its values for these pairs)
    assert L.rouge_score("a b b", "b a b") == pytest.approx(1.0) and L.rouge_score("b a b", "a b b") == pytest.approx(
        0.5
    )
    assert L.rouge_score("", "a summary") == 0.0 and L.rouge_score("...", "a summary") == 0.0
    assert L.rouge_score("same words here", "same words here") == pytest.approx(1.0)


def test_classification_retrieval_count_and_code():
    assert L.classification_score("Animal", "Animal", all_classes=CLASSES) == 1.0
    assert L.classification_score("Animal or Food", "Animal", all_classes=CLASSES) == 0.5
    assert L.classification_score("Food", "Animal", all_classes=CLASSES) == 0.0
    # "person" is named but is part of the true class's name: dropped, so 1 and not 1/2
    assert L.classification_score("Description of a person", "Description of a person", all_classes=CLASSES) == 1.0
    assert L.retrieval_score("Paragraph 12", "Paragraph 12") == 1.0
    assert L.retrieval_score("Paragraph 12, or maybe Paragraph 3", "Paragraph 12") == 0.5
    assert L.retrieval_score("Paragraph 2", "Paragraph 12") == 0.0 and L.retrieval_score("none", "Paragraph 1") == 0
    assert L.count_score("7", "7") == 1.0 and L.count_score("7 of the 10 are unique", "7") == 0.5
    assert L.count_score("17", "7") == 0.0 and L.count_score("", "7") == 0.0
    # the first line without ` # //: "x = foo(1)" vs "x = foo(2)": 9 of 10 characters match, 2 * 9 / 20 = 0.9
    assert L.code_sim_score("```python\n# call it\nx = foo(1)\ny = 2", "x = foo(2)") == 0.9
    assert L.code_sim_score("\n\nreturn x", "return x") == 1.0 and L.code_sim_score("// only", "return x") == 0.0
    assert L.code_sim_score("abcd", "abxy") == 0.5  # 2 * 2 / 8


def test_score_longbench_takes_the_best_answer_and_first_lines():
    qa = LongContextExample(
        "longbench/hotpotqa",
        [1],
        [2],
        {"dataset": "hotpotqa", "answers": ["Paris", "the city of Paris"], "metric": "qa_f1_score", "max_new": 32},
    )
    assert L.score_longbench(qa, "city of Paris") == 1.0  # 0.5 against "Paris", 1 against the second answer
    assert E.score(qa, [], "Paris, France", 0) == (pytest.approx(2 / 3), ["Paris", "the city of Paris"])
    assert E.new_tokens(qa, 16, 4) == 32
    meta = {"answers": ["Animal"], "all_classes": CLASSES, "metric": "classification_score"}
    trec = LongContextExample("longbench/trec", [1], [2], {**meta, "dataset": "trec"})
    assert L.score_longbench(trec, "\nAnimal\nFood") == 1.0  # the first line only
    not_first_line = LongContextExample("longbench/x", [1], [2], {**meta, "dataset": "passage_count"})
    assert L.score_longbench(not_first_line, "\nAnimal\nFood") == 0.5
    count = LongContextExample(
        "longbench/passage_count", [1], [2], {"dataset": "passage_count", "answers": ["3"], "metric": "count_score"}
    )
    assert L.score_longbench(count, "3\n4") == 0.5


# ----------------------------------------------------------------------------------------------------------------
# nats-eval-hf with longbench.path
# ----------------------------------------------------------------------------------------------------------------
def eval_cfg(pretrained: Path, longbench_dir: Path, out: Path, *extra: str):
    longbench = [
        f"longbench.path={longbench_dir}",
        "longbench.datasets=[hotpotqa,passage_count]",
        "longbench.num_examples=1",
    ]
    return eval_hf_config(
        pretrained, out, "methods=[full,streaming_llm]", "budgets=[0.25]", "data.tasks=[passkey]", *longbench, *extra
    )


def test_the_runner_scores_longbench_tasks(pretrained, longbench_dir, tok, tmp_path, monkeypatch):
    report = E.run(eval_cfg(pretrained, longbench_dir, tmp_path / "a"))
    rows = report["rows"]
    assert len(rows) == report["computed"] == 6  # 2 methods x (passkey + 2 LongBench examples)
    lb = [r for r in rows if r["task"].startswith("longbench/")]
    assert sorted({r["task"] for r in lb}) == ["longbench/hotpotqa", "longbench/passage_count"]
    examples = {e.task: e for e in L.load_longbench(longbench_dir, ["hotpotqa", "passage_count"], tok, 320, 1)}
    for r in lb:
        ex = examples[r["task"]]
        assert r["prompt_tokens"] == len(ex.prompt_ids) == 320 - 32  # both cut in the middle to 320 - 32 tokens
        assert 0 < r["new_tokens"] <= 32 and r["expected"] == ex.meta["answers"]
        assert r["score"] == L.score_longbench(ex, r["prediction"])
    table = (tmp_path / "a" / E.TABLE).read_text()
    assert "longbench/hotpotqa" in table and "LongBench's metric" in table
    assert json.loads((tmp_path / "a" / E.SETTINGS).read_text())["longbench"]["datasets"] == [
        "hotpotqa",
        "passage_count",
    ]
    with pytest.raises(ValueError, match=r"other settings \(longbench"):  # other LongBench examples: not resumable
        E.run(eval_cfg(pretrained, longbench_dir, tmp_path / "a", "longbench.datasets=[hotpotqa]"))

    # LongBench alone, decoding that returns each example's answer tokens (after one real step): 100 on every task
    answers = {tuple(e.prompt_ids): e.answer_ids for e in examples.values()}
    real = E.generate_one

    def answer(model, prompt, n_new, cache):
        real(model, prompt, 1, cache)
        return answers[tuple(prompt)]

    monkeypatch.setattr(E, "generate_one", answer)
    report = E.run(eval_cfg(pretrained, longbench_dir, tmp_path / "b", "methods=[full]", "data.tasks=[]"))
    assert [(r["task"], r["score"]) for r in report["rows"]] == [
        ("longbench/hotpotqa", 1.0),
        ("longbench/passage_count", 1.0),
    ]
    assert "| full | 100.0 | 100.0 | 100.0 |" in (tmp_path / "b" / E.TABLE).read_text()
