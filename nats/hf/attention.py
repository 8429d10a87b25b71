"""The NAtS attention function registered in transformers' attention registry.

`nats_attention_forward` has the signature of transformers' ``eager_attention_forward``: it receives the attention
module, query ``[B, Hq, N, D]`` and key/value ``[B, Hkv, Nk, D]`` after RoPE (and after the KV cache update),
the attention mask built by transformers, ``scaling`` and ``dropout``. It finds its layer's NAtS core in
``module.nats_scorer`` (a `nats.attention.nats.NAtSAttention`, attached by `nats.hf.attach_nats`) and the layer's
input hidden states (after the input norm) in ``module._nats_hidden``, stashed by a forward pre-hook on the
attention module (the scorer reads the block's normalised input, NATS_SPEC.md section 1, as in the native model).

* Prefill / training (``N == Nk``): types from the core (straight-through Gumbel in training, argmax in eval, token 0
  global), attention by `nats.functional.nats_attention` (Triton on CUDA, the PyTorch reference elsewhere), and the
  differentiable density (spec section 4) and KV statistics recorded on the core (``last_density``,
  ``last_stats``).
* Decode with a `nats.hf.StaticPolicyCache` (``model.generate(..., past_key_values=StaticPolicyCache(model,
  "nats"))``): the cache's policy does the attention, prefill and decode steps, over only the keys it keeps (the
  evicting NAtS cache of spec section 5, or a baseline policy).
* Decode with an ordinary transformers cache (``N < Nk``, e.g. ``DynamicCache``, the default of ``generate``):
  exact but not evicting: the core keeps the hard types of the past tokens (``past_types``, set by the prefill in
  eval mode) and the new queries attend over the NAtS mask rows of the full sequence (dense masked softmax).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from nats import functional as NF
from nats import ops

ATTN_IMPLEMENTATION = "nats"


def _check_mask(attention_mask: torch.Tensor | None, q_len: int, k_len: int) -> None:
    """NAtS is causal over one unpadded sequence per row: refuse masks that are anything else (padding)."""
    if attention_mask is None:
        return
    m = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
    m = m[..., -q_len:, :k_len]
    causal = torch.ones(q_len, k_len, dtype=torch.bool, device=m.device).tril(k_len - q_len)
    if not torch.equal(m, causal.expand_as(m)):
        raise NotImplementedError(
            "nats attention (transformers): the attention mask is not plain causal (padded or packed batches); "
            "NAtS runs over unpadded sequences only here: pass sequences of equal length without padding, or decode "
            "a left-padded batch through nats.hf.StaticPolicyCache"
        )


def rescaled(query: torch.Tensor, scaling: float | None, head_dim: int) -> torch.Tensor:
    """``query`` scaled so that nats' 1/sqrt(D) (nats_attention and the policies) gives the model's ``scaling``.
    Plain arithmetic, no math.isclose: once a second model (another scaling) has recompiled a step, dynamo traces
    ``scaling`` as a symbolic float, and math.isclose on it breaks a fullgraph compile."""
    if scaling is not None and abs(scaling * math.sqrt(head_dim) - 1.0) > 1e-6:
        return query * (scaling * math.sqrt(head_dim))
    return query


def nats_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
):
    """transformers attention function (registered as ``"nats"``; its arguments in the order of transformers' own,
    e.g. ``sdpa_attention_forward``, for wrappers that pass them by position, as kvpress' head-wise masks do);
    returns ``(out [B, N, Hq, D], None)``."""
    core = getattr(module, "nats_scorer", None)
    hidden = getattr(module, "_nats_hidden", None)
    cache = getattr(module, "_nats_cache", None)
    if hidden is None:
        raise RuntimeError(
            "nats attention (transformers): this attention module has no stashed hidden states; call "
            "nats.hf.attach_nats(model) (or nats.hf.use_policy_caches(model)) instead of setting "
            "attn_implementation='nats' by hand"
        )
    module._nats_hidden = module._nats_cache = None  # used once; do not keep the activations alive
    from nats.hf.static_cache import StaticPolicyCache  # noqa: PLC0415

    policy_cache = isinstance(cache, StaticPolicyCache)
    if core is None and not policy_cache:  # use_policy_caches on a model without scorers, no policy cache: plain
        from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: PLC0415

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout)
    if dropout:
        raise NotImplementedError("nats attention (transformers): attention dropout is not supported (set it to 0)")
    if query.dtype != value.dtype or key.dtype != value.dtype:  # under autocast transformers' RoPE returns fp32 q/k
        query, key = query.to(value.dtype), key.to(value.dtype)
    B, Hq, N, D = query.shape
    query = rescaled(query, scaling, getattr(module, "head_dim", None) or D)
    if policy_cache:  # the cache's policy attends over what it keeps (spec section 5; left padding allowed)
        y = cache.attend(module.layer_idx, query, hidden, attention_mask if N > 1 else None)
        return y.transpose(1, 2).contiguous(), None
    if getattr(core, "decode_policy", None) == "dms":  # DMS (nats.hf.dms): its masked attention, no other cache
        if N != key.shape[-2]:
            raise NotImplementedError(
                "nats attention (transformers): a DMS model decodes through its evicting cache: pass "
                "nats.hf.StaticPolicyCache(model, 'dms', ...) to generate"
            )
        _check_mask(attention_mask, N, N)
        out = core(query, key, value, hidden)
        core.last_aux, core.last_stats = out.aux_loss, out.stats
        return out.y.transpose(1, 2).contiguous(), None
    Nk = key.shape[-2]
    sliding = kwargs.get("sliding_window")
    if sliding is not None and Nk > sliding:
        raise NotImplementedError(
            f"nats attention (transformers): the model's own sliding window ({sliding}) is shorter than the "
            f"sequence ({Nk}); NAtS replaces it only where it does not bind"
        )
    _check_mask(attention_mask, N, Nk)

    if N == Nk:  # prefill / training forward
        z = core.type_logits(hidden)
        t = core.type_weights(z)  # [B, Hkv, N, 3]
        if core.force_type is not None:
            t = _forced(t, core.force_type)
        y = NF.nats_attention(
            query,
            key,
            value,
            t.to(query.dtype) if query.dtype == torch.float64 else t,
            core.window,
            backend=core.backend,
            mask_grad=core.mask_grad,
        )
        density, values = ops.density_and_stats(t, core.window)  # [B, Hkv] (differentiable), [B, Hkv, 5]
        core.last_density = density
        core.last_stats = {name: values[..., i].detach() for i, name in enumerate(ops.KV_STAT_NAMES)}
        # in training, the logits too: the density of their argmax types (what inference will keep) is computed
        # from them only when asked for (HFNAtSScorer.last_density_argmax), not on every training forward
        core.last_type_logits = z.detach() if core.training and core.force_type is None else None
        core.past_types = None if core.training else t.detach().argmax(-1)  # [B, Hkv, N]
        return y.transpose(1, 2).contiguous(), None

    # decode: new queries over past + new keys, exact NAtS rows, no eviction
    past = core.past_types
    if past is None or past.shape[-1] != Nk - N or past.shape[0] != B:
        raise RuntimeError(
            "nats attention (transformers): decoding needs the types of the cached tokens; run the prompt through "
            "the model in eval mode first (model.eval(); model.generate(...))"
        )
    if core.force_type is not None:
        new = torch.full((B, key.shape[1], N), int(core.force_type), dtype=torch.long, device=key.device)
    else:
        new = core.type_logits(hidden).argmax(-1)  # [B, Hkv, N] (not hard_types: it makes its first token global)
    types = torch.cat([past, new], dim=-1)  # [B, Hkv, Nk]
    types[..., 0] = NF.TOKEN_GLOBAL
    core.past_types = types
    mask = NF.nats_mask(types, core.window)[..., -N:, :]  # [B, Hkv, N, Nk]
    rep = Hq // key.shape[1]
    k = key.repeat_interleave(rep, dim=1)
    v = value.repeat_interleave(rep, dim=1)
    mask = mask.repeat_interleave(rep, dim=1)
    s = torch.matmul(query, k.transpose(-1, -2)).float() / math.sqrt(D)
    a = F.softmax(s.masked_fill(~mask, float("-inf")), dim=-1).to(value.dtype)
    y = torch.matmul(a, v)
    return y.transpose(1, 2).contiguous(), None


def _forced(t: torch.Tensor, force_type: int) -> torch.Tensor:
    """One-hot weights of a fixed type for every token (token 0 global), keeping t's dtype; no gradient."""
    types = torch.full(t.shape[:-1], int(force_type), dtype=torch.long, device=t.device)
    types[..., 0] = NF.TOKEN_GLOBAL
    return NF.types_to_weights(types, t.dtype)


def register() -> None:
    """Register ``"nats"`` in transformers' attention registry (and its mask registry: the sdpa mask, so that a
    padded batch reaches `nats_attention_forward` as a mask and is refused rather than silently ignored)."""
    from transformers import AttentionInterface  # noqa: PLC0415
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask  # noqa: PLC0415

    AttentionInterface.register(ATTN_IMPLEMENTATION, nats_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
