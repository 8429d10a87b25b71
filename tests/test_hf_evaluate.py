"""nats-eval-hf: the real config composed and run in-process on a tiny random Llama saved with
save_pretrained, a byte-level BPE tokenizer trained offline, and 3 short examples (passkey, niah, variable
tracking), with `full`, `nats` (random scorer weights saved to a file) and `streaming_llm` at one budget.

Checked: the rows and outputs; full holds every token, StreamingLLM its budget, NAtS fewer than it has seen (with
per-layer/head fractions); the scoring of constructed answers; an interrupted run (summary gone, a cut JSONL
line) resumes with only the missing rows, equal to the uninterrupted ones; the errors.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from helpers import eval_hf_config, tiny_model_and_scorers  # noqa: E402
from nats.data.longctx import LongContextExample  # noqa: E402
from nats.finetune import evaluate as E  # noqa: E402
from nats.hf import attach_nats  # noqa: E402
from nats.hf.pretrained import read_scorers  # noqa: E402

WINDOW, BUDGET = 8, 0.25
pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> Path:
    """A random 2-layer Llama (vocabulary 1024) and a byte-level BPE tokenizer, in the transformers layout."""
    return tiny_model_and_scorers(tmp_path_factory.mktemp("tiny_llama"), WINDOW)  # and a run's random scorers


def eval_cfg(pretrained: Path, out: Path, *extra: str):
    scorers = f"scorers={pretrained}/finetune_run/scorers.pt"
    tasks = "data.tasks=[passkey,niah,variable_tracking]"
    return eval_hf_config(
        pretrained, out, scorers, "methods=[full,nats,streaming_llm]", f"budgets=[{BUDGET}]", tasks, *extra
    )


@pytest.fixture
def count_generate(monkeypatch):
    calls = []
    real = E.generate_one

    def counted(*args, **kwargs):
        calls.append(args[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(E, "generate_one", counted)
    return calls


@pytest.fixture(scope="module")
def first_run(pretrained, tmp_path_factory):
    out = tmp_path_factory.mktemp("eval")
    report = E.run(eval_cfg(pretrained, out))
    return out, report


def lines(out: Path) -> list[str]:
    return (out / E.RESULTS).read_text().splitlines()


# ----------------------------------------------------------------------------------------------------------------
# the run and its outputs
# ----------------------------------------------------------------------------------------------------------------
def test_rows_outputs_and_kv_fractions(first_run):
    out, report = first_run
    rows = [json.loads(x) for x in lines(out)]
    assert len(rows) == report["computed"] == 9  # 3 methods x 3 examples
    assert {(r["method"], r["budget"]) for r in rows} == {("full", None), ("nats", None), ("streaming_llm", BUDGET)}
    assert {r["task"] for r in rows} == {"passkey", "niah", "variable_tracking"}
    for r in rows:
        assert 0 <= r["score"] <= 1 and r["correct"] == (r["score"] == 1)
        assert r["seen"] == r["prompt_tokens"] + r["new_tokens"] - 1  # the last new token is never fed back
        assert 280 <= r["prompt_tokens"] <= 320 and 0 < r["area"] <= 1 and 0 < r["peak"] <= 1
        assert len(r["per_head"]["area"]) == 2 and len(r["per_head"]["area"][0]) == 2  # [layer][kv_head]
        if r["method"] == "full":
            assert r["kv_fraction"] == 1.0 and r["area"] == pytest.approx(1.0) and r["budget_tokens"] is None
        elif r["method"] == "streaming_llm":
            assert r["budget_tokens"] == round(BUDGET * r["prompt_tokens"]) and r["kept"] == r["budget_tokens"]
            assert r["kv_fraction"] == pytest.approx(r["budget_tokens"] / r["seen"])
            assert r["kv_fraction"] == pytest.approx(BUDGET, rel=0.1)
        else:  # NAtS with random scorers: evicts, and records its types per layer and KV head
            assert 0 < r["kv_fraction"] < 1 and 0 < r["area"] < 1
            types = torch.tensor(r["per_head"]["type_fractions"])
            assert types.shape == (2, 2, 3) and torch.allclose(types.sum(-1), torch.ones(2, 2), atol=1e-5)
    settings = json.loads((out / E.SETTINGS).read_text())
    assert settings["window"] == WINDOW  # found in the run's nats_stats.json
    table = (out / E.TABLE).read_text()
    for name in ("full", "nats", f"streaming_llm @ {BUDGET}", "passkey", "niah", "variable_tracking", "kv_fraction"):
        assert name in table
    summary = json.loads((out / E.SUMMARY).read_text())["results"]
    assert [s["method"] for s in summary] == ["full", "nats", "streaming_llm"]
    full = summary[0]
    scores = [r["score"] for r in rows if r["method"] == "full"]
    assert full["mean_accuracy"] == pytest.approx(sum(scores) / 3) and full["kv_fraction"] == 1.0
    kv = json.loads((out / E.KV_FRACTIONS).read_text())["methods"]
    assert set(kv) == {"full", "nats", f"streaming_llm @ {BUDGET}"} and "type_fractions" in kv["nats"]
    assert (out / E.PLOT).stat().st_size > 1000


def test_resume_runs_only_the_missing_rows(first_run, pretrained, tmp_path, count_generate):
    out, _ = first_run
    before = lines(out)
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    (resumed / E.SETTINGS).write_text((out / E.SETTINGS).read_text())
    (resumed / E.RESULTS).write_text("\n".join(before[:4]) + "\n" + before[4][: len(before[4]) // 2])  # cut line
    report = E.run(eval_cfg(pretrained, resumed))
    assert report["computed"] == len(count_generate) == 5
    after = lines(resumed)
    assert len(after) == 9 and after[:4] == before[:4]
    strip = ("seconds",)
    key = E.row_key
    one = {key(r): {k: v for k, v in r.items() if k not in strip} for r in map(json.loads, before)}
    two = {key(r): {k: v for k, v in r.items() if k not in strip} for r in map(json.loads, after)}
    assert one == two  # the resumed rows are the uninterrupted run's
    assert (resumed / E.TABLE).is_file()
    # everything done: nothing is generated, the table is rewritten
    (resumed / E.TABLE).unlink()
    count_generate.clear()
    assert E.run(eval_cfg(pretrained, resumed))["computed"] == 0 and not count_generate
    assert (resumed / E.TABLE).is_file()
    # a method added to a finished run: only its rows
    report = E.run(eval_cfg(pretrained, resumed, "methods=[full,h2o]"))
    assert report["computed"] == len(count_generate) == 3 and len(lines(resumed)) == 12
    with pytest.raises(ValueError, match="other settings.*answer_margin"):
        E.run(eval_cfg(pretrained, resumed, "answer_margin=3"))


# ----------------------------------------------------------------------------------------------------------------
# scoring
# ----------------------------------------------------------------------------------------------------------------
def test_scoring_of_constructed_answers():
    passkey = LongContextExample("passkey", [1, 2], [3], {"passkey": "40521"})
    for text, want in [
        (" 40521.", 1.0),
        ("The pass key is 40521, remember", 1.0),
        (" 140521", 0.0),
        (" 4052", 0.0),
        (" 40512", 0.0),
        ("", 0.0),
    ]:
        assert E.score(passkey, [], text, 16) == (want, ["40521"]), text
    vt = LongContextExample("variable_tracking", [1], [2], {"variables": ["ABCDE", "FGHIJ", "KLMNO", "PQRST", "UVWXY"]})
    assert E.score(vt, [], " ABCDE fghij KLMNO", 16)[0] == pytest.approx(0.6)  # RULER: partial credit, any case
    assert E.score(vt, [], " ABCDE FGHIJ KLMNO PQRST UVWXY", 16)[0] == 1.0
    niah = LongContextExample("niah", [1], [2], {"value": "5135289"})
    assert E.score(niah, [], ": 5135289", 16)[0] == 1.0
    book = LongContextExample("pg19_continuation", [1], [5, 6, 7, 8, 9, 10], {})
    assert E.score(book, [5, 6, 0, 8], "", 4) == (0.75, [5, 6, 7, 8])  # the first k = 4 tokens
    assert E.score(book, [5, 6], "", 4)[0] == 0.5  # missing tokens are wrong
    assert E.new_tokens(book, 16, 4) == 4 and E.new_tokens(passkey, 16, 4) == 17


def test_the_expected_answers_score_correct_end_to_end(first_run, pretrained, tmp_path, monkeypatch):
    """Generation answering each example's own answer tokens: decoded and scored correct, 100 in the table."""
    out, _ = first_run
    name = json.loads((out / E.SETTINGS).read_text())["examples"]
    examples = [json.loads(x) for x in (pretrained / "data" / "hf_longctx" / name).read_text().splitlines()[1:]]
    answers = {tuple(ex["prompt_ids"]): ex["answer_ids"] for ex in examples}
    real = E.generate_one

    def answer(model, prompt, *args, **kwargs):  # the real decoding fills the cache; the answer replaces its output
        real(model, prompt, *args, **kwargs)
        return answers[tuple(prompt)]

    monkeypatch.setattr(E, "generate_one", answer)
    report = E.run(eval_cfg(pretrained, tmp_path, "methods=[full]"))
    assert [r["correct"] for r in report["rows"]] == [True] * 3
    assert "| full | 100.0 | 100.0 | 100.0 | 100.0 |" in (tmp_path / E.TABLE).read_text()


