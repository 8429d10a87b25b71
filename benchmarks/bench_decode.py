"""Decode throughput and KV-cache memory of the cache policies on one GPU (self-contained, random weights).

    python benchmarks/bench_decode.py                          # batch 8, prompts 4k/8k/16k/32k, ~2-3 min on an H100
    python benchmarks/bench_decode.py --lengths 4096 --steps 16 --out /tmp/bench

GPT-2-small shapes (12 layers, 12 heads, d = 768, head dim 64, vocab 50304) with random weights in bf16, a NAtS
attention core (W = 16) whose scorer types the decoded tokens, block_size = the longest prompt + the decoded
tokens (RoPE tables cover every position). For each prompt length L and policy the caches are filled directly
with synthetic keys/values for the L prompt tokens (no prefill compute), then `--steps` tokens are decoded
greedily through `nats.cache.decode.decode_step`, timed with CUDA events after `--warmup` steps:

* `full`: every key (Triton pool kernel, CUDA graph); `full (sdpa, eager)`: every key through
  torch SDPA/FlashAttention on a contiguous cache, eager (the usual implementation; not graph-capturable since
  its shapes grow);
* `nats`: synthetic types near 10 % density: per KV head a global rate drawn from U(0.05, 0.13), locals at
  rate 0.03, the rest sliding (token 0 global), for the prompt and for the decoded tokens (the scorer still runs
  in every step, its argmax is replaced by the synthetic type); head sizes therefore differ;
* `h2o` and `streaming_llm` with a budget of `--budget-frac` x L (default 0.1, about NAtS' kept share).

"graph" rows capture one decode step in a CUDA graph and replay it (host work between replays: NAtS'
periodic compaction check, which re-captures after a compaction; included in the time). "eager" rows run the
same Python step. Memory: bytes the caches have allocated (keys, values and metadata), the bytes of the keys and
values of the tokens they hold, and the ratio. Speed: ms per decode step (batch `--batch`), tokens/s, and the
time relative to the faster of the two `full` rows at the same L. A quick correctness check on a tiny model runs
first (decoding with the Triton kernel and with CUDA graphs equals the parallel forward). Writes
`bench_decode.md` and `bench_decode.json` to `--out` (default: the environment variable OUT, else
benchmarks/results) and prints the
table last.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from nats import functional as NF
from nats.cache.decode import decode_step, make_caches, policy_logits, prefill
from nats.cache.policies.full import FullCache
from nats.cache.registry import register_cache
from nats.models.gpt import GPT, GPTConfig


@register_cache("full_sdpa")
class FullSDPACache(FullCache):
    """`full` through torch SDPA (FlashAttention) over the grown prefix: eager only (shapes grow)."""

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


class SyntheticTypes:
    """Stands in for a NAtS core while decoding: the scorer still runs (its cost stays in the step), but the
    types are those of a table [T, B, H] of synthetic types indexed by the decode position (graph-safe)."""

    def __init__(self, core, types: torch.Tensor, offset: int, pos: torch.Tensor):
        self.core, self.window, self.backend, self.pos = core, core.window, core.backend, pos
        self.table = F.one_hot(types.permute(2, 0, 1), 3).float() * 10.0  # [T, B, H, 3]
        self.offset = offset

    def type_logits(self, x):
        z = self.table.index_select(0, self.pos - self.offset)  # [1, B, H, 3]
        return self.core.type_logits(x) * 0.0 + z.permute(1, 2, 0, 3)


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
class Decoder:
    """Greedy decoding with static token/position buffers; `graph=True` replays a captured step."""

    def __init__(self, model, caches, batch: int, pos: int, graph: bool, vocab: int):
        self.model, self.caches, self.graph = model, caches, graph
        self.token = torch.randint(0, vocab, (batch,), device="cuda")
        self.pos = torch.full((1,), pos, dtype=torch.long, device="cuda")
        self.logits = None
        self.g = None
        self.captures = 0

    def _step(self):
        logits = decode_step(self.model, self.caches, self.token, self.pos)
        self.token.copy_(logits.argmax(-1))
        self.pos.add_(1)
        return logits

    def warmup(self, n: int):
        """n eager steps on a side stream (compiles the kernels, initialises cuBLAS) before any capture."""
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        logits = None
        with torch.cuda.stream(s):
            for _ in range(n):
                logits = self._step()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        return logits

    def _capture(self):
        for c in self.caches:
            c.auto_maintain = False
        self.g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.g):
            self.logits = self._step()
        self.captures += 1

    def step(self):
        if not self.graph:
            return self._step()
        changed = [c.maintain() for c in self.caches]  # every cache checks (each keeps its own counter)
        if self.g is None or any(changed):
            self._capture()
        self.g.replay()
        return self.logits


@torch.no_grad()
def bench_one(model, policy: str, L: int, args, graph: bool, types, rates) -> dict:
    B = args.batch
    budget = None
    if policy in ("h2o", "streaming_llm"):
        budget = max(8, round(args.budget_frac * L))
    total = L + args.warmup + args.steps + 1
    gen = torch.Generator(device="cuda").manual_seed(0)
    caches = make_caches(model, policy, B, total, budget=budget, backend="triton", track=False, budget_check_len=total)
    fill(caches, policy, L, gen, types)
    dec = Decoder(model, caches, B, L, graph, model.config.vocab_size)
    if policy == "nats":  # decoded tokens get synthetic types from the prompt's per-head rates too
        later = synthetic_types(B, types.shape[1], total - L, gen, "cuda", rate=rates, first_global=False)
        for c in caches:
            c.core = SyntheticTypes(c.core, later, L, dec.pos)
    dec.warmup(args.warmup)
    compactions0 = sum(getattr(c, "compactions", 0) for c in caches)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if graph:  # capture outside the timed region once; re-captures after compactions are timed
        dec._capture()
    torch.cuda.synchronize()
    start.record()
    for _ in range(args.steps):
        dec.step()
    end.record()
    torch.cuda.synchronize()
    ms = start.elapsed_time(end) / args.steps
    alloc = sum(c.nbytes() for c in caches)
    kv_alloc = sum(c.kv_nbytes() for c in caches)
    kept = sum(c.kept_nbytes() for c in caches)
    peak_alloc = sum(getattr(c, "max_nbytes", c.nbytes()) for c in caches)
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
        "captures": dec.captures,
        "compactions": sum(getattr(c, "compactions", 0) for c in caches) - compactions0,
    }
    del dec, caches
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return row


# ----------------------------------------------------------------------------------------------------
# correctness on the GPU (tiny model, float32)
# ----------------------------------------------------------------------------------------------------
@torch.no_grad()
def verify() -> list[str]:
    lines = []
    torch.manual_seed(0)
    cfg = GPTConfig(
        vocab_size=97,
        block_size=96,
        n_layer=2,
        n_head=4,
        n_kv_head=2,
        n_embd=64,
        attention={"name": "nats", "window": 4, "backend": "reference"},
    )
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
    # graph replays with teacher forcing, forced compactions (re-captures)
    for policy in ("nats", "full", "streaming_llm", "h2o"):
        budget = 24 if policy in ("streaming_llm", "h2o") else None
        opts = {"check_every": 2} if policy == "nats" else {}
        P = 16
        caches = make_caches(model, policy, 3, 80, budget=budget, backend="triton", **opts)
        eager_caches = make_caches(model, policy, 3, 80, budget=budget, backend="triton", **opts)
        prefill(model, caches, idx[:, :P])
        prefill(model, eager_caches, idx[:, :P])
        dec = Decoder(model, caches, 3, P, True, 97)
        outs, eager = [], []
        for i in range(P, 80):
            dec.token.copy_(idx[:, i])
            dec.pos.fill_(i)
            # the first token eagerly on a side stream (warm-up before the first capture), then replays
            outs.append((dec.warmup(1) if i == P else dec.step()).clone())
            eager.append(decode_step(model, eager_caches, idx[:, i], i))
        diff = (torch.stack(outs) - torch.stack(eager)).abs().max().item()
        lines.append(
            f"verify {policy:13s} CUDA-graph replay vs eager decode: max |diff| = {diff:.2e} ({dec.captures} captures)"
        )
        if policy in ("nats", "full"):
            d = (torch.stack(outs, 1) - refs[policy][:, P:]).abs().max().item()
            lines.append(f"verify {policy:13s} CUDA-graph decode vs parallel forward: max |diff| = {d:.2e}")
    return lines


# ----------------------------------------------------------------------------------------------------
def table(rows: list[dict], meta: dict) -> str:
    out = [
        f"Decode benchmark on {meta['device']}: GPT-2-small shapes (12 layers, 12 heads, d=768), random weights, "
        f"bf16, batch {meta['batch']}, {meta['steps']} timed greedy decode steps after {meta['warmup']} warm-up "
        f"steps, prompt written into the cache. NAtS: synthetic types (per-head global rate U(0.05, 0.13), "
        f"locals 0.03, rest sliding, W = {meta['window']}); h2o / streaming_llm budget = "
        f"{meta['budget_frac']} x L. torch {meta['torch']}.",
        "",
        "| prompt L | policy | mode | budget | NAtS density | ms / step | tokens/s | vs full | cache MB "
        "(alloc) | kept KV MB | alloc / kept | compactions |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    best_full = {}
    for r in rows:
        if r["policy"].startswith("full"):
            best_full[r["L"]] = min(best_full.get(r["L"], math.inf), r["ms_per_step"])
    for r in rows:
        rel = r["ms_per_step"] / best_full[r["L"]] if r["L"] in best_full else float("nan")
        dens = f"{r['density']:.3f}" if r.get("density") is not None else "-"
        out.append(
            f"| {r['L']} | {r['policy']} | {r['mode']} | {r['budget'] or '-'} | {dens} | "
            f"{r['ms_per_step']:.3f} | {r['tokens_per_s']:.0f} | {rel:.2f}x | {r['alloc_MB']:.1f} | "
            f"{r['kept_MB']:.1f} | {r['alloc_over_kept']:.3f} | {r['compactions']} |"
        )
    out.append("")
    out.append(
        "`vs full`: time per step relative to the faster `full` row at the same L. `alloc / kept`: bytes the "
        "caches allocated (keys, values, metadata) over the bytes of the keys and values of the tokens they "
        "hold after the last step."
    )
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="4096,8192,16384,32768")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--policies", default="full,full_sdpa,nats,h2o,streaming_llm")
    ap.add_argument("--modes", default="graph,eager", help="graph and/or eager")
    ap.add_argument("--budget-frac", type=float, default=0.1)
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--no-verify", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(Path(__file__).resolve().parent / "results"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_decode.py needs a CUDA GPU")
    t0 = time.time()
    lines = []
    if not args.no_verify:
        try:
            lines = verify()
        except Exception as exc:  # report and go on: the timings may still work
            traceback.print_exc()
            lines = [f"verify FAILED: {type(exc).__name__}: {exc}"]
    for line in lines:
        print(line, flush=True)
    lengths = [int(x) for x in args.lengths.split(",")]
    policies = args.policies.split(",")
    modes = args.modes.split(",")
    torch.manual_seed(0)
    cfg = GPTConfig(
        block_size=max(lengths) + args.warmup + args.steps + 16, attention={"name": "nats", "window": args.window}
    )
    model = GPT(cfg).cuda().to(torch.bfloat16).eval()
    rows, failures = [], []
    for L in lengths:
        gen = torch.Generator(device="cuda").manual_seed(L)
        rates = head_rates(cfg.n_kv_head, gen, "cuda")
        types = synthetic_types(args.batch, cfg.n_kv_head, L, gen, "cuda", rate=rates)
        density = float(NF.kv_cache_sizes(types, args.window).double().sum(-1).mean() / (L * (L + 1) / 2))
        for policy in policies:
            for mode in modes:
                if policy == "full_sdpa" and mode == "graph":
                    continue
                try:
                    row = bench_one(model, policy, L, args, mode == "graph", types if policy == "nats" else None, rates)
                except Exception as exc:  # keep the other rows; the failure is listed under the table
                    traceback.print_exc()
                    failures.append(f"L={L} {policy} {mode}: {type(exc).__name__}: {exc}")
                    torch.cuda.empty_cache()
                    continue
                row["density"] = density if policy == "nats" else None
                rows.append(row)
                print(
                    f"L={L:6d} {row['policy']:14s} {row['mode']:5s} {row['ms_per_step']:8.3f} ms/step "
                    f"{row['tokens_per_s']:9.0f} tok/s  alloc {row['alloc_MB']:9.1f} MB"
                    f"  kept {row['kept_MB']:9.1f} MB"
                    f"  ratio {row['alloc_over_kept']:.3f}",
                    flush=True,
                )
    meta = {
        "device": torch.cuda.get_device_name(),
        "batch": args.batch,
        "steps": args.steps,
        "warmup": args.warmup,
        "window": args.window,
        "budget_frac": args.budget_frac,
        "torch": torch.__version__,
        "seconds": round(time.time() - t0, 1),
        "verify": lines,
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


if __name__ == "__main__":
    main()
