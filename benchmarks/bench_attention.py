"""Benchmark of the NAtS Triton kernels on one GPU (see docs/kernels.md).

(a) training forward+backward, B=16, H=12, N=1024, D=64, bf16: NAtS Triton vs dense causal SDPA (flash =
    FlashAttention-2, the x-dense baseline, and SDPA's default backend, cuDNN on Hopper) vs the NAtS PyTorch
    reference, for a few type mixes; plus the kernel's error against the reference. Times are GPU times: each
    call is replayed from a CUDA graph (``triton.testing.do_bench_cudagraph``), so Python launch overhead
    (which a training step hides behind the GPU queue) does not count; ``wall ms`` is the eager call.
(b) prefill, B=1, H=32, D=128, bf16, N = 16k..128k, type mixes of density ~50/20/10/5 %: NAtS prefill vs
    dense causal SDPA vs FlexAttention with the same mask (mask_mod over the types / next-global tensors).

Prefill times are medians of ``triton.testing.do_bench``. FLOP counts: an attention entry (one query-key pair)
costs 4*D FLOPs in the forward (q.k and p*v); "TFLOP/s" = 4 * D * H * B * entries / time, where entries
are the pairs the method has to compute: the kept NAtS entries (sum of kv_cache_sizes) for NAtS and
FlexAttention, the causal N(N+1)/2 for dense SDPA. Training counts fwd+bwd as 3.5x the forward.

Writes ``bench_attention.md`` (table), ``bench_attention.json`` and ``bench_attention.png`` into --out
after every measurement (partial results survive a timeout) and prints the table at the end.

    python benchmarks/bench_attention.py --out experiments/results [--quick] [--budget-s 330]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from nats_kernels import configure_triton

ROWS: list[dict] = []
T0 = time.time()


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


# ----------------------------------------------------------------------------------------------------
# output
# ----------------------------------------------------------------------------------------------------
def fmt(x, nd=2):
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


def table() -> str:
    lines = []
    train = [r for r in ROWS if r["part"] == "train"]
    if train:
        lines += [
            "## (a) training fwd+bwd: B=16, H=12, N=1024, D=64, bf16",
            "",
            "GPU times from CUDA-graph replays; x FA2 = fwd+bwd time / SDPA flash (FlashAttention-2) fwd+bwd "
            "time; wall = an eager call with its Python launch overhead.",
            "",
            "| method | mix | W | density | fwd ms | fwd+bwd ms | x FA2 (fwd+bwd) | wall fwd+bwd ms | "
            "max rel err vs ref | note |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in train:
            lines.append(
                f"| {r['method']} | {r.get('mix', '-')} | {r.get('W', '-')} | {fmt(r.get('density'), 3)} | "
                f"{fmt(r.get('fwd_ms'), 3)} | {fmt(r.get('ms'), 3)} | {fmt(r.get('x_dense'), 2)} | "
                f"{fmt(r.get('wall_ms'), 3)} | {fmt(r.get('err'), 4)} | {r.get('note', '')} |"
            )
        lines.append("")
    pre = sorted((r for r in ROWS if r["part"] == "prefill"), key=lambda r: r.get("N", 0))
    if pre:
        lines += [
            "## (b) prefill: B=1, H=32, D=128, bf16 (types shared by the heads)",
            "",
            "| N | target density | measured density | method | ms | speedup vs dense | TFLOP/s | note |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in pre:
            lines.append(
                f"| {r['N']} | {fmt(r.get('target'), 2)} | {fmt(r.get('density'), 3)} | {r['method']} | "
                f"{fmt(r.get('ms'), 2)} | {fmt(r.get('speedup'), 2)} | {fmt(r.get('tflops'), 1)} | "
                f"{r.get('note', '')} |"
            )
        lines.append("")
    return "\n".join(lines)


def record(row: dict, out: Path, device_name: str) -> None:
    """A measured row: kept, printed, and the tables on disk updated (a later crash loses nothing measured)."""
    ROWS.append(row)
    log(row)
    save(out, device_name)


def save(out: Path, device_name: str):
    out.mkdir(parents=True, exist_ok=True)
    head = f"# NAtS attention benchmark\n\ndevice: {device_name}; torch {torch.__version__}\n\n"
    (out / "bench_attention.md").write_text(head + table())
    (out / "bench_attention.json").write_text(json.dumps(ROWS, indent=1))


def plot(out: Path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:  # noqa: BLE001
        log("no plot:", exc)
        return
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    train = [r for r in ROWS if r["part"] == "train" and r.get("ms")]
    ax = axes[0]
    labels = [f"{r['method']}\n{r.get('mix', '')}" for r in train]
    colors = ["C0" if "triton" in r["method"] else "C7" for r in train]
    ax.bar(range(len(train)), [r["ms"] for r in train], color=colors)
    ax.set_xticks(range(len(train)), labels, rotation=60, fontsize=7, ha="right")
    ax.set_ylabel("fwd+bwd ms")
    ax.set_yscale("log")
    ax.set_title("training, B=16 H=12 N=1024 D=64 bf16")
    ax = axes[1]
    pre = [r for r in ROWS if r["part"] == "prefill" and r.get("ms")]
    dense = sorted((r["N"], r["ms"]) for r in pre if r["method"] == "sdpa_dense")
    if dense:
        ax.plot(*zip(*dense), "k-o", label="dense SDPA")
    targets = sorted({r["target"] for r in pre if r.get("target")}, reverse=True)
    for c, tgt in enumerate(targets):
        for meth, ls in (("nats_prefill", "-"), ("flex_attention", "--")):
            pts = sorted((r["N"], r["ms"]) for r in pre if r["method"] == meth and r.get("target") == tgt)
            if pts:
                ax.plot(*zip(*pts), ls, marker="o", color=f"C{c}", label=f"{meth} ~{tgt:.0%}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("N")
    ax.set_ylabel("ms")
    ax.set_title("prefill, B=1 H=32 D=128 bf16")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "bench_attention.png", dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------------
def bench(fn, grad_to_none=None, rep=100, warmup=25, graph=False):
    """Median milliseconds (triton.testing.do_bench on a GPU; a plain timer for the CPU smoke run).

    graph=True: GPU time of a CUDA-graph replay (triton.testing.do_bench_cudagraph; fn must be capturable).
    """
    if torch.cuda.is_available() and graph:
        import triton.testing

        def once():
            for x in grad_to_none or []:  # fresh gradients: no accumulation kernels in the timing
                x.grad = None
            fn()

        once()  # compile / autotune outside the capture
        torch.cuda.synchronize()
        return triton.testing.do_bench_cudagraph(once, rep=rep, return_mode="median")
    if torch.cuda.is_available():
        import triton.testing

        return triton.testing.do_bench(fn, warmup=warmup, rep=rep, grad_to_none=grad_to_none, return_mode="median")
    times = []
    for _ in range(3):
        for x in grad_to_none or []:
            x.grad = None
        t = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - t))
    return sorted(times)[1]


def sdpa_causal(q, k, v, backend: str | None = "flash"):
    """Causal SDPA; backend "flash" (FlashAttention-2) or None (SDPA's own choice: cuDNN on Hopper)."""
    if q.is_cuda and backend == "flash":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def make_types(B, H, N, probs, device, gen, shared=False):
    p = torch.tensor(probs, dtype=torch.float64)
    rows = 1 if shared else B * H
    t = torch.multinomial(p, rows * N, replacement=True, generator=gen).view(rows, N)
    t[:, 0] = 0  # token 0 is forced global (attention sink)
    t = t.to(device)
    return t.view(1, 1, N).expand(B, H, N).contiguous() if shared else t.view(B, H, N)


def density_of(types, window):
    from nats_kernels.nats_attention.reference import kv_cache_sizes

    N = types.shape[-1]
    kept = kv_cache_sizes(types, window).double().sum(-1)  # [B, H]
    return float((kept / (N * (N + 1) / 2)).mean()), float(kept.sum())


def rel_rms(a, b):
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30))


