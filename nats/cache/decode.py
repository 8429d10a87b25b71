"""Decoding a `nats.models.gpt.GPT` through per-layer KV caches: parallel prefill, token steps, `generate`.

The functions call the model's own submodules (``embed``, ``blocks[i].ln_1``, ``attn.project`` with the
token's original position, ``attn.gate_and_project``, ``ln_2``, ``mlp``, ``ln_f``, ``lm_head``) and replace only
the attention core by the cache policy, so a policy that keeps everything (``full``) or the NAtS cache with the
model's own types reproduces the model's parallel forward.

    caches = make_caches(model, "nats", batch=B, max_len=N)
    logits = prefill(model, caches, idx[:, :P])              # [B, P, V], the caches hold the state after P
    step_logits = decode_step(model, caches, idx[:, P], P)   # [B, V]
    out = generate(model, idx, 50, policy="h2o", budget=256) # [B, T + 50]

Supported models: causal language models whose attention core declares a ``decode_policy`` (``dense``,
``nats``: see `nats.attention.registry.AttentionCore`; any output gate, RoPE or learned positions, GQA).
Positions are the original ones, so a sequence cannot outgrow the model's block_size.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from nats.attention.registry import ATTENTIONS, decodable_attention
from nats.cache.base import LayerCache
from nats.cache.registry import available_caches, get_cache_class

__all__ = [
    "check_model",
    "make_caches",
    "prefill",
    "decode_step",
    "policy_logits",
    "generate",
    "generate_with_caches",
    "eval_mode",
]


def check_model(model) -> None:
    """Raise a clear error unless `model` is a GPT that the caches can decode."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "blocks"):
        raise TypeError(f"expected a nats.models.gpt.GPT, got {type(model).__name__}")
    name = config.attention.get("name")
    if not ATTENTIONS.get(name).decodable():
        supported = decodable_attention()
        raise ValueError(
            f"KV-cache decoding supports GPT models with attention {supported}; this model uses "
            f"attention {name!r}, whose attention the cache policies cannot reproduce (train with "
            f"{' or '.join(f'model/attention={n}' for n in supported)})"
        )
    if not config.causal or config.n_out is not None:
        raise ValueError("KV-cache decoding needs a causal language model (model.causal=true, model.n_out=null)")


