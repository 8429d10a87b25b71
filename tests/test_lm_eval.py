"""The lm-evaluation-harness model ``nats`` (nats/lm_eval/) on the tiny random Llama of the HF tests, with three
local tasks written here (a jsonl file, task YAMLs; no hub): multiple choice (loglikelihood, acc), generate_until
(exact_match, chrF) and loglikelihood_rolling (word perplexity, several windows).

Checked: the full cache through ``nats`` scores as the harness' own ``hf`` model (every request's log-likelihood, the
metrics, the generated text); NAtS' run reports its kept share (in the results and the log), differs from the full
cache and gives the same scores at batch 1 and 4 (left-padded contexts, right-padded continuations), as H2O does at a
fractional budget; settings mistakes are refused before the model loads; a harness task that needs the hub is refused
by ``python -m nats.lm_eval`` in one line naming the task, its dataset and the fix.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # the harness' hf model imports it

from lm_eval.tasks import TaskManager  # noqa: E402

import nats.lm_eval as NL  # noqa: E402
from conftest import REPO  # noqa: E402
from helpers import tiny_model_and_scorers  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py
TASKS = ["nats_mc", "nats_gen", "nats_ppl"]
WINDOW = 8
COLOURS = [" green", " blue grey", " dark red", " white as fresh snow"]


@pytest.fixture(scope="module", autouse=True)
def offline():
    """No hub: the harness' datasets and models from local files only."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_DATASETS_OFFLINE", "1")
        mp.setenv("HF_HUB_OFFLINE", "1")
        yield


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """The tiny random Llama in the transformers layout and random NAtS scorers beside it (finetune_run/)."""
    return tiny_model_and_scorers(tmp_path_factory.mktemp("tiny_llama"), WINDOW)


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> TaskManager:
    """Three tasks over a local jsonl file (prompts of different lengths, continuations of 1-5 tokens)."""
    root = tmp_path_factory.mktemp("lm_eval_tasks")
    words = ["grass", "sky", "sea"]
    with open(root / "data.jsonl", "w") as f:
        for i, w in enumerate(words):
            story = " ".join(["and so on"] * (i % 3))
            doc = {
                "question": f"The {w} {story} looked, in the light of day {i}, rather",
                "choices": COLOURS,
                "label": i % 4,
                "answer": COLOURS[i % 4].strip(),
                "text": " ".join(
                    f"The {v} was quiet, and the day went on as days do." for v in words[i:] + words[:i][:1]
                ),
            }
            f.write(json.dumps(doc) + "\n")
    data = (
        f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {root}/data.jsonl\n"
        f"  cache_dir: {root}/hf_cache\ntest_split: test\n"
    )
    (root / "mc.yaml").write_text(
        "task: nats_mc\n" + data + "output_type: multiple_choice\ndoc_to_text: '{{question}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: label\nmetric_list:\n  - metric: acc\n"
    )
    (root / "gen.yaml").write_text(
        "task: nats_gen\n" + data + "output_type: generate_until\ndoc_to_text: '{{question}}'\n"
        "doc_to_target: '{{answer}}'\ngeneration_kwargs:\n  until: ['\\n']\n  max_gen_toks: 6\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n  - metric: chrf\n"
    )
    (root / "ppl.yaml").write_text(
        "task: nats_ppl\n" + data + "output_type: loglikelihood_rolling\ndoc_to_text: ''\n"
        "doc_to_target: '{{text}}'\nmetric_list:\n  - metric: word_perplexity\n"
    )
    return TaskManager(include_path=str(root), include_defaults=False)


def evaluate(tasks: TaskManager, model: str, args: str, batch_size: int) -> dict:
    """The three tasks through the harness (max_length 48: the documents take 2-3 rolling windows)."""
    return lm_eval.simple_evaluate(model=model, model_args=f"{args},max_length=48", tasks=TASKS, task_manager=tasks,
                                   device="cpu", batch_size=batch_size, log_samples=True)  # fmt: skip


def scores(result: dict, task: str) -> torch.Tensor:
    """Per document, its requests' log-likelihoods (float64)."""
    return torch.tensor([[_first(r)[0] for r in s["resps"]] for s in result["samples"][task]], dtype=torch.float64)


def greedy(result: dict, task: str) -> list[list[bool]]:
    """Per document, whether each continuation is the greedy one."""
    return [[_first(r)[1] for r in s["resps"]] for s in result["samples"][task]]


