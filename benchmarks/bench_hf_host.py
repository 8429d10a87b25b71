"""The host's work around each compiled decode step of ``model.generate``: transformers' ``StaticCache`` against
NAtS' `nats.hf.StaticPolicyCache`, on any device.

    python benchmarks/bench_hf_host.py --out logs/bench/hf_host                  # SmolLM2-135M's shape, 30 layers
    python benchmarks/bench_hf_host.py --device cpu --prompt 256                 # the same on the CPU (compiled too)
    python benchmarks/bench_hf_host.py --prompt 8192 --out logs/bench/hf_host    # the pieces, direct vs Triton's

At batch 1 a decode step replayed as a CUDA graph is bound by the host: before each call dynamo checks the guards of
the compiled step (per graph input: every tensor the step reads from the model and the cache; after a second prompt
length the step is compiled with dynamic sizes, whose shape guards are checked too), and ``generate`` runs its own
Python around it. Per method (``nats``: the default Triton prefill writes; ``nats_torch_prefill``: the PyTorch
ones): the cache tensors the step reads, the guard check and the bytecode before the graph per step (profiler events
"TorchDynamo Cache Lookup" and "Pregraph bytecode", averaged over 16 steps after warm-up calls with two prompt
lengths, as a user's calls bring; under the profiler, so larger than without it), the operator calls and kernel
launches of one prefill, its wall time without the profiler and the host time spent in the attention function, and
(file ``python_prefill_<method>.txt``) its Python functions by own and by cumulative time. On the CPU ``generate``
is made to compile the step as it does on CUDA (inductor, no CUDA graphs): the guards are the same host code on
both. Then one layer's prefill attention piece by piece (host and GPU time per call). Writes
``bench_hf_host.{md,json}`` into ``--out``.
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

from nats_kernels import configure_triton


def main(argv: list[str] | None = None) -> int:
    configure_triton()  # Triton's settings before any kernel: the interpreter without a GPU, the cache folder
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
            attention_ms, attention_parts = _attention_ms(model, lambda: generate(make(), 1), device)
            _python_profile(lambda: generate(make(), 1), Path(args.out) / f"python_prefill_{method}.txt")
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                generate(make(), n_new)
            cache = make()
            generate(cache, 2)
        ev = {e.key: e for e in prof.key_averages()}
        per_step = {k: ev[k].cpu_time_total / ev[k].count / 1e3 if k in ev else None
                    for k in ("TorchDynamo Cache Lookup", "Pregraph bytecode")}  # fmt: skip
        inputs = len({id(t) for layer in cache.layers for t in _cache_tensors(layer) if t.numel() > 0})  # distinct
        rows.append({
            "method": method,
            "cache_tensors": inputs,
            "guard_ms": per_step["TorchDynamo Cache Lookup"],
            "pregraph_ms": per_step["Pregraph bytecode"],
            "prefill_aten_calls": calls,
            "prefill_kernel_launches": launches if device.type == "cuda" else None,
            "prefill_ms": prefill_ms,
            "prefill_attention_ms": attention_ms,
            "prefill_attention_parts_ms": attention_parts,
        })  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    parts = prefill_parts(model, prompt, args, device)
    write(rows, args, device, argv, parts)
    return 0


def prefill_parts(model, prompt: torch.Tensor, args, device) -> list[dict]:
    """Host and GPU time of each piece of one layer's prefill attention, each piece called ``args.layers`` times in a
    row on the first layer's real inputs (the prompt's hidden states, queries, keys and values): the host time is the
    loop's time before the GPU is waited for (what a host-bound prefill pays per layer), the GPU time the events'
    time around the same loop. StaticCache's attention is one SDPA call; NAtS' is the scorer's types, the NAtS
    kernel's plan and attention, and the cache's rows and pool writes (Triton kernels on CUDA; PyTorch on the CPU). On
    CUDA the prefill's `PrefillKernels` pieces twice: launched directly after their first call, and through Triton's
    launcher (``direct=False``), with how each kernel was launched (a failed check of the direct launch shows)."""
    import torch.nn.functional as F

    from nats import functional as NF
    from nats.cache.engine import pool_fill
    from nats.cache.policies.nats import nats_rows
    from nats.hf import scorers

    cfg = model.config
    core = scorers(model)[0]
    B, N = prompt.shape
    Hq, Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    D = cfg.hidden_size // Hq
    g = torch.Generator(device=device).manual_seed(0)
    dtype = next(model.parameters()).dtype
    q, k, v = (torch.randn(B, h, N, D, generator=g, device=device, dtype=dtype) for h in (Hq, Hkv, Hkv))
    W, new = core.window, 256
    with torch.no_grad():
        x = model.model.layers[0].input_layernorm(model.model.embed_tokens(prompt))  # the first scorer's input
        types = core.hard_types(x)
        triton = device.type == "cuda" and NF.triton_available()
        if triton:
            from nats_kernels.nats_attention.prefill_cache import prefill_pool, prefill_rows

            rows, end, _, _, last_g = prefill_rows(types, k, v, W, new)
            size = int(end) + 1
            from nats_kernels.nats_attention.prefill_cache import PrefillKernels, prefill_kernels

            w_s = core.scorer.weight
            logits = F.linear(x, w_s).view(B, N, Hkv, 3).transpose(1, 2)
            direct = prefill_kernels(q, k, v, logits, core.type_bias, W, new)
            _, d_types, d_rows, _, _, _, d_last = direct.attend(q, k, v, logits, core.type_bias)
            # the same kernels, every launch through Triton's launcher (what NATS_KERNELS_DIRECT_LAUNCH=0 gives)
            through = PrefillKernels(PrefillKernels.key(q, k, v, logits, core.type_bias, W, new), direct=False)
            through.attend(q, k, v, logits, core.type_bias)
            writes = {
                "NAtS: rows and ring (prefill_rows)": lambda: prefill_rows(types, k, v, W, new),
                "NAtS: pool (prefill_pool)": lambda: prefill_pool(types, k, v, rows, last_g, size),
                "NAtS direct: scorer's Linear, plan, attention, rows and ring (PrefillKernels.attend)": lambda: (
                    direct.attend(q, k, v, F.linear(x, w_s).view(B, N, Hkv, 3).transpose(1, 2), core.type_bias)
                ),
                "NAtS direct: pool (PrefillKernels.pool)": lambda: direct.pool(d_types, k, v, d_rows, d_last, size),
                "NAtS Triton's launcher: scorer's Linear, plan, attention, rows and ring (PrefillKernels.attend, "
                "direct=False)": lambda: through.attend(
                    q, k, v, F.linear(x, w_s).view(B, N, Hkv, 3).transpose(1, 2), core.type_bias
                ),
                "NAtS Triton's launcher: pool (PrefillKernels.pool, direct=False)": lambda: through.pool(
                    d_types, k, v, d_rows, d_last, size
                ),
            }
        else:
            keep, rank, rows, end, _, _ = nats_rows(types, k, v, W, new)
            size = int(end) + 1
            writes = {
                "NAtS: rows and ring (PyTorch)": lambda: nats_rows(types, k, v, W, new),
                "NAtS: pool (PyTorch)": lambda: pool_fill(keep, rank, rows, k, v, size),
            }
        pieces = {
            "StaticCache: SDPA (causal, GQA)": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                                      enable_gqa=True),
            "NAtS: scorer types (hard_types)": lambda: core.hard_types(x),
            "NAtS: attention (nats_attention_types)": lambda: NF.nats_attention_types(q, k, v, types, W),
            **writes,
        }  # fmt: skip
        out = []
        for name, fn in pieces.items():
            for _ in range(3):  # warm-up: compiled, autotuned
                fn()
            _sync(device)
            host, gpu = [], []
            for _ in range(5):
                start = torch.cuda.Event(enable_timing=True) if device.type == "cuda" else None
                stop = torch.cuda.Event(enable_timing=True) if device.type == "cuda" else None
                if start is not None:
                    start.record()
                t0 = time.perf_counter()
                for _ in range(args.layers):
                    fn()
                host.append((time.perf_counter() - t0) * 1e6 / args.layers)
                if stop is not None:
                    stop.record()
                _sync(device)
                if start is not None:
                    gpu.append(start.elapsed_time(stop) * 1e3 / args.layers)
            out.append(
                {"part": name, "host_us": statistics.median(host), "gpu_us": statistics.median(gpu) if gpu else None}
            )
            print(json.dumps(out[-1]), flush=True)
        if triton:  # how the "direct" rows launched (Triton's launcher where the installed Triton failed a check)
            out.append({"part": "launches", "direct": direct.launches, "through": through.launches})
            print(json.dumps(out[-1]), flush=True)
    return out


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _prefill_ms(call, device, repeats: int = 7) -> float:
    """The median wall time of a prefill (generate with one new token), without the profiler."""
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        call()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


# the parts of NAtS' prefill attention timed in situ beside the whole attention function (class, method)
_INSITU_PARTS = {
    "types_and_attention": ("nats.cache.policies.nats:NAtSRule", "prompt"),
    "direct_scorer_attention_rows": ("nats.cache.policies.nats:NAtSRule", "direct"),
    "pool_size_wait": ("nats.cache.engine:PoolLayout", "size"),
    "pool_fill_and_allocate": ("nats.cache.engine_cache:EngineCache", "_fill_pool"),
}


def _attention_ms(model, call, device, repeats: int = 5) -> tuple[float, dict[str, float]]:
    """The host time a prefill spends in the model's attention function, all layers together (the function
    transformers looks up by ``config._attn_implementation``, wrapped with a timer; median of `repeats` calls), and
    the same for the parts of the fixed-capacity caches' prefill in `_INSITU_PARTS` (0 where a method does not run;
    the pool fill includes the wait for the pool's size)."""
    import importlib

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = model.config._attn_implementation
    inner, spent = ALL_ATTENTION_FUNCTIONS[name], []
    parts: dict[str, list[float]] = {part: [] for part in _INSITU_PARTS}

    def timer(fn, acc):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            acc[-1] += time.perf_counter() - t0
            return out

        return timed

    patched = []
    for part, (where, method) in _INSITU_PARTS.items():
        module, cls = where.split(":")
        owner = getattr(importlib.import_module(module), cls)
        patched.append((owner, method, owner.__dict__[method]))
        setattr(owner, method, timer(owner.__dict__[method], parts[part]))
    # set as the model reads it: an item set on the mapping (as kvpress' attention patch sets its wrappers) wins over
    # AttentionInterface.register's
    ALL_ATTENTION_FUNCTIONS[name] = timer(inner, spent)
    try:
        for _ in range(repeats):
            _sync(device)
            for acc in (spent, *parts.values()):
                acc.append(0.0)
            call()
    finally:
        ALL_ATTENTION_FUNCTIONS[name] = inner
        for owner, method, fn in patched:
            setattr(owner, method, fn)
    return statistics.median(spent) * 1e3, {part: statistics.median(v) * 1e3 for part, v in parts.items()}


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


