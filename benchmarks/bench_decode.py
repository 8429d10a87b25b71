"""Decode step time and KV-cache memory of the cache policies on one GPU (self-contained, random weights).

    python benchmarks/bench_decode.py                          # batch 8, prompts 8k and 32k: full, nats, streaming_llm
    python benchmarks/bench_decode.py --lengths 4096 --steps 16 --policies full,full_sdpa,nats,h2o --modes graph,eager
    python benchmarks/bench_decode.py --smoke                  # CPU: a tiny model, eager, seconds (the tests run it)

GPT-2-small shapes (12 layers, 12 heads, d = 768, head dim 64, vocab 50304) with random weights in bf16, a NAtS
attention core (W = 16) whose scorer types the decoded tokens, block_size = the longest prompt + the decoded
tokens (RoPE tables cover every position). For each prompt length L and policy the caches are filled directly
with synthetic keys/values for the L prompt tokens (no prefill compute), planned for the tokens that will be
decoded (``reserve``, as `generate` does), then `--warmup` + `--steps` tokens are decoded greedily, one step
being the model's forward with the caches (`nats.cache.decode.decode_step`), timed with CUDA events over the
`--steps` after the warm-up:

* `full`: every key (Triton pool kernel); `full (sdpa)`: every key through torch SDPA/FlashAttention on a
  contiguous cache, eager only (the usual implementation; its shapes grow, so it cannot be captured);
* `nats`: synthetic types near 10 % density: per KV head a global rate drawn from U(0.05, 0.13), locals at
  rate 0.03, the rest sliding (token 0 global), for the prompt and for the decoded tokens; head sizes therefore
  differ. The scorer still runs in every step: the append kernel computes its logits and then takes the synthetic
  type, read from a table at the device position (the cache's ``type_table``, `nats.cache.policies.nats.TypeTable`),
  so the step launches no extra kernel;
* `streaming_llm` and `h2o` with a budget of NAtS' kept share of L after the prompt (the mean over layers,
  sequences and KV heads; `--budget-frac` sets another share).

"graph" rows decode through `nats.cache.decode.GraphDecoder`, as `generate` does on CUDA: the first warm-up step
runs eagerly, the second captures the step in a CUDA graph, later steps replay it (host work between replays:
each cache's `maintain()`; a reallocation would re-capture, and is counted: `re-captures`, captures after the
warm-up, should be 0; `reallocations` reads NAtS' `compactions`, the other policies here never reallocate).
"eager" rows run the same step in Python. Memory: bytes the caches have allocated (keys, values and metadata), the
bytes of the keys and values of the tokens they hold, and the ratio. Speed: ms per
decode step (batch `--batch`), tokens/s, the time relative to the fastest `full` row and to the
`streaming_llm` row of the same mode at the same L. Against the memory-bandwidth limit (`nats.cache.roofline`): the
bytes a step reads (the weights, of the embeddings one row per sequence, + the keys and values the caches hold after
the last step), the achieved GB/s and their share of the bandwidth measured in the same run (a device-to-device
copy) and of the data sheet's, and for caches keeping less than all, the bytes' bound: the smallest `vs full` those
bytes allow (the row's bytes / a full cache's). A quick correctness check on a tiny model runs first
(decoding with the Triton kernel and with CUDA graphs equals the parallel forward). Writes `bench_decode.md` and
`bench_decode.json` to `--out` (default: the environment variable OUT, else benchmarks/results) and prints the
table last. ``--profile``: after each row's timed steps, 16 more under torch.profiler: the kernels by GPU time and, for
graph rows, a replayed step's kernels, its time and the GPU's busy share of it (``profile_<policy>_<mode>_L<L>.txt``;
the row's ``profile`` in the JSON). ``--inductor KEY=VALUE``: a setting of the compiled dense work over the
defaults (`nats.models.gpt.DECODE_INDUCTOR`), passed to the graph rows' `GraphDecoder`, e.g. ``combo_kernels=True``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from nats import functional as NF
from nats.cache import roofline
from nats.cache.base import LayerCache
from nats.cache.decode import GraphDecoder, decode_step, make_caches, policy_logits, prefill
from nats.cache.policies.full import FullCache
from nats.cache.policies.nats import TypeTable
from nats.models.gpt import GPT, GPTConfig, decode_settings

PROFILE_STEPS = 16  # decode steps under the profiler after a row's timed ones (--profile)


class FullSDPACache(FullCache):
    """`full` through torch SDPA (FlashAttention) over the grown prefix: eager only (shapes grow). A baseline of
    this benchmark, passed to `make_caches` as a class (`policy_class`); not in the library's cache registry."""

    name = "full_sdpa"
    graph_safe = False

    def step(self, q, k, v, x, pos):
        self.k.index_copy_(2, pos, k)
        self.v.index_copy_(2, pos, v)
        self.length.add_(1)
        self.t += 1
        return F.scaled_dot_product_attention(
            q, self.k[:, :, : self.t], self.v[:, :, : self.t], enable_gqa=q.shape[1] != k.shape[1]
        )


