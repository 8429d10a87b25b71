"""`StaticPolicyCache`: a transformers cache of fixed-capacity buffers that ``generate`` compiles and replays as a
CUDA graph, for NAtS and the baselines users compare it with: the transformers adapter over the project's
fixed-capacity cache engine (`nats.cache.engine`).

``model.generate(ids, attention_mask=mask, max_new_tokens=n, cache=StaticPolicyCache(model, "nats",
max_new_tokens=n))`` (``past_key_values=`` before transformers 5.24; `nats.hf.compat.cache_kwargs` picks the name).

Every registered policy that declares a fixed-capacity rule runs here (`nats.cache.rule.fixed_policies`: ``full``,
``nats``, ``streaming_llm``, ``h2o``, ``snapkv``, ``pyramidkv``, ``adakv``); the rule, in the policy's own file, says
what the policy keeps of a prompt and how a decode step changes a row. This class only wires transformers to the engine:

* **Prefill** (the prompt, eager): the rule's attention over the prompt and what it keeps (NAtS: the fused Triton
  kernel with the scorer's types; the appending policies: causal SDPA and their selection; ``streaming_llm``: its
  mask), then the engine writes the kept tokens, per row, into one flat pool ``[P, D]`` in which row r owns the
  segment ``[start[r], start[r] + cap[r])``, planned as kept after the prompt + ``max_new_tokens`` (``streaming_llm``:
  its budget). Memory is therefore the kept tokens plus the new ones, per KV head. Left-padded prompts
  (``attention_mask`` with zeros on the left, ``tokenizer.padding_side = "left"``) are prefilled row by row over
  their real tokens: padding is never kept nor counted, and a row's first real token is its position 0.
* **Decode** (one token per row, compiled): device tensors only, fixed shapes, no host synchronisation: the rule
  admits the new token and the query attends over exactly what the row keeps (``nats::pool_attention``: the Triton
  split-K kernel reading each KV head once for its GQA group).
* **Overflow** (more new tokens than planned): `nats.hf.loop.generate` refuses more ``max_new_tokens`` than the
  cache was made for; ``model.generate`` cannot tell the cache its number (the cache sees its decode steps on the
  device only), so there NAtS keeps a global or local token of a full segment as a sliding one (visible for W
  steps) and the appending policies stop admitting the row's new tokens (they are attended to in their own step
  only). `overflowed` says whether it happened. Plan ``max_new_tokens`` as for ``generate``.

**A conversation**: a forward of several tokens through a cache that holds a sequence continues it (the rule's
parallel `nats.cache.rule.FixedRule.extend` where it has one, else its steps; the rows' room grown first). A generate
call through such a cache must pass the conversation so far followed by new tokens: `check_history` refuses other ids
(the cache keeps the ids it holds in ``history``; docs/hf.md, "A conversation through one cache").

Refused, in one line each: a prompt + ``max_new_tokens`` beyond the model's context (`nats.hf.limits`), checked at
the prefill and at each continuation; a prompt that does not continue what the cache holds (`check_history`, called
by `nats.hf.loop.generate` and, through `nats.hf.hooks`, by ``model.generate``); beam search and
``num_return_sequences > 1`` (a row's cache cannot be duplicated or reordered); a policy without a fixed-capacity
rule (an evaluation-only approximation such as ``h2o_dense``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from transformers.cache_utils import Cache

from nats.cache.engine import EngineLayer, mark_static
from nats.cache.engine_cache import EngineCache, fixed_policy
from nats.hf.buffers import CacheBuffers
from nats.hf.cache import FixedRowsLayer
from nats.hf.limits import check_context, context_length


class StaticPolicyLayer(FixedRowsLayer, EngineLayer):
    """One decoder layer's buffers (allocated by the prefill, when the kept tokens are known): an engine layer
    (`nats.cache.engine.EngineLayer`: storage, measurements) with transformers' layer interface."""

    is_compileable = True

    def __init__(self, owner: StaticPolicyCache, layer_idx: int):
        super().__init__(owner, layer_idx)
        self.max_cache_len = owner.max_len
        self.rule = owner.rule
        self.context = owner.layer_context(layer_idx)
        # tokens per row so far, padding included: one tensor for all layers (layer 0's; the others share it), which
        # layer 0 advances; the compiled step then reads one position counter, not one per layer (each is a guarded
        # graph input, host time at every step)
        self.cumulative_length = torch.tensor(0, dtype=torch.long)
        self.ready = False  # prefilled

    # ------------------------------------------------------------------ transformers' layer interface
    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        self.batch_size, self.n_kv_head = key_states.shape[:2]
        if self.layer_idx == 0:
            self.cumulative_length = self.cumulative_length.to(self.device)
            mark_static(self.cumulative_length)
        else:  # the layers run in order: layer 0 holds the counter already
            first = self.owner.layers[0]
            if not first.is_initialized:
                raise RuntimeError("StaticPolicyCache: layer 0 must be updated before the others")
            self.cumulative_length = first.cumulative_length
        self.is_initialized = True

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs):
        owner, n = self.owner, key_states.shape[-2]
        if not self.is_initialized:  # the prompt: within the model's context with the new tokens planned
            if self.layer_idx == 0 and owner.max_new_tokens is not None:
                check_context(owner.context, n, owner.max_new_tokens, "StaticPolicyCache",
                              "the max_new_tokens it was made for")  # fmt: skip
            self.lazy_initialization(key_states, value_states)
        elif n > 1 and self.layer_idx == 0:  # a continuation (the next turn): within the context, with the reserve
            total = int(self.cumulative_length) + n  # one host read
            check_context(owner.context, total, owner.max_new_tokens or 0, "StaticPolicyCache",
                          "the max_new_tokens it was made for",
                          what=None if owner.max_new_tokens else f"the {total} tokens of the conversation")  # fmt: skip
        # unknown lengths: the tokens so far, counted on the host (`auto_maintain`, a bool, is max_new_tokens is None:
        # the compiled step reads the flag, the same for every cache, not max_new_tokens, whose value it would guard)
        if self.layer_idx == 0 and owner.auto_maintain:
            owner.seen += n
            if owner.seen > owner.max_len:
                raise ValueError(
                    f"StaticPolicyCache: {owner.seen} tokens exceed its max_len={owner.max_len}; make the cache with a "
                    f"larger max_len (prompt + new tokens)"
                )
        self.pending = (key_states, value_states)
        if self.layer_idx == 0:  # the shared counter: the later layers of the same forward see it advanced
            self.cumulative_length.add_(key_states.shape[-2])
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.max_cache_len, 0

    def get_seq_length(self):
        return self.cumulative_length if self.is_initialized else 0

    def get_max_length(self) -> int:
        return self.max_cache_len

    get_max_cache_shape = get_max_length  # the name before transformers 5.3

    def reset(self) -> None:
        raise NotImplementedError("StaticPolicyCache: make a new cache for a new conversation")

    @property
    def t(self) -> int:
        """Tokens per row so far, padding included (`nats.cache.engine.EngineLayer.seen`)."""
        return int(self.cumulative_length)

    # ------------------------------------------------------------------ storage (nats.cache.engine.EngineLayer)
    def tensors(self) -> list[Tensor]:
        """The buffers the decode step reads and writes (the packed tensors themselves, the rule's, with tracking the
        area and peak sums, and the position counter)."""
        return self.own_tensors() + [self.cumulative_length]

    def dynamic_dims(self) -> list[tuple[Tensor, tuple[int, ...]]]:
        """The decode step's buffers with their dimensions that change with the batch and the prompt (`nats.hf.loop`
        marks them dynamic, so that one compiled step serves every request)."""
        rows = [(t, (0,)) for t in (self.area, self.peak) if t is not None]
        return self.storage_dynamic_dims() + rows + self.owner.rule.dynamic_dims(self)


