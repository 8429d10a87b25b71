"""Where the time of the NAtS training kernels goes, per kernel and type mix, against torch SDPA, on a GPU.

At the kernel benchmark's shape (B=16, H=12, N=1024, D=64, bf16) for three type mixes: the fwd+bwd
total (the file's opening line: each mix's total against FlashAttention-2 and cuDNN) and its split into the plan,
forward, dQ, dK/dV and type-gradient kernels, with the configs the autotuner chose. Tile sizes are autotuned (keyed
on the head dim, never on N), once for all mixes as in training (the first mix decides), or afresh for each mix
with ``--retune`` (what each mix would choose alone). The dK/dV variants measured with it and dropped:
docs/results/kernel_breakdown_h100_*.md.

Times are GPU times: the fwd+bwd total is a CUDA-graph replay (``triton.testing.do_bench_cudagraph``, no
Python launch overhead), and the per-kernel split comes from torch.profiler.

    python benchmarks/kernel_breakdown.py [--out experiments/results]
"""

from __future__ import annotations

import argparse
import os
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F

from nats_kernels import configure_triton

# (global, local, sliding) probabilities, i.i.d. per token. "fig3": what fig3_nats (lambda 0.05, W 16) learns, the
# train/frac_* of experiments/results/figure3/nats_l0.05_s1 from step 200 on (a global in almost every key block).
MIXES = {
    "uniform": (1 / 3, 1 / 3, 1 / 3),
    "sparse": (0.05, 0.15, 0.80),
    "all_global": (1.0, 0.0, 0.0),
    "fig3": (0.04, 0.10, 0.86),
}
DEFAULT_MIXES = ["uniform", "sparse", "all_global"]
KERNELS = {
    "_nats_fwd_kernel": "fwd",
    "_bwd_dq_kernel": "dq",
    "_bwd_dkdv_kernel": "dkdv",
    "_plan_kernel": "plan",
    "_type_grad_kernel": "type_grad",
    "_causal_lse_kernel": "lse",
}


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
    configure_triton()  # Triton's settings before any kernel: the interpreter without a GPU, the cache folder
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", type=int, nargs=4, default=[16, 12, 1024, 64], metavar=("B", "H", "N", "D"))
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--out", default="experiments/results")
    ap.add_argument("--retune", action="store_true", help="autotune afresh for every mix")
    ap.add_argument("--mixes", nargs="+", choices=list(MIXES), default=DEFAULT_MIXES, help="type mixes, in order")
    ap.add_argument("--name", default="kernel_breakdown", help="output file stem in --out")
    args = ap.parse_args()
    if args.retune:  # each mix's own choices, not written over the ones later runs read (read at the kernels' import)
        os.environ["NATS_KERNELS_AUTOTUNE_CACHE"] = "0"
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench_cudagraph

    from nats_kernels.nats_attention import backward as bwd
    from nats_kernels.nats_attention import forward as fwd
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
    from nats_kernels.nats_attention import _env

    order = "blocks first" if _env.blocks_first(B * H) else "heads first"  # as the launches chose
    lines = [
        f"GPU: {torch.cuda.get_device_name()}; B={B} H={H} N={N} D={D} W={W} bf16; grid: {order} "
        "(NATS_KERNELS_GRID); GPU times (CUDA graphs)",
        "",
    ]
    lines += ["| dense | fwd ms | fwd+bwd ms |", "|---|---|---|"]
    lines += [f"| {n} | {f:.3f} | {fb:.3f} |" for n, (f, fb) in dense.items()]
    lines += [
        "",
        "| mix | plan ms | fwd ms | causal lse ms | dq ms | dkdv ms | type grad ms | other ms | fwd+bwd ms "
        "| x FA2 | x cuDNN |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    cudnn_fb = dense["sdpa (default: cuDNN)"][1]
    totals = []  # the answer's line: each mix's fwd+bwd against FA2 / cuDNN
    tws = {}
    first = args.mixes[0]
    for mix in args.mixes:
        probs = MIXES[mix]
        t = torch.multinomial(torch.tensor(probs), B * H * N, replacement=True, generator=gen).view(B, H, N)
        tws[mix] = types_to_weights(t, torch.float32).cuda().requires_grad_()
    configs = []
    lines_other = ["", f"Kernels in 'other' ({first} mix):", "", "| kernel | ms | calls |", "|---|---|---|"]
    for mix, tw in tws.items():
        if args.retune:
            for kern in (fwd._nats_fwd_kernel, bwd._bwd_dq_kernel, bwd._bwd_dkdv_kernel):
                kern.cache.clear()  # benchmark again (nothing is kept on disk with --retune)
        go = fwd_bwd(lambda tw=tw: triton_nats_attention(q, k, v, tw, W), leaves + [tw])
        go()  # autotune and compile outside the graph
        total = timed(go, leaves + [tw])
        detail = {} if mix == first else None
        split = kernel_times(go, detail=detail)
        if detail:
            others = sorted(detail.items(), key=lambda kv: -kv[1][0])
            lines_other.extend(f"| {name[:90]} | {ms:.4f} | {n} |" for name, (ms, n) in others)
        lines.append(
            f"| {mix} | {split['plan']:.3f} | {split['fwd']:.3f} | {split['lse']:.3f} | {split['dq']:.3f} | "
            f"{split['dkdv']:.3f} | "
            f"{split['type_grad']:.3f} | {split['other']:.3f} | {total:.3f} | {total / flash_fb:.2f} | "
            f"{total / cudnn_fb:.2f} |"
        )
        print(lines[-1], flush=True)
        totals.append(f"{mix} {total:.3f} ms ({total / flash_fb:.2f}x / {total / cudnn_fb:.2f}x)")
        if mix == first or args.retune:
            for name, kern in (
                ("fwd", fwd._nats_fwd_kernel),
                ("dq", bwd._bwd_dq_kernel),
                ("dkdv", bwd._bwd_dkdv_kernel),
            ):
                cfg = getattr(kern, "best_config", None)
                configs.append(
                    f"| {name} | {mix} | {cfg.kwargs if cfg else '-'} | {cfg.num_warps if cfg else '-'} | "
                    f"{cfg.num_stages if cfg else '-'} |"
                )
    lines += ["", "Autotuned configs:", "", "| kernel | mix | tiles | warps | stages |", "|---|---|---|---|---|"]
    lines += configs
    lines += lines_other
    answer = "NAtS fwd+bwd per type mix, against SDPA's FlashAttention-2 / cuDNN: " + ", ".join(totals) + "."
    lines[:0] = [f"# NAtS training kernels against torch SDPA ({torch.cuda.get_device_name()})", "", answer, ""]
    text = "\n".join(lines)
    print(text)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"{args.name}.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