def empty_cache():
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def over_budget(args) -> bool:
    return time.time() - T0 > args.budget_s


# ----------------------------------------------------------------------------------------------------
# (a) training
# ----------------------------------------------------------------------------------------------------
TRAIN_MIXES = {  # (global, local, sliding) probabilities, window
    "uniform": ((1 / 3, 1 / 3, 1 / 3), 64),
    "sparse": ((0.05, 0.15, 0.80), 64),
    "all_global": ((1.0, 0.0, 0.0), 64),
}


def bench_training(args, out, device_name):
    from nats_kernels.nats_attention import triton_nats_attention
    from nats_kernels.nats_attention.reference import nats_attention_reference, types_to_weights

    B, H, N, D = (16, 12, 1024, 64) if not args.quick else (4, 12, 1024, 64)
    if args.smoke:
        B, H, N, D = 1, 2, 80, 32
    dev = args.device
    gen = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32  # the CPU interpreter's bf16 dot is wrong
    q, k, v, do = (torch.randn(B, H, N, D, generator=gen).to(dev, dtype) for _ in range(4))
    leaves = [x.requires_grad_() for x in (q, k, v)]

    dense_ms = None
    for method, backend in (("sdpa_flash_causal", "flash"), ("sdpa_default_causal", None)):

        def sdpa(backend=backend):
            return sdpa_causal(q, k, v, backend)

        row = {"part": "train", "method": method, "density": 1.0}
        try:
            row["fwd_ms"] = bench(lambda: sdpa(), graph=True)
            row["ms"] = bench(lambda: sdpa().backward(do), grad_to_none=leaves, graph=True)
            row["wall_ms"] = bench(lambda: sdpa().backward(do), grad_to_none=leaves)
            if backend == "flash":
                dense_ms = row["ms"]
            row["x_dense"] = row["ms"] / dense_ms if dense_ms else None
        except Exception as exc:  # noqa: BLE001
            row["note"] = f"error: {type(exc).__name__}: {exc}"[:120]
        record(row, out, device_name)

    # Timings of every mix first, then the accuracy checks: a CUDA-graph capture after the O(N^2) fp32 reference
    # had run failed on the H200 (cudaErrorStreamCaptureInvalidated), so no reference runs between captures.
    # every mix with each type-gradient estimator (NATS_SPEC.md 3a): "dense" (the default) adds the causal
    # log-sum-exp pass to the backward, "exact" does not; the forward is the same kernel
    cases = []
    for mix, (probs, W) in TRAIN_MIXES.items():
        types = make_types(B, H, N, probs, dev, gen)
        dens, _ = density_of(types, W)
        tw = types_to_weights(types, torch.float32).requires_grad_()
        for mg in args.mask_grad:
            method = f"nats_triton[{mg}]"
            if over_budget(args):
                ROWS.append({"part": "train", "method": method, "mix": mix, "note": "skipped (time budget)"})
                continue
            row = {"part": "train", "method": method, "mix": mix, "W": W, "density": dens}
            run = lambda tw=tw, W=W, mg=mg: triton_nats_attention(q, k, v, tw, W, mg)  # noqa: E731
            try:
                t_start = time.time()
                run().backward(do)  # autotune + compile
                if dev == "cuda":
                    torch.cuda.synchronize()
                log(f"{method} {mix}: first call (autotune/compile) {time.time() - t_start:.1f}s")
                row["fwd_ms"] = bench(run, graph=True)
                row["ms"] = bench(lambda run=run: run().backward(do), grad_to_none=leaves + [tw], graph=True)
                if dense_ms:
                    row["x_dense"] = row["ms"] / dense_ms
            except Exception as exc:  # noqa: BLE001
                traceback.print_exc()
                row["note"] = f"error: {type(exc).__name__}: {exc}"[:160]
            record(row, out, device_name)
            cases.append((row, mix, W, dens, tw, mg))

    ref_case = None
    for row, mix, W, dens, tw, mg in cases:
        run = lambda tw=tw, W=W, mg=mg: triton_nats_attention(q, k, v, tw, W, mg)  # noqa: E731
        if "ms" in row:
            row["wall_ms"] = bench(lambda run=run: run().backward(do), grad_to_none=leaves + [tw])
        # accuracy against the reference (fp32 math on the same bf16 values)
        try:
            for x in leaves + [tw]:
                x.grad = None
            o = run()
            o.backward(do)
            got = [o] + [x.grad.clone() for x in leaves + [tw]]
            rin = [x.detach().float().requires_grad_() for x in (q, k, v, tw)]
            ro = nats_attention_reference(*rin, W, mg)
            ro.backward(do.float())
            want = [ro] + [x.grad for x in rin]
            errs = [rel_rms(a, b) for a, b in zip(got, want)]
            row["err"] = max(errs)
            row["note"] = (row.get("note", "") + " rel-RMS o,dq,dk,dv,dt=" + ",".join(f"{e:.1e}" for e in errs)).strip()
            del rin, ro, want
        except Exception as exc:  # noqa: BLE001
            row["note"] = (row.get("note", "") + f" ref check failed: {type(exc).__name__}")[:200]
        empty_cache()
        save(out, device_name)
        if mix == "uniform" and mg == "dense":
            ref_case = (mix, W, dens, tw)

    # the O(N^2) reference last, so that its large allocations cannot disturb the graph captures above
    if ref_case is not None and not over_budget(args):
        mix, W, dens, tw = ref_case
        rrow = {"part": "train", "method": "nats_reference", "mix": mix, "W": W, "density": dens}
        try:
            rrow["fwd_ms"] = bench(lambda: nats_attention_reference(q, k, v, tw, W), rep=50, warmup=5)
            rrow["ms"] = bench(
                lambda: nats_attention_reference(q, k, v, tw, W).backward(do),
                grad_to_none=leaves + [tw],
                rep=50,
                warmup=5,
            )
            if dense_ms:
                rrow["x_dense"] = rrow["ms"] / dense_ms
        except torch.cuda.OutOfMemoryError:
            rrow["note"] = "OOM"
        except Exception as exc:  # noqa: BLE001
            rrow["note"] = f"error: {type(exc).__name__}"[:120]
        empty_cache()
        record(rrow, out, device_name)


