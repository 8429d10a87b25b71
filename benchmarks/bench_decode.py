"""Decode step time and KV-cache memory of the cache policies on one GPU (self-contained, random weights).

    python benchmarks/bench_decode.py                          # batch 8, prompts 8k and 32k: full, nats, streaming_llm
    python benchmarks/bench_decode.py --lengths 4096 --steps 16 --policies full,full_sdpa,nats,h2o --modes graph,eager
    python benchmarks/bench_decode.py --smoke                  # CPU: a tiny model, eager, seconds (the tests run it)

GPT-2-small shapes (12 layers, 12 heads, d = 768, head dim 64, vocab 50304) with random weights in bf16, a NAtS
attention core (W = 16) whose scorer types the decoded tokens, block_size = the longest prompt + the decoded
tokens (RoPE tables cover every position). For each prompt length L and policy the cache (one
`nats.cache.engine_cache.EngineCache` over the layers) is filled by its own prefill with synthetic queries, keys
and values for the L prompt tokens (`fill`: each layer's attention over the prompt and what the policy keeps of it,
without the model's dense work; H2O's prefill is its exact sequential rule, slow at long prompts), planned for the
tokens that will be decoded (``reserve``, as `generate` does), then `--warmup` + `--steps` tokens are decoded
greedily, one step being the model's forward with the cache (`nats.cache.decode.decode_step`), timed with CUDA
events over the `--steps` after the warm-up:

* `full`: every key (Triton pool kernel); `full (sdpa)`: every key through torch SDPA/FlashAttention over the
  rows' segments of the same pool viewed as a contiguous cache, eager only (the usual implementation; its shapes
  grow, so it cannot be captured);
* `nats`: synthetic types near 10 % density: per KV head a global rate drawn from U(0.05, 0.13), locals at
  rate 0.03, the rest sliding (token 0 global), for the prompt and for the decoded tokens; head sizes therefore
  differ. The types are the cache's ``type_table`` (`nats.cache.policies.nats.TypeTable`) of every position, which
  the prefill applies to the prompt and each step reads at the device position. The scorer still runs in every
  step: the append kernel computes its logits and then takes the synthetic type, so the step launches no extra
  kernel;
* `streaming_llm` and `h2o` with a budget of NAtS' kept share of L after the prompt (the mean over layers,
  sequences and KV heads; `--budget-frac` sets another share).

"graph" rows decode through `nats.cache.decode.GraphDecoder`, as `generate` does on CUDA: the first warm-up step
runs eagerly, the second captures the step in a CUDA graph, later steps replay it (host work between replays:
the cache's `maintain()`; a reallocation would re-capture, and is counted: `re-captures`, captures after the
warm-up, should be 0; `reallocations`: the cache's pool growths during the timed steps, `EngineCache.reallocations`,
0 within the reserve).
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
from nats.cache.decode import GraphDecoder, decode_step, make_caches, policy_logits, prefill
from nats.cache.engine import write_kv
from nats.cache.engine_cache import EngineCache
from nats.cache.policies.full import FullRule
from nats.cache.policies.nats import TypeTable
from nats.models.gpt import GPT, GPTConfig, decode_settings
from nats_kernels import configure_triton

PROFILE_STEPS = 16  # decode steps under the profiler after a row's timed ones (--profile)


class FullSDPARule(FullRule):
    """`full` through torch SDPA (FlashAttention) over the grown prefix: eager only (shapes grow). The rows of an
    unpadded `full` cache have equal capacities, so the pool's first ``R * cap`` slots are a contiguous cache
    ``[B, Hkv, cap, D]``; a step appends the token as `full` does and attends over the first ``t + 1`` keys. A
    baseline of this benchmark (`make_cache` puts it in a `full` cache), not in the library's cache registry."""

    name = "full_sdpa"

    def step(self, ctx, layer, core, qr, kr, vr, pos, hidden):
        R, G, D = qr.shape
        B, Hkv = layer.batch_size, layer.n_kv_head
        cap = int(layer.cap[0])  # host reads: eager only
        write_kv(layer.kv_pool, layer.start + layer.length, kr, vr)
        layer.length.add_(1)
        n = layer.t + 1  # the keys so far: the prompt and the tokens decoded, this one included
        kv = layer.kv_pool[:, : R * cap].view(2, B, Hkv, cap, D)[:, :, :, :n]
        y = F.scaled_dot_product_attention(qr.reshape(B, Hkv * G, 1, D), kv[0], kv[1], enable_gqa=G != 1)
        return y.reshape(R, G, D), layer.length


