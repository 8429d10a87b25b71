"""Gated attention at GPT-2-small scale, and what the gate does to NAtS' KV budget: the report of the study
(docs/gate_study_gpt2.md).

The study is Hydra multiruns of ``nats-train`` with the Figure 3 recipe (conf/experiment/study_gate_gpt2_*.yaml)
on any launcher; each run ends with nats-eval on both splits (``eval_validation/``, ``eval_test/``; the dense
models also StreamingLLM and H2O at N/8 and N/16) and the per-layer analysis (``analysis.json``: first-token
share, gate, NAtS types and the globals at position 0; nats.analysis.LayerAnalysis):

    nats-prepare data=pg19_subset
    nats-train -m experiment=study_gate_gpt2_dense model.attention.output_gate=none,headwise,elementwise \
        seed=0,1 hydra.sweep.dir=logs/gate_study_gpt2/dense
    nats-train -m experiment=study_gate_gpt2_nats model.attention.output_gate=none,headwise seed=0,1 \
        hydra.sweep.dir=logs/gate_study_gpt2/nats
    python experiments/gate_study_gpt2.py logs/gate_study_gpt2 --out docs/results

This script reads every run folder below the given folders, names each run's model from its config (``dense``,
``dense_headwise``, ``dense_elementwise``, ``nats``, ``nats_headwise``; a NAtS lambda other than 0.05 is part of
the name) and writes ``gate_study_gpt2.md`` (one row per model: mean ± sample standard deviation over seeds; the
baselines; per-layer tables), ``gate_study_gpt2.json`` and the plots ``gate_study_gpt2_{sink,kv,ppl_vs_area}.png``.
Runs of the same recipe from elsewhere (the Figure 3 study's dense and lambda = 0.05 models) join as further seeds
when their folders are passed too.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from datetime import date
from pathlib import Path

import collect  # experiments/collect.py, beside this script

mean_std = collect.mean_std
LAMBDA = 0.05  # the NAtS point of the study (the Figure 3 study's chosen lambda)
GATES = ("none", "headwise", "elementwise")
BASELINES = [(policy, 1 / d, f"N/{d}") for policy in ("streaming_llm", "h2o") for d in (8, 16)]


def model_of(cfg: dict) -> tuple[str, str, bool, tuple]:
    """(name, label, is NAtS, sort key) of a run's model, from its config."""
    att = cfg["model"]["attention"]
    gate = att.get("output_gate") or "none"
    nats = att.get("name") == "nats"
    if nats:
        lam = float(att["sparsity_lambda"])
        name = "nats" if math.isclose(lam, LAMBDA) else f"nats_l{lam:g}"
        label = f"NAtS λ={lam:g}"
    else:
        lam, name, label = 0.0, str(att.get("name")), str(att.get("name"))
    if gate != "none":
        name, label = f"{name}_{gate}", f"{label} + {gate} gate"
    order = GATES.index(gate) if gate in GATES else len(GATES)
    return name, label, nats, (nats, lam, order, name)


def run_setting(cfg: dict) -> dict:
    """Model size, data, steps and batch of a run (for the report's caption)."""
    model = cfg.get("model", {})
    return {
        **{k: model.get(k) for k in ("n_layer", "n_head", "n_embd", "block_size")},
        "data": cfg.get("data", {}).get("source"),
        "steps": cfg.get("trainer", {}).get("max_steps"),
        "batch": cfg.get("global_batch_size"),
    }


def load(folders: list[str], reports: list[str] = ()) -> dict:
    """Per run (``<model>_s<seed>``): its model, seed, setting, training summary, evaluations and analysis.
    ``reports``: earlier reports' JSON whose runs join them (a run folder replaces a report's run of the same
    name)."""
    # the reports' runs: JSON made the sort key `order` a list
    reported = {n: {**r, "order": tuple(r["order"])} for n, r in collect.runs_from_reports(reports).items()}

    def entry(r: dict, folder: Path) -> tuple[str, dict] | None:
        cfg = r["config"]
        if "attention" not in cfg.get("model", {}):
            return None  # not a training run
        base, label, nats, order = model_of(cfg)
        return f"{base}_s{cfg.get('seed')}", {
            "folder": str(folder),
            "base": base,
            "label": label,
            "nats": nats,
            "order": order,
            "seed": cfg.get("seed"),
            "setting": run_setting(cfg),
            "training": r["metrics"],
            "val_curve": collect.curve(r["csv"], "val/ppl"),
            "eval": {s: r["eval"].get(s) for s in ("validation", "test")},
            "analysis": r["analysis"],
        }

    return collect.training_runs(folders, entry, reported)


