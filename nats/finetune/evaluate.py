"""Long-context accuracy against KV budget of a Hugging Face model: the library of `nats-eval-hf` (its entry point
is `nats.eval_hf`; docs/hf_eval.md).

The pretrained model (``hf_model``, `nats.hf.pretrained.load_pretrained`), with NAtS attached and its fine-tuned
scorer weights loaded when ``scorers`` is given (else `use_policy_caches`), answers the long-context examples of
`nats.data.longctx` (built with the model's tokenizer, from an evaluation seed and PG-19 split). Every method of
``methods`` (an entry of ``policies``, conf/cache/*.yaml) runs once, a budgeted one at every fraction of
``budgets`` (B = round(fraction x the example's prompt length)): greedy ``model.generate`` with batch 1 and a
fresh `nats.hf.StaticPolicyCache` per example, so NAtS and the baselines share one decode path.

Scoring (per example a score in [0, 1]; RULER's ``string_match_all`` for the synthetic tasks):

* ``passkey``, ``niah``, ``variable_tracking``: the fraction of the expected strings (the pass key; the needle's
  value; the chain's variable names) found in the decoded new text, case-insensitive, as whole words (not inside a
  longer number or name). ``correct``: all of them found.
* ``longbench/<dataset>`` (``longbench.path`` set; `nats.data.longctx.longbench`): LongBench's own metric of the dataset
  (QA F1, ROUGE-L, classification, retrieval, count, code similarity), ``max_new`` = its generation length.
* ``pg19_continuation``: teacher-forced greedy next-token accuracy over the book's next ``continuation_tokens``
  tokens: the prompt, then those tokens, are fed through the cache, and each argmax prediction is compared with the
  true next token (free-running greedy text is scored 0 once it drifts from the book by one word). ``correct``: all
  of them right; ``nll``: their mean negative log-likelihood (the table shows its perplexity).

Measured per example (means over layers and KV heads, and per layer and KV head): ``area`` and ``peak`` (the
cache's KV area and peak fractions over prompt and decoding, ``StaticPolicyCache.fractions()``, spec section 6) and
``kv_fraction``, the tokens held at the end over the tokens the cache has seen (prompt + fed-back new tokens: 1
for ``full``, about the budget fraction for StreamingLLM); for NAtS also the fractions of global / local / sliding
tokens.

Outputs in ``${paths.output_dir}``: ``results.jsonl`` (one line per method, budget and example, appended as soon as
it is computed; a rerun in the same folder skips the lines present), ``run.json`` (the settings a resumed run must
share), and, rewritten after every (method, budget), ``results.md`` (accuracy per task and mean, KV area, peak and
kv_fraction per method @ budget), ``summary.json``, ``accuracy_vs_kv.png`` and ``kv_fractions.json`` (per layer and
KV head, the layout of nats-eval's).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from nats.cache.registry import get_cache_class
from nats.data.longctx import LongContextExample, load_or_build_examples
from nats.data.longctx.longbench import fingerprint, load_longbench
from nats.data.longctx.scoring import (  # noqa: F401 (nats.finetune.evaluate.score & co. stay importable)
    _round,
    budget_tokens,
    compressed_length,
    key_of,
    match_score,
    new_tokens,
    references,
    result_row,
    score,
    token_accuracy,
)
from nats.data.longctx.tasks import check_pg19_path
from nats.evaluation import configured_methods
from nats.hf.compat import cache_kwargs, generate_through
from nats.hf.pretrained import PRETRAINED_KEYS, check_dms, check_scorers_path, prepare_model, type_bias_of
from nats.utils import atomic_path, atomic_write, resolve_device
from nats.utils import markdown_table as table

log = logging.getLogger(__name__)

RESULTS, SETTINGS = "results.jsonl", "run.json"
TABLE, SUMMARY, PLOT, KV_FRACTIONS = "results.md", "summary.json", "accuracy_vs_kv.png", "kv_fractions.json"
#: the settings a resumed run must share with the rows already in its folder
RESUME_KEYS = (
    "model",
    "scorers",
    "dms",
    "window",
    "type_bias",
    "examples",
    "longbench",
    "answer_margin",
    "continuation_tokens",
    "protocol",
)


# ----------------------------------------------------------------------------------------------------------------
# scoring
# ----------------------------------------------------------------------------------------------------------------
# ----------------------------------------------------------------------------------------------------------------
# plan: methods x budgets, checked before anything runs
# ----------------------------------------------------------------------------------------------------------------
def plan_methods(cfg: DictConfig, has_scorers: bool) -> list[dict[str, Any]]:
    """The (method, budget fraction) runs; raises on unknown methods, `nats` without scorers and bad budgets."""
    runs = []
    for method, pcfg, cls, options in configured_methods(cfg):
        if pcfg.get("kvpress"):  # a kvpress press (conf/kvpress/*.yaml; nats.finetune.kvpress_methods)
            runs += _plan_kvpress(cfg, method, pcfg)
            continue
        try:
            cls.check_use(0.5 if cls.budgeted else None)  # it decodes (the budgets are checked below)
        except ValueError as err:
            raise ValueError(f"method {method!r}: {err}") from None
        if cls.requires_core == "dms" and not cfg.get("dms"):
            raise ValueError(
                f"method {method!r} needs DMS' retrofit: pass dms=<retrofit run>/dms_q_proj.pt (written by nats-train "
                "experiment=finetune_smollm2_dms), or drop it from methods"
            )
        if cls.requires_core == "nats" and not has_scorers:
            raise ValueError(
                f"method {method!r} needs scorers: pass scorers=<fine-tuning run>/scorers.pt (written by "
                "nats-train experiment=finetune_smollm2_nats), or drop it from methods"
            )
        budgets: list[float | None] = [None]
        if cls.budgeted:
            budgets = list(_budgets(cfg, method))
        label = pcfg.get("label", method)
        runs += [
            {"method": method, "policy": pcfg.name, "label": label, "budget": b, "options": options} for b in budgets
        ]
    return runs


PROTOCOLS = ("project", "kvpress")


def check_protocol(cfg: DictConfig) -> str:
    """``protocol`` (one line unless ``project`` or ``kvpress``): kvpress' compresses each example's context before its
    question (question-agnostic, `nats.data.longctx.tasks.question_start`) at ``compression_ratios`` (the share
    removed), then feeds the question uncompressed; the project's compresses the whole prompt at ``budgets``."""
    protocol = str(cfg.get("protocol", "project"))
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol={protocol!r}: choose one of {', '.join(PROTOCOLS)}")
    if protocol == "kvpress":
        ratios = cfg.get("compression_ratios") or []
        if not ratios or any(isinstance(r, bool) or not 0 < float(r) < 1 for r in ratios):
            raise ValueError(f"protocol=kvpress needs compression_ratios in (0, 1) (the share removed), got {ratios}")
    return protocol