@pytest.mark.parametrize("policy", ["full", "nats"])
def test_continuation_is_teacher_forced_through_the_cache(pretrained, policy):
    """pg19_continuation: the predictions and NLL through the policy cache (prompt, then the reference fed in)
    are the parallel forward's over prompt + reference (dense, or NAtS with the same scorers)."""
    from nats.hf import StaticPolicyCache, load_nats_state_dict, use_policy_caches

    model = transformers.AutoModelForCausalLM.from_pretrained(pretrained).eval()
    if policy == "nats":
        attach_nats(model, window=WINDOW)
        load_nats_state_dict(model, torch.load(pretrained / "finetune_run" / "scorers.pt", weights_only=True))
        model.eval()
    else:
        use_policy_caches(model)
    g = torch.Generator().manual_seed(3)
    prompt, reference = (
        torch.randint(0, 1000, (40,), generator=g).tolist(),
        torch.randint(0, 1000, (6,), generator=g).tolist(),
    )
    cache = StaticPolicyCache(model, policy, max_new_tokens=None, max_len=46, backend="torch")
    preds, nll = E.continue_one(model, prompt, reference, cache)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + reference[:-1]])).logits[0, 39:]
    assert preds == logits.argmax(-1).tolist() and len(preds) == 6
    assert nll == pytest.approx(float(torch.nn.functional.cross_entropy(logits, torch.tensor(reference))), rel=1e-4)
    assert cache.get_seq_length() == 45
    if policy == "nats":
        assert (cache.kept() < 45).any()  # it evicted on the way


