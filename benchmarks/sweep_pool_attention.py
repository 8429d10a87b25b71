"""The split-K pool attention of a decode step (`nats_kernels.nats_attention.pool_decode.triton_pool_attention`) over
its launch choices: keys per block, warps, pipeline stages, and the split (each row in ``splits`` equal chunks, chunks
balanced over the rows, or the rows' keys streamed end to end over a fixed grid of programs), for the shapes of a
full cache at batch 1 and 8 (Llama-3.1-8B: 8 KV heads of 4 query heads, D = 128; Llama-3.2-1B: D = 64) and NAtS'
shorter rows (as long, or of uneven lengths: ", spread"; with NAtS' ring of W = 64 sliding slots, half of them
valid, beside each row: ", ring"), against the bytes it must read (the keys and values, once) over a device-to-device
copy's bandwidth measured in the same run. Each row gives the split kernel's registers and spilled bytes per thread
(on a GPU: what the compiler allotted). The default choice (`pool_decode.launch_config`,
`nats.cache.engine.pool_splits`, the launch choice's split for uneven rows: what NAtS' decode step launches) is the
first row of each shape; the policies that declare ``even_rows``, the full cache among them, launch the "rows" split
with the same blocks, the second row ("rows default").

    python benchmarks/sweep_pool_attention.py --out logs/bench/sweep_pool_attention
    python benchmarks/sweep_pool_attention.py --shapes batch_8,1B      # shapes whose label has one (_ for a space)
    python benchmarks/sweep_pool_attention.py --shapes batch_8,8k --only block_n=64,split=stream   # those choices only
    python benchmarks/sweep_pool_attention.py --smoke          # tiny shapes, three choices, on the CPU (interpreter)
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

from nats_kernels import configure_triton


def timed(fn, device) -> float:
    """Median seconds of ``fn()``: ``triton.testing.do_bench_cudagraph`` on a GPU, one call on the CPU."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    import triton.testing

    # replayed as a CUDA graph, as the decode step runs it: timed one launch at a time, Triton's launch on the host
    # (~13 us a kernel) bounded the short rows instead of the GPU
    return triton.testing.do_bench_cudagraph(fn, return_mode="median") / 1e3


def kernel_resources(kernel) -> tuple[int | None, int | None]:
    """(registers per thread, spilled bytes per thread) of a launched Triton kernel; None where the launch has none
    (the CPU interpreter)."""
    regs, spills = getattr(kernel, "n_regs", None), getattr(kernel, "n_spills", None)
    return (None if regs is None else int(regs)), (None if spills is None else int(spills))