def _budgets(cfg: DictConfig, method: str) -> list[float]:
    if check_protocol(cfg) == "kvpress":  # the kept share of each example's context
        return [1 - float(r) for r in cfg.compression_ratios]
    if not cfg.get("budgets"):
        raise ValueError(f"method {method!r} needs budgets: set budgets=[0.5,0.25,...] (prompt fractions)")
    budgets = []
    for b in cfg.budgets:
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not 0 < b < 1:
            raise ValueError(f"budgets are fractions of the prompt length in (0, 1); got {b!r}")
        budgets.append(float(b))
    return budgets


def _plan_kvpress(cfg: DictConfig, method: str, pcfg: DictConfig) -> list[dict[str, Any]]:
    """The runs of a kvpress method (``kvpress: <press>`` in its config), at every budget; kvpress must import."""
    from nats.finetune.kvpress_methods import PRESSES, kvpress_module

    press = str(pcfg.kvpress)
    if press not in PRESSES:
        raise ValueError(f"method {method!r}: unknown kvpress press {press!r}; available: {', '.join(PRESSES)}")
    try:
        kvpress_module()
    except ImportError as err:
        raise ValueError(f"method {method!r}: {err}") from None
    opts = pcfg.get("options")
    options = OmegaConf.to_container(opts, resolve=True) if opts else {}
    label = pcfg.get("label", method)
    return [
        {
            "method": method,
            "policy": f"kvpress:{press}",
            "press": press,
            "label": label,
            "budget": b,
            "options": options,
        }
        for b in ([None] if PRESSES[press] is None else _budgets(cfg, method))
    ]