def test_read_scorers_of_a_lightning_checkpoint(pretrained, tmp_path):
    sd = torch.load(pretrained / "finetune_run" / "scorers.pt", weights_only=True)
    ckpt = tmp_path / "last.ckpt"
    torch.save({"state_dict": {f"model.{k}": v for k, v in sd.items()}, "hyper_parameters": {"window": 12}}, ckpt)
    got, window = read_scorers(ckpt)
    assert window == 12 and got.keys() == sd.keys() and all(torch.equal(got[k], sd[k]) for k in sd)
    assert read_scorers(pretrained / "finetune_run" / "scorers.pt")[1] is None


# ----------------------------------------------------------------------------------------------------------------
# errors
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "overrides, error, match",
    [
        (["scorers=null"], ValueError, "method 'nats' needs scorers"),
        (["methods=[full,bogus]"], ValueError, r"unknown method 'bogus'; available: full, streaming_llm, h2o, nats"),
        (
            ["methods=[streaming_llm]", "budgets=[0.01]"],
            ValueError,
            r"streaming_llm at budget 0.01 of the \d+-token prompt .* = 3 tokens: .*too small for 4 attention sinks",
        ),
        (["methods=[streaming_llm]", "budgets=[2]"], ValueError, r"fractions of the prompt length in \(0, 1\)"),
        (["methods=[snapkv]", "budgets=[0.1]"], ValueError, "snapkv: window=32 must be below the budget"),
        (["scorers=/no/such/scorers.pt"], FileNotFoundError, "does not exist"),
        (["data.max_length=600"], ValueError, "exceeds hf_model.max_context=512"),
    ],
)
def test_errors(pretrained, tmp_path, count_generate, overrides, error, match):
    with pytest.raises(error, match=match):
        E.run(eval_cfg(pretrained, tmp_path, *overrides))
    assert not count_generate and not (tmp_path / E.RESULTS).exists()