# ----------------------------------------------------------------------------------------------------
# synthetic prompts written into the caches
# ----------------------------------------------------------------------------------------------------
def head_rates(H: int, gen: torch.Generator, device) -> torch.Tensor:
    """Per KV head global rate in [0.05, 0.13] (head sizes differ)."""
    return 0.05 + 0.08 * torch.rand(1, H, 1, generator=gen, device=device)


def synthetic_types(
    B: int, H: int, L: int, gen: torch.Generator, device, rate: torch.Tensor | None = None, first_global: bool = True
) -> torch.Tensor:
    """Types [B, H, L]: global with the head's rate, local with 0.03, else sliding (token 0 global)."""
    rate = head_rates(H, gen, device) if rate is None else rate
    u = torch.rand(B, H, L, generator=gen, device=device)
    types = torch.where(u < rate, NF.TOKEN_GLOBAL, torch.where(u < rate + 0.03, NF.TOKEN_LOCAL, NF.TOKEN_SLIDING))
    if first_global:
        types[..., 0] = NF.TOKEN_GLOBAL
    return types


BASELINES = {"full_sdpa": FullSDPACache}  # the benchmark's own policies (the library's registry has the others)


def policy_class(policy: str) -> str | type[LayerCache]:
    """What `make_caches` takes for a benchmark policy name: the benchmark's own class, else the registered name."""
    return BASELINES.get(policy, policy)


def type_table(types: torch.Tensor, first_pos: int) -> TypeTable:
    """Synthetic types [B, H, T] of the positions first_pos..first_pos + T - 1 as a NAtS cache's ``type_table``
    (rows r = b * H + h): the steps take them in place of the scorer's, which still runs (its cost stays in the
    step; the fused step reads the table in its append kernel, no extra launch)."""
    B, H, T = types.shape
    return TypeTable(types.permute(2, 0, 1).reshape(T, B * H), first_pos)


def reallocations(caches) -> int:
    """The caches' storage reallocations so far: NAtS' ``compactions`` (its only reallocation); a policy without
    that counter must keep `LayerCache.maintain`, which never reallocates."""
    total = 0
    for c in caches:
        if hasattr(c, "compactions"):
            total += c.compactions
        elif type(c).maintain is not LayerCache.maintain:
            raise TypeError(f"{type(c).__name__} overrides maintain() but counts no reallocations (compactions)")
    return total


def fill(caches, policy: str, L: int, gen: torch.Generator, types: torch.Tensor | None) -> None:
    """The state after L prompt tokens with random keys/values (no compute)."""
    for c in caches:
        dev, dt = c.device, c.dtype
        if policy in ("full", "full_sdpa"):
            c.k[:, :, :L].normal_(generator=gen)
            c.v[:, :, :L].normal_(generator=gen)
            c.length.fill_(L)
        elif policy == "streaming_llm":
            c.k.normal_(generator=gen)
            c.v.normal_(generator=gen)
            c.length.fill_(c.budget)
        elif policy == "h2o":
            c.k.normal_(generator=gen)
            c.v.normal_(generator=gen)
            B = c.budget
            old = torch.randperm(L - c.recent, generator=gen, device=dev)[: B - c.recent].sort().values
            recent = torch.arange(L - c.recent, L, device=dev)
            c.slot_pos.copy_(torch.cat([old, recent]).expand(c.rows, B))
            c.score.uniform_(0, 1, generator=gen)
        elif policy == "nats":
            shape = (c.batch, c.n_kv_head, L, c.head_dim)
            k = torch.randn(shape, generator=gen, device=dev, dtype=dt)
            v = torch.randn(shape, generator=gen, device=dev, dtype=dt)
            c.load(k, v, types)
            del k, v
        else:
            raise ValueError(policy)
        c.t = L