@contextlib.contextmanager
def eval_mode(model) -> Iterator[None]:
    """Eval mode (no dropout, no Gumbel noise) and no autograd inside; the previous mode restored after."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


def policy_options(policy: str, budget: int | None, check_len: int, n_layer: int, options: dict) -> dict:
    """A policy's keyword arguments besides the shapes: its `options`, the budget of a budgeted policy (checked
    against sequences of `check_len` tokens; the others take none) and ``n_layer`` for those that need it."""
    cls = get_cache_class(policy)
    if cls.budgeted:
        cls.check_budget(budget, check_len, **options)
        options = {**options, "budget": int(budget)}
    elif budget is not None:
        raise ValueError(f"cache policy {policy!r} takes no budget (got budget={budget})")
    return {**options, "n_layer": n_layer} if cls.needs_n_layer else options


def make_caches(
    model,
    policy: str,
    batch: int,
    max_len: int,
    *,
    budget: int | None = None,
    device: Any = None,
    dtype: torch.dtype | None = None,
    backend: str = "auto",
    track: bool = True,
    budget_check_len: int | None = None,
    **options: Any,
) -> list[LayerCache]:
    """One cache of policy `policy` per layer of `model`, for `batch` sequences of up to `max_len` tokens.

    `budget` (budgeted policies only) is checked against `budget_check_len` (default `max_len`): B >= N or a
    budget too small for the policy (e.g. StreamingLLM's sinks) fails with a message naming the fix. Extra
    `options` go to the policy (e.g. ``sinks=4`` for streaming_llm, ``recent=`` for h2o, ``window=`` /
    ``check_every=`` for nats).
    """
    check_model(model)
    cls = get_cache_class(policy)
    c = model.config
    if max_len > c.block_size:
        raise ValueError(
            f"max_len={max_len} tokens exceed the model's block_size={c.block_size} (positions are kept, so the "
            f"RoPE/position tables end there): use shorter sequences"
        )
    options = policy_options(policy, budget, budget_check_len or max_len, len(model.blocks), options)
    if cls.requires_core is not None and any(b.attn.core.name != cls.requires_core for b in model.blocks):
        others = [n for n in available_caches() if get_cache_class(n).requires_core is None]
        raise ValueError(
            f"cache policy {policy!r} needs a model with {cls.requires_core} attention (model.attention.name="
            f"{cls.requires_core}); this model uses attention {c.attention.get('name')!r}: evaluate it with "
            f"{', '.join(others)}"
        )
    param = next(model.parameters())
    device = param.device if device is None else device
    dtype = param.dtype if dtype is None else dtype
    caches = []
    for i, block in enumerate(model.blocks):
        try:
            caches.append(
                cls(
                    batch=batch,
                    n_head=c.n_head,
                    n_kv_head=c.n_kv_head,
                    head_dim=c.head_dim,
                    max_len=max_len,
                    device=device,
                    dtype=dtype,
                    layer_idx=i,
                    core=block.attn.core,
                    backend=backend,
                    track=track,
                    **options,
                )
            )
        except TypeError as err:
            raise TypeError(f"cache policy {policy!r} does not accept the options {sorted(options)}: {err}") from err
    return caches


def _check_caches(model, caches) -> None:
    if len(caches) != len(model.blocks):
        raise ValueError(f"need one cache per layer: {len(caches)} caches for {len(model.blocks)} layers")


def prefill(model, caches: list[LayerCache], idx: Tensor) -> Tensor:
    """Process idx [B, N] layer by layer from empty caches; returns logits [B, N, V].

    Each layer's attention is its cache's `prefill` (a parallel masked attention for full, streaming_llm and
    nats; H2O's exact sequential rule run over the positions inside the layer)."""
    _check_caches(model, caches)
    with eval_mode(model):
        B, N = idx.shape
        positions = torch.arange(N, device=idx.device)
        x = model.embed(idx, positions)
        for block, cache in zip(model.blocks, caches):
            h = block.ln_1(x)
            q, k, v = block.attn.project(h, model.rope, positions)
            y = cache.prefill(q, k, v, h)
            x = x + block.attn.gate_and_project(y, h)
            x = x + block.mlp(block.ln_2(x))
        return model.lm_head(model.ln_f(x))


def decode_step(model, caches: list[LayerCache], token: Tensor, pos: int | Tensor) -> Tensor:
    """One token per sequence (token [B], position `pos`, an int or a LongTensor [1] on the model's device)
    through all layers; returns the logits [B, V]. With a device `pos` and graph-safe caches the step runs
    without host synchronisation (CUDA-graph capturable; the caller must be in eval mode and no_grad)."""
    if isinstance(pos, int):
        pos = torch.full((1,), pos, dtype=torch.long, device=token.device)
    x = model.embed(token[:, None], pos)
    for block, cache in zip(model.blocks, caches):
        h = block.ln_1(x)
        q, k, v = block.attn.project(h, model.rope, pos)
        y = cache.step(q, k, v, h, pos)
        x = x + block.attn.gate_and_project(y, h)
        x = x + block.mlp(block.ln_2(x))
    return model.lm_head(model.ln_f(x))[:, 0]


def policy_logits(
    model,
    idx: Tensor,
    policy: str = "full",
    *,
    sequential: bool = False,
    prefill_len: int = 0,
    budget: int | None = None,
    backend: str = "auto",
    **options: Any,
):
    """Logits [B, N, V] of idx [B, N] under a cache policy, and the caches (for their measurements).

    sequential=False: the layer-wise `prefill` of all N tokens. sequential=True: `prefill` of the first
    `prefill_len` tokens (0 = none), then one `decode_step` per remaining token (the decode loop)."""
    B, N = idx.shape
    caches = make_caches(model, policy, B, N, budget=budget, backend=backend, **options)
    if not get_cache_class(policy).decodable and sequential:
        raise ValueError(f"cache policy {policy!r} is a parallel approximation and cannot decode token by token")
    with eval_mode(model):
        if not sequential:
            return prefill(model, caches, idx), caches
        if not 0 <= prefill_len <= N:
            raise ValueError(f"prefill_len must be in [0, {N}], got {prefill_len}")
        out = []
        if prefill_len:
            out.append(prefill(model, caches, idx[:, :prefill_len]))
        for i in range(prefill_len, N):
            out.append(decode_step(model, caches, idx[:, i], i)[:, None])
        return torch.cat(out, dim=1), caches


def _sample(
    logits: Tensor, temperature: float, top_k: int | None, greedy: bool, generator, vocab_limit: int | None = None
) -> Tensor:
    """logits [B, V] -> next token [B, 1]: argmax (greedy or temperature 0), else a sample of
    softmax(logits / temperature) over the top_k largest; ids >= vocab_limit never."""
    if vocab_limit is not None and vocab_limit < logits.size(-1):
        logits = logits[..., :vocab_limit]
    if greedy or temperature == 0:
        return logits.argmax(-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1)), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)


