"""Decoding speed and KV memory: NAtS' fixed-capacity cache against the full caches (the project's, gpt-fast-style,
transformers' own), in one run.

    python benchmarks/bench_hf_decode.py --out logs/bench/hf_decode              # SmolLM2-135M's shape, GPU
    python benchmarks/bench_hf_decode.py --prompt 32768 --batch 1 8 --kept 0.25 0.1
    python benchmarks/bench_hf_decode.py --equal-memory-gib 2 --kept 0.25 0.1    # the largest batch each cache fits
    python benchmarks/bench_hf_decode.py --model-shape llama-3.1-8b --prompt 32768 --batch 1 \
        --methods sdpa_static static full nats --kept 0.25                       # against the HBM limit
    python benchmarks/bench_hf_decode.py --model-shape llama-3.2-1b --methods full nats --batch 1 --mixed 50
                                                                     # + 50 requests of batch 1-16, prompts 1k-32k
    python benchmarks/bench_hf_decode.py --smoke                                 # a tiny model on the CPU

The model has SmolLM2-135M-Instruct's architecture (Llama: 30 layers, hidden 576, 9 query / 3 KV heads, vocab
49152) with random weights, or another shape of ``--model-shape`` (``llama-3.2-1b``: 16 layers, hidden 2048, 32 /
8 heads of 64; ``llama-3.1-8b``: 32 layers, hidden 4096, 32 / 8 heads of 128, vocab 128256), built on the GPU in
the benchmark's dtype (``--model``: a folder or GGUF file instead); RoPE's context is raised to the prompt
(``max_position_embeddings``; speed does not depend on the weights). With random weights the NAtS scorers' types
are random, so each scorer's global-type offset is calibrated on the prompt to keep a share ``--kept`` of the
tokens (``--scorers``: a fine-tuned scorer file, whose types are then used as they are). A random prompt of
``--prompt`` tokens is prefilled and ``--new`` tokens are decoded greedily:

* ``dynamic``: transformers' ``DynamicCache`` (SDPA, eager: what ``generate`` does by default);
* ``static``: transformers' ``StaticCache`` (SDPA; ``generate`` compiles the decode step, CUDA graphs);
* ``full``, ``nats``, ``streaming_llm``: `nats.hf.StaticPolicyCache` (fixed-capacity buffers) decoded by
  nats-generate's loop (`nats.hf.loop`: the step compiled with CUDA graphs, no host synchronisation per token);
  ``streaming_llm`` at the same kept share as NAtS;
* ``hf_full``, ``hf_nats``: the same caches through ``model.generate`` (which compiles the decode step the same
  way, but waits for the GPU at every token before its host work for the next);
* ``nats_torch_prefill``: ``nats`` whose prefill writes the cache with PyTorch operations
  (``prefill_kernel="torch"``, the reference) instead of the default two fused Triton launches per layer;
* ``policy_nats``: the same NAtS cache without a planned number of new tokens (``max_new_tokens=None``: eager steps,
  the pool grown where a row fills; not compiled), for reference;
* ``sdpa_static``, ``flex_static``: the full cache a strong engineer would write, gpt-fast style
  (`benchmarks/gptfast_decode.py`: a hand-written decode loop over the same model's modules, static buffers, each
  KV head read once for its query group, no decode mask): SDPA over the positions so far (compiled, length
  dynamic, no CUDA graphs) or FlexAttention over the whole buffer with a block mask (compiled, CUDA graphs).

Per row (the median of ``--repeats`` timed calls, each with a new cache): prefill seconds (the first token's
latency), decode tokens/s over all sequences (the tokens after the first), the KV bytes the cache holds at the end
(the buffers allocated), the tokens it keeps as a share of those seen, the compiled graphs added by the timed runs
after a warm-up (0 = no recompilation), the ratio to ``static``'s tokens/s and prefill (the prefill ratio of
timings taken side by side: a ``StaticCache`` prefill is timed again before each of the row's timed prefills),
and the GPU's peak memory.

Against the memory-bandwidth limit (`nats.cache.roofline`): the bytes a decode step must read (the weights, of
the embedding table one row per sequence, plus the keys and values the cache holds at the end: a full cache the
P + new - 1 tokens seen per row, NAtS its pool segments and valid ring), the achieved GB/s (those bytes / step time)
and their share of the bandwidth measured in the same run (a device-to-device copy) and of the data sheet's;
``x full``: tokens/s over the fastest full-cache row of the same prompt and batch (``sdpa_static``,
``flex_static``, ``full``, ``hf_full``, ``static``, ``dynamic``), and for rows keeping less than all,
``bound``: the largest ratio to a full cache those bytes allow (full bytes / the row's bytes).
``--equal-memory-gib M`` also runs each cache at the largest batch whose KV buffers fit M GiB. ``--mixed N`` also
serves N requests of changing batch and prompt length through each of the project's caches in one process, then the
same requests again (`mixed_workload`: fixed buffers and pools of one size per batch, as a serving engine runs; the
changing stream's tokens/s against the same requests again, the graphs it compiled and the CUDA graphs it recorded;
dynamo's recompile limit is made an error). Writes
``bench_hf_decode.{md,json}`` into ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

try:
    from nats_kernels import configure_triton
except ImportError:  # an earlier nats_kernels set Triton up when imported (experiments/gpu_carry_over.sh runs one)

    def configure_triton() -> None:
        """Nothing to do: the earlier package configured Triton at its import."""


# a Llama-architecture config's sizes in LlamaConfig's order of these keys; the rest as the named models set them
SIZE_KEYS = "vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads num_key_value_heads".split()


def llama_shape(*sizes: int, **rest) -> dict:
    return {**dict(zip(SIZE_KEYS, sizes, strict=True)), "rms_norm_eps": 1e-5, "tie_word_embeddings": True, **rest}


SMOLLM2 = llama_shape(49152, 576, 1536, 30, 9, 3, rope_theta=100000.0)
LLAMA32_1B = llama_shape(128256, 2048, 8192, 16, 32, 8, head_dim=64, rope_theta=500000.0)
LLAMA31_8B = llama_shape(128256, 4096, 14336, 32, 32, 8, head_dim=128, rope_theta=500000.0, tie_word_embeddings=False)
SHAPES = {"smollm2-135m": SMOLLM2, "llama-3.2-1b": LLAMA32_1B, "llama-3.1-8b": LLAMA31_8B}
TINY = dict(SMOLLM2, vocab_size=256, hidden_size=72, intermediate_size=128, num_hidden_layers=2)
# the methods whose scorers are calibrated to a kept share
NATS = ("nats", "hf_nats", "nats_torch_prefill", "policy_nats")
FAST = {"sdpa_static": "sdpa", "flex_static": "flex"}  # gpt-fast-style full caches (benchmarks/gptfast_decode.py)
# the full caches: "x full" is to the fastest
FULL = ("sdpa_static", "flex_static", "full", "hf_full", "static", "dynamic")


def _gptfast():
    """benchmarks/gptfast_decode.py, imported from its file (this script is run from anywhere, or loaded by path)."""
    import importlib.util

    if "gptfast_decode" not in sys.modules:
        spec = importlib.util.spec_from_file_location("gptfast_decode", Path(__file__).with_name("gptfast_decode.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules["gptfast_decode"] = module
        spec.loader.exec_module(module)
    return sys.modules["gptfast_decode"]


def build_model(args, device, dtype):
    import transformers

    if args.model:
        from nats.hf.pretrained import load_pretrained

        model, _ = load_pretrained(args.model, dtype=str(dtype).split(".")[-1], device=str(device))
    else:
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(**(TINY if args.smoke else SHAPES[getattr(args, "model_shape", "smollm2-135m")]))
        longest = max(max(args.prompt), args.mixed_prompt[1] if getattr(args, "mixed", 0) else 0)
        cfg.max_position_embeddings = longest + args.new + 64
        default = torch.get_default_dtype()
        torch.set_default_dtype(dtype)  # built where it runs, in its dtype: an 8B model in seconds, not minutes
        try:
            with torch.device(device):
                model = transformers.LlamaForCausalLM(cfg)
        finally:
            torch.set_default_dtype(default)
    return model.eval()


def calibrate(model, prompt: torch.Tensor, kept: float, rows: int = 4) -> None:
    """Per layer, the global-type offset under which a share `kept` of the prompt's tokens is global (locals off,
    the rest sliding), over the first `rows` sequences (at most 8k tokens each) together: random scorers then keep
    about that share of the KV cache, averaged over the batch."""
    from nats.hf import scorers

    cores = scorers(model)
    hooks = []
    for core in cores:

        def hook(mod, args, out, core=core):  # runs before the core adds its offsets: they apply at once
            z = out.float().reshape(-1, 3)
            g = torch.quantile(z[:, 2] - z[:, 0], kept).item()  # global where g > z_s - z_g: a share `kept`
            core.type_bias.copy_(torch.tensor([g, -1e4, 0.0]))

        hooks.append(core.scorer.register_forward_hook(hook))
    with torch.no_grad():
        # each layer calibrated under the earlier layers' types (the logits of the last position only)
        model(prompt[:rows, : min(prompt.shape[1], 8192)], logits_to_keep=1)
    for h in hooks:
        h.remove()


def kv_bytes(cache) -> int:
    """Bytes of the key/value buffers a cache has allocated."""
    if hasattr(cache, "kv_nbytes"):
        return cache.kv_nbytes()
    total = 0
    for layer in getattr(cache, "layers", []):
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if torch.is_tensor(t):
                total += t.numel() * t.element_size()
    return total


def cudagraph_skips() -> int:
    """Compiled graphs that inductor left out of CUDA graphs (it logs the reason: "skipping cudagraphs due to ...");
    such a decode step launches every kernel from the host."""
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["cudagraph_skips"])


def cache_maker(model, method: str, P: int, n_new: int, kept: float | None, batch: int = 1, **serving):
    """A function that makes a fresh cache of `method` for `batch` prompts of P tokens and n_new new ones
    (``serving``: ``row_slots`` and ``buffers`` for the project's fixed-capacity caches, `nats.hf.buffers`)."""
    from transformers import DynamicCache, StaticCache

    from nats.hf import StaticPolicyCache

    budget = None if kept is None else max(8, int(kept * P))
    fast = []  # a gpt-fast-style decoder is made once and reused: its compiled step and CUDA graphs stay valid

    def make():
        if method in FAST:
            if not fast:
                cuda = next(model.parameters()).is_cuda  # compiled on a GPU, as generate compiles its step
                fast.append(_gptfast().GptFastDecoder(model, batch, P + n_new, FAST[method], compile=cuda))
            return fast[0]
        if method == "dynamic":
            return DynamicCache(config=model.config)
        if method == "static":
            return StaticCache(config=model.config, max_cache_len=P + n_new)
        if method == "policy_nats":
            return StaticPolicyCache(model, "nats", max_len=P + n_new, track=False)
        policy = method.removeprefix("hf_")
        extra = {"budget": budget} if policy == "streaming_llm" else {}
        if method == "nats_torch_prefill":
            policy, extra = "nats", {"prefill_kernel": "torch"}
        return StaticPolicyCache(model, policy, max_new_tokens=n_new, max_len=P + n_new, track=False, **extra,
                                 **serving)  # fmt: skip

    return make


def projections(model, method: str, args) -> None:
    """Each layer's q/k/v and gate/up projections as one product each (`nats.hf.fused`) for `method`'s row, unless
    ``--unfused`` or the row is one of transformers' own caches (``static``, ``dynamic``: what a transformers user
    runs)."""
    from nats.hf.fused import fuse_projections, is_fused, unfuse_projections

    fused = not getattr(args, "unfused", False) and method not in ("static", "dynamic")
    if fused and not is_fused(model):
        fuse_projections(model)
    elif not fused and is_fused(model):
        unfuse_projections(model)


@contextlib.contextmanager
def attention_of(model, method: str):
    """transformers' own caches run its SDPA attention; the project's caches the nats attention function."""
    impl = model.config._attn_implementation
    if method in ("dynamic", "static"):
        model.config._attn_implementation = "sdpa"
    try:
        yield
    finally:
        model.config._attn_implementation = impl


class _FirstToken:
    """A transformers streamer that calls ``on_prefill`` when ``model.generate`` hands it the first new token (its
    first call is the prompt)."""

    def __init__(self, on_prefill):
        self.on_prefill, self.calls = on_prefill, 0

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2:
            self.on_prefill()

    def end(self) -> None:
        pass


def generate(model, prompt: torch.Tensor, cache, n: int, compile_config=None, method: str | None = None,
             on_prefill=None, inductor: dict | None = None):  # fmt: skip
    """`n` greedy tokens after `prompt` through `cache`: the project's caches of `method` through nats-generate's
    loop (`nats.hf.loop`; ``inductor``: its compiled step's settings over `nats.hf.loop.STEP_INDUCTOR`'s), unless
    `method` is one of ``hf_*`` or None: ``model.generate`` (``compile_config``: how it compiles the step).
    ``on_prefill``: called once the prompt's forward and the first token are done (or queued), before the decode
    steps."""
    from nats.hf import StaticPolicyCache
    from nats.hf.compat import cache_kwargs
    from nats.hf.loop import generate as loop

    if type(cache).__name__ == "GptFastDecoder":  # its own decode loop
        return cache.generate(prompt, n, on_prefill=on_prefill)
    # a cache made without a number of new tokens (policy_nats: eager steps) goes through model.generate
    planned = isinstance(cache, StaticPolicyCache) and cache.max_new_tokens is not None
    if planned and method is not None and not method.startswith("hf_"):
        return loop(model, prompt, cache, n, on_prefill=on_prefill, inductor=inductor)
    extra = {} if compile_config is None else {"compile_config": compile_config}
    if on_prefill is not None:
        extra["streamer"] = _FirstToken(on_prefill)
    with torch.no_grad():
        return model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            **extra,
            **cache_kwargs(model, cache),
        )