def main(argv: list[str] | None = None) -> int:
    configure_triton()  # Triton's settings before any kernel: the interpreter without a GPU, the cache folder
    from nats.cache import roofline
    from nats.cache.engine import pool_splits
    from nats_kernels.nats_attention.decode_reference import torch_pool_attention
    from nats_kernels.nats_attention.pool_decode import launch_config, triton_pool_attention

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="logs/bench/sweep_pool_attention")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--shapes", default="", help="comma-separated substrings: only the shapes whose label has one")
    only = "KEY=VALUE,...: only the choices with those block_n, num_warps, num_stages, splits, split or programs"
    ap.add_argument("--only", default="", help=only + " (the default choices are always timed)")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.smoke:  # (label, rows, G, D, keys: the mean of a row's; spread: rows of 1/4 to 7/4 of it; ring: W slots)
        shapes = [("tiny", 2, 2, 16, 200, False, 0), ("tiny, spread", 2, 2, 16, 200, True, 0),
                  ("tiny, spread, ring", 2, 2, 16, 200, True, 8)]  # fmt: skip
        choices = [(32, 4, 2, 4, "balanced", None), (16, 2, 2, 2, "rows", None), (16, 2, 2, 0, "stream", 3)]
    else:
        # a full cache's rows (every row the prompt's length) and NAtS' at a quarter of it: as long, or spread
        # evenly from 1/4 to 7/4 of the mean as heads that keep different shares make them, and spread with NAtS'
        # ring (what its decode step launches)
        shapes = [(f"{name}, batch {b}, {n // 1024}k{', spread' if spread else ''}{', ring' if ring else ''}",
                   8 * b, 4, d, n, spread, ring)
                  for name, d in (("8B", 128), ("1B", 64)) for b in (1, 8) for n in (2048, 8192, 32768)
                  for spread, ring in ((False, 0), (True, 0), (True, 64)) if not (spread and n == 32768)]  # fmt: skip
        # (block_n, warps, stages, splits, split, programs): programs of the streamed split as SMs x (1 .. 6), or
        # None: as many as fit an SM's shared memory (`decode.stream_programs`)
        sms = torch.cuda.get_device_properties(0).multi_processor_count if device.type == "cuda" else 4
        choices = [*itertools.product((32, 64, 128), (2, 4), (2, 3), (4, 8, 16, 32), ("balanced", "rows"), (None,)),
                   *((bn, w, st, 0, "stream", per and per * sms) for bn, w, st, per
                     in itertools.product((32, 64, 128), (2, 4), (2, 3), (None, 1, 2, 3, 4, 6)))]  # fmt: skip
    if args.only:
        keys = ("block_n", "num_warps", "num_stages", "splits", "split", "programs")
        try:
            want = dict(kv.split("=", 1) for kv in args.only.split(","))
            bad = sorted(set(want) - set(keys))
        except ValueError:
            bad = [args.only]
        if bad:
            print(f"--only {args.only!r}: give KEY=VALUE pairs, comma-separated, with keys among {keys}")
            return 2
        choices = [c for c in choices if all(str(c[keys.index(k)]) == v for k, v in want.items())]
    if args.shapes:
        labels = [s[0] for s in shapes]
        wanted = [w.strip().replace("_", " ") for w in args.shapes.split(",")]  # "batch_8": no quotes needed
        shapes = [s for s in shapes if any(w in s[0] for w in wanted)]
        if not shapes:
            print(f"--shapes {args.shapes!r} matches no shape: give parts of these labels, e.g. 'batch 8': {labels}")
            return 2
    bw = roofline.measured_bandwidth(device) if device.type == "cuda" else None
    rows = []
    for label, R, G, D, n, spread, W in shapes:
        torch.manual_seed(0)
        cap = 2 * n if spread else n  # each row's slots
        q = torch.randn(R, G, D, device=device, dtype=dtype)
        k = torch.randn(R * cap, D, device=device, dtype=dtype)
        v = torch.randn(R * cap, D, device=device, dtype=dtype)
        start = torch.arange(R, device=device, dtype=torch.int64) * cap
        if spread:  # 1/4 to 7/4 of n, in a shuffled order
            lens = torch.linspace(n / 4, 7 * n / 4, R).round().long()[torch.randperm(R)]
        else:
            lens = torch.full((R,), n, dtype=torch.int64)
        length = lens.to(device)
        if W:  # NAtS' ring beside each row: W sliding slots, about half of them valid
            rk, rv = (torch.randn(R, W, D, device=device, dtype=dtype) for _ in range(2))
            rvalid = torch.rand(R, W, device=device) < 0.5
            ring = {"ring_k": rk, "ring_v": rv, "ring_valid": rvalid}
            ring_ref = {"ring_k": rk.float(), "ring_v": rv.float(), "ring_valid": rvalid}
        else:
            ring = ring_ref = {}
        held = int(lens.sum()) + (int(ring["ring_valid"].sum()) if W else 0)
        nbytes = 2 * held * D * k.element_size()
        ref = torch_pool_attention(q.float(), k.float(), v.float(), start, length, cap, **ring_ref)
        default = launch_config(R, D)
        dsplits = pool_splits(R, cap, D, device) if device.type == "cuda" else 2  # what the decode step launches
        dcfg = (default["block_n"], default["num_warps"], default["num_stages"], dsplits)
        # the default, the full cache's, the default launched plainly (no programmatic dependent launch), the rest
        named = ("default", "rows default", "default, no PDL")
        tried = [(*dcfg, default["uneven"], None, True), (*dcfg, "rows", None, True),
                 (*dcfg, default["uneven"], None, False), *((*c, True) for c in choices)]  # fmt: skip
        for i, (bn, warps, stages, splits, split, programs, pdl) in enumerate(tried):
            cfg = {"block_n": bn, "num_warps": warps, "num_stages": stages, "split": split, "programs": programs,
                   "pdl": pdl}  # fmt: skip
            splits = splits or None  # the streamed split takes none
            launched = {}  # the compiled split kernel, for its registers and spills
            call = lambda: triton_pool_attention(q, k, v, start, length, cap, splits=splits, config=cfg,  # noqa: E731
                                                 launched=launched, **ring)  # fmt: skip
            try:
                out = call()
                regs, spills = kernel_resources(launched.get("split"))
                err = float((out.float() - ref).abs().max())
                sec = timed(call, device)
            except Exception as e:  # a choice Triton cannot compile here (resources): a row saying so
                rows.append({"shape": label, **cfg, "splits": splits, "error": str(e).splitlines()[0][:80]})
                continue
            rows.append({"shape": label, "default": named[i] if i < len(named) else "fast", **cfg,
                         "splits": splits, "us": sec * 1e6,
                         "gbps": nbytes / sec / 1e9, "share": None if bw is None else nbytes / sec / bw,
                         "max_err": err, "regs": regs, "spills": spills})  # fmt: skip
        print(label, "done", flush=True)
        text = write(Path(args.out), device, dtype, bw, [s[0] for s in shapes], rows, argv)  # after every shape
    print(text)
    return 0


