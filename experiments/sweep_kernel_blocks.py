"""Tile sizes of the NAtS training kernels (forward and dQ, BLOCK_M x BLOCK_N) against torch SDPA, on a GPU.

The forward and dQ kernels walk per-query-block lists of live key blocks, so their tile sizes are fixed per
call (``kernels/nats_attention/_env.py``: ``BLOCKS`` / ``NATS_KERNELS_BLOCKS``) and not autotuned; this
script measures the candidates at the benchmark shape of issue 4 (B=16, H=12, N=1024, D=64, bf16) for three
type mixes.

Times are GPU times: the fwd+bwd total is a CUDA-graph replay (``triton.testing.do_bench_cudagraph``, no
Python launch overhead), and the per-kernel split comes from torch.profiler.

    python experiments/sweep_kernel_blocks.py [--out experiments/results]
"""
from __future__ import annotations

import argparse
import os
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F

BASE = ((128, 64), (64, 32))  # (fwd tile, dq tile): the defaults
CANDIDATES = [BASE, ((64, 128), (64, 32)), ((128, 64), (64, 64)), ((128, 64), (128, 32))]
# Measured on an H200 (docs/results/sweep_kernel_blocks_h200.md): 128x128 dQ tiles fail (shared memory); 128x128
# and 64x64 forward tiles and 64x128, 128x64, 32x32, 32x64 dQ tiles were slower. A variant that walked the
# causal key blocks directly when all are live (no index loads) was no faster in the forward and slower in dQ.
MIXES = {"uniform": (1 / 3, 1 / 3, 1 / 3), "sparse": (0.05, 0.15, 0.80), "all_global": (1.0, 0.0, 0.0)}
KERNELS = {"_nats_fwd_kernel": "fwd", "_bwd_dq_kernel": "dq", "_bwd_dkdv_kernel": "dkdv"}


def kernel_times(fn, iters: int = 10, detail: dict | None = None) -> dict[str, float]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    out: dict[str, float] = defaultdict(float)
    for e in prof.key_averages():
        if e.device_time_total > 0:
            out[KERNELS.get(e.key, "other")] += e.device_time_total / 1e3 / iters
            if detail is not None and e.key not in KERNELS:
                detail[e.key] = (e.device_time_total / 1e3 / iters, e.count // iters)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", type=int, nargs=4, default=[16, 12, 1024, 64], metavar=("B", "H", "N", "D"))
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--out", default=os.environ.get("OUT", "experiments/results"))
    args = ap.parse_args()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench_cudagraph

    from nats_kernels.nats_attention import _env
    from nats_kernels.nats_attention.autograd import triton_nats_attention
    from nats_kernels.nats_attention.reference import types_to_weights

    B, H, N, D = args.shape
    W = args.window
    gen = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(B, H, N, D, generator=gen).cuda().bfloat16().requires_grad_() for _ in range(4))
    leaves = [q, k, v]

    def fwd_bwd(fn, grads=leaves):
        def go():
            for x in grads:  # no gradient accumulation kernels in the timings
                x.grad = None
            fn().backward(do)
        return go

    def timed(go, grads):
        return do_bench_cudagraph(go, rep=50, grad_to_none=grads)

    dense = {}
    for name, backends in [("sdpa (default: cuDNN)", None), ("sdpa flash (FA2)", [SDPBackend.FLASH_ATTENTION])]:
        def sdpa(backends=backends):
            if backends is None:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
            with sdpa_kernel(backends):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        dense[name] = (timed(sdpa, None), timed(fwd_bwd(sdpa), leaves))
    flash_fb = dense["sdpa flash (FA2)"][1]
    lines = [f"GPU: {torch.cuda.get_device_name()}; B={B} H={H} N={N} D={D} W={W} bf16; GPU times (CUDA graphs)", ""]
    lines += ["| dense | fwd ms | fwd+bwd ms |", "|---|---|---|"]
    lines += [f"| {n} | {f:.3f} | {fb:.3f} |" for n, (f, fb) in dense.items()]
    lines += ["", "| fwd tile | dq tile | mix | fwd ms | dq ms | dkdv ms | other ms | fwd+bwd ms | x FA2 |"
              " x cuDNN | dkdv config |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    cudnn_fb = dense["sdpa (default: cuDNN)"][1]
    tws = {}
    for mix, probs in MIXES.items():
        t = torch.multinomial(torch.tensor(probs), B * H * N, replacement=True, generator=gen).view(B, H, N)
        tws[mix] = types_to_weights(t, torch.float32).cuda().requires_grad_()
    totals: dict[tuple, float] = defaultdict(float)
    lines_other = ["", "Kernels in 'other' (defaults, uniform mix):", "", "| kernel | ms | calls |", "|---|---|---|"]
    from nats_kernels.nats_attention.backward import _bwd_dkdv_kernel

    for fwd, dq in CANDIDATES:
        _env.BLOCKS.update(fwd=fwd, dq=dq)
        for mix, tw in tws.items():
            go = fwd_bwd(lambda tw=tw: triton_nats_attention(q, k, v, tw, W), leaves + [tw])
            try:
                go()  # autotune and compile outside the graph
                total = timed(go, leaves + [tw])
                detail = {} if (fwd, dq) == BASE and mix == "uniform" else None
                split = kernel_times(go, detail=detail)
                if detail:
                    others = sorted(detail.items(), key=lambda kv: -kv[1][0])
                    lines_other.extend(f"| {name[:90]} | {ms:.4f} | {n} |" for name, (ms, n) in others)
            except Exception as exc:  # noqa: BLE001 - e.g. a tile too large for shared memory
                lines.append(f"| {fwd[0]}x{fwd[1]} | {dq[0]}x{dq[1]} | {mix} | error: "
                             f"{type(exc).__name__}: {str(exc)[:80]} | | | | | |")
                print(lines[-1], flush=True)
                totals[(fwd, dq)] += 1e9
                continue
            totals[(fwd, dq)] += total
            cfg = getattr(_bwd_dkdv_kernel, "best_config", None)
            cfg = f"{cfg.kwargs} w{cfg.num_warps} s{cfg.num_stages}" if cfg else "-"
            lines.append(f"| {fwd[0]}x{fwd[1]} | {dq[0]}x{dq[1]} | {mix} | {split['fwd']:.3f} | "
                         f"{split['dq']:.3f} | {split['dkdv']:.3f} | {split['other']:.3f} | {total:.3f} | "
                         f"{total / flash_fb:.2f} | {total / cudnn_fb:.2f} | {cfg} |")
            print(lines[-1], flush=True)
    best = min(totals, key=totals.get)
    lines += ["", f"best (sum of fwd+bwd over the mixes): fwd tile {best[0]}, dq tile {best[1]}"]
    lines += lines_other
    text = "\n".join(lines)
    print(text)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "sweep_kernel_blocks.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