def check_budgets(runs: list[dict[str, Any]], examples: list[LongContextExample]) -> None:
    """Every budgeted run's budget in tokens suits every prompt (the policy's own `check_budget` message)."""
    for run in runs:
        if run["budget"] is None:
            continue
        if "press" in run:
            from nats.finetune.kvpress_methods import check_budget as check  # noqa: PLC0415

            def check(b, n, _check=check, _press=run["press"], _options=run["options"]):
                _check(_press, b, n, **_options)
        else:
            check = get_cache_class(run["policy"]).rule(**run["options"]).check_budget
        for ex in examples:
            n = len(ex.prompt_ids)
            b = budget_tokens(run["budget"], n)
            try:
                check(b, n)
            except ValueError as err:
                raise ValueError(
                    f"{run['method']} at budget {run['budget']} of the {n}-token prompt of {ex.task} example "
                    f"{ex.meta.get('index')} = {b} tokens: {err}"
                ) from err


# ----------------------------------------------------------------------------------------------------------------
# model and scorers
# ----------------------------------------------------------------------------------------------------------------
def load_model(hf_model: DictConfig, device: torch.device) -> tuple[Any, Any]:
    """The pretrained model (eval mode, on `device`) and its tokenizer (`nats.hf.pretrained.load_pretrained`)."""
    from nats.hf.pretrained import load_pretrained, pretrained_kwargs  # transformers, imported when needed

    return load_pretrained(**pretrained_kwargs(hf_model), device=device)


# ----------------------------------------------------------------------------------------------------------------
# one example
# ----------------------------------------------------------------------------------------------------------------
def generate_one(model: Any, prompt: list[int], n_new: int, cache: Any) -> list[int]:
    """Greedy decoding of up to `n_new` tokens (fewer when the model ends with EOS) through `cache`."""
    out = generate_through(model, torch.tensor([prompt], device=model.device), cache, n_new)
    return out[0, len(prompt) :].tolist()


def continue_one(model: Any, prompt: list[int], reference: list[int], cache: Any) -> tuple[list[int], float]:
    """Teacher-forced greedy predictions of the `reference` tokens through `cache` (the prompt, then the reference
    tokens but the last, fed in) and the mean NLL of the reference."""
    ids = torch.tensor([prompt + reference[:-1]], device=model.device)
    P = len(prompt)
    with torch.no_grad():
        logits = model(ids[:, :P], use_cache=True, logits_to_keep=1, **cache_kwargs(model, cache)).logits
        if len(reference) > 1:  # the tokens that follow the prompt: they continue the cached sequence
            rest = model(ids[:, P:], use_cache=True, **cache_kwargs(model, cache)).logits
            logits = torch.cat([logits, rest], dim=1)
    logits = logits[0].float()
    nll = F.cross_entropy(logits, torch.tensor(reference, device=logits.device))
    return logits.argmax(-1).tolist(), float(nll)