def test_type_bias_is_applied_recorded_and_checked(pretrained, tmp_path):
    """type_bias reaches the scorers (a large sliding offset leaves only token 0 global and keeps ~W tokens), is
    written to run.json and the header, must match on resume, and needs scorers."""
    out = tmp_path / "biased"
    E.run(eval_cfg(pretrained, out, "methods=[nats]", "budgets=[]", "type_bias=[0,0,50]"))
    rows = [json.loads(x) for x in lines(out)]
    for r in rows:
        types = torch.tensor(r["per_head"]["type_fractions"])  # [layer][kv_head][g, l, s]
        assert (types[..., 2] > 0.99).all()
        assert r["kept"] <= WINDOW + 1  # per layer and KV head: the window and token 0
    assert json.loads((out / E.SETTINGS).read_text())["type_bias"] == [0.0, 0.0, 50.0]
    assert "type bias (g, l, s) = (0.0, 0.0, 50.0)" in (out / E.TABLE).read_text()
    with pytest.raises(ValueError, match="type_bias"):
        E.run(eval_cfg(pretrained, out, "methods=[nats]", "budgets=[]"))  # resume without it
    with pytest.raises(ValueError, match=r"3 finite numbers .* e.g. type_bias=\[0,0.1,0\]"):
        E.run(eval_cfg(pretrained, tmp_path / "scalar", "methods=[nats]", "type_bias=0.1"))
    with pytest.raises(ValueError, match="pass scorers=<run>/scorers.pt or drop type_bias"):
        E.run(eval_cfg(pretrained, tmp_path / "none", "scorers=null", "methods=[full]", "type_bias=[-1,0,0]"))


def test_window_must_be_known(pretrained, tmp_path):
    lone = tmp_path / "scorers.pt"
    lone.write_bytes((pretrained / "finetune_run" / "scorers.pt").read_bytes())
    with pytest.raises(ValueError, match="pass window=W"):
        E.run(eval_cfg(pretrained, tmp_path, f"scorers={lone}"))


def test_resume_argv(tmp_path):
    """nats-eval-hf's resume= (nats.runs.resume_argv, as nats-train's): the run's overrides, the given ones win,
    its folder; no checkpoint to name and no resume=latest."""
    from nats.runs import resume_argv

    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "overrides.yaml").write_text("- scorers=a.pt\n- budgets=[0.5]\n")
    got = resume_argv([f"resume={tmp_path}", "budgets=[0.25]"], None, program="nats-eval-hf", checkpoint=False)
    assert got == ["scorers=a.pt", "budgets=[0.25]", f"hydra.run.dir={tmp_path}"]
    with pytest.raises(FileNotFoundError, match="not the folder of a nats-eval-hf run"):
        resume_argv([f"resume={tmp_path / 'nope'}"], None, program="nats-eval-hf", checkpoint=False)
    with pytest.raises(ValueError, match="resume=latest is not offered by nats-eval-hf"):
        resume_argv(["resume=latest"], None, program="nats-eval-hf", checkpoint=False)


def test_ruler_tasks_are_scored_by_their_answers():
    """nats.data.longctx.ruler's tasks list their answers in meta: all of them for the word tasks, any one for QA."""
    from nats.data.longctx import LongContextExample
    from nats.finetune.evaluate import score

    words = LongContextExample("common_words", [1], [2], {"answers": ["apple", "pear", "plum"], "match": "all"})
    assert score(words, [], "Answer: apple, plum and pear", 0)[0] == 1.0
    assert score(words, [], "Answer: apple and pineapple", 0)[0] == pytest.approx(1 / 3)
    qa = LongContextExample("qa_squad", [1], [2], {"answers": ["Denver Broncos", "the Broncos"], "match": "any"})
    assert score(qa, [], "Answer: the Broncos won.", 0)[0] == 1.0
    assert score(qa, [], "Answer: Carolina Panthers", 0)[0] == 0.0