# ----------------------------------------------------------------------------------------------------
# (b) prefill
# ----------------------------------------------------------------------------------------------------
PREFILL_W = 256
PREFILL_LOCAL = 0.10


def prefill_probs(target: float, N: int, W: int = PREFILL_W, fl: float = PREFILL_LOCAL):
    """(g, l, s) probabilities whose expected density is about ``target``.

    density ~ f_g + 2 f_s W / N (globals see everything after them, sliding keys W queries, locals
    about one gap between globals, negligible here); solve for f_g with f_s = 1 - f_g - f_l.
    """
    r = 2.0 * W / N
    fg = (target - r * (1.0 - fl)) / (1.0 - r)
    fg = min(max(fg, 0.001), 1.0 - fl)
    return (fg, fl, max(0.0, 1.0 - fg - fl))


FLEX_BUF: dict = {}


def flex_mask_mod(b, h, q_idx, kv_idx):
    """The NAtS mask of spec section 2 for FlexAttention, from the (shared) types and next-global buffers."""
    t = FLEX_BUF["t"][kv_idx]
    e = FLEX_BUF["e"][kv_idx]
    vis = (t == 0) | ((t == 1) & (q_idx <= e)) | ((t == 2) & (q_idx - kv_idx < PREFILL_W))
    return vis & (kv_idx <= q_idx)


