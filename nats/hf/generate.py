"""``nats-generate hf_model=...``: a transformers model continues a prompt with a KV-cache policy, by default in the
fixed-capacity cache (`nats.hf.StaticPolicyCache`) decoded by `nats.hf.loop.generate` (the step compiled with CUDA
graphs on a GPU, no host synchronisation per token; ``model.generate``'s greedy tokens through the same cache), with
each layer's q/k/v and gate/up projections fused (`nats.hf.fused`).

    nats-generate hf_model=smollm2_135m prompt="The capital of France is" max_new_tokens=32
    nats-generate hf_model=smollm2_135m scorers=<run>/scorers.pt policy=nats prompt_file=book.txt
    nats-generate hf_model=smollm2_135m policy=streaming_llm budget=0.25 temperature=0.7 top_k=50 num_samples=4

Every decodable policy is a rule of the one cache engine (`nats.cache.engine`), so every one runs here.
The report has the keys of the GPT kind's (`nats.generate`, whose `summary` reads them; ``tokens`` are the new
tokens' ids here, in the model tokenizer's vocabulary) and the cache's class and NAtS window besides.
The settings are checked before the model loads (`check_inputs`: the policy, its budget, the scorer file), so that a
mistake stops at once rather than after the load.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from nats.cache.budget import check_budget_value, resolve_budget
from nats.cache.registry import get_cache_class
from nats.sampling import sampling_options


def check_inputs(cfg: DictConfig) -> None:
    """The settings that fail without the model, checked before its (slow) load: the policy decodes, its budget
    (a budgeted policy needs one, the others take none; a whole number >= 1 or a fraction in (0, 1)), NAtS' scorer
    file (it exists, holds scorer weights, its window W is known) and ``type_bias`` (only with scorers)."""
    from nats.hf.pretrained import check_dms, read_scorers, run_window, type_bias_of

    policy = str(cfg.policy)
    budget = cfg.get("budget")
    check_budget_value(budget, "the prompt + new tokens")
    get_cache_class(policy).check_use(budget)  # an unknown name fails here, with the registered ones
    if policy == "dms" and not cfg.get("dms"):
        raise ValueError("policy=dms needs DMS' retrofit: dms=<run>/dms_q_proj.pt (or another policy)")
    check_dms(cfg)
    scorers = cfg.get("scorers")
    if policy == "nats" and not scorers:
        raise ValueError("policy=nats needs the fine-tuned scorers: scorers=<run>/scorers.pt (or another policy)")
    if not scorers:
        if type_bias_of(cfg):
            raise ValueError("type_bias offsets NAtS scorers' logits: pass scorers=<run>/scorers.pt or drop type_bias")
        return
    path = Path(str(scorers))
    _, window = read_scorers(path)  # it exists and holds scorer weights (prepare_model reads it again)
    if not (cfg.get("window") or window or run_window(path)):
        raise ValueError(
            f"the NAtS window W of scorers={path} is not known (no nats_stats.json or .hydra/config.yaml beside "
            "it): pass window=W (module.window of its fine-tuning run)"
        )
    type_bias_of(cfg)  # its form


def load_for_generation(cfg: DictConfig, device: torch.device, dtype: torch.dtype):
    """Check the settings (`check_inputs`), load the model and its tokenizer, attach NAtS' scorers where given
    (`nats.hf.pretrained.prepare_model`) and fuse the q/k/v and gate/up projections (`nats.hf.fused`; a model whose
    projections cannot be fused keeps its own). Returns (model, tokenizer, NAtS window or None)."""
    from nats.hf.fused import fuse_projections
    from nats.hf.pretrained import load_pretrained, prepare_model, pretrained_kwargs

    check_inputs(cfg)  # before the load: a mistake in the settings stops at once
    kwargs = pretrained_kwargs(cfg.hf_model)
    kwargs["dtype"] = str(dtype).split(".")[-1]
    model, tok = load_pretrained(**kwargs, device=device)
    window = prepare_model(cfg, model)
    try:
        fuse_projections(model)
    except ValueError as e:  # e.g. quantized projections: decoded with the model's own products
        print(f"nats-generate: {e}", flush=True)
    return model, tok, window


def make_cache(cfg: DictConfig, model, total: int, new: int):
    """The policy's `nats.hf.StaticPolicyCache` planned for ``new`` tokens a call; a ``budget`` fraction is of
    ``total`` tokens (prompt + new)."""
    from nats.hf import StaticPolicyCache

    budget = resolve_budget(cfg.get("budget"), total, of=f"the {total} prompt + new tokens")
    options = dict(cfg.get("cache_options") or {})
    return StaticPolicyCache(model, str(cfg.policy), max_new_tokens=max(new, 1), budget=budget, **options), budget


def cache_stats(cache, model, dtype: torch.dtype, sequences: int, processed: int) -> dict[str, Any]:
    """What the cache keeps after ``processed`` tokens a row: the report's ``stats``
    (`nats.generation_report.summary`)."""
    kept = cache.kept().double()
    layers, kv_heads = kept.shape[0], kept.shape[-1]
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    per_token = 2 * head_dim * torch.empty((), dtype=dtype).element_size()
    frac = cache.fractions() if cache.track else None
    return {
        "sequences": sequences,
        "kept": float(kept.mean()),
        "processed": processed,
        "kept_max": int(kept.max()),
        "kv_fraction": float(kept.mean()) / processed,
        "area": _number(frac["area"].mean()) if frac is not None else None,  # None: not tracked (or no step)
        "peak": _number(frac["peak"].mean()) if frac is not None else None,
        "layers": layers,
        "kv_heads": kv_heads,
        "kept_bytes": int(kept.sum()) * per_token,
        "full_bytes": sequences * layers * kv_heads * processed * per_token,
        "allocated_bytes": int(cache.kv_nbytes()),
    }


def generate_hf_report(cfg: DictConfig, prompt_text: str, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """Check the settings, load the model (`load_for_generation`), decode ``prompt_text``: the report (nothing
    written). With ``stream`` (one sample) the new text is printed as it arrives (transformers' ``TextStreamer``,
    handed the tokens every ``stream_every`` tokens by the loop)."""
    from nats.hf.limits import check_context, context_length
    from nats.hf.loop import generate as loop

    policy = str(cfg.policy)
    model, tok, window = load_for_generation(cfg, device, dtype)
    new, samples = int(cfg.max_new_tokens), int(cfg.get("num_samples", 1))
    ids = tok(prompt_text or (tok.bos_token or ""), return_tensors="pt").input_ids.to(device)
    ids = ids.expand(samples, -1).contiguous()
    P = ids.shape[1]
    check_context(context_length(model.config), P, new, "nats-generate")  # before any cache is made
    cache, n_budget = make_cache(cfg, model, P + new, new)
    sampling = sampling_options(cfg, device)
    seed = int(cfg.get("seed", 0))
    torch.manual_seed(seed)
    streamer = None
    if cfg.get("stream") and samples == 1:
        from transformers import TextStreamer

        print("---", flush=True)  # then the prompt and the continuation as it arrives, as the unstreamed text is shown
        streamer = TextStreamer(tok, skip_special_tokens=True)
    t0 = time.perf_counter()
    out = loop(model, ids, cache, new, **sampling, streamer=streamer,
               check_every=int(cfg.get("stream_every", 8)) if streamer else 32)  # fmt: skip
    decode = "cuda_graph" if device.type == "cuda" else "eager"  # the loop's compiled step replays CUDA graphs
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    new_tokens = out[:, P:]
    continuations = [tok.decode(row, skip_special_tokens=True) for row in new_tokens.tolist()]
    return {
        "model": str(cfg.hf_model.name_or_path),
        "policy": policy,
        "cache": type(cache).__name__,
        "window": window,
        "budget": n_budget,  # in tokens, as the GPT kind's (a fraction resolved against prompt + new tokens)
        "prompt": prompt_text,
        "prompt_tokens": P,
        "new_tokens": new,
        "temperature": sampling["temperature"],
        "top_k": sampling["top_k"],
        "top_p": sampling["top_p"],
        "seed": seed,
        "device": str(device),
        "precision": str(dtype).split(".")[-1],
        "decode": decode,
        "streamed": streamer is not None,
        "texts": [prompt_text + c for c in continuations],
        "continuations": continuations,
        "tokens": new_tokens.tolist(),
        "stats": cache_stats(cache, model, dtype, samples, P + new - 1),
        "seconds": round(seconds, 3),
        "tokens_per_s": round(samples * new / seconds, 1) if seconds > 0 else None,
    }


def _number(value: torch.Tensor) -> float | None:
    """A float for generation.json (strict JSON has no NaN: None)."""
    x = float(value)
    return None if math.isnan(x) else x
