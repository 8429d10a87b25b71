"""nats-generate as a user runs it (the console script, in a subprocess) on a transformers model: a tiny random Llama
and its byte-level BPE tokenizer saved with save_pretrained (nothing downloaded).

Checked: the transformers path prints its summary and writes a complete generation.json (the keys of the GPT kind's
report); a prompt is taken as it is, commas, quotes and brackets included, from ``--prompt TEXT``, ``prompt_file=``
and standard input (``--prompt -``); an override Hydra's grammar cannot read stops with one line (every console
script: `nats.cli.check_override_syntax`); the settings are checked before the model loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from conftest import compose  # noqa: E402
from nats import cli  # noqa: E402
from nats import generate as G  # noqa: E402
from nats.hf.pretrained import save_tiny_random_llama  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

#: commas (a trailing one too), both quotes, brackets, braces, an interpolation, a backslash, a new line
TEXT = 'Once upon a time, in a "small" village, it\'s ${x} [1] {a: b} C:\\path\nthe end,'
#: the keys of the GPT kind's report (nats.generate.generate_report), which summary() reads
REPORT_KEYS = {
    "prompt", "prompt_tokens", "new_tokens", "policy", "budget", "temperature", "top_k", "seed", "device", "precision",
    "decode", "texts", "continuations", "tokens", "stats", "seconds", "tokens_per_s", "model",
}  # fmt: skip
STATS_KEYS = {
    "processed", "layers", "kv_heads", "sequences", "kept", "kept_max", "kv_fraction", "area", "peak", "kept_bytes",
    "full_bytes", "allocated_bytes",
}  # fmt: skip


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """A random 2-layer Llama (hidden 64) and its tokenizer in the transformers layout."""
    return save_tiny_random_llama(tmp_path_factory.mktemp("tiny_llama"))


def nats_generate(args: list[str], stdin: str | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("nats-generate")
    base = [str(exe)] if exe.exists() else [sys.executable, "-m", "nats.generate"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run(
        [*base, *args], input=stdin, capture_output=True, text=True, env=env, timeout=timeout, check=False
    )


def hf_args(tiny: Path, *extra: str) -> list[str]:
    return ["hf_model=smollm2_135m", f"hf_model.name_or_path={tiny}", "device=cpu", *extra]


def read_report(out: Path) -> dict:
    def no_nan(name):
        raise AssertionError(f"generation.json holds {name}: not strict JSON")

    return json.loads((out / "generation.json").read_text(), parse_constant=no_nan)


def one_line(proc: subprocess.CompletedProcess) -> str:
    """The one line a failure prints (no traceback, nothing else)."""
    text = proc.stdout + proc.stderr
    lines = [x for x in text.splitlines() if x.strip()]
    assert proc.returncode != 0, text[-3000:]
    assert "Traceback" not in text and len(lines) == 1, text[-3000:]
    return lines[0]


# ----------------------------------------------------------------------------------------------------------------
# the transformers path's report
# ----------------------------------------------------------------------------------------------------------------
def test_transformers_model_prints_its_summary_and_writes_generation_json(tiny, tmp_path):
    """The user's command (hf_model=..., prompt=..., max_new_tokens=...): the text, the summary and generation.json,
    exit status 0."""
    out = tmp_path / "run"
    proc = nats_generate(
        [f"hydra.run.dir={out}", *hf_args(tiny, "prompt='The capital of France is'", "max_new_tokens=5")]
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "policy full: " in proc.stdout and "(eager decoding)" in proc.stdout and "KV fraction 1.000" in proc.stdout
    report = read_report(out)
    assert REPORT_KEYS <= set(report) and STATS_KEYS <= set(report["stats"])
    assert report["decode"] == "eager" and report["prompt"] == "The capital of France is"
    assert report["new_tokens"] == 5 and len(report["tokens"][0]) == 5  # the new tokens' ids
    assert report["texts"][0] == report["prompt"] + report["continuations"][0]
    assert report["stats"]["kept_max"] == report["stats"]["processed"]  # full keeps every token
    assert report["texts"][0] in proc.stdout


def test_transformers_report_with_a_fraction_budget(tiny, tmp_path):
    """In-process: a budgeted policy's report resolves the fraction to tokens (as the GPT kind's) and summary()
    reads it."""
    extra = ["prompt='Once upon a time'", "max_new_tokens=6", "policy=streaming_llm", "budget=0.5"]
    cfg = compose(hf_args(tiny, *extra), tmp_path, config_name="generate")
    report = G.run(cfg)
    total = report["prompt_tokens"] + 6
    assert report["budget"] == max(1, round(0.5 * total)) and isinstance(report["budget"], int)
    assert report["decode"] == "eager" and report["stats"]["kept_max"] <= report["budget"]
    assert f"policy streaming_llm, budget {report['budget']}: " in G.summary(report)
    assert read_report(tmp_path)["budget"] == report["budget"]


# ----------------------------------------------------------------------------------------------------------------
# the prompt as it is
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["--prompt", "prompt_file", "stdin"])
def test_prompt_with_commas_and_quotes_as_it_is(tiny, tmp_path, how):
    out = tmp_path / "run"
    stdin = None
    if how == "--prompt":
        args = ["--prompt", TEXT]  # before Hydra's overrides
    elif how == "prompt_file":
        (tmp_path / "prompt.txt").write_text(TEXT, encoding="utf-8")
        args = [f"prompt_file={tmp_path / 'prompt.txt'}"]
    else:
        args, stdin = ["--prompt", "-"], TEXT
    proc = nats_generate([*args, f"hydra.run.dir={out}", *hf_args(tiny, "max_new_tokens=2")], stdin=stdin)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    report = read_report(out)
    assert report["prompt"] == TEXT and report["texts"][0].startswith(TEXT)


def test_prompt_arguments():
    """--prompt TEXT (anywhere, or --prompt=TEXT) becomes a quoted override that reads back as TEXT; --prompt - is
    prompt_file=-; the mistakes say what to do."""
    args = G.prompt_arguments(["max_new_tokens=3", "--prompt", TEXT, "device=cpu"])
    assert args[1:] == ["max_new_tokens=3", "device=cpu"] and args[0].startswith("prompt=")
    assert G.prompt_arguments(["--prompt=" + TEXT]) == args[:1]
    assert G.prompt_arguments(["--prompt", "-", "x=1"]) == ["prompt_file=-", "x=1"]
    assert G.prompt_arguments(["--prompt", "--cfg"]) == [f"prompt={cli.hydra_quoted('--cfg')}"]  # the next word is text
    assert G.prompt_arguments(["prompt='a, b'", "x=1"]) == ["prompt='a, b'", "x=1"]  # a quoted override: unchanged
    for argv, needle in [
        (["x=1", "--prompt"], "--prompt needs the text after it"),
        (["--prompt", "a", "--prompt", "b"], "given 2 times"),
        (["--prompt", "a", "prompt=b"], "--prompt and prompt= both"),
        (["--prompt", "a", "prompt_file=b.txt"], "--prompt and prompt_file= both"),
        (["prompt=Once upon a time, in a village,"], "--prompt"),  # Hydra's grammar: one line naming --prompt
        (["prompt=Once upon a time, in a village"], "--prompt"),  # a sweep ("Ambiguous value")
    ]:
        with pytest.raises(ValueError, match=needle):
            G.prompt_arguments(argv)
    assert G.prompt_arguments(["-m", "prompt=a,b"]) == ["-m", "prompt=a,b"]  # a sweep over two prompts


@pytest.mark.parametrize(
    "text", [TEXT, "", "'", '"', "\\", "a\\", "\\${x}", "$${", "${a}${b}\\\\${c}", 'it\'s "both"', " lead, trail "]
)
def test_hydra_quoted_reads_back_as_the_text(text, tmp_path):
    cfg = compose([f"prompt={cli.hydra_quoted(text)}"], tmp_path, config_name="generate")
    assert cfg.prompt == text


# ----------------------------------------------------------------------------------------------------------------
# Hydra's grammar: one line
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "arg,needles",
    [
        ("prompt=Once upon a time, in a small village,", ["--prompt", "prompt_file="]),
        ("prompt=Once upon a time, in a small village", ["--prompt", "prompt_file="]),
        ("top_k=[5", ["'top_k=[5'", "quote the value", "\"top_k='[5'\""]),
        ("max_new_tokens=3,4", ["sweep", "--multirun", "\"max_new_tokens='3,4'\""]),
    ],
)
def test_malformed_override_is_one_line(tiny, tmp_path, arg, needles):
    line = one_line(nats_generate([f"hydra.run.dir={tmp_path / 'run'}", *hf_args(tiny), arg]))
    assert line.startswith("nats-generate: ")
    for needle in needles:
        assert needle in line, (needle, line)
    assert not (tmp_path / "run").exists()  # stopped before Hydra made the run folder


def test_check_override_syntax():
    """Every console script's boundary (nats.cli.console): the first unreadable override named, with its quoted
    form; flags and their values are Hydra's."""
    assert cli.check_override_syntax(["a=1", "--cfg", "job", "b='x, y'", "-m", "c=1,2"]) is None
    message = cli.check_override_syntax(["a=1", "prompt=it's"])
    assert message.startswith('Hydra cannot read the override "prompt=it\'s"') and '"prompt=\\"it\'s\\""' in message
    assert "is not an override key=value" in cli.check_override_syntax(["justaword"])
    assert "sweep" in cli.check_override_syntax(["c=1,2"])
    assert "\n" not in cli.check_override_syntax(["p=a\nb, c,"])  # one line