def _result(ev: dict | None, policy: str, budget_fraction: float | None = None) -> dict | None:
    for r in (ev or {}).get("results", []):
        fraction = r.get("budget_fraction")
        if r["policy"] == policy and (budget_fraction is None or math.isclose(fraction, budget_fraction, rel_tol=0.02)):
            return r
    return None


def run_values(r: dict) -> dict:
    """The measurements of one run (a `collect` entry), by name; missing ones are left out. Per-layer values are
    lists over layers."""
    nats = r["nats"]
    own = _result(r["eval"]["test"], "nats" if nats else "full")
    val = _result(r["eval"]["validation"], "nats" if nats else "full")
    v = {}
    if val:
        v["val_ppl"] = val["ppl"]
    if own:
        v["test_ppl"] = own["ppl"]
        if nats:
            v["area"], v["peak"] = own["area"], own["peak"]
    for policy, fraction, tag in [] if nats else BASELINES:  # against the model's own full cache
        res = _result(r["eval"]["test"], policy, fraction)
        if res:
            v[f"{policy} {tag}"], v[f"{policy} {tag} area"] = res["ppl"], res["area"]
            if own:
                v[f"{policy} {tag} rel"] = res["ppl"] / own["ppl"] - 1
    layers = (r["analysis"] or {}).get("layers")
    if layers:
        v["sink_layers"] = [lay["first_token_share"] for lay in layers]
        v["sink"] = sum(v["sink_layers"]) / len(layers)
        v["sink_max"] = max(v["sink_layers"])
        if "gate_mean" in layers[0]:
            v["gate_layers"] = [lay["gate_mean"] for lay in layers]
            v["gate"] = sum(v["gate_layers"]) / len(layers)
        if "type_fractions" in layers[0]:
            for key in ("area", "global_pos0_share", "globals_per_head", "type_fractions"):
                v[f"{key}_layers"] = [lay[key] for lay in layers]
            # of all the model's global tokens, the share at position 0 (a ratio of totals over layers)
            v["pos0_share"] = sum(lay["globals_pos0"] for lay in layers) / sum(lay["globals_total"] for lay in layers)
            v["globals_per_head"] = sum(v["globals_per_head_layers"]) / len(layers)
    return v


def summarize(runs: dict) -> list[dict]:
    """One row per model (dense before NAtS, then by lambda and gate): each measurement of run_values as mean and
    sample std over the model's seeds ({"mean", "std", "n"}; per-layer ones layer by layer)."""
    rows: dict[str, dict] = {}
    values: dict[str, dict[str, list]] = {}
    for name, r in sorted(runs.items(), key=lambda kv: (kv[1]["order"], kv[1]["seed"])):
        base = r["base"]
        row = rows.setdefault(
            base,
            {"model": base, "label": r["label"], "nats": r["nats"], "seeds": [], "unevaluated": [], "runs": []},
        )
        measured = run_values(r)
        # a run without its test evaluation (e.g. stopped during it) adds to no perplexity: named apart
        row["seeds" if "test_ppl" in measured else "unevaluated"].append(r["seed"])
        row["runs"].append(name)
        if r["analysis"]:
            row["uniform_share"], row["skip"] = r["analysis"]["uniform_share"], r["analysis"]["skip"]
        for key, value in measured.items():
            values.setdefault(base, {}).setdefault(key, []).append(value)
    for base, row in rows.items():
        row["stats"] = {}
        for key, seeds in values.get(base, {}).items():
            if isinstance(seeds[0], list):  # per layer
                per_layer = [_mean_std(layer) for layer in zip(*seeds)]
                row["stats"][key] = {"mean": [m for m, _ in per_layer], "std": [s for _, s in per_layer]}
            else:
                m, s = mean_std(seeds)
                row["stats"][key] = {"mean": m, "std": s, "values": seeds}
            row["stats"][key]["n"] = len(seeds)
    return list(rows.values())


def _mean_std(values) -> tuple:
    """mean_std over seeds of one layer's entries: floats, or lists (the type fractions) entry by entry."""
    if isinstance(values[0], list):
        parts = [mean_std(list(c)) for c in zip(*values)]
        return [m for m, _ in parts], [s for _, s in parts]
    return mean_std(list(values))


def pm(stat: dict | None, nd: int = 2, percent: bool = False) -> str:
    """'mean ± std' (the std only where there are several seeds); '-' if missing."""
    if not stat:
        return "-"
    scale, unit = (100.0, "%") if percent else (1.0, "")
    m, s = stat["mean"] * scale, stat["std"] * scale
    sign = "+" if percent and m >= 0 else ""
    text = f"{sign}{m:.{nd}f}{unit}"
    return text + (f" ± {s:.{nd}f}{unit}" if stat["n"] > 1 else "")