def new_tokens(method: str, args) -> int:
    return args.new if method not in ("dynamic", "policy_nats") else min(args.new, args.slow_new)


def set_inductor(settings: list[str]) -> dict:
    """``KEY=VALUE`` words (`nats.utils.inductor_settings`) set on ``torch._inductor.config`` (every compiled step:
    ``model.generate``'s, the gpt-fast decoder's) and returned, for nats-generate's loop to take as its step's own
    settings (`generate`'s ``inductor``: they override `nats.hf.loop.STEP_INDUCTOR`'s, which override the global
    ones). ValueError, naming the word, for a malformed word or a key inductor does not have."""
    import torch._inductor.config as inductor_config

    from nats.utils import inductor_settings

    done = inductor_settings(settings)
    for key, value in done.items():
        setattr(inductor_config, key, value)
    return done


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed_request(model, prompt: torch.Tensor, make_cache, n_new: int, method: str, device, inductor=None):
    """One request timed as every row times it: one generation, the device synchronised once the prompt's forward
    and the first token are done (the prefill's time, the first token's latency) and at the end (the decode steps'
    time). Returns (prefill seconds, decode seconds, the output, the cache). ``inductor``: `generate`'s.

    (The decode time was once the difference between this generation and one of a single token: at 8B, batch 8 x
    32k, a prefill of ~10 s against ~1.5 s of decoding, a 1% difference between the two prefills moved the decode
    time by 7%, and the stream of changing requests (`mixed_workload`) once read 1.41x its own second pass.)"""
    marks = []

    def prefilled():
        sync(device)
        marks.append(time.perf_counter())

    cache = make_cache()
    sync(device)
    t0 = time.perf_counter()
    out = generate(model, prompt, cache, n_new, method=method, on_prefill=prefilled, inductor=inductor)
    sync(device)
    t2 = time.perf_counter()
    t1 = marks[0] if marks else t2  # (a generation of one token has no decode step)
    return t1 - t0, max(1e-9, t2 - t1), out, cache