class StaticPolicyCache(EngineCache, Cache):
    """A compileable transformers cache running a KV-cache policy in fixed-capacity buffers (module docstring): the
    transformers wiring over an `nats.cache.engine_cache.EngineCache` (the prefill, the decode step and the
    measurements), which it extends so that the compiled step reads the same attributes as the engine.

    Args:
        model: a supported transformers model with NAtS attached (`nats.hf.attach_nats`) for ``"nats"``, or
            `nats.hf.use_policy_caches(model)` called for the baselines.
        policy: a registered policy with a fixed-capacity rule (`nats.cache.rule.fixed_policies`).
        max_new_tokens: the most tokens ``generate`` will add (the capacity planned per row on top of what the
            prompt leaves; pass the same number to ``generate``: `nats.hf.loop.generate` refuses more). The prompt
            + max_new_tokens must lie within the model's context (`nats.hf.limits.context_length`).
        budget: budgeted policies: tokens per row and KV head (an int), or a fraction of each row's prompt (a
            float in (0, 1)); `nats.cache.budget`.
        max_len: the longest sequence (prompt + new tokens); the size of the attention mask ``generate`` builds
            (default ``config.max_position_embeddings``).
        track: record each decode step's cache size for `fractions` (two small device ops per layer and step) and,
            for NAtS, count the token types for `type_fractions` (one more buffer and op per layer and step).
        prefill_kernel: how NAtS' prefill writes the cache: ``"triton"`` (two fused launches per layer,
            `nats_kernels.nats_attention.prefill_cache`), ``"torch"`` (some thirty small PyTorch operations per
            layer, the kernels' reference) or ``"auto"`` (default: Triton for CUDA tensors where the kernels
            import, else PyTorch).
        row_slots: each layer's pool takes at least rows x ``row_slots`` slots (rows: sequences x KV heads), so that
            requests of the same batch have pools of the same size (a serving process: `nats.hf.buffers`); a prompt
            that needs more gets a larger pool.
        buffers: a `nats.hf.CacheBuffers` that successive caches decode from (the same addresses for every request;
            `nats.hf.buffers`).
        **options: the policy's options (``sinks=``, ``exact_prefill=`` for streaming_llm; ``window=``, ``kernel=``,
            ``pooling=`` for snapkv / pyramidkv; NAtS' window comes from its scorers).
    """

    def __init__(
        self,
        model: nn.Module,
        policy: str = "nats",
        *,
        max_new_tokens: int | None = None,
        budget: int | float | None = None,
        max_len: int | None = None,
        track: bool = True,
        prefill_kernel: str = "auto",
        backend: str = "auto",
        row_slots: int | None = None,
        buffers: CacheBuffers | None = None,
        **options: Any,
    ):
        from nats.hf.hooks import routed_cores  # noqa: PLC0415

        fixed_policy(policy, "StaticPolicyCache")
        if max_new_tokens is not None and (int(max_new_tokens) != max_new_tokens or max_new_tokens < 1):
            raise ValueError(
                "StaticPolicyCache: max_new_tokens must be a positive integer or None (unknown), got "
                f"{max_new_tokens!r}"
            )
        config = model.config
        cores = routed_cores(model, "StaticPolicyCache")
        self.max_new_tokens = None if max_new_tokens is None else int(max_new_tokens)
        self.buffers = buffers
        self.n_head = config.num_attention_heads
        self.max_len = int(max_len or getattr(config, "max_position_embeddings", 0) or 0)
        self.context = context_length(config)  # prompt + max_new_tokens at most (nats.hf.limits)
        self.seen = 0  # tokens so far, counted on the host where the number of new tokens is unknown
        # the token ids the cache holds [B, T] (set by generate: nats.hf.loop.generate at its end, model.generate at
        # each step through the hook of nats.hf.hooks); None while a call runs or after a forward outside generate
        self.history: Tensor | None = None
        EngineCache.__init__(self, policy, cores, reserve=self.max_new_tokens, budget=budget, track=track,
                             prefill_kernel=prefill_kernel, backend=backend, row_slots=row_slots,
                             who="StaticPolicyCache", **options)  # fmt: skip
        if self.max_len < 1:
            raise ValueError("StaticPolicyCache: pass max_len (the model config has no max_position_embeddings)")
        if max_new_tokens is None:
            if max_len:  # the prompt + new tokens it is made for, within the model's context
                check_context(self.context, 0, self.max_len, "StaticPolicyCache",
                              what=f"max_len={self.max_len} (prompt + new tokens)")  # fmt: skip
            for layer in self.layers:  # eager steps, each after its layer's growth check (EngineLayer.maintain)
                layer.is_compileable = False
        Cache.__init__(self, layers=self.layers)

    def check_history(self, ids: Tensor, attention_mask: Tensor | None = None, who: str = "StaticPolicyCache") -> int:
        """The tokens of ``ids`` ``[B, T]`` the cache holds already (0: a fresh cache), after one line refusing ids
        that do not continue them: a generate call through a cache that holds a conversation must pass the
        conversation so far (its earlier prompts and generated tokens, as the cache saw them) followed by new tokens,
        all real (``attention_mask`` 1 after the held tokens). One host read of the held length and one comparison."""
        held = int(self.get_seq_length()) if self.layers[0].is_initialized else 0
        if not held:
            return 0
        hist = self.history
        if hist is None or hist.shape[1] != held:
            raise ValueError(
                f"{who}: this cache holds {held} tokens that did not come from a finished generate call (a forward "
                "outside generate, or a call that stopped): their ids are unknown, so no prompt can be checked "
                "against them; make a new cache"
            )
        T = ids.shape[1]
        same = ids.shape[0] == hist.shape[0] and T > held and torch.equal(ids[:, :held].to(hist.device), hist)
        if not same:
            raise ValueError(
                f"{who}: the prompt ({tuple(ids.shape)}) does not continue the conversation this cache holds "
                f"({hist.shape[0]} x {held} tokens): pass the conversation so far followed by the new text (as the "
                "chat template renders it), or make a new cache for another prompt"
            )
        if attention_mask is not None and not bool(attention_mask[:, held:].all()):
            raise ValueError(
                f"{who}: padding after the {held} tokens the cache holds: a conversation's new tokens must all be "
                "real (continue each conversation with its own cache, or give every row a new text of one length)"
            )
        return held

    def new_layer(self, layer_idx: int) -> StaticPolicyLayer:
        return StaticPolicyLayer(self, layer_idx)

    def installed(self, layer: StaticPolicyLayer) -> None:
        if self.buffers is not None:  # the layer's buffers into the fixed ones, the fresh ones freed at once
            self.buffers.adopt(self, layer)

    # ------------------------------------------------------------------ the attention function's entry point
    def attend(self, layer_idx: int, query: Tensor, hidden: Tensor, attention_mask: Tensor | None) -> Tensor:
        """The layer's attention output ``[B, Hq, N, D]`` for its new queries (after RoPE, scaled for
        1/sqrt(D)); prefill on the first call, then one decode step per token (a forward of several tokens after the
        prefill is refused by `StaticPolicyLayer.update`)."""
        layer = self.layers[layer_idx]
        k, v = layer.pending
        layer.pending = None
        B, _, N, _ = query.shape
        if not layer.ready:  # the padding from transformers' mask, read at the first layer
            pads = None if self.prompt_lengths is not None else _left_padding(attention_mask, B, N, query.device)
            return self._prefill(layer, query, k, v, hidden, pads)
        if N == 1 and not self.auto_maintain:  # the compiled fixed-capacity step
            pos = (layer.cumulative_length - 1).reshape(1)  # the new token's position (padding included)
            return self._decode(layer, query, k, v, hidden, pos)
        if N > 1:  # the tokens that continue the sequence (a conversation's next turn), in parallel where the rule can
            return self._extend(layer, query, k, v, hidden, int(layer.cumulative_length) - N)
        # an eager step (unknown lengths: growth first)
        return self._steps(layer, query, k, v, hidden, (layer.cumulative_length - N).reshape(1))


def _left_padding(attention_mask: Tensor | None, B: int, N: int, device) -> Tensor:
    """Padding tokens per row, LongTensor ``[B]``, from the 4-D mask transformers built for the prompt (None or
    plain causal: none). Only left padding is accepted."""
    if attention_mask is None:
        return torch.zeros(B, dtype=torch.long, device=device)
    m = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
    valid = m[:, 0, -1, :N]  # the last query (a real token under left padding) sees every real key
    pads = N - valid.sum(-1)
    pos = torch.arange(N, device=valid.device)
    if not torch.equal(valid, pos[None, :] >= pads[:, None]) or bool((pads >= N).any()):
        raise ValueError(
            "StaticPolicyCache: the prompt batch is not left-padded (padding must come first in every row, and "
            "every row needs a real token): set tokenizer.padding_side = 'left'"
        )
    return pads.to(device)
