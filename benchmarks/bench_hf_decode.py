"""Decode speed and KV memory of a transformers model through `generate` with the NAtS cache against the full
cache.

    python benchmarks/bench_hf_decode.py --out logs/bench                # SmolLM2-135M's shape, random weights, GPU
    python benchmarks/bench_hf_decode.py --scorers <run>/scorers.pt ...  # the fine-tuned scorers' types
    python benchmarks/bench_hf_decode.py --smoke                         # a tiny model on the CPU (tests the script)

The model has SmolLM2-135M-Instruct's architecture (Llama: 30 layers, hidden 576, 9 query / 3 KV heads, vocab
49152) with random weights, or a real one (``--model``: a folder or a GGUF file): the speed does not depend on the
weights, but the NAtS cache's size depends on the types, so ``--scorers`` loads fine-tuned scorers and
``--sliding-bias`` shifts random scorers towards sliding tokens (a controlled KV fraction). A synthetic prompt of
``--prompt`` tokens (default 8192) is prefilled, then ``--new`` tokens (default 256) are decoded greedily, each
method through ``model.generate``:

* ``dynamic``: transformers' own ``DynamicCache`` with SDPA attention (the model as shipped);
* ``full``: `nats.hf.PolicyCache` with the full policy (every key kept; the same decode path as NAtS);
* ``nats``: `PolicyCache` with the evicting NAtS cache (spec section 5).

Reported per method: prefill seconds (the first token's latency), decode tokens/s (the new tokens after the first,
per sequence), the KV memory the cache has allocated at the end (`PolicyCache.nbytes`, or the DynamicCache's
tensors) and the tokens it holds as a fraction of those seen, and the GPU's peak memory. Writes
``bench_hf_decode.{md,json}`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

SMOLLM2 = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=8192 + 1024,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    tie_word_embeddings=True,
)
TINY = dict(SMOLLM2, vocab_size=256, hidden_size=72, intermediate_size=128, num_hidden_layers=2)


def build_model(args, device, dtype):
    import transformers

    if args.model:
        from nats.hf.pretrained import load_pretrained

        model, _ = load_pretrained(args.model, dtype=str(dtype).split(".")[-1], device=str(device))
    else:
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(**(TINY if args.smoke else SMOLLM2))
        cfg._attn_implementation = "sdpa"
        model = transformers.LlamaForCausalLM(cfg).to(device=device, dtype=dtype)
    return model.eval()


def kv_bytes_dynamic(cache) -> int:
    total = 0
    for layer in getattr(cache, "layers", []):
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if torch.is_tensor(t):
                total += t.numel() * t.element_size()
    return total


def run_method(model, method: str, prompt: torch.Tensor, args, device) -> dict:
    from transformers import DynamicCache

    from nats.hf import PolicyCache

    n_new = args.new
    max_len = prompt.shape[1] + n_new

    def make_cache():
        if method == "dynamic":
            return DynamicCache(config=model.config)
        return PolicyCache(model, method, max_len=max_len)

    def gen(cache, n):
        return model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            past_key_values=cache,
        )

    impl = model.config._attn_implementation
    if method == "dynamic":
        model.config._attn_implementation = "sdpa"
    try:
        with torch.no_grad():
            gen(make_cache(), 2)  # warm-up: kernels compiled / autotuned, allocator primed
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            first = make_cache()
            gen(first, 1)  # prefill + one token: the first token's latency
            if device.type == "cuda":
                torch.cuda.synchronize()
            t1 = time.perf_counter()
            cache = make_cache()
            out = gen(cache, n_new)
            if device.type == "cuda":
                torch.cuda.synchronize()
            t2 = time.perf_counter()
    finally:
        model.config._attn_implementation = impl
    prefill_s = t1 - t0
    decode_s = max(1e-9, (t2 - t1) - prefill_s)  # the n_new - 1 tokens after the first
    seen = prompt.shape[1] + n_new - 1
    if method == "dynamic":
        nbytes, kept_frac = kv_bytes_dynamic(cache), 1.0
    else:
        nbytes = cache.nbytes()
        kept_frac = float(cache.kept().double().mean()) / seen
    return {
        "method": method,
        "prefill_s": prefill_s,
        "decode_tokens_per_s": (n_new - 1) / decode_s,
        "kv_mib": nbytes / 2**20,
        "kept_fraction": kept_frac,
        "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
        "generated": out.shape[1] - prompt.shape[1],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--model", default=None, help="a model folder or GGUF file (default: random SmolLM2-shape)")
    ap.add_argument("--scorers", default=None, help="a scorers.pt of a fine-tuning run (nats_state_dict)")
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--sliding-bias", type=float, default=0.0, help="added to random scorers' sliding logit")
    ap.add_argument("--prompt", type=int, default=8192)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--methods", nargs="+", default=["dynamic", "full", "nats"])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--smoke", action="store_true", help="tiny model, short prompt, CPU: tests the script")
    args = ap.parse_args(argv)
    if args.smoke:
        args.prompt, args.new, args.window = min(args.prompt, 96), min(args.new, 8), min(args.window, 8)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = getattr(torch, "float32" if device.type == "cpu" else args.dtype)
    from nats.hf import attach_nats, load_nats_state_dict, scorers

    model = build_model(args, device, dtype)
    attach_nats(model, window=args.window)
    model.eval()
    if args.scorers:
        load_nats_state_dict(model, torch.load(args.scorers, map_location=device, weights_only=True))
    elif args.sliding_bias:
        for s in scorers(model):  # no bias term: shift the sliding row's weights along a fixed direction
            with torch.no_grad():
                s.scorer.weight.view(-1, 3, s.scorer.weight.shape[-1])[:, 2] += args.sliding_bias / 10
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (args.batch, args.prompt), generator=gen).to(device)
    rows = []
    for method in args.methods:
        r = run_method(model, method, prompt, args, device)
        rows.append(r)
        print(json.dumps(r), flush=True)
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else "CPU"
    lines = [
        f"# Decode through `generate`: NAtS cache vs full cache ({name}, {args.prompt}-token prompt, "
        f"{args.new} new tokens, batch {args.batch}, {dtype}, W = {args.window})",
        "",
        "| method | prefill s | decode tokens/s | KV memory MiB | kept / seen | peak GPU GiB |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        peak = "" if r["peak_gpu_gib"] is None else f"{r['peak_gpu_gib']:.2f}"
        lines.append(
            f"| {r['method']} | {r['prefill_s']:.3f} | {r['decode_tokens_per_s']:.1f} | {r['kv_mib']:.2f} | "
            f"{r['kept_fraction']:.3f} | {peak} |"
        )
    text = "\n".join(lines) + "\n"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_hf_decode.md").write_text(text)
    (out / "bench_hf_decode.json").write_text(json.dumps({"args": vars(args), "device": name, "rows": rows}, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
