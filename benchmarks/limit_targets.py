"""The decoding-at-the-limit targets, checked against `bench_hf_decode.py` results: one line per target and
setting, with the measured value, the goal and whether it is met.

    python benchmarks/limit_targets.py OUT/limit8b/bench_hf_decode.json OUT/eq8b/bench_hf_decode.json ...
    python benchmarks/limit_targets.py --out docs/results/limit_targets.md RESULTS...

Targets (one GPU; a benchmark's numbers, not a timed test):

* at Llama-3.1-8B's and Llama-3.2-1B's shapes (any but SmolLM2-135M's), the fastest full cache of each prompt and
  batch at >= 70% of the bandwidth measured in its run (a device-to-device copy; ``FULL_SHARE``); each NAtS row
  at >= 70% of the bandwidth for its own bytes (``NATS_SHARE``), and at >= 0.9 x the speed-up over the
  fastest full cache that the bytes allow (``OF_BOUND``);
* at equal KV memory of 32 GiB at Llama-3.1-8B's shape, NAtS >= 3.5x the fastest full cache's tokens/s
  (``EQUAL_MEMORY_X``; other budgets: the 0.9 x bound target only);
* SmolLM2-135M's shape, 8k, batch 1: the full cache and NAtS at >= 600 tokens/s (``SMOL_TOKENS``);
* the prefill at 32k: NAtS <= 0.85x the fastest full cache's time (``PREFILL_X``);
* no graph compiled and no CUDA graph recorded inside the timed requests (transformers' own caches aside:
  ``TRANSFORMERS``; the methods that did are named), and a changing workload (``--mixed``)
  within 15% of the same requests decoded again (``MIXED_WITHIN``; either way: a stream much faster than its second
  pass is a measurement to distrust), none compiled in its stream.

A row without the numbers a target needs is not listed for it. Exit status 0 (the table is a report, not a gate).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

_spec = importlib.util.spec_from_file_location("bench_hf_decode", Path(__file__).with_name("bench_hf_decode.py"))
_bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_bench)
NATS = _bench.NATS  # the benchmark's NAtS methods (its rows name the fastest full cache: ``full_method``)
FULL_SHARE = NATS_SHARE = 0.70
OF_BOUND = 0.9
EQUAL_MEMORY_X = 3.5
SMOL_TOKENS = 600.0
PREFILL_X = 0.85
MIXED_WITHIN = 0.15
#: transformers' own caches, left out of the graph targets: what a transformers user gets (a new StaticCache per
#: request lies at new addresses, and its compiled step records its CUDA graph again)
TRANSFORMERS = ("static", "dynamic")


def checks(result: dict) -> list[tuple[str, str, str, str, bool]]:
    """(target, setting, measured, goal, met) for one result file's rows."""
    shape = result["args"].get("model_shape") or result["args"].get("model") or "?"
    device = result.get("device", "?")
    out = []

    def add(target, setting, measured, goal, met):
        out.append((target, f"{shape}, {setting} ({device})", measured, goal, bool(met)))

    rows = result["rows"]
    main = [r for r in rows if not r.get("mixed") and r.get("equal_memory_gib") is None]
    best = {(r["prompt"], r["batch"]): r for r in main if r["method"] == r.get("full_method")}  # the bench's choice
    smol = shape == "smollm2-135m"  # its target is in tokens/s (at ~0.5 GB a step is bound by launches)
    for (P, B), r in sorted(best.items()):
        share = r.get("share_of_measured")
        if smol:
            continue
        if share is not None:
            add("fastest full cache at the bandwidth", f"{P} prompt, batch {B}, {r['method']}", f"{share:.1%}",
                f">= {FULL_SHARE:.0%}", share >= FULL_SHARE)  # fmt: skip
    for r in rows:
        if r.get("mixed") or r["method"] not in NATS or smol:
            continue
        gib = r.get("equal_memory_gib")
        setting = f"{r['prompt']} prompt, batch {r['batch']}" + ("" if gib is None else f", {gib:g} GiB of KV")
        share = r.get("share_of_measured")
        if gib is None and share is not None:
            add("NAtS at the bandwidth for its bytes", setting, f"{share:.1%}", f">= {NATS_SHARE:.0%}",
                share >= NATS_SHARE)  # fmt: skip
        x, bound = r.get("x_full"), r.get("limit_x_full")
        if x is not None and bound is not None:
            add("NAtS over the fastest full cache, of the bytes' bound", setting, f"{x:.2f}x (bound {bound:.2f}x)",
                f">= {OF_BOUND * bound:.2f}x", x >= OF_BOUND * bound)  # fmt: skip
        if gib == 32 and shape == "llama-3.1-8b" and x is not None:
            add("NAtS at equal KV memory", setting, f"{x:.2f}x", f">= {EQUAL_MEMORY_X}x", x >= EQUAL_MEMORY_X)
        full = best.get((r["prompt"], r["batch"]))
        if gib is None and r["prompt"] >= 32768 and full is not None:
            ratio = r["prefill_s"] / full["prefill_s"]
            add("NAtS prefill over the fastest full cache's", setting, f"{ratio:.2f}x", f"<= {PREFILL_X}x",
                ratio <= PREFILL_X)  # fmt: skip
    if smol:
        for r in main:
            if r["prompt"] == 8192 and r["batch"] == 1 and r["method"] in ("full", "nats"):
                add("SmolLM2 decoding speed", f"8192 prompt, batch 1, {r['method']}", f"{r['tokens_per_s']:.0f} tok/s",
                    f">= {SMOL_TOKENS:.0f} tok/s", r["tokens_per_s"] >= SMOL_TOKENS)  # fmt: skip
    for r in rows:
        if r.get("mixed"):
            setting = f"{r['requests']} requests, batch {r['batches']}, prompts {r['prompts']}, {r['method']}"
            add("changing workload against the same requests again", setting, f"{r['ratio']:.2f}",
                f"{1 - MIXED_WITHIN:.2f}-{1 + MIXED_WITHIN:.2f}", abs(r["ratio"] - 1) <= MIXED_WITHIN)  # fmt: skip
    for key, target in (("new_graphs", "no graph compiled while timed"),
                        ("cudagraphs_recorded", "no CUDA graph recorded while timed")):  # fmt: skip
        counted = [r for r in rows if r.get(key) is not None and r["method"] not in TRANSFORMERS]
        if counted:
            total = sum(r[key] for r in counted)
            which = sorted({r["method"] for r in counted if r[key]})
            measured = str(total) + (f" ({', '.join(which)})" if which else "")
            add(target, f"all {len(counted)} rows but transformers' caches", measured, "0", total == 0)
    return out


def table(results: list[dict], sources: list[str] | None = None) -> str:
    """The targets of every result, one line each; with ``sources`` (one name per result, e.g. its file) a first
    column says which result a line comes from."""
    head = "| target | setting | measured | goal | met |"
    if sources is not None:
        head = "| result " + head
    lines = [head, "|---" * head.count(" | ") + "|---|"]
    for i, result in enumerate(results):
        for target, setting, measured, goal, met in checks(result):
            line = f"| {target} | {setting} | {measured} | {goal} | {'yes' if met else '**no**'} |"
            lines.append(line if sources is None else f"| {sources[i]} {line}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results", nargs="+", help="bench_hf_decode.json files")
    ap.add_argument("--out", default=None, help="also write the table here (markdown)")
    args = ap.parse_args(argv)
    results = []
    for path in args.results:
        try:
            results.append(json.loads(Path(path).read_text()))
        except (OSError, json.JSONDecodeError) as e:
            raise SystemExit(
                f"limit_targets: cannot read {path} ({e}); pass bench_hf_decode.py's JSON output"
            ) from None
    text = table(results, [Path(p).stem for p in args.results] if len(args.results) > 1 else None)
    print(text, end="")
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