def bench_prefill(args, out, device_name):
    from nats_kernels.nats_attention import nats_prefill
    from nats_kernels.nats_attention.plan import type_indices

    dev = args.device
    flex = None
    if dev == "cuda":
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            flex = torch.compile(flex_attention, dynamic=False)
        except Exception as exc:  # noqa: BLE001
            log("FlexAttention unavailable:", exc)

    B, H, D = 1, 32, 128
    # N = 128k first: the headline comparison should not be the one the time budget cuts
    Ns = [131072, 16384, 32768, 65536] if not args.quick else [16384, 32768]
    if args.prefill_n:
        Ns = args.prefill_n
    targets = [0.5, 0.2, 0.1, 0.05]
    if args.smoke:
        B, H, D, Ns, targets = 1, 2, 32, [300], [0.5, 0.1]
    gen = torch.Generator().manual_seed(1)
    for N in Ns:
        if over_budget(args):
            ROWS.append({"part": "prefill", "N": N, "method": "all", "note": "skipped (time budget)"})
            save(out, device_name)
            continue
        dtype = torch.bfloat16 if dev == "cuda" else torch.float32
        q, k, v = (torch.randn(B, H, N, D, device=dev, dtype=dtype) for _ in range(3))
        causal_entries = N * (N + 1) / 2 * B * H
        row = {"part": "prefill", "N": N, "method": "sdpa_dense", "density": 1.0}
        try:
            row["ms"] = bench(lambda: sdpa_causal(q, k, v), rep=200, warmup=5)
            row["speedup"] = 1.0
            row["tflops"] = 4 * D * causal_entries / (row["ms"] * 1e-3) / 1e12
            dense_ms = row["ms"]
        except Exception as exc:  # noqa: BLE001
            row["note"] = f"error: {type(exc).__name__}: {exc}"[:120]
            dense_ms = None
        ROWS.append(row)
        log(row)
        # SDPA's default backend (cuDNN on Hopper) as a second dense baseline; "speedup" stays vs FA2 (flash)
        crow = {"part": "prefill", "N": N, "method": "sdpa_default_dense", "density": 1.0}
        try:
            crow["ms"] = bench(lambda: sdpa_causal(q, k, v, None), rep=200, warmup=5)
            crow["speedup"] = dense_ms / crow["ms"] if dense_ms else None
            crow["tflops"] = 4 * D * causal_entries / (crow["ms"] * 1e-3) / 1e12
        except Exception as exc:  # noqa: BLE001
            crow["note"] = f"error: {type(exc).__name__}: {exc}"[:120]
        record(crow, out, device_name)

        for tgt in targets:
            if over_budget(args):
                ROWS.append(
                    {"part": "prefill", "N": N, "target": tgt, "method": "nats/flex", "note": "skipped (time budget)"}
                )
                continue
            W = PREFILL_W if not args.smoke else 16
            types = make_types(B, H, N, prefill_probs(tgt, N, W), dev, gen, shared=True)
            dens, kept = density_of(types[:, :1], W)
            kept_all = kept * H
            row = {"part": "prefill", "N": N, "target": tgt, "density": dens, "method": "nats_prefill", "W": W}
            try:
                o = nats_prefill(q, k, v, types, W)
                row["ms"] = bench(lambda: nats_prefill(q, k, v, types, W), rep=200, warmup=5)
                row["tflops"] = 4 * D * kept_all / (row["ms"] * 1e-3) / 1e12
                if dense_ms:
                    row["speedup"] = dense_ms / row["ms"]
            except Exception as exc:  # noqa: BLE001
                traceback.print_exc()
                row["note"] = f"error: {type(exc).__name__}: {exc}"[:160]
                o = None
            record(row, out, device_name)

            if flex is None or args.no_flex or over_budget(args):
                continue
            frow = {"part": "prefill", "N": N, "target": tgt, "density": dens, "method": "flex_attention", "W": W}
            try:
                t1, e1, _ = type_indices(types[:, :1].contiguous())
                # one mask_mod reading fixed buffers, refilled in place: no recompilation per type mix
                if "t" not in FLEX_BUF:
                    FLEX_BUF["t"] = torch.full((max(Ns),), 3, dtype=torch.int32, device=dev)
                    FLEX_BUF["e"] = torch.zeros((max(Ns),), dtype=torch.int32, device=dev)
                FLEX_BUF["t"][:N].copy_(t1[0, 0])
                FLEX_BUF["e"][:N].copy_(e1[0, 0])
                ts = time.time()
                bm = create_block_mask(flex_mask_mod, B=None, H=None, Q_LEN=N, KV_LEN=N, device=dev, _compile=True)
                torch.cuda.synchronize()
                frow["note"] = f"block mask {1e3 * (time.time() - ts):.0f} ms (first incl. compile), not timed"
                of = flex(q, k, v, block_mask=bm)
                frow["ms"] = bench(lambda: flex(q, k, v, block_mask=bm), rep=200, warmup=5)
                frow["tflops"] = 4 * D * kept_all / (frow["ms"] * 1e-3) / 1e12
                if dense_ms:
                    frow["speedup"] = dense_ms / frow["ms"]
                if o is not None:
                    err = rel_rms(o, of)
                    row["note"] = (row.get("note", "") + f" rel-RMS vs flex {err:.1e}").strip()
            except Exception as exc:  # noqa: BLE001
                traceback.print_exc()
                frow["note"] = f"error: {type(exc).__name__}: {exc}"[:160]
            record(frow, out, device_name)
        empty_cache()


