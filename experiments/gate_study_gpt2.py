"""Gated attention at GPT-2-small scale, and what the gate does to NAtS' KV budget (issue 19;
docs/gate_study_gpt2.md).

Five models with the recipe of the Figure 3 study (docs/figure3.md: GPT-2-small from scratch at N = 1024 on the
PG-19 subset, 2000 steps of 32 x 1024, `experiment=fig3_dense` / `fig3_nats`): dense, dense + headwise gate,
dense + elementwise gate (`model.attention.output_gate=...`), NAtS at lambda = 0.05 and W = 16 without and with
the headwise gate. Per model: validation and test perplexity (`nats-eval`), and on validation windows the
first-token attention share per layer (the attention sink) and the mean gate per layer; for the NAtS models the
KV area and peak, the global / local / sliding fractions per layer and head and the share of the global tokens
that sit at position 0; for the dense models StreamingLLM and H2O at B = N/8 and N/16.

The study runs on one GPU in resumable pieces (``--budget-s``); every subcommand can be repeated and picks up
where the last one stopped:

    python experiments/gate_study_gpt2.py train  [--runs dense nats ...] [--seeds 0 1] [--eval] [--budget-s 540]
    python experiments/gate_study_gpt2.py status
    python experiments/gate_study_gpt2.py eval   [--runs ...] [--seeds 0 1] [--budget-s 540]
    python experiments/gate_study_gpt2.py pack   --out $OUT/gate_study_gpt2.tar.gz
    python experiments/gate_study_gpt2.py report --root experiments/results/gate_study_gpt2 --packed a.tar.gz
    python experiments/gate_study_gpt2.py train --smoke --eval && ... report --smoke   # tiny, on a CPU

``train`` starts each run that is neither finished nor running as a background process of its own
(``nats-train experiment=fig3_dense|fig3_nats <gate overrides> seed=S ckpt_path=auto``, run folder
``<root>/<model>_s<seed>``), at most ``--max-train`` at a time on the one GPU, and waits until they have finished
or ``--budget-s`` has passed; a stopped run restarts from its ``checkpoints/last.ckpt``. ``eval`` (or
``train --eval``, as each run finishes) starts per finished run, at most ``--max-eval`` at a time: ``nats-eval``
on the validation and the test split (``eval_validation/``, ``eval_test/``) and ``analyse`` (``analysis.json``:
sink, gates, NAtS types on the first ``--analysis-windows`` validation windows). The dense models' ``nats-eval``
(full-cache logits, ~70 GB at batch 128) runs alone: not beside a training or another one. Finished pieces are
skipped.
Processes started by this script (and only those) can be stopped with ``kill``.

The process and status helpers are figure3.py's (imported from this folder).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from nats.attention.nats import kv_stats
from nats.functional import TOKEN_GLOBAL

sys.path.insert(0, str(Path(__file__).resolve().parent))  # experiments/: figure3.py's helpers
import figure3  # noqa: E402
from figure3 import alive, launch, mean_std, print_status, read_csv_metrics, train_done  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEFAULT_ROOT = REPO / "logs" / "gate_study_gpt2"
SMOKE_ROOT = REPO / "logs" / "gate_study_gpt2_smoke"
LAMBDA = 0.05  # issue 8/13's main point (docs/figure3.md): KV area 0.079 at +1.3% test perplexity
HEADWISE, ELEMENTWISE = "model.attention.output_gate=headwise", "model.attention.output_gate=elementwise"
NATS_LAMBDA = f"model.attention.sparsity_lambda={LAMBDA}"
# name -> (experiment, overrides, label); seeds are appended as _s<seed>
RUNS: dict[str, tuple[str, list[str], str]] = {
    "dense": ("fig3_dense", [], "dense"),
    "dense_headwise": ("fig3_dense", [HEADWISE], "dense + headwise gate"),
    "dense_elementwise": ("fig3_dense", [ELEMENTWISE], "dense + elementwise gate"),
    "nats": ("fig3_nats", [NATS_LAMBDA], f"NAtS λ={LAMBDA:g}"),
    "nats_headwise": ("fig3_nats", [NATS_LAMBDA, HEADWISE], f"NAtS λ={LAMBDA:g} + headwise gate"),
}
BUDGETS = "[0.125,0.0625]"  # the dense models' StreamingLLM and H2O at B = N/8 and N/16
BASELINES = [(policy, 1 / d, f"N/{d}") for policy in ("streaming_llm", "h2o") for d in (8, 16)]
# `--smoke`: the tiny model on the embedded Gutenberg corpus, a few CPU steps (what tests/test_gate_study_gpt2.py
# runs end to end)
SMOKE_EXTRA = [
    "model=tiny",
    "trainer=cpu",
    "compile=false",
    "data=gutenberg",
    "data.micro_batch_size=4",
    "global_batch_size=4",
    "trainer.max_steps=4",
    "eval_every=2",
    "data.max_eval_windows=4",
    "data.num_workers=0",
    "trainer.log_every_n_steps=1",
]
# options left unset get these (GPU study) or SMOKE_DEFAULTS (--smoke)
DEFAULTS = {
    "root": str(DEFAULT_ROOT),
    "max_train": 5,  # 5 GPT-2-small trainings fit an H200 (141 GB); gpu_gate_study_gpt2.sh takes 3 on 80 GB
    "max_eval": 6,
    "max_windows": 512,
    "batch_size_dense": 128,
    "batch_size_nats": 16,
    "analysis_windows": 64,
}
SMOKE_DEFAULTS = {
    "root": str(SMOKE_ROOT),
    "max_train": 2,  # two CPU cores, one thread per process
    "max_eval": 3,
    "max_windows": 4,
    "batch_size_dense": 4,
    "batch_size_nats": 4,
    "analysis_windows": 4,
}
PACK_PATTERNS = [
    "csv/metrics.csv",
    "metrics.json",
    ".hydra/config.yaml",
    "eval_*/results.json",
    "eval_*/results.md",
    "eval_*/kv_fractions.json",
    "analysis.json",
    "*.out",
]


def parse_run(run: str) -> tuple[str, int]:
    return figure3.parse_run(run, RUNS)


def expand(names: list[str], seeds: list[int]) -> list[str]:
    """Run names: a name of RUNS gets every seed; a name with its seed (``dense_s1``) stays as it is."""
    return figure3.expand(names, seeds, RUNS)


def is_nats(run: str) -> bool:
    return RUNS[parse_run(run)[0]][0] == "fig3_nats"


def data_overrides(extra: list[str]) -> list[str]:
    """The data options of `extra` (what nats-prepare, nats-eval and the analysis need), the PG-19 subset by
    default."""
    data = [e for e in extra if e.startswith(("data", "paths.data_dir="))]
    if not any(e.startswith("data=") for e in data):
        data.insert(0, "data=pg19_subset")
    return data


def prepare(extra: list[str]) -> None:
    """The token cache, once (nats-prepare returns at once when it exists)."""
    cmd = [sys.executable, "-m", "nats.prepare", *data_overrides(extra)]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=REPO, check=True, env={**os.environ, "PROJECT_ROOT": str(REPO)})


# ----------------------------------------------------------------------------------------------------
# jobs: background processes, resumable (done = their output exists), at most so many of a kind at a time
# ----------------------------------------------------------------------------------------------------
@dataclass
class Job:
    kind: str  # "train" | "eval" (evaluations and the analysis share a limit)
    label: str
    folder: Path  # the run folder; the process logs to <folder>/<log_name>, its pid in <log_name>.pid
    log_name: str
    cmd: list[str]
    output: Path  # exists once the job has finished
    after: Path | None = None  # must exist before the job can start (a training's metrics.json)
    # a job that needs most of the GPU's memory (the dense models' full-cache nats-eval: batch x 1024 x 50304 fp32
    # logits, ~70 GB at batch 128): it starts only while no training and no other heavy job runs (on one H200,
    # two of them at once, or one beside five trainings, ran out of memory)
    heavy: bool = False

    def done(self) -> bool:
        return self.output.is_file()

    def running(self) -> bool:
        return alive(self.folder / f"{self.log_name}.pid")

    def ready(self) -> bool:
        return self.after is None or self.after.is_file()


def schedule(jobs: list[Job], root: Path, budget_s: float, limits: dict[str, int], every_s: float = 60.0) -> None:
    """Start jobs that are neither done nor running once they are ready, at most limits[kind] running at a time,
    until none is running and none can start, or budget_s has passed (the processes outlive this call; the next
    call waits for them). A job that exits without its output is not restarted in this call: its log says why,
    and the next call tries again (a training from its last checkpoint)."""
    for job in jobs:
        if job.done():
            print(f"{job.label}: done, skipped", flush=True)
    t0 = shown = time.time()
    started: set[str] = set()
    while True:
        for job in jobs:
            if job.label in started or job.done() or job.running() or not job.ready():
                continue
            if sum(j.running() for j in jobs if j.kind == job.kind) >= limits[job.kind]:
                continue
            if job.heavy and any(j.running() for j in jobs if j.kind == "train" or j.heavy):
                continue
            resume = job.kind == "train" and (job.folder / "checkpoints" / "last.ckpt").is_file()
            print(f"{'resuming' if resume else 'starting'} {job.label}", flush=True)
            launch(job.cmd, job.folder, job.log_name)
            started.add(job.label)
        running = [j for j in jobs if j.running()]
        waiting = [j for j in jobs if j.label not in started and not j.done() and not j.running() and j.ready()]
        if (not running and not waiting) or time.time() - t0 > budget_s:
            break
        time.sleep(2.0)
        if time.time() - shown >= every_s:
            print_status(root)
            shown = time.time()
    print_status(root)
    for job in jobs:
        if job.label in started and not job.done() and not job.running():
            print(f"{job.label}: stopped without {job.output.name}, see {job.folder / job.log_name}", flush=True)
    left = [j.label for j in jobs if j.running()]
    print(f"{len(left)} still running after {time.time() - t0:.0f}s" + (f": {' '.join(left)}" if left else ""))


def train_cmd(run: str, root: Path, extra: list[str], steps: int | None) -> list[str]:
    base, seed = parse_run(run)
    experiment, overrides, _ = RUNS[base]
    cmd = [
        sys.executable,
        "-m",
        "nats.train",
        f"experiment={experiment}",
        *overrides,
        f"seed={seed}",
        f"hydra.run.dir={root / run}",
        "ckpt_path=auto",
        "callbacks.progress_bar.refresh_rate=0",
    ]
    return cmd + ([f"trainer.max_steps={steps}"] if steps else []) + list(extra)


def train_job(run: str, root: Path, args) -> Job:
    folder = root / run
    cmd = train_cmd(run, root, args.extra, args.steps)
    return Job("train", f"{run} train", folder, "train.out", cmd, folder / "metrics.json")


def eval_jobs(run: str, root: Path, args) -> list[Job]:
    """nats-eval on both splits (the dense models: full cache, and on test StreamingLLM and H2O at N/8, N/16;
    the NAtS models: their learned types) and the analysis of the validation windows."""
    folder = root / run
    ckpt = folder / "checkpoints" / "last.ckpt"
    nats = is_nats(run)
    data = data_overrides(args.extra)
    jobs = []
    for split in ("validation", "test"):
        methods = "[nats]" if nats else "[full,streaming_llm,h2o]" if split == "test" else "[full]"
        cmd = [
            sys.executable,
            "-m",
            "nats.eval",
            f"ckpt_path={ckpt}",
            *data,
            f"split={split}",
            f"methods={methods}",
            f"budgets={BUDGETS}",
            f"max_windows={args.max_windows}",
            f"batch_size={args.batch_size_nats if nats else args.batch_size_dense}",
            "device=auto",
            "progress=false",
            f"hydra.run.dir={folder / f'eval_{split}'}",
        ]
        out = folder / f"eval_{split}" / "results.json"
        jobs.append(
            Job(
                "eval",
                f"{run} eval {split}",
                folder,
                f"eval_{split}.out",
                cmd,
                out,
                after=folder / "metrics.json",
                heavy=not nats,
            )
        )
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "analyse",
        "--ckpt",
        str(ckpt),
        "--out",
        str(folder / "analysis.json"),
        "--windows",
        str(args.analysis_windows),
        "--batch-size",
        str(args.analysis_batch_size),
        "--skip",
        str(args.skip),
        "--extra",
        *data,
    ]
    out = folder / "analysis.json"
    jobs.append(Job("eval", f"{run} analysis", folder, "analysis.out", cmd, out, folder / "metrics.json"))
    return jobs


def resolve_defaults(args) -> None:
    """The defaults of the options left unset: the GPU study's, or with --smoke the tiny CPU setting's (its
    overrides go before --extra, and it has a root and a report folder of its own)."""
    if args.smoke:
        args.extra = [*SMOKE_EXTRA, *args.extra]
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # the processes it starts share a few CPU cores
    for key, value in (SMOKE_DEFAULTS if args.smoke else DEFAULTS).items():
        if getattr(args, key, "absent") is None:
            setattr(args, key, value)
    if args.cmd == "report" and args.out is None:
        args.out = f"{args.root}_report" if args.smoke else str(REPO / "docs" / "results")


def cmd_train(args) -> None:
    root = Path(args.root)
    runs = expand(args.runs, args.seeds)
    if not args.no_prepare:
        prepare(args.extra)
    jobs = [train_job(run, root, args) for run in runs]
    if args.eval:  # evaluate each run as soon as its training has finished
        jobs += [job for run in runs for job in eval_jobs(run, root, args)]
    schedule(jobs, root, args.budget_s, {"train": args.max_train, "eval": args.max_eval})


def cmd_eval(args) -> None:
    root = Path(args.root)
    jobs = []
    for run in expand(args.runs, args.seeds):
        if not train_done(root / run):
            print(f"{run}: not trained yet, skipped", flush=True)
            continue
        jobs += eval_jobs(run, root, args)
    schedule(jobs, root, args.budget_s, {"train": 0, "eval": args.max_eval})


def cmd_pack(args) -> None:
    root, out = Path(args.root), Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    with tarfile.open(tmp, "w:gz") as tar:
        for folder in sorted(p for p in root.iterdir() if p.is_dir()):
            for pattern in PACK_PATTERNS:
                for f in sorted(folder.glob(pattern)):
                    tar.add(f, arcname=str(f.relative_to(root)))
    tmp.replace(out)
    print(f"packed {out} ({out.stat().st_size / 1e6:.2f} MB)")


def cmd_kill(args) -> None:
    """Stop the processes this script started under --root (by their recorded pids' process groups)."""
    for pid_file in sorted(Path(args.root).glob("*/*.pid")):
        if alive(pid_file):
            os.killpg(int(pid_file.read_text()), signal.SIGTERM)
            print("stopped", pid_file.parent.name, pid_file.name)


# ----------------------------------------------------------------------------------------------------
# measurements (the `analyse` subcommand)
# ----------------------------------------------------------------------------------------------------
def first_token_share(p0: torch.Tensor, skip: int = 0) -> torch.Tensor:
    """p0 [B, H, N]: the attention probability that query i puts on key 0. Returns [H]: its mean over the batch
    and the queries i >= skip (the first queries see few keys, query 0 only key 0, and are left out)."""
    if not 0 <= skip < p0.shape[-1]:
        raise ValueError(f"skip={skip} must be in [0, N) with N = {p0.shape[-1]}")
    return p0[..., skip:].double().mean(dim=(0, 2))


def uniform_first_token_share(n: int, skip: int = 0) -> float:
    """first_token_share of uniform causal attention (query i puts 1 / (i + 1) on key 0): the no-sink level."""
    return sum(1.0 / (i + 1) for i in range(skip, n)) / (n - skip)


def globals_at_position0(types: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """types [B, H, N] (NAtS hard types). Returns per head [H], summed over the batch: (the global tokens at
    position 0, all global tokens). Their ratio is the share of the globals that are the sink token (token 0
    is global by the NAtS rule, so the share is 1 / the mean number of globals of a head and window)."""
    is_global = types == TOKEN_GLOBAL
    return is_global[..., 0].sum(0).double(), is_global.sum(dim=(0, 2)).double()


@torch.no_grad()
def layer_probes(model, idx: torch.Tensor) -> list[dict[str, torch.Tensor]]:
    """One eval forward of `model` (a nats GPT) on idx [B, N]; per layer a dict with

    * "p0" [B, Hq, N]: the attention probability of query i on key 0, read as in nats.analysis: the layer's
      core is called again on its own q, k with a probe value (v_j = 1 for j = 0, else 0), so its output is
      P[i, 0] in every channel (exact for dense/SDPA and for NAtS, whose mask does not depend on v);
    * "gate" [B, N, Hq] (gated layers): sigmoid(x W_g), per head (elementwise: the mean over the head's channels);
    * "types" [B, Hkv, N] (NAtS layers): the hard types (argmax of the scorer, token 0 global)."""
    records: list[dict[str, torch.Tensor]] = [{} for _ in model.blocks]

    def hook_of(layer: int):
        def hook(attn, args, output):
            x, rope, positions = args[:3]
            q, k, v = attn.project(x, rope, positions)
            probe = torch.zeros_like(v)
            probe[:, :, 0, :] = 1.0
            rec = records[layer]
            rec["p0"] = attn.core(q, k, probe, x).y[..., 0].float()
            if attn.gate is not None:
                g = torch.sigmoid(attn.gate(x).float())  # [B, N, H] or [B, N, C]
                if attn.gate.kind == "elementwise":
                    g = g.view(*g.shape[:2], attn.n_head, -1).mean(-1)
                rec["gate"] = g
            if hasattr(attn.core, "hard_types"):
                rec["types"] = attn.core.hard_types(x)

        return hook

    handles = [block.attn.register_forward_hook(hook_of(i)) for i, block in enumerate(model.blocks)]
    was_training = model.training
    model.eval()
    try:
        model(idx)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return records


def measure(model, batches, skip: int) -> dict:
    """layer_probes over (x, y) batches; per layer the sink (first-token share, per head and mean), the gate mean
    and, for NAtS layers, KV area / peak, type fractions and the globals at position 0 (per head and per layer)."""
    device = next(model.parameters()).device
    sums: list[dict[str, torch.Tensor]] = []
    n = 0
    N = None
    for x, _ in batches:
        B, N = x.shape
        for layer, rec in enumerate(layer_probes(model, x.to(device))):
            s = {"sink": first_token_share(rec["p0"], skip).cpu() * B}
            if "gate" in rec:
                s["gate"] = rec["gate"].double().mean(dim=(0, 1)).cpu() * B
            if "types" in rec:
                t = rec["types"]
                s["pos0"], s["globals"] = (v.cpu() for v in globals_at_position0(t))
                stats = kv_stats(t, model.blocks[layer].attn.core.window)
                s["area"] = stats["density"].double().sum(0).cpu()
                s["peak"] = stats["peak"].double().sum(0).cpu()
                s["types"] = torch.nn.functional.one_hot(t, 3).double().sum(dim=(0, 2)).cpu()  # [Hkv, 3]
            if layer == len(sums):
                sums.append(s)
            else:
                sums[layer] = {k: sums[layer][k] + v for k, v in s.items()}
        n += B
    if n == 0:
        raise ValueError("measure() got no windows")
    layers = []
    for s in sums:
        sink = s["sink"] / n
        out = {"first_token_share": float(sink.mean()), "first_token_share_heads": sink.tolist()}
        if "gate" in s:
            gate = s["gate"] / n
            out.update(gate_mean=float(gate.mean()), gate_heads=gate.tolist())
        if "types" in s:
            types = s["types"] / s["types"].sum(-1, keepdim=True)
            out.update(
                area=float((s["area"] / n).mean()),
                peak=float((s["peak"] / n).mean()),
                area_heads=(s["area"] / n).tolist(),
                peak_heads=(s["peak"] / n).tolist(),
                type_fractions=types.mean(0).tolist(),  # [global, local, sliding], mean over heads
                type_fractions_heads=types.tolist(),
                globals_total=float(s["globals"].sum()),
                globals_pos0=float(s["pos0"].sum()),
                global_pos0_share=float(s["pos0"].sum() / s["globals"].sum()),
                global_pos0_share_heads=(s["pos0"] / s["globals"]).tolist(),
                globals_per_head=float(s["globals"].sum() / (n * len(s["globals"]))),
            )
        layers.append(out)
    return {"windows": n, "N": N, "skip": skip, "uniform_share": uniform_first_token_share(N, skip), "layers": layers}


def cmd_analyse(args) -> None:
    """Measure a checkpoint on the first --windows validation windows; writes --out (JSON) atomically."""
    from nats.eval import eval_windows, load_checkpoint
    from nats.train import compose_config
    from nats.utils import atomic_write

    model, model_cfg = load_checkpoint(args.ckpt)
    n = model.config.block_size
    cfg = compose_config([*data_overrides(args.extra), "split=validation", f"max_windows={args.windows}"], "eval")
    dataset = eval_windows(cfg, n, model.config.vocab_size)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = model.to(device).eval()
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, shuffle=False)
    t0 = time.time()
    result = measure(model, loader, args.skip)
    attention = model_cfg.get("attention", {})
    result = {
        "checkpoint": str(args.ckpt),
        "split": "validation",
        "attention": attention.get("name"),
        "output_gate": attention.get("output_gate", "none"),
        "device": str(device),
        "seconds": round(time.time() - t0, 2),
        **result,
    }
    atomic_write(args.out, json.dumps(result, indent=1))
    print(f"wrote {args.out}: {result['windows']} windows in {result['seconds']} s", flush=True)


# ----------------------------------------------------------------------------------------------------
# report
# ----------------------------------------------------------------------------------------------------
def load_json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def run_setting(folder: Path) -> dict | None:
    """Model size, data, steps and batch of a run, from its .hydra/config.yaml (for the report's caption)."""
    f = folder / ".hydra" / "config.yaml"
    if not f.is_file():
        return None
    cfg = yaml.safe_load(f.read_text())
    model = cfg.get("model", {})
    return {
        **{k: model.get(k) for k in ("n_layer", "n_head", "n_embd", "block_size")},
        "data": cfg.get("data", {}).get("source"),
        "steps": cfg.get("trainer", {}).get("max_steps"),
        "batch": cfg.get("global_batch_size"),
    }


def collect(root: Path, added: dict[str, Path] | None = None) -> dict:
    """Per run folder of `root`: its model, seed, training summary, evaluations and analysis; `added` names more
    run folders elsewhere (run name -> folder), e.g. earlier runs of the same recipe under another seed."""
    runs = {}
    folders = [(p.name, p) for p in sorted(root.iterdir()) if p.is_dir()] if root.is_dir() else []
    for name, folder in [*folders, *(added or {}).items()]:
        try:
            base, seed = parse_run(name)
        except SystemExit:
            continue
        if name in runs:
            raise SystemExit(f"run {name} is both in {root} and added as {folder}: give the added one another seed")
        rows = read_csv_metrics(folder)
        runs[name] = {
            "folder": str(folder),
            "base": base,
            "seed": seed,
            "experiment": RUNS[base][0],
            "overrides": RUNS[base][1],
            "setting": run_setting(folder),
            "training": load_json(folder / "metrics.json"),
            "val_curve": [(int(r["step"]), float(r["val/ppl"])) for r in rows if r.get("val/ppl") not in (None, "")],
            "eval": {s: load_json(folder / f"eval_{s}" / "results.json") for s in ("validation", "test")},
            "analysis": load_json(folder / "analysis.json"),
        }
    return runs


def _result(ev: dict | None, policy: str, budget_fraction: float | None = None) -> dict | None:
    for r in (ev or {}).get("results", []):
        fraction = r.get("budget_fraction")
        if r["policy"] == policy and (budget_fraction is None or math.isclose(fraction, budget_fraction, rel_tol=0.02)):
            return r
    return None


def run_values(r: dict) -> dict:
    """The measurements of one run (a `collect` entry), by name; missing ones are left out. Per-layer values are
    lists over layers."""
    nats = RUNS[r["base"]][0] == "fig3_nats"
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
    """One row per model, in the order of RUNS: each measurement of run_values as mean and sample std over the
    model's seeds ({"mean", "std", "n"}; per-layer ones layer by layer)."""
    rows: dict[str, dict] = {}
    values: dict[str, dict[str, list]] = {}
    for name, r in sorted(runs.items(), key=lambda kv: (list(RUNS).index(kv[1]["base"]), kv[1]["seed"])):
        base = r["base"]
        row = rows.setdefault(
            base,
            {"model": base, "label": RUNS[base][2], "nats": RUNS[base][0] == "fig3_nats", "seeds": [], "runs": []},
        )
        row["seeds"].append(r["seed"])
        row["runs"].append(name)
        if r["analysis"]:
            row["uniform_share"], row["skip"] = r["analysis"]["uniform_share"], r["analysis"]["skip"]
        for key, value in run_values(r).items():
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


def markdown(rows: list[dict], setting: str) -> str:
    st = {r["model"]: r["stats"] for r in rows}
    dense_test = st.get("dense", {}).get("test_ppl")
    n_layer = max((len(r["stats"]["sink_layers"]["mean"]) for r in rows if "sink_layers" in r["stats"]), default=0)
    uniform = next(((r["uniform_share"], r["skip"]) for r in rows if "uniform_share" in r), None)
    lines = [
        "# Gated attention at GPT-2-small scale, and the gate in NAtS (issue 19)",
        "",
        "Produced by `experiments/gate_study_gpt2.py report` from the run folders (docs/gate_study_gpt2.md). "
        f"{setting} Perplexities: `nats-eval` on the first windows of each split; first-token share, gate and "
        "the NAtS types per layer: the first validation windows (`analysis.json` of each run). Mean ± sample "
        "standard deviation over seeds where there are several.",
        "",
        "| model | seeds | val ppl | test ppl | test vs dense | first-token share (mean over layers) | "
        "max layer | mean gate | KV area (test) | KV peak (test) | globals at position 0 | globals per head |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        s = r["stats"]
        rel = "-"
        if dense_test and "test_ppl" in s:
            rel = f"{100 * (s['test_ppl']['mean'] / dense_test['mean'] - 1):+.1f}%"
        seeds = ", ".join(map(str, r["seeds"]))
        lines.append(
            f"| {r['label']} | {seeds} | {pm(s.get('val_ppl'))} | {pm(s.get('test_ppl'))} | {rel} | "
            f"{pm(s.get('sink'), 4)} | {pm(s.get('sink_max'), 4)} | {pm(s.get('gate'), 3)} | {pm(s.get('area'), 4)} "
            f"| {pm(s.get('peak'), 4)} | {pm(s.get('pos0_share'), 3)} | {pm(s.get('globals_per_head'), 1)} |"
        )
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
        "Plots: gate_study_gpt2_sink.png (first-token share and gate per layer), gate_study_gpt2_kv.png (NAtS per "
        "layer), gate_study_gpt2_ppl_vs_area.png (test perplexity against KV area, NAtS and the baselines).",
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
    color = {name: f"C{i}" for i, name in enumerate(RUNS)}

    def save_per_layer(fig, axes, name: str) -> None:  # x = layer index
        for ax in axes:
            ax.set_xlabel("layer")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
        fig.tight_layout()
        written.append(out / name)
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)

    with_sink = [r for r in rows if "sink_layers" in r["stats"]]
    if with_sink:
        fig, axes = plt.subplots(1, 2, figsize=(13, 4.6))
        for r in with_sink:
            st = r["stats"]["sink_layers"]
            style = "--" if r["nats"] else "-"
            axes[0].errorbar(
                range(len(st["mean"])),
                st["mean"],
                yerr=st["std"],
                fmt="o" + style,
                capsize=2,
                color=color[r["model"]],
                label=r["label"],
            )
            if "gate_layers" in r["stats"]:
                g = r["stats"]["gate_layers"]
                axes[1].errorbar(
                    range(len(g["mean"])),
                    g["mean"],
                    yerr=g["std"],
                    fmt="o" + style,
                    capsize=2,
                    color=color[r["model"]],
                    label=r["label"],
                )
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
            axes[0].errorbar(
                layers,
                s["area_layers"]["mean"],
                yerr=s["area_layers"]["std"],
                fmt="o-",
                capsize=2,
                color=c,
                label=r["label"],
            )
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


def cmd_report(args) -> None:
    root = Path(args.root)
    for packed in args.packed or []:  # several: e.g. one per GPU lease
        root.mkdir(parents=True, exist_ok=True)
        with tarfile.open(packed) as tar:
            tar.extractall(root, filter="data")
    added = {}
    for item in args.add or []:
        name, sep, folder = item.partition("=")
        if not sep or not Path(folder).is_dir():
            raise SystemExit(
                f"--add {item!r}: expected RUN=FOLDER with an existing run folder, e.g. "
                "dense_s1=experiments/results/figure3/dense_s1"
            )
        added[name] = Path(folder)
    runs = collect(root, added)
    if not runs:
        raise SystemExit(f"no run folders in {root}")
    rows = summarize(runs)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    setting = caption(runs, args.device)
    if added:
        setting += (
            " Runs added from other folders (the same recipe, another seed): "
            + ", ".join(
                f"{name} ({folder}{'' if (folder / 'analysis.json').is_file() else ', no analysis'})"
                for name, folder in added.items()
            )
            + "."
        )
    (out / "gate_study_gpt2.md").write_text(markdown(rows, setting))
    (out / "gate_study_gpt2.json").write_text(json.dumps({"setting": setting, "rows": rows, "runs": runs}, indent=1))
    plots(rows, out)
    print((out / "gate_study_gpt2.md").read_text())


# ----------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("train", "eval", "status", "pack", "kill", "report", "analyse"):
        p = sub.add_parser(name)
        p.add_argument("--root", default=None, help=f"folder of the run folders (default {DEFAULT_ROOT})")
        p.add_argument("--smoke", action="store_true", help="the tiny CPU setting (model=tiny, a few steps)")
        p.add_argument("--extra", nargs="*", default=[], help="Hydra overrides for every run, e.g. data.path=...")
        if name in ("train", "eval"):
            p.add_argument("--runs", nargs="+", default=list(RUNS), help=f"from {list(RUNS)} (default: all)")
            p.add_argument("--seeds", nargs="+", type=int, default=[0])
            p.add_argument("--budget-s", type=float, default=540.0, help="return after this many seconds")
            p.add_argument("--max-eval", type=int, default=None, help="evaluation processes at a time (6)")
            p.add_argument("--max-windows", type=int, default=None, help="nats-eval windows per split (512)")
            p.add_argument("--batch-size-dense", type=int, default=None, help="nats-eval batch, dense (128)")
            p.add_argument("--batch-size-nats", type=int, default=None, help="nats-eval batch, NAtS (16)")
            p.add_argument("--analysis-windows", type=int, default=None, help="validation windows analysed (64)")
            p.add_argument("--analysis-batch-size", type=int, default=8)
            p.add_argument("--skip", type=int, default=16, help="first-token share: leave out queries i < skip")
        if name == "train":
            p.add_argument("--steps", type=int, default=None, help="trainer.max_steps (default: the config's 2000)")
            p.add_argument("--max-train", type=int, default=None, help="trainings at a time on the GPU (5)")
            p.add_argument("--no-prepare", action="store_true")
            p.add_argument("--eval", action="store_true", help="evaluate each run as soon as it has finished")
        if name == "pack":
            p.add_argument("--out", required=True)
        if name == "report":
            p.add_argument(
                "--add",
                nargs="*",
                default=[],
                metavar="RUN=FOLDER",
                help="more run folders as seeds of a model, e.g. dense_s1=experiments/results/figure3/dense_s1",
            )
            p.add_argument("--packed", nargs="*", default=None, help="`pack` archives to extract into --root first")
            p.add_argument("--out", default=None, help="default docs/results (--smoke: <root>_report)")
            p.add_argument("--device", default=None, help="the machine, for the caption (default: cpu / cuda)")
        if name == "analyse":  # one run's measurements; started by `eval` as a background process
            p.add_argument("--ckpt", required=True)
            p.add_argument("--out", required=True)
            p.add_argument("--windows", type=int, default=64)
            p.add_argument("--batch-size", type=int, default=8)
            p.add_argument("--skip", type=int, default=16)
    args = ap.parse_args(argv)
    resolve_defaults(args)
    {
        "train": cmd_train,
        "eval": cmd_eval,
        "status": lambda a: print_status(Path(a.root)),
        "pack": cmd_pack,
        "kill": cmd_kill,
        "report": cmd_report,
        "analyse": cmd_analyse,
    }[args.cmd](args)


if __name__ == "__main__":
    main()