def test_another_console_script_answers_in_one_line(tmp_path):
    exe = Path(sys.executable).with_name("nats-prepare")
    base = [str(exe)] if exe.exists() else [sys.executable, "-m", "nats.prepare"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("HYDRA_FULL_ERROR", None)
    proc = subprocess.run(
        [*base, f"hydra.run.dir={tmp_path / 'run'}", "data.name=a]b"], capture_output=True, text=True, env=env
    )
    assert one_line(proc).startswith("nats-prepare: Hydra cannot read the override 'data.name=a]b'")


# ----------------------------------------------------------------------------------------------------------------
# the settings, before the model loads
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "extra,error,match",
    [
        (["scorers=missing.pt"], FileNotFoundError, "scorers=missing.pt does not exist"),
        (["policy=nats", "scorers=missing.pt"], FileNotFoundError, "scorers=missing.pt does not exist"),
        (["policy=nats", "scorers={tiny}/config.json"], ValueError, "not a readable torch file"),
        (["policy=streaming_llm", "budget=-2"], ValueError, "budget=-2 must be a whole number"),
        (["policy=h2o"], ValueError, "'h2o' needs a budget"),
        (["policy=full", "budget=4"], ValueError, "'full' takes no budget"),
        (["policy=h2o_dense", "budget=4"], ValueError, "'h2o_dense' is a parallel approximation"),
        (["policy=bogus"], ValueError, "unknown cache policy 'bogus'"),
        (["type_bias=[1.0,0.0,0.0]"], ValueError, "type_bias offsets NAtS scorers"),
    ],
)
def test_settings_are_checked_before_the_model_loads(tiny, tmp_path, monkeypatch, extra, error, match):
    import nats.hf.pretrained as pretrained

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the settings were checked")

    monkeypatch.setattr(pretrained, "load_pretrained", no_load)
    overrides = [a.format(tiny=tiny) for a in extra]
    cfg = compose(hf_args(tiny, "prompt=Hello", "max_new_tokens=3", *overrides), tmp_path, "generate")
    with pytest.raises(error, match=match):
        G.generate_report(cfg)


def test_missing_scorers_stop_before_a_model_that_would_not_load(tmp_path):
    """The console script: a model folder that passes the offline check but cannot load (config.json only) and a
    scorer file that does not exist: the scorer file is named, in one line (the load, 25-33 s for SmolLM2, never
    starts)."""
    broken = tmp_path / "broken_model"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    args = [f"hydra.run.dir={tmp_path / 'run'}", *hf_args(broken, f"scorers={tmp_path}/missing.pt", "prompt=Hi")]
    line = one_line(nats_generate(args))
    assert line == f"nats-generate: scorers={tmp_path}/missing.pt does not exist: pass <fine-tuning run>/scorers.pt " \
        "(or its .ckpt, or an adapter folder)"  # fmt: skip