def run(model, method: str, prompt: torch.Tensor, args, device, kept: float | None, static_prefill=None) -> dict:
    """One row; ``static_prefill``: a function timing one StaticCache prefill of the same prompt, called before each
    of this row's timed prefills (the row's prefill ratio then compares timings taken side by side)."""
    from nats.hf import CacheBuffers, StaticPolicyCache
    from nats.hf.loop import compiled_graphs, cudagraph_recordings

    B, P = prompt.shape
    n_new = new_tokens(method, args)
    # the project's fixed-capacity caches decode every request of the row from the same buffers (nats.hf.buffers),
    # as the gpt-fast-style decoder reuses its own: a graph recorded once, replayed by every request
    serving = {} if method in (*FAST, "static", "dynamic", "policy_nats") else {"buffers": CacheBuffers()}
    make_cache = cache_maker(model, method, P, n_new, kept, B, **serving)
    skips0 = cudagraph_skips()
    projections(model, method, args)
    row = f"bench_hf_decode: {method}, prompt {P}, batch {B}"
    with attention_of(model, method):
        # warm-up: compiled, autotuned, CUDA graphs recorded
        t0 = time.perf_counter()
        print(f"{row}: warm-up (compiles the decode step, tunes the kernels)", flush=True)
        generate(model, prompt, make_cache(), min(n_new, 4), method=method, inductor=args.inductor)
        generate(model, prompt, make_cache(), min(n_new, 4), method=method, inductor=args.inductor)
        sync(device)
        print(f"{row}: warm-up done in {time.perf_counter() - t0:.1f} s", flush=True)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        g0, r0 = compiled_graphs(), cudagraph_recordings()
        prefills, decodes, beside = [], [], []
        for _ in range(max(1, getattr(args, "repeats", 1))):  # the median of repeated timings
            if static_prefill is not None:
                beside.append(static_prefill())
            out = cache = None  # the last request's cache freed: this one takes the buffers
            prefill_s, decode_s, out, cache = timed_request(
                model, prompt, make_cache, n_new, method, device, args.inductor
            )
            prefills.append(prefill_s)
            decodes.append(decode_s)
            print(f"{row}: request {len(decodes)}: prefill {prefill_s:.3f} s, decode {decode_s:.3f} s", flush=True)
        new_graphs, recorded = compiled_graphs() - g0, cudagraph_recordings() - r0
    prefill_s = statistics.median(prefills)
    decode_s = statistics.median(decodes)
    seen = P + n_new - 1
    share = 1.0
    extra = {"static_prefill_s": statistics.median(beside)} if beside else {}
    if hasattr(cache, "kept"):  # [n_layer, B, Hkv] tokens held: how even the rows each layer's attention reads are
        held = cache.kept().double().flatten(1)
        if isinstance(cache, StaticPolicyCache):
            share = float(held.mean()) / seen
        uneven = float((held.amax(1) / held.mean(1).clamp_min(1)).mean())  # a layer's longest row over its mean
        extra["row_kept"] = {"min": float(held.min()), "mean": float(held.mean()), "max": float(held.max()),
                             "layer_max_over_mean": uneven}  # fmt: skip
    tokens_per_s = B * (n_new - 1) / decode_s
    return {
        **extra,
        "method": method,
        "prompt": P,
        "batch": B,
        "kept_target": kept,
        "new_tokens": n_new,
        "prefill_s": prefill_s,
        "tokens_per_s": tokens_per_s,
        **limit_columns(model, cache, B, seen, tokens_per_s, args),
        "kv_mib": kv_bytes(cache) / 2**20,
        "kept_share": share,
        "new_graphs": new_graphs,
        "cudagraphs_recorded": recorded,
        "cudagraph_skips": cudagraph_skips() - skips0,
        "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
        "generated": out.shape[1] - P,
    }