def evaluate_one(model, tokenizer, example: LongContextExample, run: dict[str, Any], cfg: DictConfig) -> dict:
    """Answer one example with `run`'s method and budget; its score and KV measurements (a row)."""
    from nats.hf import StaticPolicyCache

    if "press" in run:  # kvpress: its press on a transformers DynamicCache (nats.finetune.kvpress_methods)
        from nats.finetune.kvpress_methods import evaluate_one as evaluate_press  # noqa: PLC0415

        return evaluate_press(model, tokenizer, example, run, cfg)
    prompt = example.prompt_ids
    k = int(cfg.continuation_tokens)
    n_new = new_tokens(example, int(cfg.answer_margin), k)
    context = compressed_length(example, tokenizer, check_protocol(cfg))
    b = budget_tokens(run["budget"], context)
    extra = {} if b is None else {"budget": b}
    # the engine's cache with growth (the number of new tokens is not known: decoding stops at the end token), its
    # NAtS prefill by the PyTorch reference (the quality tables are measured on it)
    cache = StaticPolicyCache(model, run["policy"], max_len=len(prompt) + n_new, backend=cfg.backend,
                              prefill_kernel="torch", **extra, **run["options"])  # fmt: skip
    t0 = time.time()
    nll = None
    if context < len(prompt):  # the context alone compressed, then the question continues it (uncompressed)
        ids = torch.tensor([prompt[:context]], device=model.device)
        with torch.no_grad():
            model(ids, use_cache=True, logits_to_keep=1, **cache_kwargs(model, cache))
        cache.history = ids  # what generate continues
    if example.task == "pg19_continuation":
        generated, nll = continue_one(model, prompt, example.answer_ids[:n_new], cache)
    else:
        generated = generate_one(model, prompt, n_new, cache)
    seconds = time.time() - t0
    text = tokenizer.decode(generated, skip_special_tokens=True)
    fr = cache.fractions()
    area, peak = fr["area"][:, 0], fr["peak"][:, 0]  # [n_layer, Hkv]
    seen = int(cache.get_seq_length())
    kept = cache.kept()[:, 0].double()
    per_head = {"area": _round(area), "peak": _round(peak), "kv_fraction": _round(kept / seen)}
    if cache.counts_types():  # NAtS: global / local / sliding
        per_head["type_fractions"] = _round(cache.type_fractions()[:, 0])
    kv = {"area": area.mean(), "peak": peak.mean(), "kv_fraction": (kept / seen).mean()}
    return result_row(run, example, budget_tokens=b, generated=generated, text=text, k=k, nll=nll, kv=kv,
                      kept=kept.mean(), seen=seen, seconds=seconds, per_head=per_head)  # fmt: skip


# ----------------------------------------------------------------------------------------------------------------
# results.jsonl: appended line by line, read back for resuming
# ----------------------------------------------------------------------------------------------------------------
def row_key(row: dict[str, Any]) -> tuple:
    return row["method"], row["budget"], row["task"], row["index"]