def generate(
    model,
    idx: Tensor,
    max_new_tokens: int,
    policy: str = "full",
    *,
    budget: int | None = None,
    temperature: float = 1.0,
    top_k: int | None = None,
    greedy: bool = False,
    generator: torch.Generator | None = None,
    backend: str = "auto",
    **options: Any,
) -> Tensor:
    """Continue idx [B, T] by `max_new_tokens` tokens under a cache policy; returns [B, T + max_new_tokens].

    The prompt is prefilled layer by layer (`prefill`), then each new token is one `decode_step`. Sampling:
    greedy (or temperature 0), else softmax(logits / temperature) restricted to the `top_k` largest."""
    return generate_with_caches(
        model,
        idx,
        max_new_tokens,
        policy,
        budget=budget,
        temperature=temperature,
        top_k=top_k,
        greedy=greedy,
        generator=generator,
        backend=backend,
        **options,
    )[0]


def generate_with_caches(
    model,
    idx: Tensor,
    max_new_tokens: int,
    policy: str = "full",
    *,
    budget: int | None = None,
    temperature: float = 1.0,
    top_k: int | None = None,
    greedy: bool = False,
    vocab_limit: int | None = None,
    generator: torch.Generator | None = None,
    backend: str = "auto",
    **options: Any,
) -> tuple[Tensor, list]:
    """`generate`, also returning the caches (one per layer, after the last token fed: for their statistics);
    ids >= `vocab_limit` (e.g. the padding of a vocabulary rounded up) are never chosen."""
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if temperature < 0 or not math.isfinite(temperature):
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1 or null (no cut), got {top_k}")
    check_model(model)
    B, T = idx.shape
    if T < 1:
        raise ValueError("generation needs a prompt of at least one token")
    total = T + max_new_tokens
    if total > model.config.block_size:
        raise ValueError(
            f"prompt ({T} tokens) + max_new_tokens ({max_new_tokens}) = {total} exceeds the model's block_size "
            f"{model.config.block_size}: positions are kept, so shorten the prompt or generate fewer tokens"
        )
    if not get_cache_class(policy).decodable:
        decodable = [n for n in available_caches() if get_cache_class(n).decodable]
        raise ValueError(
            f"cache policy {policy!r} is a parallel approximation and cannot decode token by token: "
            f"use one of {decodable}"
        )
    caches = make_caches(
        model,
        policy,
        B,
        total,
        budget=budget,
        backend=backend,
        budget_check_len=max(total, (budget or 0) + 1),
        **options,
    )
    out = [idx]
    with eval_mode(model):
        logits = prefill(model, caches, idx)[:, -1]
        for s in range(max_new_tokens):
            nxt = _sample(logits, temperature, top_k, greedy, generator, vocab_limit)
            out.append(nxt)
            if s + 1 < max_new_tokens:
                logits = decode_step(model, caches, nxt[:, 0], T + s)
    return torch.cat(out, dim=1), caches