# ----------------------------------------------------------------------------------------------------
# timing
# ----------------------------------------------------------------------------------------------------
def nats_kept_share(types: torch.Tensor, window: int) -> float:
    """The share of the L prompt tokens the NAtS cache keeps after them (as `NAtSCache.load`): every global,
    the locals after the row's last global, the sliding tokens of the last W - 1 positions; mean over rows."""
    L = types.shape[-1]
    pos = torch.arange(L, device=types.device)
    isg = types == NF.TOKEN_GLOBAL
    last_g = torch.where(isg, pos, torch.full_like(pos, -1)).amax(-1, keepdim=True)
    keep = isg | ((types == NF.TOKEN_LOCAL) & (pos > last_g)) | ((types == NF.TOKEN_SLIDING) & (pos > L - window))
    return float(keep.sum(-1).double().mean()) / L


class Timer:
    """CUDA events on a GPU, the wall clock on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def start(self):
        if self.cuda:
            self.a, self.b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            self.a.record()
        else:
            self.t0 = time.perf_counter()

    def ms(self) -> float:
        if self.cuda:
            self.b.record()
            torch.cuda.synchronize()
            return self.a.elapsed_time(self.b)
        return (time.perf_counter() - self.t0) * 1000.0


@torch.no_grad()
def bench_one(model, policy: str, L: int, args, graph: bool, types, rates, budget: int | None) -> dict:
    B, dev = args.batch, torch.device(args.device)
    profiled = PROFILE_STEPS if args.profile else 0  # steps decoded under the profiler after the timed ones
    total = L + args.warmup + args.steps + profiled + 1
    gen = torch.Generator(device=dev).manual_seed(0)
    options = {}
    if policy == "nats":  # decoded tokens get synthetic types from the prompt's per-head rates too
        later = synthetic_types(B, types.shape[1], total - L, gen, dev, rate=rates, first_global=False)
        options["type_table"] = type_table(later, L)
    caches = make_caches(
        model,
        policy_class(policy),
        B,
        total,
        budget=budget,
        backend=args.backend,
        track=False,
        budget_check_len=total,
        reserve=args.warmup + args.steps + profiled,
        **options,
    )
    fill(caches, policy, L, gen, types)
    token = torch.randint(0, model.config.vocab_size, (B,), device=dev)
    dec = GraphDecoder(model, caches, inductor=args.inductor) if graph else None
    pos = dec.pos if graph else torch.full((1,), L, dtype=torch.long, device=dev)

    def step(i: int) -> None:
        nonlocal token
        if graph:
            logits = dec(token, L + i)
        else:
            logits = decode_step(model, caches, token, pos)
            pos.add_(1)
        token = logits.argmax(-1)

    for i in range(args.warmup):
        step(i)
    captures0, realloc0 = dec.captures if graph else 0, reallocations(caches)
    compactions0 = sum(getattr(c, "compactions", 0) for c in caches)
    timer = Timer(dev)
    timer.start()
    for i in range(args.warmup, args.warmup + args.steps):
        step(i)
    ms = timer.ms() / args.steps
    steps = profile_steps(step, args, L, policy, graph) if args.profile else None
    alloc = sum(c.nbytes() for c in caches)
    kv_alloc = sum(c.kv_nbytes() for c in caches)
    kept = sum(c.kept_nbytes() for c in caches)
    peak_alloc = sum(getattr(c, "max_nbytes", c.nbytes()) for c in caches)
    weights = roofline.weight_bytes(model, B)
    elem = torch.empty((), dtype=caches[0].dtype).element_size()
    cfg = model.config
    full = weights + roofline.kv_bytes(cfg.n_layer, B * cfg.n_kv_head, caches[0].t, cfg.head_dim, elem)
    nbytes = weights + kept
    bw = getattr(args, "bandwidth", {}) or {}
    row = {
        "L": L,
        "policy": policy if policy != "full_sdpa" else "full (sdpa)",
        "mode": "graph" if graph else "eager",
        "budget": budget,
        "ms_per_step": ms,
        "tokens_per_s": B * 1000.0 / ms,
        "alloc_MB": alloc / 2**20,
        "kv_alloc_MB": kv_alloc / 2**20,
        "kept_MB": kept / 2**20,
        "alloc_over_kept": alloc / kept,
        "peak_alloc_over_kept": peak_alloc / kept,
        "kept_share": kept
        / (len(caches) * B * model.config.n_kv_head * model.config.head_dim * 2)
        / caches[0].t
        / torch.empty((), dtype=caches[0].dtype).element_size(),
        "recaptures": dec.captures - captures0 if graph else None,
        "reallocations": reallocations(caches) - realloc0,
        "compactions": sum(getattr(c, "compactions", 0) for c in caches) - compactions0,
        **roofline.step_stats(nbytes, B * 1000.0 / ms, B, bw.get("measured"), bw.get("datasheet")),
        "bound_vs_full": nbytes / full,
        "profile": None if steps is None else {k: steps[k] for k in ("kernels_per_step", "span_us", "busy_us")},
    }
    return row  # the caches and the graph are freed with this frame (the caller empties the CUDA cache)


def profile_steps(step, args, L: int, policy: str, graph: bool) -> dict | None:
    """`PROFILE_STEPS` more decode steps (``step(i)``) under torch.profiler: the kernels' table by GPU time and, for
    graph rows, where a replayed step's time goes (`nats.cache.roofline.graph_steps`: kernels per step, a token's
    time, the GPU's busy share), into ``profile_<policy>_<mode>_L<L>.txt`` in ``--out``. Returns the graph steps'
    summary (None for eager rows)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.device(args.device).type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    first = args.warmup + args.steps
    with profile(activities=acts) as prof:
        for i in range(first, first + PROFILE_STEPS):
            step(i)
        if cuda:
            torch.cuda.synchronize()
    mode = "graph" if graph else "eager"
    text = [
        f"## {policy} {mode} L={L} batch={args.batch}: {PROFILE_STEPS} decode steps",
        prof.key_averages().table("cuda_time_total" if cuda else "cpu_time_total", row_limit=40),
    ]
    steps = roofline.profiled_steps(prof) if graph else None
    if steps:
        line, lines = roofline.steps_report(steps, f"{policy} L={L} batch={args.batch}")
        print(line, flush=True)
        text += lines
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"profile_{policy}_{mode}_L{L}.txt").write_text("\n".join(text) + "\n")
    return steps


