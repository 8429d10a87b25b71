"""The host's work around each compiled decode step of ``model.generate``: transformers' ``StaticCache`` against
NAtS' `nats.hf.StaticPolicyCache`, on any device.

    python benchmarks/bench_hf_host.py --out logs/bench/hf_host                  # SmolLM2-135M's shape, 30 layers
    python benchmarks/bench_hf_host.py --device cpu --prompt 256                 # the same on the CPU (compiled too)

At batch 1 a decode step replayed as a CUDA graph is bound by the host: before each call dynamo checks the guards of
the compiled step (per graph input: every tensor the step reads from the model and the cache; after a second prompt
length the step is compiled with dynamic sizes, whose shape guards are checked too), and ``generate`` runs its own
Python around it. Per method (``nats``: the default Triton prefill writes; ``nats_torch_prefill``: the PyTorch
ones): the cache tensors the step reads, the guard check and the bytecode before the graph per step (profiler events
"TorchDynamo Cache Lookup" and "Pregraph bytecode", averaged over 16 steps after warm-up calls with two prompt
lengths, as a user's calls bring; under the profiler, so larger than without it), the operator calls and kernel
launches of one prefill, its wall time without the profiler, and (file ``python_prefill_<method>.txt``) its Python
functions by own and by cumulative time. On the CPU ``generate`` is made to compile the step as it does on CUDA
(inductor, no CUDA graphs): the guards are the same host code on both. Writes ``bench_hf_host.{md,json}`` into
``--out``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_hf_decode as hf  # noqa: E402  (benchmarks/bench_hf_decode.py: the model, calibration, caches)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="logs/bench/hf_host")
    ap.add_argument("--device", default="auto", help="auto (cuda if available) | cpu | cuda")
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=30, help="decoder layers (SmolLM2-135M: 30)")
    ap.add_argument("--kept", type=float, default=0.25, help="NAtS' kept share (calibrated random scorers)")
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--smoke", action="store_true", help="tiny model, short prompt, CPU: tests the script")
    args = ap.parse_args(argv)
    import transformers
    from torch.profiler import ProfilerActivity, profile

    from nats.hf import attach_nats

    auto = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(auto if args.device == "auto" else args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    n_new = 17
    if args.smoke:
        args.prompt, args.window, args.layers = 48, 8, 2
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**{**(hf.TINY if args.smoke else hf.SMOLLM2), "num_hidden_layers": args.layers})
    cfg.max_position_embeddings = args.prompt + n_new + 64
    model = transformers.LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()
    attach_nats(model, window=args.window)
    cc = transformers.CompileConfig()  # generate's default: reduce-overhead (CUDA graphs on CUDA)
    cc._compile_all_devices = True  # generate compiles on CUDA only otherwise
    prompt = torch.randint(0, model.config.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(0))
    prompt = prompt.to(device)

    def generate(cache, n: int, ids=prompt):
        return hf.generate(model, ids, cache, n, compile_config=cc)

    rows = []
    for method in ("static", "nats", "nats_torch_prefill"):
        kept = args.kept if method in hf.NATS else None
        if kept:
            hf.calibrate(model, prompt, kept)
        make = hf.cache_maker(model, method, args.prompt, n_new, kept)
        torch._dynamo.reset()
        with hf.attention_of(model, method):
            generate(make(), 4)
            # a prompt of another length, as a user's next call brings: dynamo compiles the step once more with
            # those sizes dynamic, and that graph (its guards) serves every later prompt
            generate(make(), 4, prompt[:, : args.prompt - 16])
            generate(make(), 4)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                generate(make(), 1)
            calls = sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))
            launches = sum(e.count for e in prof.key_averages() if e.key in ("cudaLaunchKernel", "cuLaunchKernelEx"))
            prefill_ms = _prefill_ms(lambda: generate(make(), 1), device)
            _python_profile(lambda: generate(make(), 1), Path(args.out) / f"python_prefill_{method}.txt")
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                generate(make(), n_new)
            cache = make()
            generate(cache, 2)
        ev = {e.key: e for e in prof.key_averages()}
        per_step = {k: ev[k].cpu_time_total / ev[k].count / 1e3 if k in ev else None
                    for k in ("TorchDynamo Cache Lookup", "Pregraph bytecode")}  # fmt: skip
        inputs = sum(t.numel() > 0 for layer in cache.layers for t in _cache_tensors(layer))
        rows.append({
            "method": method,
            "cache_tensors": inputs,
            "guard_ms": per_step["TorchDynamo Cache Lookup"],
            "pregraph_ms": per_step["Pregraph bytecode"],
            "prefill_aten_calls": calls,
            "prefill_kernel_launches": launches if device.type == "cuda" else None,
            "prefill_ms": prefill_ms,
        })  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    write(rows, args, device, argv)
    return 0


def _prefill_ms(call, device, repeats: int = 7) -> float:
    """The median wall time of a prefill (generate with one new token), without the profiler."""
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        call()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _python_profile(call, path: Path, top: int = 40) -> None:
    """The Python functions of one prefill by own and by cumulative time (cProfile): where the host's time goes."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.runcall(call)
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(2 * top)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(buf.getvalue())


def _cache_tensors(layer) -> list[torch.Tensor]:
    """The tensors a cache layer holds for the decode step (the compiled step's inputs from the cache)."""
    if hasattr(layer, "tensors"):
        return layer.tensors()
    return [t for t in (getattr(layer, n, None) for n in ("keys", "values", "cumulative_length")) if torch.is_tensor(t)]


def write(rows: list[dict], args, device, argv) -> None:
    import transformers

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.processor() or 'x86_64'})"
    fmt = lambda v: "-" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = [
        "# The host's work around each compiled decode step of `model.generate`\n",
        f"{name}, torch {torch.__version__}, transformers {transformers.__version__}; "
        f"{'a tiny model' if args.smoke else 'SmolLM2-135M shape'}, {args.layers} layers, prompt {args.prompt}, "
        f"batch 1, NAtS kept {args.kept}, W = {args.window}; per decode step under the profiler.",
        f"Command: `python benchmarks/bench_hf_host.py {' '.join(sys.argv[1:] if argv is None else argv)}`\n",
        "| method | cache tensors read by the step | guard check ms / step | pregraph bytecode ms / step | "
        "prefill operator calls | prefill kernel launches | prefill ms (no profiler, median of 7) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['method']} | {r['cache_tensors']} | {fmt(r['guard_ms'])} | {fmt(r['pregraph_ms'])} | "
            f"{r['prefill_aten_calls']} | {fmt(r['prefill_kernel_launches'])} | {fmt(r['prefill_ms'])} |"
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_hf_host.md").write_text("\n".join(lines) + "\n")
    (out / "bench_hf_host.json").write_text(json.dumps({"device": name, "rows": rows}, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