def step_bytes(model, cache, B: int, seen: int) -> tuple[float, float]:
    """The bytes a decode step of `cache` reads (the weights + the keys and values it holds at the end) and those of a
    full cache at the same batch (every row holding the `seen` tokens)."""
    from nats.cache import roofline

    cfg = model.config
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    elem = next(model.parameters()).element_size()
    rows, layers = B * cfg.num_key_value_heads, cfg.num_hidden_layers
    weights = roofline.weight_bytes(model, B)
    full = weights + roofline.kv_bytes(layers, rows, seen, D, elem)
    if hasattr(cache, "kept"):  # [n_layer, B, Hkv] tokens held: pool segments and valid ring
        held = float(cache.kept().double().sum())
        return weights + roofline.kv_bytes(1, 1, held, D, elem), full
    return full, full


def limit_columns(model, cache, B: int, seen: int, tokens_per_s: float, args) -> dict:
    """A row's bytes per step, achieved GB/s and their share of the bandwidth (`nats.cache.roofline.step_stats`),
    and the bytes' bound on its speed-up over a full cache (``limit_x_full``)."""
    from nats.cache import roofline

    nbytes, full = step_bytes(model, cache, B, seen)
    bw = getattr(args, "bandwidth", {}) or {}
    stats = roofline.step_stats(nbytes, tokens_per_s, B, bw.get("measured"), bw.get("datasheet"))
    return {**stats, "limit_x_full": roofline.limit_ratio(full, nbytes)}