def main():
    configure_triton()  # Triton's settings before any kernel: the interpreter without a GPU, the cache folder
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="experiments/results")
    ap.add_argument("--budget-s", type=float, default=330.0, help="skip what remains after this many seconds")
    ap.add_argument("--quick", action="store_true", help="smaller sizes (smoke test)")
    ap.add_argument("--skip", nargs="*", default=[], choices=["train", "prefill"])
    ap.add_argument("--prefill-n", type=int, nargs="+", default=None, help="prefill lengths (default 128k..16k)")
    ap.add_argument("--no-flex", action="store_true", help="skip FlexAttention in the prefill part")
    ap.add_argument(
        "--mask-grad",
        nargs="+",
        default=["dense", "exact"],
        choices=["dense", "exact"],
        help="type-gradient estimators to time in the training part (NATS_SPEC.md 3a)",
    )
    ap.add_argument("--smoke", action="store_true", help="tiny sizes; runs on the CPU (Triton interpreter) too")
    args = ap.parse_args()
    args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cpu" and not args.smoke:
        print("bench_attention.py needs a CUDA GPU (or --smoke for a tiny CPU run)", file=sys.stderr)
        sys.exit(1)
    out = Path(args.out)
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (Triton interpreter)"
    log("device:", device_name, "out:", out)
    torch.manual_seed(0)
    if "train" not in args.skip:
        try:
            bench_training(args, out, device_name)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
    if "prefill" not in args.skip:
        try:
            bench_prefill(args, out, device_name)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
    save(out, device_name)
    plot(out)
    print()
    print(table())


if __name__ == "__main__":
    main()
