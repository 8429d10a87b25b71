"""A transformers `Cache` whose layers are the project's KV-cache policies (spec section 5).

``model.generate(ids, past_key_values=PolicyCache(model, "nats"))`` decodes a NAtS model (`nats.hf.attach_nats`) with
the evicting NAtS cache of `nats.cache.policies.nats`: per KV head, globals stay, locals go once a later global
has been queried, sliding tokens leave after W - 1 steps; the cache holds only what the queries may still read.
The same class runs the baselines on any supported model (``"full"``, ``"streaming_llm"``, ``"h2o"``,
``"snapkv"``, ...: every policy of `nats.cache.available_caches`), so all of them are compared through one decode
path, transformers' own ``generate``.

How it plugs into transformers (public extension points only):

* `PolicyCache` is a ``transformers.Cache`` of `PolicyCacheLayer` (a ``CacheLayerMixin``). A layer's ``update``
  does not store anything: it keeps the new keys/values for the attention call that follows and returns them.
  ``get_seq_length`` counts the tokens seen, so ``generate`` computes positions (and RoPE) as usual.
* The attention function registered as ``"nats"`` (`nats.hf.attention`) finds the cache through a forward pre-hook
  on each attention module (it stashes ``past_key_values``, as it stashes the scorer's input) and hands the layer's
  queries, new keys/values and normalised input to the policy: ``prefill`` for the prompt (for NAtS the fused,
  compacting Triton kernel on CUDA, the reference elsewhere), then one ``step`` per new token. The policy does
  the attention over exactly what it keeps.

A model without NAtS scorers needs the hooks and the attention function too: `use_policy_caches(model)` installs
them (``attach_nats`` already does). Limits: one unpadded sequence per batch row (every row at the same position),
greedy or sampled decoding (no beam search: a policy cache cannot be reordered), and a cache is used for one
``generate`` call (make a new one per prompt, or ``reset()`` it): a forward of several tokens through a cache that
holds tokens (the prompt of a second call) is refused, unless inside ``with cache.continuing():`` (teacher forcing
the tokens that follow, as `nats.finetune.evaluate.continue_one` does). ``max_len`` beyond the model's context
(`nats.hf.limits`) is refused.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from transformers.cache_utils import Cache, CacheLayerMixin

from nats.cache import available_caches, get_cache_class
from nats.cache.base import LayerCache
from nats.cache.decode import policy_options
from nats.hf.limits import check_context, context_length, reuse_message


class FixedRowsLayer(CacheLayerMixin):
    """A cache layer whose rows (sequence x KV head) keep their own policy state, which cannot be reordered,
    copied or selected: beam search, ``num_return_sequences > 1`` and contrastive search are refused, naming the
    owner's class (``self.owner``). ``update`` keeps the new keys/values in ``pending`` for the attention call that
    follows (the owner's ``attend``)."""

    is_sliding = False
    is_compileable = False
    is_croppable = False
    supports_early_init = False

    def __init__(self, owner, layer_idx: int):
        super().__init__()
        # the owner by a weak reference: owner -> layers -> owner would be a reference cycle, and a cache (at 8B,
        # batch 8 x 32k, 34 GB of buffers) would be freed only by Python's cyclic collector, requests after it
        # allocating theirs meanwhile (out of memory after three requests)
        self._owner = weakref.ref(owner)
        self.layer_idx = layer_idx
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def owner(self):
        """The cache this layer belongs to."""
        return self._owner()

    def _refuse(self, what: str):
        raise NotImplementedError(f"{type(self.owner).__name__} does not support {what}")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._refuse("beam search (num_beams=1 only)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._refuse("num_return_sequences > 1 or beam search")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._refuse("contrastive search or batch selection")


class PolicyCacheLayer(FixedRowsLayer):
    """One decoder layer's cache: a `nats.cache.base.LayerCache` of the chosen policy, built at the first update
    (when batch size, KV heads, head size, dtype and device are known)."""

    def __init__(self, owner: PolicyCache, layer_idx: int):
        super().__init__(owner, layer_idx)
        self.policy: LayerCache | None = None
        self.seen = 0  # tokens processed (positions), what generate asks for

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.policy = self.owner.make_layer(self.layer_idx, key_states)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        elif self.seen and key_states.shape[-2] > 1 and not self.owner.continuation:
            raise ValueError(reuse_message(self.owner, self.seen, "PolicyCache"))
        if self.seen + key_states.shape[-2] > self.owner.max_len:
            raise ValueError(
                f"PolicyCache: {self.seen + key_states.shape[-2]} tokens exceed its max_len={self.owner.max_len}; "
                f"make the cache with a larger max_len (prompt + max_new_tokens)"
            )
        self.pending = (key_states, value_states)
        self.seen += key_states.shape[-2]
        return key_states, value_states

    def get_mask_sizes(self, query_length) -> tuple[int, int]:
        if isinstance(query_length, torch.Tensor):  # transformers < 5.3 passes the cache positions
            query_length = query_length.shape[0]
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return self.owner.max_len

    get_max_cache_shape = get_max_length  # the name before transformers 5.3

    def reset(self) -> None:
        self.policy, self.pending, self.seen, self.is_initialized = None, None, 0, False


class PolicyCache(Cache):
    """A transformers cache that runs a KV-cache policy of the project in every layer.

    Args:
        model: the transformers model (``LlamaForCausalLM``-style); for ``policy="nats"`` with NAtS attached
            (`nats.hf.attach_nats`), for other policies NAtS attached or `use_policy_caches(model)` called.
        policy: a name of `nats.cache.available_caches()` (``nats``, ``full``, ``streaming_llm``, ``h2o``, ...).
        max_len: the most tokens (prompt + new) it will see; default ``config.max_position_embeddings``
            (preallocating policies such as ``full`` allocate it: pass what you need); beyond the model's context
            (`nats.hf.limits.context_length`) it is refused.
        budget: the token budget of budgeted policies (StreamingLLM, H2O, SnapKV, ...).
        backend: ``auto`` (Triton on CUDA), ``triton`` or ``torch``.
        track: record the per-step cache sizes (``fractions()``).
        **options: the policy's own options (``sinks=`` for streaming_llm, ``window=`` / ``check_every=`` for nats,
            ...).
    """

    def __init__(
        self,
        model: nn.Module,
        policy: str = "nats",
        *,
        max_len: int | None = None,
        budget: int | None = None,
        backend: str = "auto",
        track: bool = True,
        **options: Any,
    ):
        from nats.hf.hooks import routed_cores  # noqa: PLC0415

        if policy not in available_caches():
            raise ValueError(
                f"PolicyCache: unknown cache policy {policy!r}; available: {', '.join(available_caches())}"
            )
        self.policy_cls = get_cache_class(policy)
        if not self.policy_cls.decodable:
            raise ValueError(f"PolicyCache: cache policy {policy!r} is evaluation-only and cannot decode")
        config = model.config
        self.cores = routed_cores(model, "PolicyCache")
        if self.policy_cls.requires_core == "nats" and any(c is None for c in self.cores):
            raise ValueError(f"PolicyCache: policy {policy!r} needs NAtS scorers: call nats.hf.attach_nats(model)")
        self.policy = policy
        self.n_head = config.num_attention_heads
        self.max_len = int(max_len or getattr(config, "max_position_embeddings", 0) or 0)
        if self.max_len < 1:
            raise ValueError("PolicyCache: pass max_len (the model config has no max_position_embeddings)")
        if max_len:  # the prompt + new tokens it is made for, within the model's context
            check_context(context_length(config), 0, self.max_len, "PolicyCache",
                          what=f"max_len={self.max_len} (prompt + new tokens)")  # fmt: skip
        self.continuation = False  # inside `continuing`: forwards of several tokens extend the sequence
        self.backend, self.track = backend, track
        self.options = policy_options(
            policy, budget, self.max_len, len(self.cores), options
        )  # budget, n_layer included
        super().__init__(layers=[PolicyCacheLayer(self, i) for i in range(len(self.cores))])

    @contextlib.contextmanager
    def continuing(self) -> Iterator[PolicyCache]:
        """Inside, forwards of several tokens feed the tokens that follow the sequence the cache holds (teacher
        forcing: the model's positions follow `get_seq_length`); outside, such a forward through a cache that holds
        tokens is refused as the prompt of a second ``generate`` call."""
        self.continuation = True
        try:
            yield self
        finally:
            self.continuation = False

    def make_layer(self, layer_idx: int, key_states: torch.Tensor) -> LayerCache:
        B, Hkv, _, D = key_states.shape
        return self.policy_cls(
            batch=B,
            n_head=self.n_head,
            n_kv_head=Hkv,
            head_dim=D,
            max_len=self.max_len,
            device=key_states.device,
            dtype=key_states.dtype,
            layer_idx=layer_idx,
            core=self.cores[layer_idx],
            backend=self.backend,
            track=self.track,
            **self.options,
        )

    def attend(self, layer_idx: int, query: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The layer's attention output ``[B, Hq, N, D]`` for its N new queries (``[B, Hq, N, D]``, after RoPE and
        scaled for 1/sqrt(D)) and their normalised input ``hidden [B, N, C]``, through the policy: ``prefill``
        for the first call of a sequence, then ``step`` per token."""
        with torch.no_grad():  # the policy's buffers hold keys and values, never their autograd history
            return self._attend(self.layers[layer_idx], query, hidden)

    def _attend(self, layer, query: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        k, v = layer.pending
        layer.pending = None
        pol = layer.policy
        N = query.shape[-2]
        if pol.t == 0 and N > 1:
            return pol.prefill(query, k, v, hidden)
        out = []
        for i in range(N):
            pos = torch.full((1,), pol.t, dtype=torch.long, device=query.device)
            s = slice(i, i + 1)
            out.append(pol.step(query[:, :, s], k[:, :, s], v[:, :, s], hidden[:, s], pos))
        return torch.cat(out, dim=2)

    # measurements (spec section 6), per layer [B, Hkv]
    def kept(self) -> torch.Tensor:
        """Tokens held now, ``[n_layer, B, Hkv]``."""
        return torch.stack([layer.policy.kept() for layer in self.layers])

    def fractions(self) -> dict[str, torch.Tensor]:
        """KV area and peak fractions so far (``area``, ``peak``: ``[n_layer, B, Hkv]``)."""
        per = [layer.policy.fractions() for layer in self.layers]
        return {key: torch.stack([p[key] for p in per]) for key in per[0]}

    def nbytes(self) -> int:
        """Bytes the layers' caches have allocated (keys, values, metadata)."""
        return sum(layer.policy.nbytes() for layer in self.layers if layer.policy is not None)


def use_policy_caches(model: nn.Module) -> nn.Module:
    """Route a supported model's attention through nats so that `PolicyCache` can run any policy on it (without
    NAtS scorers; `attach_nats` does this too). Without a `PolicyCache` the model then computes ordinary causal
    attention (the ``full`` policy's prefill). Undo with `nats.hf.detach_nats`."""
    from nats.hf.hooks import attach_hooks  # noqa: PLC0415

    return attach_hooks(model)