def set_inductor(settings: list[str]) -> dict:
    """``KEY=VALUE`` words (`nats.utils.inductor_settings`) as the compiled decode parts' inductor settings, to pass
    to `GraphDecoder` (``inductor=``; over `nats.models.gpt.DECODE_INDUCTOR`'s). ValueError, naming the word, for a
    malformed word or a key inductor does not have."""
    from nats.utils import inductor_settings

    return inductor_settings(settings)


# ----------------------------------------------------------------------------------------------------
# correctness on the GPU (tiny model, float32)
# ----------------------------------------------------------------------------------------------------
@torch.no_grad()
def verify(inductor: dict | None = None) -> list[str]:
    lines = []
    torch.manual_seed(0)
    cfg = GPTConfig.tiny(block_size=96, n_embd=64, attention={"name": "nats", "window": 4, "backend": "reference"})
    model = GPT(cfg).cuda().eval()
    for b in model.blocks:
        b.attn.core.scorer.weight.normal_(0, 1.0)
    idx = torch.randint(0, 97, (3, 80), device="cuda")
    ref_nats = model(idx).logits  # the NAtS mask of the learned (here random) types
    saved = [b.attn.core.scorer.weight.detach().clone() for b in model.blocks]
    for b in model.blocks:  # zero type logits: argmax = global for every token, i.e. dense causal attention
        b.attn.core.scorer.weight.zero_()
    ref_full = model(idx).logits
    for b, w in zip(model.blocks, saved):
        b.attn.core.scorer.weight.copy_(w)
    refs = {"nats": ref_nats, "full": ref_full}
    for policy in ("nats", "full"):
        opts = {"check_every": 4} if policy == "nats" else {}
        out, _ = policy_logits(model, idx, policy, sequential=True, prefill_len=16, backend="triton", **opts)
        lines.append(
            f"verify {policy:13s} eager triton decode vs parallel forward: max |diff| = "
            f"{(out - refs[policy]).abs().max().item():.2e}"
        )
    # graph replays with teacher forcing: planned caches (reserve: 1 capture), and nats with a small reserve
    # (overflow: compactions, re-captures)
    P = 16
    for policy, opts in (
        ("nats", {"reserve": 80 - P}),
        ("nats", {"reserve": 2, "check_every": 2}),
        ("full", {}),
        ("streaming_llm", {}),
        ("h2o", {}),
    ):
        budget = 24 if policy in ("streaming_llm", "h2o") else None
        caches = make_caches(model, policy, 3, 80, budget=budget, backend="triton", **opts)
        eager_caches = make_caches(model, policy, 3, 80, budget=budget, backend="triton", **opts)
        prefill(model, caches, idx[:, :P])
        prefill(model, eager_caches, idx[:, :P])
        dec = GraphDecoder(model, caches, inductor=inductor)
        outs, eager = [], []
        for i in range(P, 80):
            outs.append(dec(idx[:, i], i).clone())
            eager.append(decode_step(model, eager_caches, idx[:, i], i))
        diff = (torch.stack(outs) - torch.stack(eager)).abs().max().item()
        name = f"{policy} {opts.get('reserve', '')}".strip()
        lines.append(
            f"verify {name:13s} CUDA-graph replay vs eager decode: max |diff| = {diff:.2e} ({dec.captures} captures)"
        )
        if policy in ("nats", "full"):
            d = (torch.stack(outs, 1) - refs[policy][:, P:]).abs().max().item()
            lines.append(f"verify {name:13s} CUDA-graph decode vs parallel forward: max |diff| = {d:.2e}")
    return lines