def fit_batch(model, method: str, P: int, kept, budget: float, nbytes: float, args, gen, device):
    """The largest batch (and its random prompt) whose KV buffers fit `budget` bytes, starting from the estimate
    budget / `nbytes` (one sequence's bytes at the smallest batch): the buffers a cache allocates at prefill are
    read back (a prefill and one token) and the batch shrinks in proportion until they fit, since a NAtS pool
    holds what the prompt's types keep, which the estimate does not know exactly."""
    B = max(1, int(budget // nbytes))
    for _ in range(4):
        prompt = torch.randint(0, model.config.vocab_size, (B, P), generator=gen).to(device)
        if method in NATS:
            calibrate(model, prompt, kept)
        cache = cache_maker(model, method, P, new_tokens(method, args), kept, B)()
        with attention_of(model, method):
            generate(model, prompt, cache, 1, method=method, inductor=args.inductor)
        used = kv_bytes(cache)
        del cache
        if used <= budget or B == 1:
            return B, prompt
        B = max(1, min(B - 1, int(B * budget / used)))
    return B, torch.randint(0, model.config.vocab_size, (B, P), generator=gen).to(device)


def profile(model, method: str, prompt: torch.Tensor, args, device, kept) -> None:
    """The GPU kernels of one prefill and of 16 decode steps (after `run`'s warm-up), by total time, into
    ``profile_<method>_<kept>_b<B>_n<P>.txt``: what bounds each phase."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from nats.cache import roofline

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    B, P = prompt.shape
    n_new = new_tokens(method, args)
    make_cache = cache_maker(model, method, P, n_new, kept, B)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    key = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    text = []
    with attention_of(model, method):
        for label, n in (("prefill (+1 token)", 1), ("prefill + decode steps", min(17, n_new))):
            with torch_profile(activities=acts) as prof:
                generate(model, prompt, make_cache(), n, method=method, inductor=args.inductor)
                sync(device)
            text += [
                f"## {method} kept={kept} batch={B} prompt={P}: {label}",
                prof.key_averages().table(key, row_limit=40, max_name_column_width=100),
                "### the same by host time (cudaGraphLaunch: decode steps replayed as CUDA graphs)",
                prof.key_averages().table("self_cpu_time_total", row_limit=25, max_name_column_width=100),
            ]
            steps = roofline.profiled_steps(prof)
            if steps:  # the decode steps' timeline: a token's time, the GPU's busy share of it, kernels per step
                line, lines = roofline.steps_report(steps, f"{method} kept={kept} batch={B} prompt={P}")
                print(line, flush=True)
                text += lines
    (out / f"profile_{method}_{kept}_b{B}_n{P}.txt").write_text("\n".join(text))


def best_full(rows: list[dict]) -> None:
    """Each row's ``x_full``: its tokens/s over the fastest full-cache row (`FULL`) of the same prompt and batch, or,
    at equal KV memory, of the same prompt and memory (whatever batch that cache fits), and that row's method
    (``full_method``). At equal memory the bytes' bound (``limit_x_full``) is then of tokens per byte: (batch / step
    bytes) of the row over those of that full row."""

    def key(r):
        gib = r.get("equal_memory_gib")
        return (r["prompt"], r["batch"]) if gib is None else (r["prompt"], "equal", gib)

    best: dict = {}
    for r in rows:
        if r["method"] in FULL and r["tokens_per_s"] > best.get(key(r), {}).get("tokens_per_s", 0):
            best[key(r)] = r
    for r in rows:
        b = best.get(key(r))
        r["x_full"] = None if b is None else r["tokens_per_s"] / b["tokens_per_s"]
        r["full_method"] = None if b is None else b["method"]
        if b is not None and r.get("equal_memory_gib") is not None:
            r["limit_x_full"] = (r["batch"] / r["step_gb"]) / (b["batch"] / b["step_gb"])


def fmt(x, spec: str) -> str:
    return "" if x is None else format(x, spec)


def table(rows: list[dict]) -> list[str]:
    best_full(rows)
    lines = [
        "| prompt | batch | method | kept (target) | prefill s | tokens/s | x full | bound x full | step GB | GB/s | "
        "of measured BW | of data sheet | x StaticCache tok/s | x StaticCache prefill | KV MiB | kept / seen | "
        "new graphs | CUDA graphs recorded | graph skips | peak GiB |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        bound = fmt(r.get("limit_x_full"), ".2f") if r["kept_share"] < 1.0 else ""
        lines.append(
            f"| {r['prompt']} | {r['batch']} | {r['method']} | {fmt(r['kept_target'], '.2f')} | "
            f"{r['prefill_s']:.3f} | {r['tokens_per_s']:.1f} | {fmt(r.get('x_full'), '.2f')} | {bound} | "
            f"{r['step_gb']:.4g} | {r['achieved_gbps']:.4g} | {fmt(r.get('share_of_measured'), '.1%')} | "
            f"{fmt(r.get('share_of_datasheet'), '.1%')} | {fmt(r.get('x_static'), '.2f')} | "
            f"{fmt(r.get('x_static_prefill'), '.2f')} | {r['kv_mib']:.1f} | {r['kept_share']:.3f} | "
            f"{r['new_graphs']} | {r.get('cudagraphs_recorded', '')} | {r.get('cudagraph_skips', '')} | "
            f"{fmt(r['peak_gpu_gib'], '.1f')} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    configure_triton()  # Triton's settings before any kernel: the interpreter without a GPU, the cache folder
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="logs/bench/hf_decode")
    ap.add_argument("--model", default=None, help="a model folder or GGUF file (default: random weights)")
    ap.add_argument("--model-shape", choices=sorted(SHAPES), default="smollm2-135m", help="the random model's shape")
    ap.add_argument("--scorers", default=None, help="fine-tuned scorers (nats_state_dict file); else calibrated")
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--prompt", type=int, nargs="+", default=[8192])
    ap.add_argument("--new", "--new-tokens", dest="new", type=int, default=256)
    ap.add_argument("--slow-new", type=int, default=32, help="new tokens for the uncompiled methods")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--kept", type=float, nargs="+", default=[0.25, 0.1], help="NAtS kept shares (calibrated)")
    ap.add_argument("--methods", nargs="+", default=["static", "full", "nats", "streaming_llm"])
    ap.add_argument(
        "--equal-memory-gib",
        type=float,
        nargs="+",
        default=None,
        metavar="GIB",
        help="also run each cache at the largest batch whose KV buffers fit GIB (one setting per value)",
    )
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=3, help="timed generate calls per row; the median is reported")
    ap.add_argument("--profile", action="store_true", help="kernel tables of a prefill and 16 decode steps")
    ap.add_argument(
        "--unfused",
        action="store_true",
        help="every row with the model's own q/k/v and gate/up products (default: fused, nats.hf.fused, for every row "
        "but transformers' caches static and dynamic)",
    )
    ap.add_argument(
        "--mixed",
        type=int,
        default=0,
        help="also serve this many requests of changing batch and prompt "
        "through each project method (a changing workload; --mixed-batch, --mixed-prompt)",
    )
    ap.add_argument("--mixed-only", action="store_true", help="with --mixed: no single-shape rows before it")
    ap.add_argument("--mixed-batch", type=int, nargs=2, default=[1, 16], metavar=("MIN", "MAX"))
    ap.add_argument("--mixed-prompt", type=int, nargs=2, default=[1024, 32768], metavar=("MIN", "MAX"))
    ap.add_argument(
        "--inductor",
        nargs="+",
        action="extend",
        default=[],
        metavar="KEY=VALUE",
        help="torch._inductor.config settings for every compiled step, e.g. coordinate_descent_tuning=True "
        "(or --inductor=KEY=VALUE, one word per setting)",
    )
    ap.add_argument("--smoke", action="store_true", help="tiny model, short prompt, CPU: tests the script")
    args = ap.parse_args(argv)
    try:
        args.inductor = set_inductor(args.inductor)
    except ValueError as e:
        print(f"bench_hf_decode: {e}")
        return 2
    if args.smoke:
        args.prompt, args.new, args.window, args.batch = [96], 8, 8, [1, 2]
        args.mixed_batch, args.mixed_prompt = [1, 3], [24, 120]
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = getattr(torch, "float32" if device.type == "cpu" else args.dtype)
    torch._dynamo.config.cache_size_limit = 64
    args.bandwidth = bandwidth(device)
    args.failed = []  # the rows not measured, and why
    from nats.hf import attach_nats, load_nats_state_dict

    model = build_model(args, device, dtype)
    attach_nats(model, window=args.window)
    model.eval()
    if args.scorers:
        load_nats_state_dict(model, torch.load(args.scorers, map_location=device, weights_only=True))
        args.kept = [None]
    rows: list[dict] = []

    def record(r, static):
        """Keep and print a row, with its ratios to the StaticCache row of the same setting (`static`, None: none)."""
        if static is not None:
            r["x_static"] = r["tokens_per_s"] / static["tokens_per_s"]
            r["x_static_prefill"] = r["prefill_s"] / r.get("static_prefill_s", static["prefill_s"])
        rows.append(r)
        print(json.dumps(r), flush=True)
        write(rows, args, argv, device, dtype)

    def out_of_memory(what: str) -> None:
        """A row too large for the GPU: said under the table, the others go on."""
        args.failed.append(f"{what}: out of GPU memory")
        print(f"{what}: out of GPU memory, no row", flush=True)
        gc.collect()
        torch.cuda.empty_cache()
        write(rows, args, argv, device, dtype)

    gen = torch.Generator().manual_seed(0)
    for P in [] if args.mixed and args.mixed_only else args.prompt:
        base = torch.randint(0, model.config.vocab_size, (max(args.batch), P), generator=gen).to(device)
        for B in args.batch:
            prompt = base[:B]
            static = None
            for method in args.methods:
                shares = args.kept if method in (*NATS, "streaming_llm") else [None]
                for kept in shares:
                    if method in NATS and kept is not None:
                        calibrate(model, prompt, kept)
                    timer = None if static is None else static_prefill_timer(model, prompt, args, device)
                    try:
                        r = run(model, method, prompt, args, device, kept, timer)
                    except torch.OutOfMemoryError:  # a row too large for the GPU: said under the table, others go on
                        out_of_memory(f"prompt {P}, batch {B}, {method}{'' if kept is None else f' {kept}'}")
                        continue
                    except Exception:  # a gpt-fast-style baseline that fails to compile here: the other rows go on
                        if method not in FAST:
                            raise
                        import traceback

                        traceback.print_exc()
                        print(f"{method} failed at prompt {P}, batch {B}: no row", flush=True)
                        continue
                    static = r if method == "static" else static
                    record(r, static)
                    if args.profile:
                        profile(model, method, prompt, args, device, kept)
        per_seq = {}
        for r in rows:
            if r["prompt"] == P and r["batch"] == min(args.batch) and "equal_memory_gib" not in r:
                per_seq[(r["method"], r["kept_target"])] = r["kv_mib"] * 2**20 / r["batch"]
        for gib in args.equal_memory_gib or ():
            static = None
            for (method, kept), nbytes in per_seq.items():
                if method not in ("static", "full", "flex_static", "nats"):
                    continue
                try:
                    B, prompt = fit_batch(model, method, P, kept, gib * 2**30, nbytes, args, gen, device)
                    r = run(model, method, prompt, args, device, kept)
                except torch.OutOfMemoryError:
                    out_of_memory(f"prompt {P}, {method}{'' if kept is None else f' {kept}'} at {gib:g} GiB of KV")
                    continue
                r["equal_memory_gib"] = gib
                static = r if method == "static" else static
                record(r, static)
    if args.mixed:
        for method in args.methods:
            if method in (*NATS, "full", "hf_full", "streaming_llm") and method != "policy_nats":
                r = mixed_workload(model, method, args, device, gen)
                r["mixed"] = True
                rows.append(r)
                print(json.dumps(r), flush=True)
                write(rows, args, argv, device, dtype)
    write(rows, args, argv, device, dtype, final=True)
    return 0


def mixed_workload(model, method: str, args, device, gen) -> dict:
    """``--mixed N`` requests of random batch (``--mixed-batch``) and prompt length (``--mixed-prompt``) served by
    one process through `method`'s cache, as a serving engine runs them: fixed buffers (`nats.hf.CacheBuffers`, every
    request decoding from the same addresses) and pools of one size per batch (``row_slots``: the longest prompt and
    the new tokens for the full cache; for NAtS 1.2 x its kept share of the longest prompt, the new tokens and 64),
    after a warm-up that records the decode step's CUDA graph of every batch size (largest first, short prompts).
    NAtS' scorers are calibrated to the kept share once, on the first request (each request then keeps what the
    scorers choose, as a trained model's would).
    Each request is decoded twice, first in the changing stream, then again (the speed of the same requests with
    everything in place). Dynamo's recompile limit is made an error: a fall-back to eager decoding fails the row
    instead of slowing it. Returns the row: tokens/s of both passes, their ratio, the graphs compiled and the CUDA
    graphs recorded in the stream."""
    from nats.hf import CacheBuffers
    from nats.hf.loop import compiled_graphs, cudagraph_recordings

    kept = args.kept[0] if method in (*NATS, "streaming_llm") else None
    rng = torch.Generator().manual_seed(1)
    lo_b, hi_b = args.mixed_batch
    lo_p, hi_p = args.mixed_prompt
    draw = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=rng))  # noqa: E731
    shapes = [(draw(lo_b, hi_b), draw(lo_p, hi_p)) for _ in range(args.mixed)]
    prompts = [torch.randint(0, model.config.vocab_size, s, generator=gen).to(device) for s in shapes]
    n_new = new_tokens(method, args)
    slots = hi_p + n_new if kept is None or method not in NATS else int(1.2 * kept * hi_p) + n_new + 64
    serving = {"row_slots": slots, "buffers": CacheBuffers()}

    if method in NATS and kept is not None:  # once, on the first request: the scorers then stay as a model's would
        calibrate(model, prompts[0], kept)

    def serve(prompt) -> tuple[int, float]:
        """(tokens decoded after the first, seconds they took) of one request."""
        make = cache_maker(model, method, hi_p, n_new, kept, prompt.shape[0], **serving)
        _, decode_s, _, _ = timed_request(model, prompt, make, n_new, method, device, args.inductor)
        return prompt.shape[0] * (n_new - 1), decode_s

    projections(model, method, args)
    with attention_of(model, method), torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        for b in range(hi_b, lo_b - 1, -1):  # warm-up: the step's graph of every batch size
            serve(torch.randint(0, model.config.vocab_size, (b, lo_p), generator=gen).to(device))
        g0, r0 = compiled_graphs(), cudagraph_recordings()
        first = [serve(p) for p in prompts]
        new_graphs, recorded = compiled_graphs() - g0, cudagraph_recordings() - r0
        again = [serve(p) for p in prompts]
    rate = lambda done: sum(n for n, _ in done) / sum(t for _, t in done)  # noqa: E731
    return {
        "method": method,
        "kept_target": kept,
        "requests": args.mixed,
        "batches": f"{min(b for b, _ in shapes)}-{max(b for b, _ in shapes)}",
        "prompts": f"{min(p for _, p in shapes)}-{max(p for _, p in shapes)}",
        "row_slots": slots,
        "buffers_gib": serving["buffers"].nbytes() / 2**30,
        "tokens_per_s": rate(first),
        "tokens_per_s_warm": rate(again),
        "ratio": rate(first) / rate(again),
        "new_graphs": new_graphs,
        "cudagraphs_recorded": recorded,
    }


def mixed_table(rows: list[dict]) -> list[str]:
    lines = [
        "| method | kept (target) | requests | batch | prompt | slots per row | buffers GiB | tokens/s, changing "
        "stream | tokens/s, same requests again | ratio | new graphs in the stream | CUDA graphs recorded in the "
        "stream |",
        "|---|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['method']} | {fmt(r['kept_target'], '.2f')} | {r['requests']} | {r['batches']} | {r['prompts']} | "
            f"{r['row_slots']} | {r['buffers_gib']:.2f} | {r['tokens_per_s']:.1f} | {r['tokens_per_s_warm']:.1f} | "
            f"{r['ratio']:.2f} | {r['new_graphs']} | {r['cudagraphs_recorded']} |"
        )
    return lines


def bandwidth(device) -> dict:
    """The GPU's name, its copy bandwidth measured now (bytes/s; 1 GiB on a GPU, 64 MiB on the CPU) and its data
    sheet's (None if unknown)."""
    from nats.cache import roofline

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    measured = roofline.measured_bandwidth(device, 1 << (30 if device.type == "cuda" else 26))
    return {"device": name, "measured": measured, "datasheet": roofline.datasheet_bandwidth(name)}