# ----------------------------------------------------------------------------------------------------
# synthetic prompts through the cache's prefill
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


BASELINES = {"full_sdpa": FullSDPARule}  # the benchmark's own policies (the library's registry has the others)


def type_table(types: torch.Tensor, first_pos: int) -> TypeTable:
    """Synthetic types [B, H, T] of the positions first_pos..first_pos + T - 1 as a NAtS cache's ``type_table``
    (rows r = b * H + h): the prefill and the steps take them in place of the scorer's, which still runs (its cost
    stays in the step; the fused step reads the table in its append kernel, no extra launch)."""
    B, H, T = types.shape
    return TypeTable(types.permute(2, 0, 1).reshape(T, B * H), first_pos)


def make_cache(model, policy: str, batch: int, max_len: int, **kw) -> EngineCache:
    """`make_caches` for a benchmark policy: a registered one, or the benchmark's own rule (`BASELINES`) put in the
    cache of the policy it derives from before anything is filled."""
    own = BASELINES.get(policy)
    if own is None:
        return make_caches(model, policy, batch, max_len, **kw)
    cache = make_caches(model, own.__mro__[1].name, batch, max_len, **kw)
    rule = own.rule(**cache.rule.options)
    cache.rule = rule
    for layer in cache.layers:
        layer.rule = rule
    return cache


@torch.no_grad()
def fill(cache: EngineCache, model, B: int, L: int, gen: torch.Generator) -> None:
    """The state after L prompt tokens of B sequences through the cache's own prefill, layer by layer, with random
    queries, keys and values (and block inputs for NAtS' scorer; the types come from the cache's ``type_table``):
    each layer's attention over the prompt and what its policy keeps, without the model's dense work."""
    cfg = model.config
    Hq, Hkv, D = cfg.n_head, cfg.n_kv_head, cfg.head_dim
    p = next(model.parameters())
    rand = lambda *shape: torch.randn(*shape, generator=gen, device=p.device, dtype=p.dtype)  # noqa: E731
    for i in range(len(cache)):
        q, k, v = rand(B, Hq, L, D), rand(B, Hkv, L, D), rand(B, Hkv, L, D)
        hidden = rand(B, L, cfg.n_embd) if cache.policy_cls.requires_core is not None else None
        cache.attend(i, q, k, v, hidden)
        del q, k, v, hidden


