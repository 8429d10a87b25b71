"""`StaticPolicyCache`: a transformers cache of fixed-capacity buffers that ``generate`` compiles and replays as a
CUDA graph, for NAtS and the baselines users compare it with: the transformers adapter over the project's
fixed-capacity cache engine (`nats.cache.engine`).

``model.generate(ids, attention_mask=mask, max_new_tokens=n, cache=StaticPolicyCache(model, "nats",
max_new_tokens=n))`` (``past_key_values=`` before transformers 5.24; `nats.hf.compat.cache_kwargs` picks the name).

Every registered policy that declares a fixed-capacity rule runs here (`nats.cache.engine.fixed_policies`: ``full``,
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

Refused, in one line each: a prompt + ``max_new_tokens`` beyond the model's context (`nats.hf.limits`), checked at
the prefill; a second ``generate`` call through the same cache (one call per cache: make a new one per batch),
checked where a forward of several tokens reaches a cache that holds tokens (the prompt of the second call; the
compiled decode step, one token, carries no check) and, whatever the prompt, by `nats.hf.loop.generate` before its
prefill; beam search and ``num_return_sequences > 1`` (a row's cache cannot be duplicated or reordered); a policy
without a fixed-capacity rule (an evaluation-only approximation such as ``h2o_dense``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from transformers.cache_utils import Cache

from nats.cache import engine
from nats.cache.budget import check_budget_value, row_budgets
from nats.cache.engine import EngineLayer, PoolLayout, PromptState, RuleContext, mark_static
from nats.cache.registry import get_cache_class
from nats.hf.buffers import CacheBuffers
from nats.hf.cache import FixedRowsLayer
from nats.hf.limits import check_context, context_length, reuse_message


class StaticPolicyLayer(FixedRowsLayer, EngineLayer):
    """One decoder layer's buffers (allocated by the prefill, when the kept tokens are known): an engine layer
    (`nats.cache.engine.EngineLayer`: storage, measurements) with transformers' layer interface."""

    is_compileable = True

    def __init__(self, owner: StaticPolicyCache, layer_idx: int):
        super().__init__(owner, layer_idx)
        self.max_cache_len = owner.max_len
        self.rule = owner.rule
        self.context = RuleContext(layer_idx, owner.n_layer, owner.max_new_tokens, owner.track, owner.prefill_kernel)
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
        if not self.is_initialized:  # the prompt: within the model's context with the new tokens planned
            if self.layer_idx == 0:
                owner = self.owner
                check_context(owner.context, key_states.shape[-2], owner.max_new_tokens, "StaticPolicyCache",
                              "the max_new_tokens it was made for")  # fmt: skip
            self.lazy_initialization(key_states, value_states)
        elif key_states.shape[-2] > 1:  # a new prompt (a decode step is one token: the compiled step has no check)
            raise ValueError(reuse_message(self.owner, int(self.cumulative_length), "StaticPolicyCache"))
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
        raise NotImplementedError("StaticPolicyCache: make a new cache per generate call")

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