# ----------------------------------------------------------------------------------------------------
def table(rows: list[dict], meta: dict) -> str:
    out = [
        f"Decode benchmark on {meta['device']}: {meta['model']}, random weights, {meta['dtype']}, batch "
        f"{meta['batch']}, {meta['steps']} timed greedy decode steps after {meta['warmup']} warm-up steps, prompt "
        f"written into the cache. NAtS: synthetic types (per-head global rate U(0.05, 0.13), locals 0.03, rest "
        f"sliding, W = {meta['window']}); streaming_llm / h2o budget = {meta['budget_rule']}. torch {meta['torch']}.",
        "",
        f"Bandwidth: {meta['bandwidth_gbps']:.0f} GB/s measured (a device-to-device copy, read + write), data sheet "
        f"{meta['datasheet_gbps'] or 'unknown'} GB/s.",
        "",
        "| prompt L | policy | mode | budget | kept share | ms / step | tokens/s | vs full | bytes' bound | step MB | "
        "GB/s | of measured BW | of data sheet | vs streaming_llm | cache MB (alloc) | kept KV MB | alloc / kept | "
        "compactions | re-captures |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    best_full, stream = {}, {}
    for r in rows:
        if r["policy"].startswith("full"):
            best_full[r["L"]] = min(best_full.get(r["L"], math.inf), r["ms_per_step"])
        if r["policy"] == "streaming_llm":
            stream[r["L"], r["mode"]] = r["ms_per_step"]
    for r in rows:
        rel = r["ms_per_step"] / best_full[r["L"]] if r["L"] in best_full else float("nan")
        srel = r["ms_per_step"] / stream[r["L"], r["mode"]] if (r["L"], r["mode"]) in stream else float("nan")
        rec = "-" if r["recaptures"] is None else r["recaptures"]
        bound = f"{r['bound_vs_full']:.2f}x" if r["bound_vs_full"] < 1.0 else "-"
        shares = [f"{x:.1%}" if x is not None else "-" for x in (r["share_of_measured"], r["share_of_datasheet"])]
        out.append(
            f"| {r['L']} | {r['policy']} | {r['mode']} | {r['budget'] or '-'} | {r['kept_share']:.3f} | "
            f"{r['ms_per_step']:.3f} | {r['tokens_per_s']:.0f} | {rel:.2f}x | {bound} | {r['step_gb'] * 1e3:.1f} | "
            f"{r['achieved_gbps']:.4g} | {shares[0]} | {shares[1]} | {srel:.2f}x | {r['alloc_MB']:.1f} | "
            f"{r['kept_MB']:.1f} | {r['alloc_over_kept']:.3f} | {r['compactions']} | {rec} |"
        )
    out.append("")
    out.append(
        "`vs full`: time per step relative to the fastest `full` row at the same L; `vs streaming_llm`: to the "
        "`streaming_llm` row of the same mode and L. `kept share`: tokens held after the last step over tokens "
        "processed. `alloc / kept`: bytes the caches allocated (keys, values, metadata) over the bytes of the keys "
        "and values of the tokens they hold after the last step. `re-captures`: CUDA-graph captures during the "
        "timed steps (storage reallocated). `step MB`: the bytes a step reads (the weights + the kept keys and "
        "values); `GB/s`: step MB / step time; `bytes' bound`: the smallest `vs full` those bytes allow (the row's "
        "bytes / a full cache's)."
    )
    return "\n".join(out) + "\n"


def smoke_args(args) -> None:
    """--smoke: a tiny model on the CPU, eager, the torch backend (seconds; the tests run it)."""
    args.lengths, args.batch, args.steps, args.warmup = "48,64", 2, 6, 2
    args.modes, args.device, args.backend, args.no_verify = "eager", "cpu", "torch", True
    args.window = 4


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="8192,32768")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=4, help=">= 2 for graph rows (eager step, then the capture)")
    ap.add_argument(
        "--policies", default="full,nats,streaming_llm", help="of full, full_sdpa, nats, streaming_llm, h2o"
    )
    ap.add_argument("--modes", default="graph", help="graph and/or eager")
    ap.add_argument(
        "--budget-frac", type=float, default=None, help="streaming_llm / h2o budget share (NAtS' kept share)"
    )
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--no-verify", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU, eager (checks the script runs)")
    ap.add_argument(
        "--profile", action="store_true", help=f"each row's kernels over {PROFILE_STEPS} more steps (profile_*.txt)"
    )
    ap.add_argument(
        "--inductor",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="settings of the compiled decode parts over nats.models.gpt.DECODE_INDUCTOR, e.g. combo_kernels=True",
    )
    ap.add_argument("--out", default=os.environ.get("OUT") or str(Path(__file__).resolve().parent / "results"))
    args = ap.parse_args(argv)
    try:
        args.inductor = set_inductor(args.inductor)
    except ValueError as exc:
        raise SystemExit(f"bench_decode.py: {exc}") from None
    args.device, args.backend = "cuda", "triton"
    if args.smoke:
        smoke_args(args)
    elif not torch.cuda.is_available():
        raise SystemExit("bench_decode.py needs a CUDA GPU (or --smoke on the CPU)")
    modes = args.modes.split(",")
    if "graph" in modes and args.warmup < 2:
        raise SystemExit("--warmup must be >= 2 for graph rows (one eager step, then the capture)")
    dev = torch.device(args.device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else None
    args.bandwidth = {
        "measured": roofline.measured_bandwidth(dev, 1 << (30 if dev.type == "cuda" else 26)),
        "datasheet": roofline.datasheet_bandwidth(name),
    }
    t0 = time.time()
    lines = []
    if not args.no_verify:
        try:
            lines = verify(args.inductor)
        except Exception as exc:  # report and go on: the timings may still work
            traceback.print_exc()
            lines = [f"verify FAILED: {type(exc).__name__}: {exc}"]
    for line in lines:
        print(line, flush=True)
    lengths = [int(x) for x in args.lengths.split(",")]
    policies = args.policies.split(",")
    if "nats" in policies:  # NAtS first: the budgets follow its kept share
        policies = ["nats"] + [p for p in policies if p != "nats"]
    torch.manual_seed(0)
    block_size = max(lengths) + args.warmup + args.steps + PROFILE_STEPS + 16
    if args.smoke:
        cfg = GPTConfig(
            vocab_size=97,
            block_size=block_size,
            n_layer=2,
            n_head=4,
            n_kv_head=2,
            n_embd=32,
            attention={"name": "nats", "window": args.window, "backend": "reference"},
        )
        model, dtype, what = GPT(cfg).eval(), "float32", "a tiny GPT (2 layers, 4 heads, d=32)"
    else:
        cfg = GPTConfig(block_size=block_size, attention={"name": "nats", "window": args.window})
        model = GPT(cfg).cuda().to(torch.bfloat16).eval()
        dtype, what = "bf16", "GPT-2-small shapes (12 layers, 12 heads, d=768)"
    rows, failures = [], []
    for L in lengths:
        gen = torch.Generator(device=dev).manual_seed(L)
        rates = head_rates(cfg.n_kv_head, gen, dev)
        types = synthetic_types(args.batch, cfg.n_kv_head, L, gen, dev, rate=rates)
        share = nats_kept_share(types, args.window) if args.budget_frac is None else args.budget_frac
        for policy in policies:
            budget = max(8, round(share * L)) if policy in ("h2o", "streaming_llm") else None
            for mode in modes:
                if policy == "full_sdpa" and mode == "graph":
                    continue
                try:
                    row = bench_one(
                        model, policy, L, args, mode == "graph", types if policy == "nats" else None, rates, budget
                    )
                except Exception as exc:  # keep the other rows; the failure is listed under the table
                    traceback.print_exc()
                    failures.append(f"L={L} {policy} {mode}: {type(exc).__name__}: {exc}")
                    if dev.type == "cuda":
                        torch.cuda.empty_cache()
                    continue
                rows.append(row)
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.empty_cache()
                print(
                    f"L={L:6d} {row['policy']:14s} {row['mode']:5s} {row['ms_per_step']:8.3f} ms/step "
                    f"{row['tokens_per_s']:9.0f} tok/s  alloc {row['alloc_MB']:9.1f} MB"
                    f"  kept {row['kept_MB']:9.1f} MB  share {row['kept_share']:.3f}"
                    f"  re-captures {row['recaptures']}  reallocations {row['reallocations']}",
                    flush=True,
                )
    meta = {
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
        "model": what,
        "dtype": dtype,
        "batch": args.batch,
        "steps": args.steps,
        "warmup": args.warmup,
        "window": args.window,
        "budget_rule": "NAtS' kept share x L" if args.budget_frac is None else f"{args.budget_frac} x L",
        "torch": torch.__version__,
        "inductor": decode_settings(args.inductor),
        "bandwidth_gbps": args.bandwidth["measured"] / 1e9,
        "datasheet_gbps": None if args.bandwidth["datasheet"] is None else args.bandwidth["datasheet"] / 1e9,
        "seconds": round(time.time() - t0, 1),
        "verify": lines,
        "argv": sys.argv[1:] if argv is None else argv,
    }
    meta["failures"] = failures
    md = table(rows, meta)
    if failures:
        md += "\nFailed runs:\n\n" + "\n".join(f"- {x}" for x in failures) + "\n"
    if lines:
        md += "\nCorrectness on the GPU (tiny float32 model):\n\n" + "\n".join(f"- {x}" for x in lines) + "\n"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_decode.md").write_text(md)
    (out / "bench_decode.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"\n(total {meta['seconds']} s; written to {out / 'bench_decode.md'})\n")
    print(md)
    if failures:
        raise SystemExit(f"{len(failures)} benchmark run(s) failed")
    return rows


if __name__ == "__main__":
    main()
