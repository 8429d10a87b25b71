"""Perplexity against KV-cache budget of a nats-train checkpoint (NATS_SPEC.md sections 6-8): the library of
`nats-eval` (its entry point is `nats.eval`), also run at the end of training (`nats.callbacks.EvalAfterTraining`).

Protocol (spec section 8): the split's tokens cut into non-overlapping windows of N + 1 tokens (N = the model's
block_size unless `block_size` is given), each window from an empty cache, perplexity = exp(mean next-token NLL
over all predicted tokens). Every method of `methods` (an entry of `policies`, conf/cache/*.yaml) runs at every
budget of `budgets` if it is budgeted, else once; `nats` only on NAtS models. Reported per method and budget:
perplexity, area fraction and peak fraction (spec section 6), measured from the caches' per-step sizes and
averaged over layers, KV heads and windows (for fixed budgets they equal `budget_fractions(B, N)`).

Each policy runs its exact parallel path (`sequential: false`: one layer-wise masked forward per window batch;
for full, streaming_llm and nats) or the token-by-token decode loop (`sequential: true`, the default for h2o).
`h2o_dense` is a labelled parallel approximation of H2O, not H2O.

Outputs, written only after everything has been computed (through temporary files renamed at the end), to
`${paths.output_dir}` (the Hydra run folder): results.csv, results.json, results.md, ppl_vs_area.png,
ppl_vs_peak.png and kv_fractions.json (per layer and KV head: area and peak fractions of every method and, for
nats, the fractions of global / local / sliding tokens).
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hydra
import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf, open_dict
from tqdm.auto import tqdm

from nats.attention.registry import decodable_attention
from nats.cache.budget import resolve_budget
from nats.cache.decode import check_graph, policy_logits
from nats.cache.registry import get_cache_class
from nats.data.windows import check_eval_windows
from nats.functional import budget_fractions
from nats.hub import load_checkpoint
from nats.models.gpt import GPT, GPTConfig
from nats.utils import markdown_table as table
from nats.utils import resolve_device

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}
OUTPUT_FILES = ("results.csv", "results.json", "results.md", "ppl_vs_area.png", "ppl_vs_peak.png", "kv_fractions.json")
# the logits of a batch are computed for at most this many bytes of fp32 logits at a time (the windows of a batch
# are independent): batch_size=128 at N = 1024 would otherwise hold 128 x 1024 x 50304 x 4 bytes = 26 GB at once
LOGITS_BYTES = 2 << 30


# ----------------------------------------------------------------------------------------------------
# checkpoint
# ----------------------------------------------------------------------------------------------------
def check_decodable(config: GPTConfig, name: str) -> None:
    """nats-eval evaluates causal language models whose attention the KV caches decode (`nats.hub.load_checkpoint`
    reads any nats-train checkpoint); others are refused, naming the checkpoint (``name``)."""
    attention = config.attention.get("name")
    supported = decodable_attention()  # the cores that declare a decode_policy
    if attention not in supported or not config.causal or config.n_out is not None:
        raise ValueError(
            f"{name} holds a model of another architecture (attention {attention!r}, causal={config.causal}, "
            f"n_out={config.n_out}): nats-eval evaluates causal language models with attention "
            f"{' or '.join(supported)} (model/attention=dense or model/attention=nats)"
        )


# ----------------------------------------------------------------------------------------------------
# plan: methods x budgets, all checked before anything runs
# ----------------------------------------------------------------------------------------------------
def configured_methods(cfg: DictConfig) -> Iterator[tuple[str, Any, type, dict[str, Any]]]:
    """``(method, its entry of policies, the policy's cache class, its options)`` for each method of
    ``cfg.methods``, once each, in order: the lookup that both run planners share (`plan_runs` here and
    `nats.finetune.evaluate.plan_methods`). An empty ``methods`` and a method that is not a configured policy are
    errors that name the configured ones."""
    policies = cfg.get("policies") or {}
    methods = list(cfg.get("methods") or [])
    if not methods:
        raise ValueError(f"methods is empty: list some of {', '.join(policies)}, e.g. methods=[full,h2o]")
    for method in dict.fromkeys(methods):
        if method not in policies:
            raise ValueError(
                f"unknown method {method!r}; available: {', '.join(policies)} (it is not one of the configured "
                "policies: conf/cache/*.yaml, composed into `policies`)"
            )
        pcfg = policies[method]
        opts = pcfg.get("options")
        options = OmegaConf.to_container(opts, resolve=True) if isinstance(opts, DictConfig) else dict(opts or {})
        # a kvpress press (nats-eval-hf's conf/kvpress/) names no policy of the project: no class
        yield method, pcfg, get_cache_class(pcfg.name) if pcfg.get("name") is not None else None, options


def plan_runs(cfg: DictConfig, n: int, is_nats: bool) -> tuple[list[dict[str, Any]], list[str]]:
    """The (method, budget) runs; raises on unknown methods and bad budgets. Returns (runs, notes)."""
    runs, notes = [], []
    for method, pcfg, cls, options in configured_methods(cfg):
        if cls is None:
            raise ValueError(f"method {method!r} is not a cache policy of the project (kvpress presses: nats-eval-hf)")
        sequential = bool(pcfg.get("sequential", False))
        if sequential and not cls.decodable:
            raise ValueError(
                f"{method}: policy {pcfg.name!r} is a parallel approximation; set policies.{method}.sequential=false"
            )
        if pcfg.name == "nats" and not is_nats:
            notes.append(f"{method}: skipped, the model has no NAtS attention (nats needs model.attention.name=nats)")
            continue
        budgets = [None]
        if cls.budgeted:
            if not cfg.budgets:
                raise ValueError(f"{method} needs budgets: set budgets=[0.5,0.25,...] (fractions of N or token counts)")
            budgets = []
            for spec in cfg.budgets:
                b = resolve_budget(spec, n, of=f"the window's N={n} tokens")  # a fraction of N, or tokens
                try:
                    cls.rule(**options).check_budget(b, n)
                except ValueError as err:
                    # a fraction that rounds to a budget this policy cannot use (e.g. N/32 = 4 tokens for 4
                    # StreamingLLM sinks at N = 128) is skipped with a note; a token count is an error
                    if isinstance(spec, float) and 0 < spec < 1 and b < n:
                        notes.append(f"{method}: budget {spec} x N = {b} skipped ({err})")
                        continue
                    raise ValueError(f"{method} at N={n}: {err}") from err
                budgets.append(b)
            if not budgets:
                raise ValueError(
                    f"{method}: no usable budget at N={n} ({'; '.join(notes)}); give token counts, "
                    f"e.g. budgets=[{n // 2}]"
                )
        for b in budgets:
            runs.append(
                {
                    "method": method,
                    "policy": pcfg.name,
                    "cls": cls,  # the name resolved once; policy_logits takes the class
                    "label": pcfg.get("label", method),
                    "budget": b,
                    "sequential": sequential,
                    "options": options,
                }
            )
    if not runs:
        raise ValueError("nothing to evaluate: " + "; ".join(notes))
    return runs, notes


# ----------------------------------------------------------------------------------------------------
# evaluation
# ----------------------------------------------------------------------------------------------------
def _max_windows(cfg: DictConfig) -> int | None:
    """``max_windows``, checked here so that the error names the key the user typed (not data.max_eval_windows)."""
    value = cfg.get("max_windows")
    if value is not None and int(value) < 1:
        raise ValueError(
            f"max_windows={value} must be >= 1 (the number of windows to evaluate), or null (the "
            "default) for the whole split"
        )
    return value


def eval_windows(cfg: DictConfig, n: int, model_vocab_size: int | None = None):
    """The split's windows of N + 1 tokens (TokenDataModule.eval_dataset); with ``model_vocab_size``, checked
    to be readable by a model of that vocabulary."""
    max_windows = _max_windows(cfg)
    with open_dict(cfg):
        cfg.data.block_size = n
        cfg.data.max_eval_windows = max_windows
        cfg.data.eval_windows = cfg.get("windows", "spread")  # checked by evaluate, before the checkpoint load
        cfg.model.block_size = n
    datamodule = hydra.utils.instantiate(cfg.data)
    datamodule.prepare_data()
    if model_vocab_size is not None and hasattr(datamodule, "check_vocab"):
        datamodule.check_vocab(
            model_vocab_size,
            fix=(
                f"The checkpoint {cfg.get('ckpt_path')} was trained on another vocabulary: evaluate it on data of "
                "the tokenizer it was trained with (data=... data.tokenizer=...)"
            ),
        )
    try:
        dataset = datamodule.eval_dataset(cfg.split)
    except ValueError as err:
        if "fewer than block_size" in str(err):
            raise ValueError(
                f"the {cfg.split} split has no window of N + 1 = {n + 1} tokens ({err}); use a larger split, "
                f"another data source, or a smaller block_size=..."
            ) from err
        raise
    if len(dataset) == 0:
        raise ValueError(f"the {cfg.split} split is empty: nothing to evaluate (check data=... and split=...)")
    return dataset


def _graph(cfg: DictConfig) -> bool | str:
    """``graph`` (auto | true | false): how the sequential methods decode (`nats.cache.decode.policy_logits`)."""
    value = cfg.get("graph", "auto")
    check_graph(value)
    return value


def chunk_rows(n: int, vocab_size: int) -> int:
    """Windows of N tokens whose fp32 logits fit in :data:`LOGITS_BYTES` (at least 1)."""
    return max(1, LOGITS_BYTES // (n * vocab_size * 4))


def _run_one(model: GPT, run: dict[str, Any], loader, device, backend: str, bar, graph="auto") -> dict[str, Any]:
    nll, tokens, windows = 0.0, 0, 0
    area = peak = types = None
    info: dict[str, str] = {}
    for xb, yb in loader:
        # a batch in chunks of windows whose logits fit in LOGITS_BYTES (windows are evaluated independently)
        rows = chunk_rows(xb.shape[1], model.config.vocab_size)
        for x, y in zip(xb.split(rows), yb.split(rows)):
            x, y = x.to(device), y.to(device)
            logits, cache = policy_logits(
                model,
                x,
                run["cls"],
                sequential=run["sequential"],
                budget=run["budget"],
                backend=backend,
                graph=graph,
                info=info,
                **run["options"],
            )
            nll += float(F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="sum"))
            del logits
            tokens += y.numel()
            windows += x.shape[0]
            fr = cache.fractions()  # [L, B, Hkv] each
            a, p = fr["area"].sum(1).cpu(), fr["peak"].sum(1).cpu()  # [L, Hkv], summed over the batch
            area = a if area is None else area + a
            peak = p if peak is None else peak + p
            if cache.counts_types():
                t = cache.type_fractions().sum(1).cpu()  # [L, Hkv, 3]
                types = t if types is None else types + t
        bar.update(1)
    area, peak = area / windows, peak / windows
    out = {
        **{k: run[k] for k in ("method", "policy", "label", "budget", "sequential")},
        "ppl": math.exp(nll / tokens),
        "nll": nll / tokens,
        "area": float(area.mean()),
        "peak": float(peak.mean()),
        "windows": windows,
        "tokens": tokens,
        "per_head": {"area": area.tolist(), "peak": peak.tolist()},
        "decode": info.get("decode", "parallel"),  # a sequential run: cuda_graph or eager
    }
    if types is not None:
        out["per_head"]["type_fractions"] = (types / windows).tolist()
    return out


def evaluate(cfg: DictConfig) -> dict[str, Any]:
    """Load, plan, evaluate; returns the results (nothing written)."""
    _max_windows(cfg)  # before the (slow) checkpoint load
    check_eval_windows(cfg.get("windows", "spread"), "windows")
    graph = _graph(cfg)
    model = load_checkpoint(cfg.get("ckpt_path"), key="ckpt_path")
    check_decodable(model.config, f"ckpt_path={cfg.get('ckpt_path')}")
    model_cfg = model.config.to_dict()
    n = int(cfg.block_size) if cfg.get("block_size") else model.config.block_size
    if n > model.config.block_size:
        raise ValueError(
            f"block_size={n} exceeds the model's block_size {model.config.block_size}: positions are "
            f"kept, so evaluate at N <= {model.config.block_size}"
        )
    if n < 2:
        raise ValueError(f"block_size must be >= 2, got {n}")
    is_nats = model.config.attention.get("name") == "nats"
    runs, notes = plan_runs(cfg, n, is_nats)
    if cfg.get("precision", "float32") not in DTYPES:
        raise ValueError(f"precision={cfg.precision!r} is not one of {sorted(DTYPES)}")
    if int(cfg.batch_size) < 1:
        raise ValueError(f"batch_size must be >= 1, got {cfg.batch_size}")
    dataset = eval_windows(cfg, n, model.config.vocab_size)
    device = resolve_device(str(cfg.get("device", "auto")))
    model = model.to(device=device, dtype=DTYPES[cfg.get("precision", "float32")]).eval()
    loader = torch.utils.data.DataLoader(dataset, batch_size=int(cfg.batch_size), shuffle=False)
    for note in notes:
        log.info(f"note: {note}")
    results = []
    t0 = time.time()
    with tqdm(
        total=len(runs) * len(loader), desc="nats-eval", disable=not cfg.get("progress", True), dynamic_ncols=True
    ) as bar:
        for i, run in enumerate(runs, 1):
            bar.set_postfix_str(f"{run['label']} B={run['budget']}")
            t_run = time.time()
            try:
                results.append(_run_one(model, run, loader, device, "auto", bar, graph=graph))
            except (torch.OutOfMemoryError, RuntimeError) as err:
                if not isinstance(err, torch.OutOfMemoryError) and "can't allocate memory" not in str(err):
                    raise
                b = int(cfg.batch_size)
                raise ValueError(
                    f"out of memory on {device} evaluating {run['label']} (budget {run['budget']}) on batches of "
                    f"{b} windows of N = {n} tokens: lower batch_size={b} (e.g. batch_size={max(1, b // 4)}), or "
                    f"evaluate in precision=bfloat16"
                ) from err
            # a line per method and budget, also where the bar is off (callbacks.eval_after): long work shows progress;
            # written above the bar (which is drawn again below it), never glued to one of its frames
            with tqdm.external_write_mode(file=sys.stdout, nolock=bar.disable):
                log.info(
                    f"nats-eval {cfg.split} {i}/{len(runs)}: {run['label']} (budget {run['budget']}) ppl "
                    f"{results[-1]['ppl']:.2f} on {results[-1]['windows']} windows in {time.time() - t_run:.1f} s "
                    f"({results[-1]['decode']})"
                )
    for r in results:
        r["budget_fraction"] = None if r["budget"] is None else r["budget"] / n
        if r["budget"] is not None:
            r["area_budget"], r["peak_budget"] = budget_fractions(r["budget"], n)
    return {
        "checkpoint": str(cfg.ckpt_path),
        "N": n,
        "split": cfg.split,
        "windows": len(dataset),
        "tokens": len(dataset) * n,
        "model": model_cfg,
        "n_layer": model.config.n_layer,
        "n_kv_head": model.config.n_kv_head,
        "device": str(device),
        "precision": cfg.get("precision", "float32"),
        "seconds": round(time.time() - t0, 2),
        "notes": notes,
        "results": results,
    }


# ----------------------------------------------------------------------------------------------------
# outputs
# ----------------------------------------------------------------------------------------------------
CSV_FIELDS = [
    "method",
    "label",
    "policy",
    "budget",
    "budget_fraction",
    "sequential",
    "ppl",
    "nll",
    "area",
    "peak",
    "windows",
    "tokens",
]


def markdown_table(report: dict[str, Any], notes: bool = True) -> str:
    """results.md: the run's setting, then perplexity, area and peak fraction per method and budget."""
    rows = []
    for r in report["results"]:
        b = "-" if r["budget"] is None else str(r["budget"])
        bf = "-" if r["budget"] is None else f"1/{report['N'] / r['budget']:.3g}"
        mode = " (sequential)" if r["sequential"] else ""
        rows.append([f"{r['label']}{mode}", b, bf, f"{r['area']:.4f}", f"{r['peak']:.4f}", f"{r['ppl']:.3f}"])
    columns = ["method", "budget B", "B/N", "area fraction", "peak fraction", "perplexity"]
    lines = [
        f"Perplexity vs KV budget: `{report['checkpoint']}`, {report['split']} split, N = {report['N']}, "
        f"{report['windows']} windows ({report['tokens']} predicted tokens), {report['precision']} on "
        f"{report['device']}.",
        "",
        table(columns, rows),
    ]
    for note in report["notes"] if notes else ():
        lines.append(f"\nNote: {note}")
    return "\n".join(lines) + "\n"


def _plot(report: dict[str, Any], key: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    by_label: dict[str, list[dict]] = {}
    for r in report["results"]:
        by_label.setdefault(r["label"], []).append(r)
    for label, rows in by_label.items():
        rows = sorted(rows, key=lambda r: r[key])
        xs, ys = [r[key] for r in rows], [r["ppl"] for r in rows]
        style = {"marker": "*", "markersize": 12} if rows[0]["policy"] in ("nats", "full") else {"marker": "o"}
        ax.plot(xs, ys, label=label, linestyle="-" if len(rows) > 1 else "none", **style)
    ax.set_xscale("log")
    ax.set_xlabel(f"{key} fraction of the KV cache (log)")
    ax.set_ylabel("perplexity")
    ax.set_title(f"perplexity vs {key} fraction, N = {report['N']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def kv_fractions_payload(report: dict[str, Any]) -> dict[str, Any]:
    methods = {}
    for r in report["results"]:
        key = r["label"] if r["budget"] is None else f"{r['label']}@{r['budget']}"
        methods[key] = {"method": r["method"], "policy": r["policy"], "budget": r["budget"], **r["per_head"]}
    return {
        "N": report["N"],
        "n_layer": report["n_layer"],
        "n_kv_head": report["n_kv_head"],
        "layout": "area/peak: [layer][kv_head]; type_fractions: [layer][kv_head][global, local, sliding]",
        "methods": methods,
    }


def write_outputs(report: dict[str, Any], out_dir: str | os.PathLike) -> dict[str, Path]:
    """Write every output into a temporary folder inside out_dir, then rename the files into place."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".nats-eval-", dir=out))
    try:
        rows = [{k: r.get(k) for k in CSV_FIELDS} for r in report["results"]]
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=CSV_FIELDS)
        writer.writeheader()
        writer.writerows(rows)
        (tmp / "results.csv").write_text(buf.getvalue())
        slim = {**report, "results": [{k: v for k, v in r.items() if k != "per_head"} for r in report["results"]]}
        (tmp / "results.json").write_text(json.dumps(slim, indent=2))
        (tmp / "results.md").write_text(markdown_table(report))
        _plot(report, "area", tmp / "ppl_vs_area.png")
        _plot(report, "peak", tmp / "ppl_vs_peak.png")
        (tmp / "kv_fractions.json").write_text(json.dumps(kv_fractions_payload(report)))
        paths = {}
        for name in OUTPUT_FILES:
            os.replace(tmp / name, out / name)
            paths[name] = out / name
        return paths
    finally:
        for f in tmp.glob("*"):
            f.unlink()
        tmp.rmdir()


def run(cfg: DictConfig) -> dict[str, Any]:
    """Evaluate and write the outputs to ${paths.output_dir}; returns the report (with `outputs`)."""
    report = evaluate(cfg)
    paths = write_outputs(report, cfg.paths.output_dir)
    # on the console and in the run's eval.log; its notes were said before the evaluation (results.md has them)
    log.info(markdown_table(report, notes=False))
    log.info(f"outputs in {Path(cfg.paths.output_dir).resolve()}")
    report["outputs"] = {k: str(v) for k, v in paths.items()}
    return report


# ----------------------------------------------------------------------------------------------------
# nats-eval's config for code that evaluates without the command line (nats.callbacks.EvalAfterTraining)
# ----------------------------------------------------------------------------------------------------
def compose_eval(
    settings: dict[str, Any] | None = None,
    data: dict[str, Any] | None = None,
    ckpt_path: str | None = None,
    output_dir: str | None = None,
) -> DictConfig:
    """conf/eval.yaml as `nats-eval` composes it, with `settings` (its keys: split, methods, budgets, ...) merged
    in, `data` (a resolved data config, e.g. a training run's) in place of its data group, and the checkpoint and
    output folder set. Works inside a running Hydra app (nats-train) and outside one."""
    from hydra import compose
    from hydra.core.global_hydra import GlobalHydra

    from nats.cli import compose as compose_outside

    if GlobalHydra.instance().is_initialized():  # inside nats-train: its config search path is conf/
        cfg = compose(config_name="eval")
    else:
        cfg = compose_outside([], "eval")
    unknown = sorted(set(settings or {}) - set(cfg) - {"data"})
    if unknown:
        raise ValueError(f"unknown nats-eval settings {unknown}: use keys of conf/eval.yaml ({', '.join(cfg)})")
    with open_dict(cfg):
        cfg.merge_with(settings or {})
        if data is not None:
            cfg.data = OmegaConf.create(dict(data))
        if ckpt_path is not None:
            cfg.ckpt_path = ckpt_path
        if output_dir is not None:
            cfg.paths.output_dir = output_dir
    return cfg