def static_prefill_timer(model, prompt: torch.Tensor, args, device):
    """A function that times one prefill through transformers' ``StaticCache`` (seconds): the rows after the static
    one time it before each of their own prefills, so that their prefill ratio is of timings taken side by side (a
    host's speed drifts over a run, and at batch 1 the prefill is bound by the host)."""
    make = cache_maker(model, "static", prompt.shape[1], new_tokens("static", args), None)

    def once() -> float:
        with attention_of(model, "static"):
            sync(device)
            t0 = time.perf_counter()
            generate(model, prompt, make(), 1)
            sync(device)
            return time.perf_counter() - t0

    return once


def write(rows: list[dict], args, argv, device, dtype, final: bool = False) -> None:
    """The table (markdown) and the rows (JSON) into ``args.out``: after every row, so that a run stopped part way
    (a time limit) keeps what it measured; the final call also prints the table."""
    import transformers

    name = torch.cuda.get_device_name(0) if device.type == "cuda" else f"CPU ({platform.processor() or 'x86_64'})"
    shape = "a tiny model's" if args.smoke else f"{args.model_shape}'s shape (random weights"
    if args.model:
        shape = f"{args.model} (its weights"
    elif not args.smoke:
        shape += ", fine-tuned scorers)" if args.scorers else ", scorers calibrated to the kept share)"
    fusion = (
        "Every row with the model's own q/k/v and gate/up products"
        if getattr(args, "unfused", False)
        else "q/k/v and gate/up projections as one product each (nats.hf.fused) in every row but static and dynamic"
    )
    bw = args.bandwidth
    sheet = "unknown" if bw["datasheet"] is None else f"{bw['datasheet'] / 1e9:.0f} GB/s"
    head = (
        f"# Decoding speed: NAtS' fixed-capacity cache against the full caches (the project's, gpt-fast-style, "
        f"transformers')\n\n"
        f"{name}, torch {torch.__version__}, transformers {transformers.__version__}, {dtype}; {shape}, "
        f"W = {args.window}, {args.new} new tokens (greedy); tokens/s over all sequences of the batch; graph skips: "
        f"compiled graphs inductor did not CUDA-graph (the log says why).\n"
        f"Bandwidth: {bw['measured'] / 1e9:.0f} GB/s measured (a device-to-device copy, read + write), data sheet "
        f"{sheet}. step GB: the weights (of the embedding one row per sequence) + the keys and values the cache holds; "
        f"GB/s: step GB / step time; x full: tokens/s over the fastest full-cache row of the prompt and batch "
        f"(sdpa_static, flex_static, full, hf_full, static, dynamic); bound x full: the largest x full those bytes "
        f"allow "
        f"(full bytes / the row's bytes, at the same share of the bandwidth); x StaticCache: over transformers' "
        f"StaticCache, which repeats each KV head for its query group and passes a mask to SDPA. "
        f"{fusion}.\n"
        f"Command: `python benchmarks/bench_hf_decode.py {' '.join(sys.argv[1:] if argv is None else argv)}`\n"
    )
    mixed_rows = [r for r in rows if r.get("mixed")]
    main_rows = [r for r in rows if "equal_memory_gib" not in r and not r.get("mixed")]
    eq_rows = [r for r in rows if "equal_memory_gib" in r]
    text = head + "\n" + "\n".join(table(main_rows)) + "\n"
    if getattr(args, "failed", None):
        text += "\nNot measured: " + "; ".join(args.failed) + ".\n"
    for gib in sorted({r["equal_memory_gib"] for r in eq_rows}):
        text += (
            f"\n## Equal KV memory ({gib:g} GiB): the largest batch each cache fits (x full: over the fastest "
            f"full cache at this memory, whatever its batch; bound x full: its tokens per byte over that row's)\n\n"
        )
        text += "\n".join(table([r for r in eq_rows if r["equal_memory_gib"] == gib])) + "\n"
    if mixed_rows:
        text += (f"\n## A changing workload: {args.mixed} requests of batch {args.mixed_batch[0]}-"
                 f"{args.mixed_batch[1]} and prompts of {args.mixed_prompt[0]}-{args.mixed_prompt[1]} tokens in one "
                 f"process (fixed buffers, one pool size per batch), then the same requests again\n\n")  # fmt: skip
        text += "\n".join(mixed_table(mixed_rows)) + "\n"
    if not final:
        text += "\n(incomplete: the run is still going, or was stopped)\n"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_hf_decode.md").write_text(text)
    (out / "bench_hf_decode.json").write_text(
        json.dumps({"args": vars(args), "device": name, "complete": final, "rows": rows}, indent=1)
    )
    if final:
        print(text)


if __name__ == "__main__":
    raise SystemExit(main())