def write(rows: list[dict], args, device, argv, parts: list[dict] | None = None) -> None:
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
        "prefill operator calls | prefill kernel launches | prefill ms (no profiler, median of 7) | "
        "of which host ms in the attention function (all layers, median of 5) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['method']} | {r['cache_tensors']} | {fmt(r['guard_ms'])} | {fmt(r['pregraph_ms'])} | "
            f"{r['prefill_aten_calls']} | {fmt(r['prefill_kernel_launches'])} | {fmt(r['prefill_ms'])} | "
            f"{fmt(r['prefill_attention_ms'])} |"
        )
    lines += [
        "",
        "In situ, host ms of the prefill's attention function spent in (all layers, median of 5): "
        + "; ".join(
            f"{r['method']}: " + ", ".join(f"{k} {v:.3f}" for k, v in r["prefill_attention_parts_ms"].items())
            for r in rows
            if any(r["prefill_attention_parts_ms"].values())
        ),
    ]
    if parts:
        lines += [
            "",
            f"One layer's prefill attention piece by piece (each called {args.layers} times in a row on the first "
            "layer's inputs, the median of 5 loops; host: the loop's time before the GPU is waited for; GPU: CUDA "
            "events around it; microseconds per call):",
            "",
            "| piece | host us / call | GPU us / call |",
            "|---|---:|---:|",
        ]
        lines += [
            f"| {p['part']} | {p['host_us']:.1f} | {'-' if p['gpu_us'] is None else round(p['gpu_us'], 1)} |"
            for p in parts
            if "host_us" in p
        ]
        lines += [
            f"\nLaunches of the 'NAtS direct' rows: {', '.join(f'{k} {v}' for k, v in p['direct'].items())}; of the "
            f"'Triton's launcher' rows: {', '.join(f'{k} {v}' for k, v in p['through'].items())}."
            for p in parts
            if p["part"] == "launches"
        ]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_hf_host.md").write_text("\n".join(lines) + "\n")
    (out / "bench_hf_host.json").write_text(json.dumps({"device": name, "rows": rows, "parts": parts}, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