def test_build_script_makes_the_file_the_evaluation_reads(pretrained, tmp_path, monkeypatch):
    """experiments/build_hf_examples.py eval <overrides> writes the example file that nats-eval-hf with the same
    overrides then reads as it is (copied to a machine without PG-19 or tokenizer set-up)."""
    import sys

    from conftest import load_script

    mod = load_script("experiments/build_hf_examples.py")
    data_dir = tmp_path / "data"
    cfg = eval_cfg(pretrained, tmp_path / "out", f"paths.data_dir={data_dir}", "methods=[full]")
    overrides = [f"{k}={v}" for k, v in [("paths.data_dir", data_dir), ("hf_model.name_or_path", pretrained)]]
    overrides += ["hf_model.max_context=512", "data.tasks=[passkey,niah,variable_tracking]", "data.num_examples=1"]
    overrides += ["data.max_length=320", "data.min_length=300", "data.pg19_path=null"]
    monkeypatch.setattr(sys, "argv", ["build_hf_examples.py", "eval", *overrides])
    mod.main()
    built = list((data_dir / "hf_longctx").glob("longctx-*.jsonl"))
    assert len(built) == 1 and len(built[0].read_text().splitlines()) == 1 + 3  # settings line + 3 examples
    stamp = built[0].stat().st_mtime_ns
    E.run(cfg)
    settings = json.loads((tmp_path / "out" / E.SETTINGS).read_text())
    assert settings["examples"] == built[0].name and built[0].stat().st_mtime_ns == stamp  # read, not rebuilt
    assert list((data_dir / "hf_longctx").glob("longctx-*.jsonl")) == built


# ----------------------------------------------------------------------------------------------------------------
# kvpress' protocol: the context compressed without its question
# ----------------------------------------------------------------------------------------------------------------
def test_question_start_splits_each_task_before_its_question(pretrained):
    """Every task with a question splits where it starts (the context's tokens are the prompt's own, and the rest
    decodes to the question); the PG-19 continuation is all context."""
    from nats.data.longctx.tasks import QUESTION_MARKERS, build_examples, question_start

    tok = transformers.AutoTokenizer.from_pretrained(pretrained)
    examples = build_examples(tok, tasks=["passkey", "niah", "variable_tracking"], num_examples=2, max_length=480)
    for ex in examples:
        n = question_start(ex, tok)
        assert 0 < n < len(ex.prompt_ids), ex.task
        assert QUESTION_MARKERS[ex.task].strip() in tok.decode(ex.prompt_ids[n:]), ex.task
    whole = LongContextExample("pg19_continuation", [5, 6, 7], [8])
    assert question_start(whole, tok) == 3
    with pytest.raises(ValueError, match="no known question marker"):
        question_start(LongContextExample("other", [1, 2], [3]), tok)


def test_kvpress_protocol_compresses_the_context_and_feeds_the_question(pretrained, tmp_path):
    """protocol=kvpress: the full cache answers as under the project's protocol (nothing is dropped either way);
    StreamingLLM keeps its budget of the context (the compression ratio's complement), then holds the question and
    the answer on top, so its budget is smaller than the project protocol's at the same kept share; a bad ratio or
    protocol is refused in one line. (kvpress' own presses under it: tests/test_kvpress.py.)"""
    common = ["methods=[full,streaming_llm]", "data.tasks=[passkey]"]
    project = E.run(eval_hf_config(pretrained, tmp_path / "p", *common, "budgets=[0.5]"))
    kv = E.run(eval_hf_config(pretrained, tmp_path / "k", *common, "protocol=kvpress", "compression_ratios=[0.5]"))
    by = {name: {r["method"]: r for r in rep["rows"]} for name, rep in (("project", project), ("kvpress", kv))}
    assert by["kvpress"]["full"]["generated"] == by["project"]["full"]["generated"]
    assert by["kvpress"]["streaming_llm"]["budget_tokens"] < by["project"]["streaming_llm"]["budget_tokens"]
    run_json = json.loads((tmp_path / "k" / E.SETTINGS).read_text())
    assert run_json["protocol"] == "kvpress"
    with pytest.raises(ValueError, match="compression_ratios in \\(0, 1\\)"):
        E.check_inputs(
            eval_hf_config(pretrained, tmp_path / "x", *common, "protocol=kvpress", "compression_ratios=[1.5]")
        )
    with pytest.raises(ValueError, match="protocol='other'"):
        E.check_inputs(eval_hf_config(pretrained, tmp_path / "y", *common, "protocol=other"))