def append_row(path: Path, row: dict[str, Any]) -> None:
    """Append one JSON line with a single write, flushed to disk: a crash leaves whole lines and at most a cut last
    line without its newline, which `read_rows` drops."""
    with open(path, "ab") as f:
        f.write((json.dumps(row) + "\n").encode())
        f.flush()
        os.fsync(f.fileno())


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of results.jsonl; a cut last line (an interrupted write) is removed from the file."""
    if not path.is_file():
        return []
    text = path.read_text(encoding="utf-8")
    whole, _, cut = text.rpartition("\n")
    if cut:
        log.warning(f"{path}: dropping an incomplete last line (an interrupted write)")
        atomic_write(path, whole + "\n" if whole else "")
    rows = []
    for i, line in enumerate(whole.splitlines(), 1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}, line {i} is not JSON ({err}): remove it to resume") from None
    return rows


def check_settings(out: Path, settings: dict[str, Any]) -> None:
    """Write run.json, or check that the folder's results were computed with the same settings (methods may be
    added; a method run before must keep its options)."""
    path = out / SETTINGS
    if path.is_file():
        saved = json.loads(path.read_text())
        saved.setdefault("protocol", "project")  # a folder written before the protocols: the project's
        saved.setdefault("dms", None)  # ... before DMS' retrofit
        differ = [k for k in RESUME_KEYS if saved.get(k) != settings.get(k)]
        old, new = saved.get("policies", {}), settings["policies"]
        differ += [f"policies.{m}" for m in new if m in old and old[m] != new[m]]
        settings = {**settings, "policies": {**old, **new}}
        if differ:
            raise ValueError(
                f"{out} holds results of other settings ({', '.join(differ)} differ from {path}): resume with the "
                "same model, scorers, data and options, or write to a new folder"
            )
    atomic_write(path, json.dumps(settings, indent=1) + "\n")


# ----------------------------------------------------------------------------------------------------------------
# summary: table, plot, per-head fractions
# ----------------------------------------------------------------------------------------------------------------
def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def summarize(rows: list[dict[str, Any]], runs: list[dict[str, Any]], tasks: list[str]) -> list[dict[str, Any]]:
    """Per run (method @ budget) with rows: accuracy per task (mean score), their mean, and the mean KV fractions."""
    out = []
    for run in runs:
        mine = [r for r in rows if r["method"] == run["method"] and r["budget"] == run["budget"]]
        if not mine:
            continue
        acc = {t: _mean([r["score"] for r in mine if r["task"] == t]) for t in tasks}
        done = [a for a in acc.values() if a == a]  # tasks with rows (not NaN)
        nll = [r["nll"] for r in mine if r.get("nll") is not None]
        out.append(
            {
                **{k: run[k] for k in ("method", "label", "policy", "budget")},
                "examples": len(mine),
                "accuracy": acc,
                "mean_accuracy": _mean(done),
                **{k: _mean([r[k] for r in mine]) for k in ("area", "peak", "kv_fraction")},
                "continuation_ppl": math.exp(_mean(nll)) if nll else None,
            }
        )
    return out


def _name(s: dict[str, Any]) -> str:
    return s["label"] if s["budget"] is None else f"{s['label']} @ {s['budget']:g}"


def markdown_table(summary: list[dict[str, Any]], tasks: list[str], header: str) -> str:
    """results.md: ``header``, then accuracy per task and mean, KV area, peak and kv_fraction per method @ budget."""
    ppl = "pg19_continuation" in tasks
    columns = [
        "method @ budget",
        *tasks,
        "mean",
        "KV area",
        "KV peak",
        "kv_fraction",
        *(["pg19 ppl"] if ppl else []),
        "examples",
    ]
    rows = []
    for s in summary:
        cont = s["continuation_ppl"]
        rows.append(
            [
                _name(s),
                *("-" if a != a else f"{100 * a:.1f}" for a in s["accuracy"].values()),
                f"{100 * s['mean_accuracy']:.1f}",
                f"{s['area']:.3f}",
                f"{s['peak']:.3f}",
                f"{s['kv_fraction']:.3f}",
                *((["-" if cont is None else f"{cont:.2f}"]) if ppl else []),
                s["examples"],
            ]
        )
    lines = [header, "", table(columns, rows)]
    lines.append(
        "\nAccuracy: mean score in percent (RULER's string_match_all; pg19_continuation: teacher-forced greedy "
        "next-token accuracy over the book's next k tokens; pg19 ppl: their perplexity); mean = over tasks. KV area / "
        "peak: fractions of the full cache over prompt and decoding; kv_fraction: tokens held at the end / tokens "
        "seen. Means over layers, KV heads and examples."
        + (" longbench/*: LongBench's metric of each dataset." if any("longbench/" in t for t in tasks) else "")
    )
    return "\n".join(lines) + "\n"


def plot(summary: list[dict[str, Any]], path: Path, title: str) -> None:
    from matplotlib.figure import Figure  # no pyplot: the caller's backend (a notebook's inline one) stays
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter

    by_label: dict[str, list[dict]] = {}
    for s in summary:
        by_label.setdefault(s["label"], []).append(s)
    # the legend goes below both panels, where it hides no point (several NAtS rows make it long): 0.3 inch a row
    legend_rows = -(-len(by_label) // 3)
    height = 4 + 0.3 * legend_rows
    fig = Figure(figsize=(10, height))
    axes = fig.subplots(1, 2, sharey=True)
    for ax, key in zip(axes, ("kv_fraction", "area")):
        for label, points in by_label.items():
            points = sorted(points, key=lambda s: s[key])
            style = {"marker": "*", "markersize": 12} if points[0]["budget"] is None else {"marker": "o"}
            xs, ys = [s[key] for s in points], [100 * s["mean_accuracy"] for s in points]
            ax.plot(xs, ys, label=label, linestyle="-" if len(points) > 1 else "none", **style)
        ax.set_xscale("log")
        # plain fractions at powers of two (budgets are 1/2, 1/4, ...): log-scale minor labels overlap
        ax.xaxis.set_major_locator(FixedLocator([1 / 2**k for k in range(7)]))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_ylim(-2, 102)
        ax.set_xlabel({"kv_fraction": "KV kept at the end / tokens seen", "area": "KV area fraction"}[key])
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("mean accuracy (%)")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(3, len(labels)), frameon=False)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.3 * legend_rows / height + 0.02, 1, 1))
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120, format="png")


def kv_fractions(rows: list[dict[str, Any]], summary: list[dict[str, Any]]) -> dict[str, Any]:
    """Per method @ budget, the per layer and KV head fractions averaged over its examples."""
    methods = {}
    for s in summary:
        mine = [r["per_head"] for r in rows if r["method"] == s["method"] and r["budget"] == s["budget"]]
        methods[_name(s)] = {
            "method": s["method"],
            "budget": s["budget"],
            **{k: _round(torch.tensor([p[k] for p in mine]).mean(0)) for k in mine[0]},
        }
    return {
        "layout": "area/peak/kv_fraction: [layer][kv_head]; type_fractions: [layer][kv_head][global, local, sliding]",
        "methods": methods,
    }


def write_summary(out: Path, rows, runs, tasks: list[str], header: str) -> list[dict[str, Any]]:
    summary = summarize(rows, runs, tasks)
    if summary:
        atomic_write(out / TABLE, markdown_table(summary, tasks, header))
        atomic_write(out / SUMMARY, json.dumps({"header": header, "tasks": tasks, "results": summary}, indent=1))
        atomic_write(out / KV_FRACTIONS, json.dumps(kv_fractions(rows, summary)))
        plot(summary, out / PLOT, header.split(":")[0])
    return summary


# ----------------------------------------------------------------------------------------------------------------
# the run
# ----------------------------------------------------------------------------------------------------------------
def check_inputs(cfg: DictConfig) -> list[dict[str, Any]]:
    """The checks of the settings that need neither the model nor the examples, made before the (slow) model load,
    and by nats-eval-hf before its run folder is made: the methods and their budgets (`plan_methods`), the scorers
    file, the longest example against the model's context, the device. Returns the planned runs."""
    runs = plan_methods(cfg, has_scorers=bool(cfg.get("scorers")))
    if cfg.get("scorers"):
        check_scorers_path(cfg.scorers)
    check_dms(cfg)
    check_pg19_path(cfg.data.get("pg19_path"))
    max_context = cfg.hf_model.get("max_context")
    longest = int(cfg.data.max_length) + int(cfg.answer_margin)
    if max_context and longest > int(max_context):
        raise ValueError(
            f"data.max_length + answer_margin = {longest} exceeds hf_model.max_context={max_context}: "
            "use a smaller data.max_length"
        )
    resolve_device(str(cfg.device))
    return runs