def write(out: Path, device, dtype, bw, labels: list[str], rows: list[dict], argv) -> str:
    """The answer (the default's time against the fastest choice's), the table (the default choice and the five
    fastest of each shape) and every row as JSON, in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else "CPU (interpreter)"
    ratios = []  # per shape: (the default's time over the fastest choice's, shape, default us, fastest us)
    for label in labels:
        ok = [r for r in rows if r["shape"] == label and "us" in r]
        default = next((r for r in ok if r["default"] == "default"), None)
        if default is not None:
            fastest = min(r["us"] for r in ok)
            ratios.append((default["us"] / fastest, label, default["us"], fastest))
    answer = "No shape timed yet."
    if ratios:
        worst = max(ratios)
        answer = (
            f"The default launch takes {min(ratios)[0]:.2f}-{worst[0]:.2f}x the time of the fastest choice timed, "
            f"over {len(ratios)} shapes (the most at {worst[1]}: {worst[2]:.1f} against {worst[3]:.1f} us)."
        )
    lines = [
        f"# Split-K pool attention over its launch choices ({name}, torch {torch.__version__}, {dtype})",
        "",
        answer,
        "",
        f"Bandwidth measured: {'-' if bw is None else f'{bw / 1e9:.0f} GB/s'}. Bytes: the keys and values read once. "
        f"Command: `python benchmarks/sweep_pool_attention.py {' '.join(sys.argv[1:] if argv is None else argv)}`",
        "",
        "| shape | choice | block_n | warps | stages | split | splits, programs | regs, spills | us | GB/s "
        "| of copy BW | max err |",
        "|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for label in labels:
        ok = [r for r in rows if r["shape"] == label and "us" in r]
        best = sorted((r for r in ok if r["default"] == "fast"), key=lambda r: r["us"])[:5]
        for r in [x for x in ok if x["default"] != "fast"] + best:
            share = "" if r["share"] is None else f"{100 * r['share']:.1f}%"
            n = r["splits"] if r["split"] != "stream" else (r["programs"] or "fit")
            res = "-" if r.get("regs") is None else f"{r['regs']}, {r['spills']}"
            lines.append(
                f"| {label} | {r['default']} | {r['block_n']} | {r['num_warps']} | {r['num_stages']} | {r['split']} | "
                f"{n} | {res} | {r['us']:.1f} | {r['gbps']:.0f} | {share} | {r['max_err']:.1e} |"
            )
    text = "\n".join(lines) + "\n"
    (out / "sweep_pool_attention.md").write_text(text)
    (out / "sweep_pool_attention.json").write_text(json.dumps({"device": name, "bandwidth": bw, "rows": rows}))
    return text


if __name__ == "__main__":
    raise SystemExit(main())