def caption(runs: dict, device: str | None) -> str:
    """What was trained and where, as the run folders say (a smoke run is not mistaken for the GPU study)."""
    settings = sorted({json.dumps(r["setting"], sort_keys=True) for r in runs.values() if r["setting"]})
    parts = []
    for text in settings:
        c = json.loads(text)
        parts.append(
            f"{c['n_layer']} layers x {c['n_head']} heads, d = {c['n_embd']}, N = {c['block_size']}, data "
            f"{c['data']}, {c['steps']} steps of {c['batch']} x {c['block_size']} tokens"
        )
    if device is None:
        found = {(r["analysis"] or {}).get("device") for r in runs.values()} - {None}
        device = ", ".join(sorted(found)) or "an unrecorded device"
    return f"Setting: {'; '.join(parts) or 'unrecorded'}; evaluated on {device}."


def answer(rows: list[dict], uniform: tuple | None) -> list[str]:
    """The report's opening in words: each model's test perplexity against dense's (NAtS: at its KV area), and the
    first-token share of each model's layer with the most, against uniform attention's."""
    st = {r["model"]: r["stats"] for r in rows}
    dense = st.get("dense", {}).get("test_ppl")
    parts = []
    for r in rows:
        s = r["stats"]
        if r["model"] == "dense" or "test_ppl" not in s:
            continue
        rel = f" ({100 * (s['test_ppl']['mean'] / dense['mean'] - 1):+.1f}%)" if dense else ""
        area = f" at KV area {s['area']['mean']:.4f}" if "area" in s else ""
        parts.append(f"{r['label']} {s['test_ppl']['mean']:.2f}{rel}{area}")
    lines = []
    if parts:
        head = (
            f"Test perplexity (mean over seeds) against dense's {dense['mean']:.2f}: " if dense else "Test perplexity: "
        )
        lines.append(head + ", ".join(parts) + ".")
    sinks = [f"{r['label']} {r['stats']['sink_max']['mean']:.4f}" for r in rows if "sink_max" in r["stats"]]
    if sinks:
        ref = f" (uniform causal attention: {uniform[0]:.4f})" if uniform else ""
        lines.append(f"First-token share of each model's layer with the most{ref}: " + ", ".join(sinks) + ".")
    return lines


