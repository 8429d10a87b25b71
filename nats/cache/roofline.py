"""The memory-bandwidth limit of a decode step: the bytes it must read, and what a measured speed makes of them.

A decode step of a transformer at a small batch is bound by memory traffic: it reads every weight once (the
embedding table aside, of which it reads one row per sequence) and every key and value the cache holds, and does
little arithmetic on them. So

    step seconds >= (weight bytes + KV bytes) / bandwidth,   tokens/s <= batch * bandwidth / (weight + KV bytes),

and a cache holding fewer tokens can be at most ``full bytes / its bytes`` times faster than a full cache of the same
model at the same batch (`limit_ratio`): at batch 1 the weights dominate the bytes and the bound is small, at larger
batches and longer contexts the KV does. A measured ratio above that bound says the full cache it is compared with
is slower than its bytes (a slow baseline), not that the smaller cache is fast.

The bandwidth is measured in the same run with a device-to-device copy (`measured_bandwidth`: bytes read plus bytes
written over the copy's time, what a streaming kernel reaches), beside the data-sheet figure of the GPU
(`datasheet_bandwidth`). `step_stats` turns a row's bytes and tokens/s into its achieved GB/s and their share of
both. The benchmarks `benchmarks/bench_hf_decode.py` and `benchmarks/bench_decode.py` report these per row.
"""

from __future__ import annotations

import time

import torch
from torch import nn

__all__ = [
    "DATASHEET_TBPS",
    "weight_bytes",
    "kv_bytes",
    "datasheet_bandwidth",
    "measured_bandwidth",
    "step_stats",
    "limit_ratio",
    "graph_steps",
    "profiled_steps",
    "steps_report",
]

# HBM bandwidth from the vendors' data sheets, bytes/s, by a part of the name torch.cuda.get_device_name gives
# (checked in order: the first match counts)
DATASHEET_TBPS = (
    ("H200", 4.8),
    ("H100 PCIe", 2.0),
    ("H100 NVL", 3.9),
    ("H100", 3.35),  # SXM5 ("NVIDIA H100 80GB HBM3")
    ("A100-SXM4-80GB", 2.039),
    ("A100 80GB PCIe", 1.935),
)


