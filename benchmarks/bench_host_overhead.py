"""Host (CPU) time per call of the NAtS custom ops, at shapes so small that the GPU is never the bottleneck:
what a training step pays in Python and launch overhead per layer, whatever the GPU's speed.

    python benchmarks/bench_host_overhead.py              # on a GPU machine
    python benchmarks/bench_host_overhead.py --cprofile   # and the top Python functions of attention_bwd

Each op is called `--calls` times without synchronising; the wall time per call is the host's cost (the GPU
runs each call's kernels in microseconds). For scale: a compiled GPT-2-small step on an H100 takes ~70 ms of
GPU time for 12 layers, and the host must issue everything inside that.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from nats_kernels import configure_triton


def per_call_us(fn, calls: int) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6


def main() -> None:
    configure_triton()  # Triton's settings before any kernel: the interpreter without a GPU, the cache folder
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--cprofile", action="store_true")
    args = ap.parse_args()

    import nats.ops  # noqa: F401  (registers nats::density_terms)
    from nats_kernels.nats_attention import autograd as ka
    from nats_kernels.nats_attention.backward import nats_backward
    from nats_kernels.nats_attention.causal_lse import causal_lse
    from nats_kernels.nats_attention.forward import nats_forward
    from nats_kernels.nats_attention.plan import compact_plan

    dev = "cuda"
    B, H, N, D, W = args.batch, args.heads, args.seq, 64, args.window
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, N, D, device=dev, dtype=torch.bfloat16) for _ in range(3))
    tw = torch.nn.functional.one_hot(torch.randint(0, 3, (B, H, N), device=dev), 3).float()
    o, lse, types, plan = ka.attention_fwd(q, k, v, tw, W, "dense")
    do = torch.randn_like(o)
    ops = {
        "nats::attention_fwd (custom op)": lambda: torch.ops.nats.attention_fwd(q, k, v, tw, W, "dense"),
        "nats::attention_bwd (custom op)": lambda: torch.ops.nats.attention_bwd(
            do, q, k, v, o, lse, types, plan, W, "dense"
        ),
        "nats::density_terms (custom op)": lambda: torch.ops.nats.density_terms(tw, W),
        "compact_plan (1 launch)": lambda: compact_plan(tw, W),
        "nats_forward (1 launch)": lambda: nats_forward(q, k, v, plan, W),
        "causal_lse (1 launch)": lambda: causal_lse(q, k, D**-0.5),
        "nats_backward (4 launches)": lambda: nats_backward(do, q, k, v, o, lse, types, plan, W),
        "torch.empty x5": lambda: [torch.empty(B, H, N, device=dev) for _ in range(5)],
        "x.add(1) (1 aten launch)": lambda: q.add(1),
    }
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; B={B} H={H} N={N} D={D} W={W}")
    print("\n| op | host us/call |\n|---|---|")
    for name, fn in ops.items():
        print(f"| {name} | {per_call_us(fn, args.calls):.1f} |")
    if args.cprofile:
        fn = ops["nats::attention_bwd (custom op)"]
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(200):
            fn()
        prof.disable()
        torch.cuda.synchronize()
        print("\n## cProfile of 200 nats::attention_bwd calls")
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