def _first(response) -> tuple:
    """A request's answer: (log-likelihood, greedy), or (log-likelihood,) for a rolling one."""
    answer = response[0]
    return tuple(answer) if isinstance(answer, (list, tuple)) else (answer,)


def generations(result: dict) -> list:
    return [s["resps"] for s in result["samples"]["nats_gen"]]


@pytest.fixture(scope="module")
def hf_and_full(tiny, tasks):
    # logits_cache=False: lm-eval 0.4.13's logits cache scores a request whose input (context + continuation but its
    # last token) equals another's, with a shorter continuation, on the first positions of the other's continuation
    # instead of its last ones (here: the last rolling window of one document, whose text another one repeats)
    hf = evaluate(tasks, "hf", f"pretrained={tiny},dtype=float32,logits_cache=False", 3)
    full = evaluate(tasks, "nats", f"pretrained={tiny},policy=full", 3)
    return hf, full


@pytest.fixture(scope="module")
def nats_runs(tiny, tasks):
    args = f"pretrained={tiny},policy=nats,scorers={tiny}/finetune_run/scorers.pt"
    return evaluate(tasks, "nats", args, 1), evaluate(tasks, "nats", args, 4)


# ----------------------------------------------------------------------------------------------------------------
# the full cache scores as the harness' hf model
# ----------------------------------------------------------------------------------------------------------------
def test_full_cache_scores_as_the_harness_hf_model(hf_and_full):
    hf, full = hf_and_full
    for task in ("nats_mc", "nats_ppl"):
        a, b = scores(hf, task), scores(full, task)
        assert a.shape == b.shape and a.numel() >= 3
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-4), (task, (a - b).abs().max())
    assert scores(hf, "nats_mc").shape[1] == len(COLOURS)
    # multiple choice: the same greedy flags, the same accuracy
    assert greedy(hf, "nats_mc") == greedy(full, "nats_mc")
    assert hf["results"]["nats_mc"]["acc,none"] == full["results"]["nats_mc"]["acc,none"]
    # generation: the same text, the same metrics
    assert generations(hf) == generations(full) and any(g[0] for g in generations(full))
    for metric in ("exact_match,none", "chrf,none"):
        assert hf["results"]["nats_gen"][metric] == full["results"]["nats_gen"][metric]
    assert full["results"]["nats_gen"]["chrf,none"] > 0
    ppl = "word_perplexity,none"
    assert full["results"]["nats_ppl"][ppl] == pytest.approx(hf["results"]["nats_ppl"][ppl], rel=1e-5)
    # what the full cache kept: every token it was fed
    info = full["config"]["nats"]
    assert info["policy"] == "full" and info["budget"] is None
    assert set(info["kv"]) == {"loglikelihood", "loglikelihood_rolling", "generate_until"}
    for kind, row in info["kv"].items():
        assert row["rows"] > 0 and row["kv_fraction"] == 1.0 and row["area"] == pytest.approx(1.0), kind
    # 48 tokens a window: the 3 documents take more windows than documents
    assert info["kv"]["loglikelihood_rolling"]["rows"] > 3


# ----------------------------------------------------------------------------------------------------------------
# NAtS: its kept share, its scores, batches
# ----------------------------------------------------------------------------------------------------------------
def test_nats_reports_its_kept_share_and_batches_alike(nats_runs, hf_and_full):
    one, four = nats_runs
    info = four["config"]["nats"]
    assert info["policy"] == "nats" and info["window"] == WINDOW and info["scorers"].endswith("scorers.pt")
    for kind in ("loglikelihood", "loglikelihood_rolling", "generate_until"):
        row = info["kv"][kind]
        assert 0 < row["kv_fraction"] < 1 and 0 < row["area"] < 1, (kind, row)
        assert sum(row["type_fractions"]) == pytest.approx(1.0, abs=1e-5), (kind, row)
    # batch 1 and batch 4 (padding in both directions) score alike, and not as the full cache does
    full = hf_and_full[1]
    for task in ("nats_mc", "nats_ppl"):
        assert torch.allclose(scores(one, task), scores(four, task), rtol=1e-5, atol=1e-4), task
        assert (scores(one, task) - scores(full, task)).abs().max() > 1e-2, task
    assert generations(one) == generations(four)