# ----------------------------------------------------------------------------------------------------
# timing
# ----------------------------------------------------------------------------------------------------
def nats_kept_share(types: torch.Tensor, window: int) -> float:
    """The share of the L prompt tokens the NAtS cache keeps after them (as its prefill: every global and the
    locals after the row's last global, `nats.cache.policies.nats.kept_after_prompt`, and in its ring the sliding
    tokens of the last W - 1 positions); mean over rows."""
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
    if policy == "nats":  # the prompt's types, then the decoded tokens' from the prompt's per-head rates too
        later = synthetic_types(B, types.shape[1], total - L, gen, dev, rate=rates, first_global=False)
        options["type_table"] = type_table(torch.cat([types, later], -1), 0)
    cache = make_cache(
        model,
        policy,
        B,
        total,
        budget=budget,
        backend=args.backend,
        track=False,
        budget_check_len=total,
        reserve=args.warmup + args.steps + profiled,
        **options,
    )
    fill(cache, model, B, L, gen)
    token = torch.randint(0, model.config.vocab_size, (B,), device=dev)
    dec = GraphDecoder(model, cache, inductor=args.inductor) if graph else None
    pos = dec.pos if graph else torch.full((1,), L, dtype=torch.long, device=dev)

    def step(i: int) -> None:
        nonlocal token
        if graph:
            logits = dec(token, L + i)
        else:
            logits = decode_step(model, cache, token, pos)
            pos.add_(1)
        token = logits.argmax(-1)

    for i in range(args.warmup):
        step(i)
    captures0, realloc0 = dec.captures if graph else 0, cache.reallocations()
    timer = Timer(dev)
    timer.start()
    for i in range(args.warmup, args.warmup + args.steps):
        step(i)
    ms = timer.ms() / args.steps
    steps = profile_steps(step, args, L, policy, graph) if args.profile else None
    alloc, kv_alloc, kept, peak_alloc = cache.nbytes(), cache.kv_nbytes(), cache.kept_nbytes(), cache.peak_nbytes()
    weights = roofline.weight_bytes(model, B)
    elem = cache.layers[0].kv_pool.element_size()
    cfg = model.config
    full = weights + roofline.kv_bytes(cfg.n_layer, B * cfg.n_kv_head, cache.t, cfg.head_dim, elem)
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
        "kept_share": kept / (len(cache) * B * cfg.n_kv_head * cfg.head_dim * 2) / cache.t / elem,
        "recaptures": dec.captures - captures0 if graph else None,
        "reallocations": cache.reallocations() - realloc0,
        **roofline.step_stats(nbytes, B * 1000.0 / ms, B, bw.get("measured"), bw.get("datasheet")),
        "bound_vs_full": nbytes / full,
        "profile": None if steps is None else {k: steps[k] for k in ("kernels_per_step", "span_us", "busy_us")},
    }
    return row  # the cache and the graph are freed with this frame (the caller empties the CUDA cache)


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
    for policy in ("nats", "full"):  # no reserve: the pools grow while decoding
        out, _ = policy_logits(model, idx, policy, sequential=True, prefill_len=16, backend="triton")
        lines.append(
            f"verify {policy:13s} eager triton decode vs parallel forward: max |diff| = "
            f"{(out - refs[policy]).abs().max().item():.2e}"
        )
    # graph replays with teacher forcing: planned caches (reserve: 1 capture), and nats without a reserve (its
    # pools grow: reallocations, re-captures)
    P = 16
    for policy, opts in (
        ("nats", {"reserve": 80 - P}),
        ("nats", {}),
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
        name = f"{policy} {opts.get('reserve', 'grows')}" if policy == "nats" else policy
        lines.append(
            f"verify {name:13s} CUDA-graph replay vs eager decode: max |diff| = {diff:.2e} ({dec.captures} captures, "
            f"{caches.reallocations()} reallocations)"
        )
        if policy in ("nats", "full"):
            d = (torch.stack(outs, 1) - refs[policy][:, P:]).abs().max().item()
            lines.append(f"verify {name:13s} CUDA-graph decode vs parallel forward: max |diff| = {d:.2e}")
    return lines


# ----------------------------------------------------------------------------------------------------
def table(rows: list[dict], meta: dict) -> str:
    out = [
        f"Decode benchmark on {meta['device']}: {meta['model']}, random weights, {meta['dtype']}, batch "
        f"{meta['batch']}, {meta['steps']} timed greedy decode steps after {meta['warmup']} warm-up steps, synthetic "
        f"prompt prefilled by the cache. NAtS: synthetic types (per-head global rate U(0.05, 0.13), locals 0.03, rest "
        f"sliding, W = {meta['window']}); streaming_llm / h2o budget = {meta['budget_rule']}. torch {meta['torch']}.",
        "",
        f"Bandwidth: {meta['bandwidth_gbps']:.0f} GB/s measured (a device-to-device copy, read + write), data sheet "
        f"{meta['datasheet_gbps'] or 'unknown'} GB/s.",
        "",
        "| prompt L | policy | mode | budget | kept share | ms / step | tokens/s | vs full | bytes' bound | step MB | "
        "GB/s | of measured BW | of data sheet | vs streaming_llm | cache MB (alloc) | kept KV MB | alloc / kept | "
        "reallocations | re-captures |",
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
            f"{r['kept_MB']:.1f} | {r['alloc_over_kept']:.3f} | {r['reallocations']} | {rec} |"
        )
    out.append("")
    out.append(
        "`vs full`: time per step relative to the fastest `full` row at the same L; `vs streaming_llm`: to the "
        "`streaming_llm` row of the same mode and L. `kept share`: tokens held after the last step over tokens "
        "processed. `alloc / kept`: bytes the caches allocated (keys, values, metadata) over the bytes of the keys "
        "and values of the tokens they hold after the last step. `re-captures`: CUDA-graph captures during the "
        "timed steps (storage reallocated); `reallocations`: the pools' growths during them. `step MB`: the bytes a "
        "step reads (the weights + the kept keys and values); `GB/s`: step MB / step time; `bytes' bound`: the "
        "smallest `vs full` those bytes allow (the row's "
        "bytes / a full cache's)."
    )
    return "\n".join(out) + "\n"


def smoke_args(args) -> None:
    """--smoke: a tiny model on the CPU, eager, the torch backend (seconds; the tests run it)."""
    args.lengths, args.batch, args.steps, args.warmup = "48,64", 2, 6, 2
    args.modes, args.device, args.backend, args.no_verify = "eager", "cpu", "torch", True
    args.window = 4


def main(argv: list[str] | None = None) -> list[dict]:
    configure_triton()  # Triton's settings before any kernel: the interpreter without a GPU, the cache folder
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
