"""The NAtS paper's Figure 3 at reduced scale: the report of the study (docs/figure3.md).

The study is two Hydra multiruns of ``nats-train`` (conf/experiment/study_fig3_dense.yaml, study_fig3_nats.yaml)
on any launcher (basic, joblib, submitit / SLURM); each run evaluates its final checkpoint at its end with
nats-eval (``callbacks.eval_after``: ``eval_validation/``, ``eval_test/`` in the run folder):

    nats-prepare data=pg19_subset
    nats-train -m experiment=study_fig3_dense seed=1,2 hydra.sweep.dir=logs/figure3/dense
    nats-train -m experiment=study_fig3_nats model.attention.sparsity_lambda=0,0.01,0.03,0.05,0.1,0.3,1,3 seed=1 \
        hydra.sweep.dir=logs/figure3/nats
    python experiments/figure3.py logs/figure3 --out docs/results

This script reads every run folder below the given folders (a folder with ``.hydra/config.yaml``), names each
run's model from its config (``dense``, ``nats_l<lambda>``, ``nats_l<lambda>_exact`` for mask_grad=exact, a
``_<gate>`` suffix for an output gate) and writes ``figure3.md`` (the tables: mean ± sample standard deviation
over seeds), ``figure3.json``, ``figure3_ppl_vs_area.png``, ``figure3_ppl_vs_peak.png``, ``figure3_loss.png``
(training curves) and ``figure3_kv_layers.png`` (per-layer / per-head KV area and type fractions of NAtS).
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

CURVES = (
    "train/loss",
    "val/loss",
    "val/ppl",
    "train/density",
    "train/grad_norm",
    "train/grad_norm_scorer",
    "train/grad_norm_backbone",
    "train/device/items_per_sec",
)
mean_std = collect.mean_std


def model_name(cfg: dict) -> str:
    """The model of a run, from its config: dense, nats_l0.05, nats_l1_exact, ..., with _<gate> for a gate."""
    att = cfg.get("model", {}).get("attention", {})
    gate = att.get("output_gate") or "none"
    name = str(att.get("name"))
    if name == "nats":
        name = f"nats_l{float(att['sparsity_lambda']):g}"
        if att.get("mask_grad", "dense") != "dense":
            name += f"_{att['mask_grad']}"
    return name if gate == "none" else f"{name}_{gate}"


def fmt(v, nd=3):
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{nd}g}" if abs(v) < 1e4 else f"{v:.3e}"
    return str(v)


def setting(cfg: dict) -> str:
    """What a run trained, from its config: 'GPT 12 x 12 x 768, N = 1024, data pg19, 2000 steps of 32 x 1024'."""
    m = cfg.get("model", {})
    n = m.get("block_size")
    return (
        f"GPT {m.get('n_layer')} layers x {m.get('n_head')} heads x d = {m.get('n_embd')}, N = {n}, data "
        f"{cfg.get('data', {}).get('source')}, {cfg.get('trainer', {}).get('max_steps')} steps of "
        f"{cfg.get('global_batch_size')} x {n} tokens"
    )


def load(folders: list[str], checkpoint: str = "last", reports: list[str] = ()) -> dict:
    """Per run (``<model>_s<seed>``): its model, seed, training summary, curves and evaluations (of its final
    checkpoint, ``eval_<split>/``, or with ``checkpoint="best"`` of its best by validation loss,
    ``eval_<split>_best/``: callbacks.eval_after's ``checkpoint: best`` entries). ``reports``: earlier reports'
    JSON whose runs join them (a run folder replaces a report's run of the same name); such a run has the curves
    and evaluations the JSON kept (no per-layer KV fractions)."""
    suffix = "" if checkpoint == "last" else f"_{checkpoint}"
    reported: dict[str, dict] = {}
    for name, r in collect.runs_from_reports(reports).items():
        curves = {k: [tuple(p) for p in r.get("curves", {}).get(k, [])] for k in CURVES}
        if not curves["val/ppl"]:
            curves["val/ppl"] = [(s, math.exp(v)) for s, v in curves["val/loss"]]
        reported[name] = {**r, "curves": curves, "kv_fractions": r.get("kv_fractions")}

    def entry(r: dict, folder: Path) -> tuple[str, dict] | None:
        cfg = r["config"]
        if "model" not in cfg or "attention" not in cfg["model"]:
            return None  # not a training run
        att = cfg["model"]["attention"]
        base, seed = model_name(cfg), cfg.get("seed")
        return f"{base}_s{seed}", {
            "dir": str(folder),
            "base": base,
            "seed": seed,
            "setting": setting(cfg),
            "N": cfg["model"].get("block_size"),
            "attention": att.get("name"),
            "lambda": att.get("sparsity_lambda") if att.get("name") == "nats" else None,
            "metrics": r["metrics"],
            "curves": {k: collect.curve(r["csv"], k) for k in CURVES},
            "eval": {s: r["eval"].get(s + suffix) for s in ("validation", "test")},
            "kv_fractions": r["kv_fractions"].get("test" + suffix),
        }

    return dict(sorted(collect.training_runs(folders, entry, reported).items()))


def summarize(runs: dict) -> dict:
    """Rows of the result table: per (method, setting) mean and spread over seeds, on both splits."""
    table: dict[tuple, dict] = {}
    for r in runs.values():
        for split in ("validation", "test"):
            ev = r["eval"][split]
            if not ev:
                continue
            for res in ev["results"]:
                model = r["base"]
                if r["attention"] != "nats":
                    setting = res["label"] + ("" if res["budget"] is None else f" B=N/{ev['N'] / res['budget']:g}")
                else:
                    setting = f"NAtS lambda={r['lambda']:g}" + (" exact" if "exact" in r["base"] else "")
                key = (model, setting, split)
                row = table.setdefault(
                    key,
                    {
                        "model": model,
                        "setting": setting,
                        "split": split,
                        "policy": res["policy"],
                        "budget": res["budget"],
                        "ppl": [],
                        "area": [],
                        "peak": [],
                        "seeds": [],
                    },
                )
                row["ppl"].append(res["ppl"])
                row["area"].append(res["area"])
                row["peak"].append(res["peak"])
                row["seeds"].append(r["seed"])
    out = []
    for row in table.values():
        for k in ("ppl", "area", "peak"):
            row[k + "_mean"], row[k + "_std"] = mean_std(row[k])
        out.append(row)
    # dense models first (each: full cache, then the baselines by shrinking area), then NAtS by shrinking area
    return sorted(
        out,
        key=lambda r: (r["split"], r["policy"] == "nats", "" if r["policy"] == "nats" else r["model"], -r["area_mean"]),
    )


# The study's claims as pairs of test rows (model, setting): A against B. Pairs whose rows are missing are skipped.
COMPARISONS = (
    (("nats_l0.05", "NAtS lambda=0.05"), ("dense", "full")),
    (("nats_l0.03", "NAtS lambda=0.03"), ("dense", "full")),
    (("nats_l0.05", "NAtS lambda=0.05"), ("dense", "h2o B=N/16")),
    (("nats_l0.05", "NAtS lambda=0.05"), ("dense", "streaming_llm B=N/16")),
    (("dense", "h2o B=N/16"), ("dense", "streaming_llm B=N/16")),
    (("nats_l0.05_headwise", "NAtS lambda=0.05"), ("nats_l0.05", "NAtS lambda=0.05")),
    (("dense_headwise", "full"), ("dense", "full")),
    (("nats_l0.05_headwise", "NAtS lambda=0.05"), ("dense_headwise", "full")),
)


def compare(a: dict, b: dict) -> dict:
    """Test perplexity of row a against row b over their seeds: the difference of the means, its standard error
    (sqrt(s_a^2 / n_a + s_b^2 / n_b), the seeds' sample standard deviations), whether the seed ranges overlap,
    and whether the difference exceeds the seed spread: both more than two standard errors and no overlap (a rough
    criterion with two or three seeds; one seed on either side has no spread and is never judged)."""
    diff = a["ppl_mean"] - b["ppl_mean"]
    judged = len(a["ppl"]) > 1 and len(b["ppl"]) > 1
    se = (a["ppl_std"] ** 2 / len(a["ppl"]) + b["ppl_std"] ** 2 / len(b["ppl"])) ** 0.5 if judged else None
    overlap = max(min(a["ppl"]), min(b["ppl"])) <= min(max(a["ppl"]), max(b["ppl"]))
    return {
        "a": (a["model"], a["setting"]),
        "b": (b["model"], b["setting"]),
        "seeds": (len(a["ppl"]), len(b["ppl"])),
        "diff": diff,
        "rel": diff / b["ppl_mean"],
        "se": se,
        "overlap": overlap,
        "exceeds": bool(judged and not overlap and abs(diff) > 2 * se),
        "judged": judged,
    }


def comparisons(rows: list[dict]) -> list[dict]:
    test = {(r["model"], r["setting"]): r for r in rows if r["split"] == "test"}
    return [compare(test[a], test[b]) for a, b in COMPARISONS if a in test and b in test]


def _label(model: str, setting: str) -> str:
    """A test row in words: 'NAtS lambda=0.05 + headwise gate', 'dense, h2o B=N/16', 'dense, full cache'."""
    gate = model.rsplit("_", 1)[-1]
    gate = f" + {gate} gate" if gate in ("headwise", "elementwise") else ""
    if setting.startswith("NAtS"):
        return setting + gate
    return f"dense{gate}, " + ("full cache" if setting == "full" else setting)


def answer(rows: list[dict], pairs: list[dict], most: int = 4) -> list[str]:
    """The report's opening: the first ``most`` comparisons of COMPARISONS (the study's claims) in words."""
    test = {(r["model"], r["setting"]): r for r in rows if r["split"] == "test"}
    lines = []
    for c in pairs[:most]:
        a, b = test[c["a"]], test[c["b"]]
        area = f"{a['area_mean']:.4f}" + ("" if b["policy"] == "full" else f" against {b['area_mean']:.4f}")
        verdict = (
            "beyond the seed spread"
            if c["exceeds"]
            else ("within the seed spread" if c["judged"] else "one seed, not judged")
        )
        lines.append(
            f"- {_label(*c['a'])} against {_label(*c['b'])}: {a['ppl_mean']:.2f} against {b['ppl_mean']:.2f} "
            f"({100 * c['rel']:+.1f}%) at KV area {area}; {verdict}."
        )
    if lines:
        lines = ["Test perplexity (mean over seeds) and the share of the KV cache kept (KV area):", *lines, ""]
    return lines


def markdown(runs: dict, rows: list[dict], device: str, checkpoint: str = "last", command: str = "") -> str:
    which = "" if checkpoint == "last" else " Evaluations of each run's best checkpoint by validation loss."
    pairs = comparisons(rows)
    lines = ["# Figure 3 at reduced scale: perplexity against KV-cache size", "", *answer(rows, pairs)]
    provenance = (
        f"Trained and evaluated on {device}. Setting: "
        + "; ".join(sorted({r["setting"] for r in runs.values()}))
        + ". Mean ± sample standard deviation over seeds where there are several."
        + which
        + (f" Report of {date.today().isoformat()}: `{command}`." if command else "")
    )
    full_test = [r for r in rows if r["split"] == "test" and r["policy"] == "full"]
    ref = full_test[0]["ppl_mean"] if full_test else None
    for split in ("test", "validation"):
        sub = [r for r in rows if r["split"] == split]
        if not sub:
            continue
        refs = [r for r in sub if r["policy"] == "full"]
        base_ppl = refs[0]["ppl_mean"] if refs else ref
        lines += [
            f"## {split} split",
            "",
            "| model | method | seeds | KV area | KV peak | perplexity | vs dense full |",
            "|---|---|---:|---:|---:|---:|---:|",
        ]
        for r in sub:
            many = len(r["ppl"]) > 1 and r["policy"] == "nats"  # a budgeted policy's area is fixed by its budget

            def pm(key, nd, r=r, many=many):
                return f"{r[key + '_mean']:.{nd}f}" + (f" ± {r[key + '_std']:.{nd}f}" if many else "")

            ppl = f"{r['ppl_mean']:.2f}" + (f" ± {r['ppl_std']:.2f}" if len(r["ppl"]) > 1 else "")
            rel = f"{100 * (r['ppl_mean'] / base_ppl - 1):+.1f}%" if base_ppl else "-"
            lines.append(
                f"| {r['model']} | {r['setting']} | {len(r['seeds'])} | {pm('area', 4)} | {pm('peak', 4)} | {ppl} | "
                f"{rel} |"
            )
        lines.append("")
        if split == "test":
            lines += [provenance, "", "![test perplexity against KV area](figure3_ppl_vs_area.png)", ""]
    if not any(r["split"] == "test" for r in rows):
        lines[2:2] = [provenance, ""]
    if pairs:
        lines += [
            "## Which differences exceed the seed spread (test perplexity)",
            "",
            "A - B: difference of the means over seeds (relative to B); SE: its standard error from the seeds' "
            "standard deviations; exceeds: more than 2 SE apart and no overlap of the seeds' values (with two or "
            "three seeds a rough criterion; one seed has no spread and is not judged).",
            "",
            "| A | B | seeds A / B | A - B | SE | seed values overlap | exceeds the spread |",
            "|---|---|---:|---:|---:|---|---|",
        ]
        for c in pairs:
            se = "-" if c["se"] is None else f"{c['se']:.2f}"
            verdict = "yes" if c["exceeds"] else ("no" if c["judged"] else "not judged")
            lines.append(
                f"| {c['a'][0]} {c['a'][1]} | {c['b'][0]} {c['b'][1]} | {c['seeds'][0]} / {c['seeds'][1]} | "
                f"{c['diff']:+.2f} ({100 * c['rel']:+.1f}%) | {se} | {'yes' if c['overlap'] else 'no'} | {verdict} |"
            )
        lines.append("")
    lines += [
        "## Training",
        "",
        "| run | steps | final val ppl (training's validation) | train density (last) | tokens/s (last) |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, r in runs.items():
        m = {
            **(r["metrics"] or {}).get("metrics", {}),
            **{k: v for k, v in (r["metrics"] or {}).items() if k != "metrics"},
        }
        c = r["curves"]
        dens = c["train/density"][-1][1] if c["train/density"] else None
        tps = c["train/device/items_per_sec"][-1][1] if c["train/device/items_per_sec"] else None
        steps, val = m.get("global_step"), m.get("val/ppl")
        if steps is None and c["train/loss"]:  # no metrics.json: stopped before its end; its CSV says how far
            steps = f"{c['train/loss'][-1][0] + 1} (stopped)"
            val = c["val/ppl"][-1][1] if c["val/ppl"] else None
        lines.append(
            f"| {name} | {'-' if steps is None else steps} | {fmt(val, 4)} | {fmt(dens)} | {fmt(tps and round(tps))} |"
        )
    lines.append("")
    lines.append("More plots: figure3_ppl_vs_peak.png, figure3_loss.png, figure3_kv_layers.png.")
    return "\n".join(lines) + "\n"


def along_training(runs: dict) -> str:
    """Each NAtS run beside the dense run of its seed at every validation of the training: both validation
    perplexities, NAtS' gap, and NAtS' training density (the KV share its types keep) averaged over the steps since
    the previous validation: whether the gap and the KV share move as the training goes on."""
    dense = {r["seed"]: n for n, r in runs.items() if r["attention"] != "nats" and r["base"] == "dense"}
    lines = []
    for name, r in runs.items():
        if r["attention"] != "nats" or r["seed"] not in dense:
            continue
        d = dense[r["seed"]]
        dv, nv = dict(runs[d]["curves"]["val/ppl"]), dict(r["curves"]["val/ppl"])
        lines += [
            f"### {name} beside {d}",
            "",
            "| step | dense val ppl | NAtS val ppl | gap | NAtS train density (since the previous validation) |",
            "|---:|---:|---:|---:|---:|",
        ]
        prev = -1
        for step in sorted(set(dv) & set(nv)):
            if prev >= 0 and step - prev == 1 and (dv[step], nv[step]) == (dv[prev], nv[prev]):
                continue  # the end of the fit logs its last validation again, a step later
            dens = [v for s, v in r["curves"]["train/density"] if prev < s <= step]
            gap = f"{100 * (nv[step] / dv[step] - 1):+.1f}%"
            dens = fmt(sum(dens) / len(dens) if dens else None)
            lines.append(f"| {step + 1} | {dv[step]:.2f} | {nv[step]:.2f} | {gap} | {dens} |")
            prev = step
        lines.append("")
    if not lines:
        return ""
    return "## Validation along the training\n\n" + "\n".join(lines) + "\n"


def plots(runs: dict, rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, FormatStrFormatter, NullFormatter

    test = [r for r in rows if r["split"] == "test"]

    def bars(ax, pts, key, fmt, color, label, **kw):
        """Mean points with the seeds' standard deviation as error bars on both axes (none for one seed)."""
        pts = sorted(pts, key=lambda r: r[key + "_mean"])
        if pts:
            ax.errorbar(
                [r[key + "_mean"] for r in pts],
                [r["ppl_mean"] for r in pts],
                xerr=[r[key + "_std"] for r in pts],
                yerr=[r["ppl_std"] for r in pts],
                fmt=fmt,
                color=color,
                label=label,
                capsize=3,
                **kw,
            )
        return pts

    for key in ("area", "peak"):
        fig, ax = plt.subplots(figsize=(6.8, 4.6))
        for label, policy, color in (("StreamingLLM", "streaming_llm", "C1"), ("H2O", "h2o", "C2")):
            base = [r for r in test if r["model"] == "dense" and r["policy"] == policy]
            bars(ax, base, key, "o-", color, f"{label} (dense model)")
        for model, ls, label in (("dense", "--", "dense"), ("dense_headwise", ":", "dense + headwise gate")):
            full = [r for r in test if r["model"] == model and r["policy"] == "full"]
            if full:
                m, sd = full[0]["ppl_mean"], full[0]["ppl_std"]
                ax.axhline(m, color="k", ls=ls, lw=1, label=f"{label}, full cache ({len(full[0]['ppl'])} seeds)")
                if sd:
                    ax.axhspan(m - sd, m + sd, color="k", alpha=0.08)
        plain = [r for r in test if r["policy"] == "nats" and r["model"].count("_") == 1]  # nats_l<lambda>
        for r in bars(ax, plain, key, "*", "C3", "NAtS", markersize=11):
            ax.annotate(
                r["setting"].replace("NAtS lambda=", "λ=") + (f" ({len(r['ppl'])})" if len(r["ppl"]) > 1 else ""),
                (r[key + "_mean"], r["ppl_mean"]),
                textcoords="offset points",
                xytext=(5, 5),
                fontsize=8,
            )
        gated = [r for r in test if r["policy"] == "nats" and r["model"].endswith("_headwise")]
        bars(ax, gated, key, "D", "C4", "NAtS + headwise gate", markersize=7)
        exact = [r for r in test if r["policy"] == "nats" and r["model"].endswith("_exact")]
        bars(ax, exact, key, "x", "0.5", "NAtS, exact estimator (ablation)")
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(FixedLocator([0.03, 0.05, 0.1, 0.2, 0.5, 1.0]))
        ax.xaxis.set_major_formatter(FormatStrFormatter("%g"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel(f"KV {key} fraction (log)")
        ax.set_ylabel("test perplexity")
        ns = "/".join(str(n) for n in sorted({r["N"] for r in runs.values()}))
        ax.set_title(f"perplexity vs KV {key} (test, N = {ns}); bars: ± 1 sd over seeds", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # no evaluated run (e.g. only stopped ones): no legend
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / f"figure3_ppl_vs_{key}.png", dpi=120)
        plt.close(fig)

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.4))
    for i, (name, r) in enumerate(sorted(runs.items())):
        color = "k" if r["attention"] != "nats" else f"C{i % 10}"
        tl = r["curves"]["train/loss"]
        if tl:
            xs, ys = zip(*tl)
            k = 8  # running mean over 8 logged points
            sm = [sum(ys[max(0, j - k + 1) : j + 1]) / len(ys[max(0, j - k + 1) : j + 1]) for j in range(len(ys))]
            axes[0].plot(xs, sm, color=color, label=name)
        vl = r["curves"]["val/loss"]
        if vl:
            axes[1].plot(*zip(*vl), "o-", color=color, label=name)
        gn = r["curves"]["train/grad_norm_scorer"]
        if gn:
            axes[2].plot(*zip(*gn), color=color, label=f"{name} scorer")
        gb = r["curves"]["train/grad_norm_backbone"] or r["curves"]["train/grad_norm"]
        if gb:
            axes[2].plot(*zip(*gb), color=color, ls=":", label=f"{name} backbone")
    axes[0].set_title("train loss (CE, running mean)")
    axes[1].set_title("validation loss")
    axes[2].set_title("gradient norms (before clipping)")
    axes[2].set_yscale("log")
    for ax in axes:
        ax.set_xlabel("optimizer step")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylim(top=6.0)
    for ax, size, ncol in ((axes[0], 7, 1), (axes[2], 6, 2)):
        if ax.get_legend_handles_labels()[0]:  # nothing to label when no curve was logged
            ax.legend(fontsize=size, ncol=ncol)
    fig.tight_layout()
    fig.savefig(out / "figure3_loss.png", dpi=110)
    plt.close(fig)

    nats_runs = sorted(
        ((n, r) for n, r in runs.items() if r["kv_fractions"] and r["attention"] == "nats"),
        key=lambda nr: (nr[1]["lambda"], "exact" in nr[0], nr[1]["seed"]),
    )
    if nats_runs:
        fig, axes = plt.subplots(2, len(nats_runs), figsize=(3.2 * len(nats_runs), 7), squeeze=False)
        for c, (name, r) in enumerate(nats_runs):
            m = next(v for v in r["kv_fractions"]["methods"].values() if v["policy"] == "nats")
            im = axes[0][c].imshow(m["area"], aspect="auto", cmap="viridis", vmin=0, vmax=max(map(max, m["area"])))
            axes[0][c].set_title(f"{name}\nKV area per layer x head", fontsize=8)
            axes[0][c].set_ylabel("layer")
            fig.colorbar(im, ax=axes[0][c])
            tf = m.get("type_fractions")
            if tf:
                layers = range(len(tf))
                for t, (lab, col) in enumerate((("global", "C0"), ("local", "C1"), ("sliding", "C2"))):
                    axes[1][c].plot(
                        layers, [sum(h[t] for h in layer) / len(layer) for layer in tf], "o-", color=col, label=lab
                    )
                axes[1][c].set_xlabel("layer")
                axes[1][c].set_title("type fractions (mean over heads)", fontsize=8)
                axes[1][c].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "figure3_kv_layers.png", dpi=85)  # many panels: small enough for docs/results
        plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    collect.add_run_sources(ap, "figure3.json")
    ap.add_argument("--out", default="docs/results", help="folder for the table, the JSON and the plots")
    ap.add_argument("--device", default=None, help="the machine, for the caption (default: what nats-eval recorded)")
    ap.add_argument(
        "--checkpoint",
        choices=("last", "best"),
        default="last",
        help="the evaluations of each run's final checkpoint (eval_<split>/) or of its best by validation loss "
        "(eval_<split>_best/, where callbacks.eval_after made them)",
    )
    ap.add_argument(
        "--along-training",
        action="store_true",
        help="also a table per NAtS run of its validation perplexity, its gap to the dense run of its seed and its "
        "training density at every validation (for long trainings)",
    )
    args = ap.parse_args(argv)
    collect.check_run_sources(ap, args)
    runs = load(args.folders, args.checkpoint, args.runs_from)
    rows = summarize(runs)
    if args.device is None:  # cuda / cpu, as the evaluations recorded it
        found = {ev["device"] for r in runs.values() for ev in r["eval"].values() if ev and ev.get("device")}
        args.device = ", ".join(sorted(found)) or "an unrecorded device"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    along = "\n" + along_training(runs) if args.along_training else ""
    command = shlex.join(["python", "experiments/figure3.py", *(sys.argv[1:] if argv is None else argv)])
    (out / "figure3.md").write_text(markdown(runs, rows, args.device, args.checkpoint, command) + along)
    kept_curves = ("train/loss", "val/loss", "train/density")  # the JSON keeps these (and the last tokens/s)
    slim = {
        n: {**{k: v for k, v in r.items() if k not in ("kv_fractions", "curves")},
            "curves": {**{k: v for k, v in r["curves"].items() if k in kept_curves},
                       "train/device/items_per_sec": r["curves"]["train/device/items_per_sec"][-1:]}}
        for n, r in runs.items()
    }  # fmt: skip
    payload = {"device": args.device, "rows": rows, "comparisons": comparisons(rows), "runs": slim}
    (out / "figure3.json").write_text(
        json.dumps(payload, separators=(",", ":"))
    )  # compact: the md is the readable form
    plots(runs, rows, out)
    print((out / "figure3.md").read_text())
    return {"runs": runs, "rows": rows, "comparisons": payload["comparisons"]}


if __name__ == "__main__":
    main()
