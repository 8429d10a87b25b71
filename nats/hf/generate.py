"""``nats-generate hf_model=...``: a transformers model continues a prompt with a KV-cache policy, by default in the
fixed-capacity cache (`nats.hf.StaticPolicyCache`) decoded by `nats.hf.loop.generate` (the step compiled with CUDA
graphs on a GPU, no host synchronisation per token; ``model.generate``'s greedy tokens through the same cache), with
each layer's q/k/v and gate/up projections fused (`nats.hf.fused`).

    nats-generate hf_model=smollm2_135m prompt="The capital of France is" max_new_tokens=32
    nats-generate hf_model=smollm2_135m scorers=<run>/scorers.pt policy=nats prompt_file=book.txt
    nats-generate hf_model=smollm2_135m policy=streaming_llm budget=0.25 temperature=0.7 top_k=50 num_samples=4

Every decodable policy has a fixed-capacity rule (`nats.cache.engine`); `nats.hf.PolicyCache` (through
``model.generate``) is the fallback for one that would not.
The report has the same keys as the GPT kind's (`nats.generate`).
"""

from __future__ import annotations

import time
from typing import Any

import torch
from omegaconf import DictConfig

from nats.cache.budget import resolve_budget
from nats.cache.engine import fixed_policies


def generate_hf(cfg: DictConfig, prompt_text: str, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    from nats.hf import PolicyCache, StaticPolicyCache
    from nats.hf.compat import generate_through
    from nats.hf.fused import fuse_projections
    from nats.hf.loop import generate as loop
    from nats.hf.pretrained import load_pretrained, prepare_model, pretrained_kwargs

    policy = str(cfg.policy)
    if policy == "nats" and not cfg.get("scorers"):
        raise ValueError("policy=nats needs the fine-tuned scorers: scorers=<run>/scorers.pt (or another policy)")
    kwargs = pretrained_kwargs(cfg.hf_model)
    kwargs["dtype"] = str(dtype).split(".")[-1]
    model, tok = load_pretrained(**kwargs, device=device)
    window = prepare_model(cfg, model)
    new, samples = int(cfg.max_new_tokens), int(cfg.get("num_samples", 1))
    ids = tok(prompt_text or (tok.bos_token or ""), return_tensors="pt").input_ids.to(device)
    ids = ids.expand(samples, -1).contiguous()
    P = ids.shape[1]
    budget = cfg.get("budget")  # tokens, or a fraction of prompt + new tokens (as for the GPT kind)
    n_budget = resolve_budget(budget, P + new, of=f"the {P + new} prompt + new tokens")
    options = dict(cfg.get("cache_options") or {})
    fast = policy in fixed_policies()
    if fast:
        cache = StaticPolicyCache(model, policy, max_new_tokens=max(new, 1), budget=n_budget, **options)
    else:
        cache = PolicyCache(model, policy, max_len=P + new, budget=n_budget, **options)
    temperature = float(cfg.get("temperature", 0.0))
    sample = {"do_sample": True, "temperature": temperature, "top_k": cfg.get("top_k")} if temperature > 0 else {}
    torch.manual_seed(int(cfg.get("seed", 0)))
    t0 = time.perf_counter()
    if fast:  # the loop without a host synchronisation per token (nats.hf.loop), one q/k/v and one gate/up product
        try:
            fuse_projections(model)
        except ValueError as e:  # e.g. quantized projections: decoded with the model's own products
            print(f"nats-generate: {e}", flush=True)
        gen = torch.Generator(device).manual_seed(int(cfg.get("seed", 0))) if temperature > 0 else None
        out = loop(model, ids, cache, new, temperature=temperature, top_k=cfg.get("top_k"), generator=gen)
    else:
        out = generate_through(model, ids, cache, new, exact_length=True, **sample)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    new_tokens = out[:, P:]
    kept = cache.kept().double()
    processed = P + new - 1
    layers, kv_heads = kept.shape[0], kept.shape[-1]
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    per_token = 2 * head_dim * torch.empty((), dtype=dtype).element_size()
    if fast:
        allocated = cache.kv_nbytes()
        frac = cache.fractions() if cache.track else None
    else:
        allocated = cache.nbytes()
        frac = cache.fractions()
    stats = {
        "sequences": samples,
        "kept": float(kept.mean()),
        "processed": processed,
        "kept_max": int(kept.max()),
        "kv_fraction": float(kept.mean()) / processed,
        "area": float(frac["area"].mean()) if frac is not None else float("nan"),
        "peak": float(frac["peak"].mean()) if frac is not None else float("nan"),
        "layers": layers,
        "kv_heads": kv_heads,
        "kept_bytes": int(kept.sum()) * per_token,
        "full_bytes": samples * layers * kv_heads * processed * per_token,
        "allocated_bytes": int(allocated),
    }
    return {
        "model": str(cfg.hf_model.name_or_path),
        "policy": policy,
        "cache": type(cache).__name__,
        "window": window,
        "budget": budget,
        "prompt": prompt_text,
        "prompt_tokens": P,
        "new_tokens": new,
        "texts": [prompt_text + tok.decode(row, skip_special_tokens=True) for row in new_tokens.tolist()],
        "tokens": new_tokens.tolist(),
        "seconds": seconds,
        "tokens_per_s": round(samples * new / max(seconds, 1e-9), 1),
        "device": str(device),
        "precision": str(dtype).split(".")[-1],
        "stats": stats,
    }