def run(cfg: DictConfig) -> dict[str, Any]:
    """Evaluate every (method, budget, example) not yet in ``${paths.output_dir}/results.jsonl``; write the summary
    outputs; returns ``{"summary", "rows", "computed"}``."""
    runs = check_inputs(cfg)  # before the model is loaded
    data = OmegaConf.to_container(cfg.data, resolve=True)
    device = resolve_device(str(cfg.device))
    model, tokenizer = load_model(cfg.hf_model, device)
    window = prepare_model(cfg, model)
    examples, examples_path = load_or_build_examples(tokenizer, **data)
    lb = cfg.get("longbench") or {}
    longbench = None
    if lb.get("path"):  # prompt + the dataset's generation length <= data.max_length, as the generated tasks
        opts = {"num_examples": lb.get("num_examples"), "chat_template": lb.get("chat_template", "auto")}
        lb_examples = load_longbench(lb.path, list(lb.datasets), tokenizer, data["max_length"], **opts)
        longbench = {"datasets": list(lb.datasets), "examples": fingerprint(lb_examples)}
        examples = examples + lb_examples
    check_budgets(runs, examples)

    out = Path(cfg.paths.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    tasks = list(dict.fromkeys(ex.task for ex in examples))
    settings = {
        "model": {k: cfg.hf_model.get(k) for k in PRETRAINED_KEYS},
        "scorers": str(Path(cfg.scorers).resolve()) if cfg.get("scorers") else None,
        "dms": str(Path(cfg.dms).resolve()) if cfg.get("dms") else None,
        "window": window,
        "type_bias": type_bias_of(cfg) if window else None,
        "examples": examples_path.name,
        "longbench": longbench,
        "data": data,
        "answer_margin": int(cfg.answer_margin),
        "continuation_tokens": int(cfg.continuation_tokens),
        "protocol": check_protocol(cfg),
        "policies": {r["method"]: r["options"] for r in runs},
        "device": str(device),
    }
    check_settings(out, settings)
    header = (
        f"{cfg.hf_model.name_or_path}: accuracy vs KV budget, {len(examples)} examples ({', '.join(tasks)}; "
        f"{data['min_length']}-{data['max_length']} tokens, seed {data['seed']}, PG-19 split {data['split']})"
        + (f", NAtS scorers {cfg.scorers} (W = {window})" if window else "")
        + (f", type bias (g, l, s) = {tuple(settings['type_bias'])}" if settings["type_bias"] else "")
    )

    results = out / RESULTS
    wanted = {row_key(key_of(r, ex)) for r in runs for ex in examples}
    rows = [x for x in read_rows(results) if row_key(x) in wanted]
    done = {row_key(x) for x in rows}
    if done:
        log.info(f"resuming: {len(done)} of {len(wanted)} results already in {results}")
    todo = [(r, ex) for r in runs for ex in examples if row_key(key_of(r, ex)) not in done]
    order = str(cfg.get("order", "methods"))
    if order == "examples":  # every method on one example, then the next (kvpress methods share its prefill);
        # the tasks' first examples first, then their second ones, ... (a run stopped early has every task)
        position = {id(ex): (ex.meta.get("index", i), i) for i, ex in enumerate(examples)}
        todo.sort(key=lambda pair: position[id(pair[1])])  # stable: the methods' order within an example
    elif order != "methods":
        raise ValueError(f"order must be methods or examples, got {order!r}")
    left = {id(r): sum(rr is r for rr, _ in todo) for r in runs}
    mine = {id(r): [x for x in rows if (x["method"], x["budget"]) == (r["method"], r["budget"])] for r in runs}

    def finished(r) -> None:
        acc, kv = _mean([x["score"] for x in mine[id(r)]]), _mean([x["kv_fraction"] for x in mine[id(r)]])
        log.info(
            f"{_name(r)}: {len(mine[id(r)])}/{len(examples)} examples, accuracy {100 * acc:.1f}%, kv_fraction {kv:.3f}"
        )

    computed = 0
    with tqdm(total=len(todo), desc="nats-eval-hf", disable=not cfg.get("progress", True), dynamic_ncols=True) as bar:
        for r in runs:
            if not left[id(r)]:
                finished(r)
        for r, ex in todo:
            acc = f"{100 * _mean([x['score'] for x in mine[id(r)]]):.1f}%" if mine[id(r)] else "-"
            bar.set_postfix_str(f"{_name(r)}: {ex.task} #{ex.meta['index']}, accuracy so far {acc}")
            row = evaluate_one(model, tokenizer, ex, r, cfg)
            append_row(results, row)
            rows.append(row)
            mine[id(r)].append(row)
            computed += 1
            bar.update(1)
            left[id(r)] -= 1
            if not left[id(r)]:
                finished(r)
                write_summary(out, rows, runs, tasks, header)
    summary = write_summary(out, rows, runs, tasks, header)
    log.info(markdown_table(summary, tasks, header))
    log.info(f"outputs in {out.resolve()}")
    return {"summary": summary, "rows": rows, "computed": computed}