def markdown(rows: list[dict], setting: str, command: str = "") -> str:
    st = {r["model"]: r["stats"] for r in rows}
    dense_test = st.get("dense", {}).get("test_ppl")
    n_layer = max((len(r["stats"]["sink_layers"]["mean"]) for r in rows if "sink_layers" in r["stats"]), default=0)
    uniform = next(((r["uniform_share"], r["skip"]) for r in rows if "uniform_share" in r), None)
    lines = ["# Gated attention at GPT-2-small scale, and the gate in NAtS", ""]
    lines += [part for line in answer(rows, uniform) for part in (line, "")]  # a paragraph each
    lines += [
        "| model | seeds | val ppl | test ppl | test vs dense | first-token share (mean over layers) | "
        "max layer | mean gate | KV area (test) | KV peak (test) | globals at position 0 | globals per head |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        s = r["stats"]
        rel = "-"
        if dense_test and "test_ppl" in s:
            rel = f"{100 * (s['test_ppl']['mean'] / dense_test['mean'] - 1):+.1f}%"
        seeds = ", ".join(map(str, r["seeds"])) or "-"
        if r.get("unevaluated"):
            seeds += f" ({', '.join(map(str, r['unevaluated']))}: trained, not evaluated)"
        lines.append(
            f"| {r['label']} | {seeds} | {pm(s.get('val_ppl'))} | {pm(s.get('test_ppl'))} | {rel} | "
            f"{pm(s.get('sink'), 4)} | {pm(s.get('sink_max'), 4)} | {pm(s.get('gate'), 3)} | {pm(s.get('area'), 4)} "
            f"| {pm(s.get('peak'), 4)} | {pm(s.get('pos0_share'), 3)} | {pm(s.get('globals_per_head'), 1)} |"
        )
    lines += [
        "",
        f"{setting} Perplexities: `nats-eval` on the first windows of each split; first-token share, gate and the "
        "NAtS types per layer: the first validation windows (`analysis.json` of each run). Mean ± sample standard "
        "deviation over seeds where there are several."
        + (
            f" Report of {date.today().isoformat()}: `{command}`; the runs: docs/gate_study_gpt2.md." if command else ""
        ),
        "",
        "![first-token share and gate per layer](gate_study_gpt2_sink.png)",
    ]
    if uniform is not None:
        lines += [
            "",
            f"First-token share: the attention probability on key 0, averaged over heads and the queries "
            f"i >= {uniform[1]} of each window; uniform causal attention would give {uniform[0]:.4f}. Globals at "
            "position 0: of all global tokens of the model (layers, heads, windows), the share that is token 0 "
            "(global by the NAtS rule); globals per head: per layer, head and window, token 0 included (mean over "
            "layers).",
        ]
    dense_rows = [r for r in rows if not r["nats"] and "test_ppl" in r["stats"]]
    if dense_rows:
        lines += [
            "",
            "## KV-cache baselines on the dense models (test; change against the model's own full cache)",
            "",
            "| model | full cache | StreamingLLM N/8 | StreamingLLM N/16 | H2O N/8 | H2O N/16 |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for r in dense_rows:
            s = r["stats"]
            cells = [
                f"{pm(s.get(key))} ({pm(s.get(key + ' rel'), 1, percent=True)})"
                for key in ("streaming_llm N/8", "streaming_llm N/16", "h2o N/8", "h2o N/16")
            ]
            lines.append(f"| {r['label']} | {pm(s['test_ppl'])} | " + " | ".join(cells) + " |")
    if n_layer:
        head = "| model | " + " | ".join(f"L{i}" for i in range(n_layer)) + " |"
        rule = "|---|" + "---:|" * n_layer
        lines += ["", "## First-token share per layer (validation)", "", head, rule]
        for r in rows:
            if "sink_layers" in r["stats"]:
                lines.append(f"| {r['label']} | " + _layer_cells(r["stats"]["sink_layers"], 3) + " |")
        gated = [r for r in rows if "gate_layers" in r["stats"]]
        if gated:
            lines += ["", "## Mean gate per layer (validation)", "", head, rule]
            for r in gated:
                lines.append(f"| {r['label']} | " + _layer_cells(r["stats"]["gate_layers"], 3) + " |")
        nats_rows = [r for r in rows if "area_layers" in r["stats"]]
        if nats_rows:
            lines += [
                "",
                "## NAtS per layer (validation; mean over heads)",
                "",
                "| model | measure | " + " | ".join(f"L{i}" for i in range(n_layer)) + " |",
                "|---|---|" + "---:|" * n_layer,
            ]
            for r in nats_rows:
                s = r["stats"]
                tf = s["type_fractions_layers"]["mean"]  # [L][3]
                for measure, values in (
                    ("KV area", s["area_layers"]["mean"]),
                    ("global fraction", [t[0] for t in tf]),
                    ("local fraction", [t[1] for t in tf]),
                    ("sliding fraction", [t[2] for t in tf]),
                    ("globals at position 0", s["global_pos0_share_layers"]["mean"]),
                    ("globals per head", s["globals_per_head_layers"]["mean"]),
                ):
                    nd = 1 if measure == "globals per head" else 3
                    lines.append(f"| {r['label']} | {measure} | " + " | ".join(f"{v:.{nd}f}" for v in values) + " |")
            lines.append("")
            lines.append("Per head: `analysis.json` of each run (`*_heads`), and `eval_test/kv_fractions.json`.")
    lines += [
        "",
        "More plots: gate_study_gpt2_kv.png (NAtS per layer), gate_study_gpt2_ppl_vs_area.png (test perplexity "
        "against KV area, NAtS and the baselines).",
    ]
    return "\n".join(lines) + "\n"


def _layer_cells(stat: dict, nd: int) -> str:
    cells = []
    for m, s in zip(stat["mean"], stat["std"]):
        cells.append(f"{m:.{nd}f}" + (f" ± {s:.{nd}f}" if stat["n"] > 1 else ""))
    return " | ".join(cells)


def plots(rows: list[dict], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    written = []
    color = {r["model"]: f"C{i % 10}" for i, r in enumerate(rows)}

    def save_per_layer(fig, axes, name: str) -> None:  # x = layer index
        for ax in axes:
            ax.set_xlabel("layer")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.grid(True, alpha=0.3)
            if ax.get_legend_handles_labels()[0]:  # e.g. no gate panel entries without a gated model
                ax.legend(fontsize=7)
        fig.tight_layout()
        written.append(out / name)
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)

    with_sink = [r for r in rows if "sink_layers" in r["stats"]]
    if with_sink:
        fig, axes = plt.subplots(1, 2, figsize=(13, 4.6))
        for r in with_sink:
            style = dict(fmt="o" + ("--" if r["nats"] else "-"), capsize=2, color=color[r["model"]], label=r["label"])
            for ax, key in zip(axes, ("sink_layers", "gate_layers")):  # per layer: mean and std over the seeds
                if key in r["stats"]:
                    st = r["stats"][key]
                    ax.errorbar(range(len(st["mean"])), st["mean"], yerr=st["std"], **style)
        uniform = with_sink[0].get("uniform_share")
        if uniform is not None:
            axes[0].axhline(uniform, color="k", ls=":", lw=1, label="uniform causal attention")
        axes[0].set_title("first-token attention share (the sink), per layer")
        axes[0].set_ylim(bottom=0)
        axes[1].set_title("mean output gate, per layer")
        axes[1].set_ylim(0, 1)
        save_per_layer(fig, axes, "gate_study_gpt2_sink.png")

    nats_rows = [r for r in rows if "area_layers" in r["stats"]]
    if nats_rows:
        fig, axes = plt.subplots(1, 3, figsize=(16, 4.4))
        for r in nats_rows:
            s, c = r["stats"], color[r["model"]]
            layers = range(len(s["area_layers"]["mean"]))
            area = s["area_layers"]
            axes[0].errorbar(layers, area["mean"], yerr=area["std"], fmt="o-", capsize=2, color=c, label=r["label"])
            tf = s["type_fractions_layers"]["mean"]
            axes[1].plot(layers, [t[0] for t in tf], "o-", color=c, label=f"{r['label']}: global")
            axes[1].plot(layers, [t[1] for t in tf], "s--", color=c, label=f"{r['label']}: local")
            p0 = s["global_pos0_share_layers"]
            axes[2].errorbar(layers, p0["mean"], yerr=p0["std"], fmt="o-", capsize=2, color=c, label=r["label"])
        axes[0].set_title("KV area fraction per layer (validation)")
        axes[1].set_title("global and local token fractions per layer")
        axes[2].set_title("share of the globals that are token 0")
        axes[2].set_ylim(0, 1.05)
        save_per_layer(fig, axes, "gate_study_gpt2_kv.png")

    fig, ax = plt.subplots(figsize=(6.8, 4.6))
    drawn = False
    for r in rows:
        s, c = r["stats"], color[r["model"]]
        if "test_ppl" not in s:
            continue
        drawn = True
        if r["nats"]:
            if "area" in s:
                ax.errorbar(
                    s["area"]["mean"],
                    s["test_ppl"]["mean"],
                    yerr=s["test_ppl"]["std"],
                    fmt="*",
                    markersize=13,
                    color=c,
                    label=r["label"],
                )
            continue
        ax.plot([1.0], [s["test_ppl"]["mean"]], "D", color=c, label=f"{r['label']}, full cache")
        for policy, marker, ls in (("streaming_llm", "o", "-"), ("h2o", "^", ":")):
            pts = [
                (s[f"{policy} {tag} area"]["mean"], s[f"{policy} {tag}"]["mean"])
                for tag in ("N/8", "N/16")
                if f"{policy} {tag}" in s
            ]
            if pts:  # the line ends at the model's full cache (area 1)
                ax.plot(*zip(*pts, (1.0, s["test_ppl"]["mean"])), marker + ls, color=c, label=f"{r['label']}, {policy}")
    if drawn:
        ax.set_xscale("log")
        ax.set_xlabel("KV area fraction (log)")
        ax.set_ylabel("test perplexity")
        ax.set_title("perplexity vs KV area (test)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6)
        fig.tight_layout()
        written.append(out / "gate_study_gpt2_ppl_vs_area.png")
        fig.savefig(written[-1], dpi=120)
    plt.close(fig)
    return written


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    collect.add_run_sources(ap, "gate_study_gpt2.json")
    ap.add_argument("--out", default="docs/results", help="folder for the table, the JSON and the plots")
    ap.add_argument("--device", default=None, help="the machine, for the caption (default: what analysis.json says)")
    args = ap.parse_args(argv)
    collect.check_run_sources(ap, args)
    runs = load(args.folders, args.runs_from)
    rows = summarize(runs)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    setting = caption(runs, args.device)
    command = shlex.join(["python", "experiments/gate_study_gpt2.py", *(sys.argv[1:] if argv is None else argv)])
    (out / "gate_study_gpt2.md").write_text(markdown(rows, setting, command))
    (out / "gate_study_gpt2.json").write_text(  # compact: the md is the readable form
        json.dumps({"setting": setting, "rows": rows, "runs": runs}, separators=(",", ":"))
    )
    plots(rows, out)
    print((out / "gate_study_gpt2.md").read_text())
    return rows


if __name__ == "__main__":
    main()