def test_the_log_names_the_kept_share(tiny, tasks, caplog):
    args = f"pretrained={tiny},policy=nats,scorers={tiny}/finetune_run/scorers.pt"
    with caplog.at_level(logging.INFO, logger="nats.lm_eval"):
        lm_eval.simple_evaluate(model="nats", model_args=args, tasks=["nats_mc"], task_manager=tasks, device="cpu",
                                batch_size=4, limit=2)  # fmt: skip
    lines = [r.getMessage() for r in caplog.records if r.name == "nats.lm_eval"]
    assert any("nats, loglikelihood: the caches of" in m and "kept 0." in m and "global / local / sliding" in m
               for m in lines), lines  # fmt: skip


def test_h2o_at_a_fraction_batches_alike(tiny, tasks):
    """H2O's rows of one batch share a budget in tokens (the engine's padded prefill): a fraction of prompts of
    different lengths is resolved per row, batch 4 scores as batch 1, and H2O keeps about that share."""
    args = f"pretrained={tiny},policy=h2o,budget=0.5"
    one, four = evaluate(tasks, "nats", args, 1), evaluate(tasks, "nats", args, 4)
    for task in ("nats_mc", "nats_ppl"):
        assert torch.allclose(scores(one, task), scores(four, task), rtol=1e-5, atol=1e-4), task
    assert generations(one) == generations(four)
    kv = four["config"]["nats"]["kv"]
    assert 0.3 < kv["loglikelihood_rolling"]["kv_fraction"] < 0.6 and kv["generate_until"]["kv_fraction"] < 0.7


# ----------------------------------------------------------------------------------------------------------------
# refusals
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "args, message",
    [
        ("policy=bogus", "unknown policy='bogus'; available: full,"),
        ("policy=nats", "policy=nats needs NAtS' fine-tuned scorers: pass scorers="),
        ("policy=snapkv", "needs a budget: budget=B"),
        ("policy=full,budget=0.5", "takes no budget"),
        ("policy=streaming_llm,budget=1.5", "budget=1.5 must be a whole number of tokens"),
        ("policy=snapkv,budget=0.5,sinks=4", "unknown model_args ['sinks']"),
        ("policy=full,batch_size=auto", "batch_size=auto is not supported"),
        ("policy=full,scorers=missing.pt", "scorers=missing.pt does not exist"),
    ],
)
def test_settings_refused_before_the_model_loads(tiny, monkeypatch, args, message):
    from lm_eval.utils import simple_parse_args_string

    def no_load(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("nats.hf.pretrained.load_pretrained", no_load)
    with pytest.raises((ValueError, FileNotFoundError)) as err:
        NL.NAtSLM(pretrained=str(tiny), **simple_parse_args_string(args))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_snapkv_window_against_a_short_context_is_one_line(tiny, tasks):
    with pytest.raises(
        ValueError, match=r"snapkv at budget=0.5 of a \d+-token context \(\d+ tokens\): snapkv: window=32"
    ):
        evaluate(tasks, "nats", f"pretrained={tiny},policy=snapkv,budget=0.5", 2)


def test_a_task_that_needs_the_hub_is_refused_in_one_line(tiny):
    """The harness' hellaswag (Rowan/hellaswag on the hub) through ``python -m nats.lm_eval``, as a user runs it (the
    module registers ``nats`` once, beside the harness' models), offline by its own default (neither variable set):
    one line on stderr, exit status 1."""
    cmd = [sys.executable, "-m", "nats.lm_eval", "--model", "nats", "--model_args", f"pretrained={tiny}",
           "--tasks", "hellaswag", "--device", "cpu"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")}
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 1, res.stderr[-3000:]
    message = res.stderr.strip().splitlines()[-1]
    assert message.startswith("nats.lm_eval: task 'hellaswag' needs the dataset 'Rowan/hellaswag' from the Hugging"), (
        res.stderr[-3000:]
    )
    for fix in ("HF_DATASETS_OFFLINE=1", "--include_path", "dataset_path: json", "load_dataset('Rowan/hellaswag')"):
        assert fix in message, fix
    assert "Traceback" not in res.stderr


def test_the_model_is_registered_beside_the_harness_own():
    from lm_eval.api.registry import get_model

    assert get_model("nats") is NL.NAtSLM and issubclass(NL.NAtSLM, get_model("hf"))