class StaticPolicyCache(Cache):
    """A compileable transformers cache running a KV-cache policy in fixed-capacity buffers (module docstring).

    Args:
        model: a supported transformers model with NAtS attached (`nats.hf.attach_nats`) for ``"nats"``, or
            `nats.hf.use_policy_caches(model)` called for the baselines.
        policy: a registered policy with a fixed-capacity rule (`nats.cache.engine.fixed_policies`).
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
        max_new_tokens: int,
        budget: int | float | None = None,
        max_len: int | None = None,
        track: bool = True,
        prefill_kernel: str = "auto",
        row_slots: int | None = None,
        buffers: CacheBuffers | None = None,
        **options: Any,
    ):
        from nats.hf.hooks import routed_cores  # noqa: PLC0415

        fixed = engine.fixed_policies()
        if policy not in fixed:
            raise ValueError(
                f"StaticPolicyCache: policy {policy!r} has no fixed-capacity form; choose one of {', '.join(fixed)}"
                " (evaluation-only policies do not decode)"
            )
        if int(max_new_tokens) != max_new_tokens or max_new_tokens < 1:
            raise ValueError(f"StaticPolicyCache: max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        config = model.config
        self.cores = routed_cores(model, "StaticPolicyCache")
        self.policy, self.policy_cls = policy, get_cache_class(policy)
        self.rule = self.policy_cls.rule(**options)  # the policy's options bound to its rule
        if self.policy_cls.requires_core == "nats" and any(c is None for c in self.cores):
            raise ValueError(
                f"StaticPolicyCache: policy {policy!r} needs NAtS scorers: call nats.hf.attach_nats(model)"
            )
        if self.policy_cls.budgeted and budget is None:
            raise ValueError(f"StaticPolicyCache: policy {policy!r} needs a budget (tokens, or a fraction in (0, 1))")
        try:
            check_budget_value(budget, "each row's prompt")
        except ValueError as err:
            raise ValueError(f"StaticPolicyCache: {err}") from None
        self.budget, self.options = budget, dict(options)
        self.max_new_tokens = int(max_new_tokens)
        self.track = track
        if prefill_kernel not in ("auto", "torch", "triton"):
            raise ValueError(
                f"StaticPolicyCache: prefill_kernel must be 'auto', 'torch' or 'triton', got {prefill_kernel!r}"
            )
        self.prefill_kernel = prefill_kernel
        if row_slots is not None and (int(row_slots) != row_slots or row_slots < 1):
            raise ValueError(f"StaticPolicyCache: row_slots must be a positive integer, got {row_slots!r}")
        self.row_slots, self.buffers = row_slots, buffers
        self.n_head, self.n_layer = config.num_attention_heads, len(self.cores)
        self.max_len = int(max_len or getattr(config, "max_position_embeddings", 0) or 0)
        if self.max_len < 1:
            raise ValueError("StaticPolicyCache: pass max_len (the model config has no max_position_embeddings)")
        self.context = context_length(config)  # prompt + max_new_tokens at most (nats.hf.limits)
        self.prompt_lengths: Tensor | None = None  # real tokens per sequence, set by the prefill
        self._real_rows: Tensor | None = None  # the same per row (sequence x KV head)
        self._unallocated: list[tuple] = []  # prefilled layers whose pools are allocated at the next layer
        self._sizes_host: Tensor | None = None  # CUDA: the layers' pool sizes, copied into pinned memory ...
        self._stream = None  # ... on this stream (both set by the first prefilled layer)
        self._budgets: Tensor | None = None  # budgeted policies: tokens per sequence, set by the prefill ...
        self._budgets_host: list[int] = []  # ... and the same on the host ...
        self._row_budgets: Tensor | None = None  # ... and per row (sequence x KV head)
        super().__init__(layers=[StaticPolicyLayer(self, i) for i in range(len(self.cores))])

    # ------------------------------------------------------------------ the attention function's entry point
    def attend(self, layer_idx: int, query: Tensor, hidden: Tensor, attention_mask: Tensor | None) -> Tensor:
        """The layer's attention output ``[B, Hq, N, D]`` for its new queries (after RoPE, scaled for
        1/sqrt(D)); prefill on the first call, then one decode step per token (a forward of several tokens after the
        prefill is refused by `StaticPolicyLayer.update`)."""
        layer = self.layers[layer_idx]
        k, v = layer.pending
        layer.pending = None
        if not layer.ready:
            return self._prefill(layer, query, k, v, hidden, attention_mask)
        return self._decode(layer, query, k, v, hidden)

    # ------------------------------------------------------------------ prefill
    def _prefill(self, layer, q, k, v, hidden, attention_mask) -> Tensor:
        B, Hq, N, D = q.shape
        Hkv = k.shape[1]
        R = B * Hkv
        if self.prompt_lengths is None:  # the first layer: the padding, once for every layer
            pads = _left_padding(attention_mask, B, N, q.device)
            self.prompt_lengths, self._pads = N - pads, pads
            self._groups = None if bool((pads == 0).all()) else [(slice(b, b + 1), int(pads[b])) for b in range(B)]
            self._real_rows = self.prompt_lengths.repeat_interleave(Hkv)  # [R], the same for every layer
        groups, rule = self._groups, self.rule
        core = self.cores[layer.layer_idx]
        if self.budget is not None and self._budgets is None:  # the rows' budgets, on the device and the host, once
            self._budgets = row_budgets(self.budget, self.prompt_lengths)
            self._budgets_host = self._budgets.tolist()
            self._row_budgets = self._budgets.repeat_interleave(Hkv)
        direct = None if groups is not None else rule.direct(layer.context, core, q, k, v, hidden)
        if direct is not None:  # the rule's fused prefill planned the storage itself
            y, plan = direct
        else:
            if groups is None:  # no padding: every row at once
                top = None if self._budgets is None else max(self._budgets_host)
                state = rule.prompt(layer.context, core, q, k, v, hidden, top)
            else:  # left padding: row by row over the real tokens, padding marked (-1 types, dropped keys)
                state = self._prompt_padded(layer, core, q, k, v, hidden, groups)
            plan = rule.plan(layer.context, core, state, k, v, self._row_budgets, self._real_rows)
            if plan.sizes is None and state.sizes is not None:
                plan.sizes = state.sizes.reshape(R, N)
        # the pool is allocated one layer later (PoolLayout), all remaining ones at the last layer
        host = stream = None
        if q.is_cuda:  # the sizes' pinned slots and the stream, once per prefill
            if self._sizes_host is None:
                self._sizes_host = torch.empty(self.n_layer, dtype=torch.long, pin_memory=True)
                self._stream = torch.cuda.current_stream(q.device)
            host, stream = self._sizes_host[layer.layer_idx : layer.layer_idx + 1], self._stream
        self._unallocated.append((layer, PoolLayout(plan.rows, plan.end, plan.fill, host, stream), plan, N))
        last = layer.layer_idx == self.n_layer - 1
        while len(self._unallocated) > (0 if last else 1):
            self._fill_pool(*self._unallocated.pop(0))
        return y if direct is not None else state.y

    def _prompt_padded(self, layer, core, q, k, v, hidden, groups) -> PromptState:
        """The rule's prompt state of a left-padded batch, one sequence at a time over its real tokens: the output
        is zero on padding, the keep mask false there, the types -1 and the cache sizes 0."""
        B, _, N, _ = q.shape
        Hkv = k.shape[1]
        whole = PromptState(torch.zeros_like(q))
        for rows, p in groups:
            bb = None if self._budgets is None else max(self._budgets_host[rows])
            part = self.rule.prompt(layer.context, core, q[rows, :, p:], k[rows, :, p:], v[rows, :, p:],
                                    hidden[rows, p:], bb, offset=p)  # fmt: skip
            whole.y[rows, :, p:] = part.y
            if part.extra is not None:  # the rule's own per-row state, the sequences in order
                whole.extra = whole.extra or {}
                for name, value in part.extra.items():
                    whole.extra.setdefault(name, []).append(value)
            for name, fill, dtype in (("keep", False, torch.bool), ("types", -1, torch.long), ("sizes", 0, torch.long)):
                value = getattr(part, name)
                if value is None:
                    continue
                if getattr(whole, name) is None:
                    setattr(whole, name, torch.full((B, Hkv, N), fill, dtype=dtype, device=q.device))
                getattr(whole, name)[rows, :, p:] = value
        if whole.extra is not None:
            whole.extra = {name: torch.cat(parts) for name, parts in whole.extra.items()}
        return whole

    def _fill_pool(self, layer, layout, plan, N) -> None:
        """A prefilled layer's buffers: its pool, its bookkeeping, its ring (if the rule has one), the rule's own
        buffers, its sizes so far (`nats.cache.engine.EngineLayer.install`)."""
        need = layout.size() + 1  # + the scratch slot (the last one) where skipped writes go
        fixed = None if self.row_slots is None else layout.rows.shape[-1] * self.row_slots + 1  # by the batch alone
        size = fixed if fixed is not None and need <= fixed else engine.rounded(need)
        layer.install(plan, layout.fill(size))
        layer.ready = True
        layer.real = self._real_rows
        layer.prompt_width = N
        if self.buffers is not None:  # the layer's buffers into the fixed ones, the fresh ones freed at once
            self.buffers.adopt(self, layer)

    # ------------------------------------------------------------------ decode (compiled by generate)
    def _decode(self, layer, q, k, v, hidden) -> Tensor:
        B, Hq, _, D = q.shape
        R = layer.seg.shape[1]
        G = Hq // (R // B)
        pos = (layer.cumulative_length - 1).reshape(1)  # the new token's position (padding included)
        y, size = self.rule.step(layer.context, layer, self.cores[layer.layer_idx], q.reshape(R, G, D),
                                 k.reshape(R, D), v.reshape(R, D), pos, hidden.reshape(B, -1))  # fmt: skip
        if self.track:
            layer.record(size)
        return y.reshape(B, Hq, 1, D)

    # ------------------------------------------------------------------ measurements
    # the engine's measurements (`nats.cache.engine.EngineLayer`), per layer, sequence and KV head
    def _per_layer(self, values) -> Tensor:
        return torch.stack([v.view(layer.batch_size, layer.n_kv_head, *v.shape[1:]) for layer, v in values])

    def kept(self) -> Tensor:
        """Tokens held now per layer, sequence and KV head, ``[n_layer, B, Hkv]``."""
        return self._per_layer((layer, layer.kept()) for layer in self.layers)

    def fractions(self) -> dict[str, Tensor]:
        """Area and peak fractions (spec section 6) over each row's real tokens so far, ``[n_layer, B, Hkv]``."""
        if not self.track:
            raise RuntimeError("StaticPolicyCache: made with track=False, it has no area / peak record")
        per = [(layer, layer.fractions()) for layer in self.layers]
        return {key: self._per_layer((layer, f[key]) for layer, f in per) for key in ("area", "peak")}

    def type_fractions(self) -> Tensor:
        """NAtS: fractions of global, local and sliding tokens so far (the prompt's real tokens and the decoded
        ones), float64 ``[n_layer, B, Hkv, 3]``; counted while tracking."""
        if not self.track:
            raise RuntimeError("StaticPolicyCache: made with track=False, it has no type counts")
        return self._per_layer((layer, layer.type_fractions()) for layer in self.layers)

    def kv_nbytes(self) -> int:
        """Bytes of the key/value buffers (pools and rings) allocated now."""
        return sum(layer.kv_nbytes() for layer in self.layers if layer.ready)

    def nbytes(self) -> int:
        """Bytes of every buffer the layers allocated (keys, values, bookkeeping, the rule's and the tracking's)."""
        return sum(layer.nbytes() for layer in self.layers if layer.ready)

    def kept_nbytes(self) -> int:
        """Bytes of the keys and values of the tokens held now."""
        return sum(layer.kept_nbytes() for layer in self.layers if layer.ready)

    def overflowed(self) -> bool:
        """True if more tokens were decoded than ``max_new_tokens`` planned (see Overflow in the module docstring)."""
        layer = self.layers[0]
        return layer.ready and int(layer.cumulative_length) - layer.prompt_width > self.max_new_tokens


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