def weight_bytes(model: nn.Module, batch: int = 1) -> int:
    """Bytes of the parameters a decode step of ``batch`` sequences reads: every parameter once, but of a table only
    held by embedding modules (`nn.Embedding`: token or learned position embeddings) only the ``batch`` rows it
    looks up. A table tied to an output projection (the LM head of ``tie_word_embeddings``) is read whole, once."""
    whole: dict[int, torch.Tensor] = {}
    lookups: dict[int, tuple[torch.Tensor, int]] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if isinstance(module, nn.Embedding):
                lookups[id(p)] = (p, min(batch, p.shape[0]))
            else:
                whole[id(p)] = p
    total = sum(p.numel() * p.element_size() for p in whole.values())
    for key, (p, rows) in lookups.items():
        if key not in whole:
            total += rows * (p.numel() // p.shape[0]) * p.element_size()
    return total


def kv_bytes(layers: int, rows: int, tokens: float, head_dim: int, elem_size: int) -> float:
    """Bytes of the keys and values a step reads: per layer, ``rows`` (sequences x KV heads) of ``tokens`` each (the
    mean tokens a row holds; a float for rows of different sizes), a key and a value of ``head_dim`` elements of
    ``elem_size`` bytes per token."""
    return layers * rows * tokens * 2 * head_dim * elem_size


def datasheet_bandwidth(name: str | None) -> float | None:
    """The data-sheet HBM bandwidth (bytes/s) of a GPU by its name (`torch.cuda.get_device_name`), None if unknown."""
    if not name:
        return None
    for part, tbps in DATASHEET_TBPS:
        if part.lower() in name.lower():
            return tbps * 1e12
    return None


def measured_bandwidth(device: torch.device | str, nbytes: int = 1 << 30, iters: int = 10) -> float:
    """Bytes/s of a device-to-device copy of ``nbytes`` (bytes read + bytes written, over the copy's time; the best of
    ``iters`` copies after a warm-up), timed with CUDA events on a GPU, the wall clock elsewhere."""
    device = torch.device(device)
    n = max(1, nbytes // 4)
    src = torch.empty(n, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(iters):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src)
            b.record()
            b.synchronize()
            seconds = a.elapsed_time(b) / 1000.0
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            seconds = time.perf_counter() - t0
        best = min(best, max(seconds, 1e-9))
    return 2 * n * 4 / best


def step_stats(step_bytes: float, tokens_per_s: float, batch: int, measured: float | None, datasheet: float | None):
    """A row's place against the limit: ``step_bytes`` read per decode step of ``batch`` sequences, decoded at
    ``tokens_per_s`` over all of them. Returns the step's bytes (GB), the achieved GB/s (bytes / step time), its share
    of the measured and of the data-sheet bandwidth, and the tokens/s the measured bandwidth allows."""
    step_s = batch / tokens_per_s
    achieved = step_bytes / step_s
    return {
        "step_gb": step_bytes / 1e9,
        "achieved_gbps": achieved / 1e9,
        "share_of_measured": None if not measured else achieved / measured,
        "share_of_datasheet": None if not datasheet else achieved / datasheet,
        "limit_tokens_per_s": None if not measured else batch * measured / step_bytes,
    }


def limit_ratio(full_bytes: float, step_bytes: float) -> float:
    """The largest speed-up over a full cache that a step reading ``step_bytes`` instead of ``full_bytes`` can have
    (the same model and batch; both steps at the same share of the bandwidth)."""
    return full_bytes / step_bytes


def graph_steps(trace: dict) -> dict | None:
    """Where the time of decode steps replayed as CUDA graphs goes, from a profiler's Chrome trace
    (``torch.profiler.profile(...).export_chrome_trace``, loaded as a dict): the kernels each ``cudaGraphLaunch``
    ran (matched by their correlation id) make one step. Returns the steps' count, the kernels per step, and per step
    (medians, microseconds): ``span_us`` (first kernel's start to the next step's first kernel's start: the time a
    token takes), ``busy_us`` (the union of its kernels' intervals), ``idle_us`` (span - busy: the gaps between
    kernels inside the graph and between graphs), ``between_us`` (the last kernel's end to the next step's first
    kernel's start: the part of the idle time between graphs, the host's launch of the next step), and the kernels'
    total by name (``by_kernel``, us per step, the 40 largest; ``launches``: their launches per step). None if the
    trace has no graph launch."""
    import statistics
    from collections import Counter

    events = trace.get("traceEvents", trace) if isinstance(trace, dict) else trace
    launches = {
        e["args"]["correlation"]
        for e in events
        if e.get("name") == "cudaGraphLaunch" and "correlation" in e.get("args", {})
    }
    steps: dict[int, list[tuple[float, float, str]]] = {}
    for e in events:
        if e.get("cat") == "kernel" and e.get("args", {}).get("correlation") in launches:
            steps.setdefault(e["args"]["correlation"], []).append((float(e["ts"]), float(e["dur"]), e["name"]))
    if not steps:
        return None
    ordered = sorted((sorted(k) for k in steps.values()), key=lambda k: k[0][0])
    spans, busys, between, totals, counts = [], [], [], Counter(), Counter()
    for i, kernels in enumerate(ordered):
        busy, reach = 0.0, kernels[0][0]  # the union of the intervals: each kernel adds what lies past the reach
        for t, d, name in kernels:
            totals[name] += d
            counts[name] += 1
            busy += max(0.0, t + d - max(t, reach))
            reach = max(reach, t + d)
        busys.append(busy)
        if i + 1 < len(ordered):  # the last step has no next one: its span is not known
            nxt = ordered[i + 1][0][0]
            spans.append(nxt - kernels[0][0])
            between.append(nxt - reach)
    n = len(ordered)
    span = statistics.median(spans) if spans else None
    busy = statistics.median(busys)
    return {
        "steps": n,
        "kernels_per_step": statistics.median(len(k) for k in ordered),
        "span_us": span,
        "busy_us": busy,
        "idle_us": None if span is None else span - busy,
        "between_us": statistics.median(between) if between else None,
        "by_kernel": (top := dict(sorted(((k, v / n) for k, v in totals.items()), key=lambda kv: -kv[1])[:40])),
        "launches": {k: counts[k] / n for k in top},
    }


def profiled_steps(prof) -> dict | None:
    """`graph_steps` of a finished ``torch.profiler.profile`` (its Chrome trace, written to a temporary file and read
    back); None where no step was a CUDA graph."""
    import json
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        return graph_steps(json.loads(path.read_text()))


def steps_report(steps: dict, what: str) -> tuple[str, list[str]]:
    """A `graph_steps` result as one line (``what``: the row, then the steps' count, kernels per step, a token's time
    and the GPU's busy and idle shares of it) and that line with the kernels' table (us per step, launches, name)."""

    def us(x):
        return "-" if x is None else f"{x:.0f}"

    line = (
        f"{what}: {steps['steps']} replayed steps, {steps['kernels_per_step']:g} kernels each, "
        f"{us(steps['span_us'])} us per token, GPU busy {steps['busy_us']:.0f} us, idle {us(steps['idle_us'])} us "
        f"(between steps {us(steps['between_us'])} us)"
    )
    per = steps["launches"]
    rows = [f"| {t:.1f} | {per[name]:g} | {name[:100]} |" for name, t in steps["by_kernel"].items()]
    return line, ["### replayed steps", line, "", "| us per step | launches | kernel |", "|---:|---:|---|", *rows]
