"""`EngineCache`: the fixed-capacity cache engine (`nats.cache.engine`) over a model's decoder layers, independent of
transformers: one `EngineLayer` per layer running a policy's rule, the prompt's prefill across the layers (left
padding, budgets, the pools' layout with their sizes read without stalling the stream), the decode step and the
cache-level measurements.

A caller drives it one layer at a time, in order: `EngineCache.attend` prefills a layer at its first call (the
prompt ``[B, Hq, N, D]``, ``pads`` ``[B]`` left-padding tokens per sequence, read at the first layer) and decodes one
token per row after that (positions counted on the host). `nats.hf.StaticPolicyCache` is the transformers adapter
over this class: it takes the keys and values from transformers' ``update``, keeps the position counter on the
device (its compiled decode step reads no host state) and calls `_prefill` and `_decode` itself.

**Prefill**: the rule's attention over the prompt and what it keeps (`FixedRule.direct`, or `FixedRule.prompt` and
`FixedRule.plan`; a left-padded batch one sequence at a time over its real tokens, `_prompt_padded`), then each row's
segment, planned as the kept tokens + the reserve (``reserve``: the tokens to decode; None: `GROW_STEPS`). Layer l's
pool is allocated when layer l + 1 has been planned (`PoolLayout`: its size arrives meanwhile), the remaining ones
at the last layer (`_fill_pool`). **Decode**: the rule's step for the token at a given position, its cache sizes
recorded where tracked. **Measurements** per layer, sequence and KV head: `kept`, `fractions`, `type_fractions`,
and the bytes `nbytes`, `kv_nbytes`, `kept_nbytes`; `overflowed` says whether more tokens were decoded than the
reserve planned (the rule's overflow then bound).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from nats.cache import engine
from nats.cache.attention import resolve_backend
from nats.cache.budget import check_budget_value, row_budgets
from nats.cache.engine import EngineLayer, PoolLayout
from nats.cache.registry import get_cache_class
from nats.cache.rule import PromptState, RuleContext

__all__ = ["EngineCache", "LayerPort", "fixed_policy"]


def fixed_policy(policy: str, who: str, decodable: bool = True):
    """The registered class of ``policy`` if it declares a fixed-capacity rule (and decodes, with ``decodable``), else
    a ValueError naming ``who``."""
    try:
        cls = get_cache_class(policy)  # an unknown name fails with the registered ones
        if decodable:  # the budget is checked with the cache
            cls.check_decodes()
    except ValueError as err:
        raise ValueError(f"{who}: {err}") from None
    return cls


class EngineCache:
    """The engine over ``n_layer`` decoder layers (module docstring).

    Args:
        policy: a registered policy with a fixed-capacity rule (`nats.cache.rule.fixed_policies`).
        cores: each layer's attention core (NAtS' scorer; None where it has none), ``n_layer`` of them.
        reserve: tokens to decode after the prompt, planned per row on top of what the prompt leaves (None: unknown,
            `GROW_STEPS` free slots; `RuleContext.reserve`).
        budget: budgeted policies: tokens per row and KV head (an int), or a fraction of each row's prompt (a float
            in (0, 1)); `nats.cache.budget`.
        track: record each decode step's cache size for `fractions` and, for NAtS, count the token types.
        prefill_kernel: how NAtS' prefill writes the cache: ``"auto"``, ``"torch"`` or ``"triton"``.
        backend: the decode attention's kernels: ``"auto"``, ``"torch"`` or ``"triton"`` (`RuleContext.backend`).
        row_slots: each layer's pool takes at least rows x ``row_slots`` slots (rows: sequences x KV heads).
        who: the name errors start with.
        **options: the policy's options, bound to its rule (``FixedRule.rule``).
    """

    def __init__(
        self,
        policy: str,
        cores: list,
        *,
        reserve: int | None,
        budget: int | float | None = None,
        track: bool = True,
        prefill_kernel: str = "auto",
        backend: str = "auto",
        row_slots: int | None = None,
        device: Any = None,
        who: str = "EngineCache",
        decodable: bool = True,
        **options: Any,
    ):
        self.policy, self.policy_cls = policy, fixed_policy(policy, who, decodable)
        self.rule = self.policy_cls.rule(**options)  # the policy's options bound to its rule
        self.cores, self.n_layer = list(cores), len(cores)
        need = self.policy_cls.requires_core
        if need is not None and any(getattr(c, "name", None) != need for c in self.cores):
            attach = {"nats": "nats.hf.attach_nats(model)", "dms": "nats.hf.attach_dms(model)"}.get(need, need)
            raise ValueError(
                f"{who}: policy {policy!r} needs the model's {need} attention in every layer (a transformers model: "
                f"{attach}; a GPT: model.attention.name={need})"
            )
        try:
            self.policy_cls.check_use(budget, decode=decodable)
            check_budget_value(budget, "each row's prompt")
        except ValueError as err:
            raise ValueError(f"{who}: {err}") from None
        self.budget = budget
        self.reserve, self.track, self.backend, self.who = reserve, track, backend, who
        if prefill_kernel not in ("auto", "torch", "triton"):
            raise ValueError(f"{who}: prefill_kernel must be 'auto', 'torch' or 'triton', got {prefill_kernel!r}")
        self.prefill_kernel = prefill_kernel
        if row_slots is not None and (int(row_slots) != row_slots or row_slots < 1):
            raise ValueError(f"{who}: row_slots must be a positive integer, got {row_slots!r}")
        self.row_slots = row_slots
        self.device = None if device is None else torch.device(device)  # where the layers will be (known or not)
        # an eager caller's growth: each decode step runs the layer's `EngineLayer.maintain` first; a caller that
        # replays the step as a CUDA graph calls `maintain` itself before each replay (nats.cache.decode.GraphDecoder)
        self.auto_maintain = reserve is None
        self.prompt_lengths: Tensor | None = None  # real tokens per sequence, set by the prefill
        self._real_rows: Tensor | None = None  # the same per row (sequence x KV head)
        self._unallocated: list[tuple] = []  # prefilled layers whose pools are allocated at the next layer
        self._sizes_host: Tensor | None = None  # CUDA: the layers' pool sizes, copied into pinned memory ...
        self._stream = None  # ... on this stream (both set by the first prefilled layer)
        self._continued_to: int | None = None  # tokens per row at the end of the last continuation (`_extend`)
        self._budgets: Tensor | None = None  # budgeted policies: tokens per sequence, set by the prefill ...
        self._budgets_host: list[int] = []  # ... and the same on the host ...
        self._row_budgets: Tensor | None = None  # ... and per row (sequence x KV head)
        self.layers = [self.new_layer(i) for i in range(self.n_layer)]

    def layer_context(self, layer_idx: int) -> RuleContext:
        """Where the rule runs in layer ``layer_idx``."""
        return RuleContext(layer_idx, self.n_layer, self.reserve, self.track, self.prefill_kernel, self.backend)

    def new_layer(self, layer_idx: int) -> EngineLayer:
        """Layer ``layer_idx``'s `EngineLayer`, unfilled (an adapter makes its own kind)."""
        layer = EngineLayer(self.rule, self.layer_context(layer_idx), self.cores[layer_idx])
        layer.layer_idx, layer.ready = layer_idx, False
        return layer

    def installed(self, layer: EngineLayer) -> None:
        """Called once a layer's buffers are filled (an adapter moves them into fixed buffers here)."""

    # ------------------------------------------------------------------ driven directly
    def attend(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor, hidden: Tensor | None = None,
               pads: Tensor | None = None, pos: Tensor | None = None) -> Tensor:  # fmt: skip
        """The layer's attention output ``[B, Hq, N, D]`` for its new queries (q ``[B, Hq, N, D]``, k, v ``[B, Hkv,
        N, D]``, ``hidden`` ``[B, N, C]``: NAtS' scorer input): the prompt at the layer's first call (``pads`` ``[B]``:
        each sequence's left padding, read at the first layer; None: none), then decode steps: each of the N tokens
        in turn (teacher forcing), at ``pos`` (a device LongTensor ``[1]``, one token: a step without host
        synchronisation) or at the position counted on the host (``layer.t``). With ``auto_maintain`` (a cache made
        without a reserve) each step first grows the layer's pool where a row may fill (`EngineLayer.maintain`);
        else the capacity is fixed at the prefill and past the reserve the rule's overflow binds (`overflowed`)."""
        layer = self.layers[layer_idx]
        if not layer.ready:
            layer.batch_size, layer.n_kv_head = k.shape[:2]
            layer.t = q.shape[2]
            return self._prefill(layer, q, k, v, hidden, pads)
        if q.shape[2] > 1:  # a continuation of the sequence (the next turn of a conversation)
            y = self._extend(layer, q, k, v, hidden, layer.t if pos is None else int(pos))
        else:
            first = pos if pos is not None else torch.full((1,), layer.t, dtype=torch.long, device=q.device)
            y = self._steps(layer, q, k, v, hidden, first)
        layer.t += q.shape[2]
        return y

    def __len__(self) -> int:
        return self.n_layer

    def __getitem__(self, layer_idx: int) -> LayerPort:
        """Layer ``layer_idx`` as a model's attention layer calls it (`LayerPort`: ``prefill`` and ``step``)."""
        if not 0 <= layer_idx < self.n_layer:
            raise IndexError(f"{self.who}: layer {layer_idx} of {self.n_layer}")
        return LayerPort(self, layer_idx)

    def maintain(self) -> bool:
        """Every layer's upkeep before a decode step that the caller runs itself (a CUDA-graph replay): True when a
        layer's pool was reallocated (the graph must be captured again; `EngineLayer.maintain`)."""
        return any([layer.maintain() for layer in self.layers])  # every layer (each keeps its own counters)

    def replayed(self) -> None:
        """The host counters of a decode step that ran as a CUDA-graph replay (the graph holds only its device
        work)."""
        for layer in self.layers:
            layer.t += 1

    @property
    def t(self) -> int:
        """Tokens per row so far, padding included (0 before the prefill)."""
        layer = self.layers[0]
        return layer.t if layer.ready else 0

    def graph_safe(self) -> bool:
        """Whether a decode step through this cache can be captured in a CUDA graph: its layers on a CUDA device (the
        ``device`` it was made for) and the Triton decode kernels (which read the lengths on the device)."""
        dev = self.device
        return dev is not None and dev.type == "cuda" and resolve_backend(self.backend, dev) == "triton"

    def reallocations(self) -> int:
        """The layers' pool growths so far (`EngineLayer.grow`)."""
        return sum(layer.reallocations for layer in self.layers)

    def peak_nbytes(self) -> int:
        """The most bytes the layers' buffers took (after the prefill or a growth)."""
        return sum(layer.peak_nbytes for layer in self.layers if layer.ready)

    # ------------------------------------------------------------------ prefill
    def _prefill(self, layer, q, k, v, hidden, pads) -> Tensor:
        B, Hq, N, D = q.shape
        Hkv = k.shape[1]
        R = B * Hkv
        if self.prompt_lengths is None:  # the first layer: the padding, once for every layer
            if pads is None:
                pads = torch.zeros(B, dtype=torch.long, device=q.device)
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
            shared = slice(None) if self.rule.shared_budget else rows  # the batch's rows, or the sequence's
            bb = None if self._budgets is None else max(self._budgets_host[shared])
            x = None if hidden is None else hidden[rows, p:]
            part = self.rule.prompt(layer.context, core, q[rows, :, p:], k[rows, :, p:], v[rows, :, p:], x, bb,
                                    offset=p)  # fmt: skip
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
        layer.install(plan, layout.fill(size), self._real_rows, N)
        layer.ready = True
        self.installed(layer)

    # ------------------------------------------------------------------ decode (compiled by an adapter)
    def _steps(self, layer, q, k, v, hidden, first: Tensor) -> Tensor:
        """Decode steps of the layer's N new tokens in turn (teacher forcing), at positions ``first`` ``[1]``,
        ``first + 1``, ..., each after the layer's growth check where the cache grows (``auto_maintain``,
        `EngineLayer.maintain`). Returns the outputs ``[B, Hq, N, D]``."""
        ys = []
        for i in range(q.shape[2]):
            if self.auto_maintain:
                layer.maintain()
            s = slice(i, i + 1)
            x = None if hidden is None else hidden[:, s]
            ys.append(self._decode(layer, q[:, :, s], k[:, :, s], v[:, :, s], x, first if i == 0 else first + i))
        return ys[0] if len(ys) == 1 else torch.cat(ys, dim=2)

    def _extend(self, layer, q, k, v, hidden, first: int) -> Tensor:
        """The N tokens that continue every row's sequence at positions ``first`` .. ``first + N - 1``: the rule's
        parallel `FixedRule.extend` after its rows' room is made for them (and for the reserve a fixed-capacity
        caller decodes next; `EngineLayer.make_room`), else N decode steps in turn (`_steps`). The outputs ``[B, Hq,
        N, D]``; the cache sizes recorded where tracked."""
        B, Hq, N, D = q.shape
        R = layer.rows.shape[1]
        G = Hq // (R // B)
        layer.make_room(N + (0 if self.auto_maintain else int(self.reserve or 0)))
        if layer.layer_idx == 0:  # the reserve is planned again after a continuation (`overflowed`)
            self._continued_to = first + N
        out = self.rule.extend(layer.context, layer, self.cores[layer.layer_idx], q.reshape(R, G, N, D),
                               k.reshape(R, N, D), v.reshape(R, N, D), hidden, first)  # fmt: skip
        if out is None:
            return self._steps(layer, q, k, v, hidden, torch.full((1,), first, dtype=torch.long, device=q.device))
        y, sizes = out
        if self.track:
            layer.area.add_(sizes.sum(1).to(torch.float64))
            torch.maximum(layer.peak, sizes.amax(1), out=layer.peak)
        return y.reshape(B, Hq, N, D)

    def _decode(self, layer, q, k, v, hidden, pos) -> Tensor:
        """One decode step of every row of the layer: the new token (q ``[B, Hq, 1, D]``, k, v ``[B, Hkv, 1, D]``)
        at position ``pos`` ``[1]`` (padding included); device tensors only, no host synchronisation."""
        B, Hq, _, D = q.shape
        R = layer.rows.shape[1]
        G = Hq // (R // B)
        x = None if hidden is None else hidden.reshape(B, -1)
        # k and v as [B, Hkv, D] views where the projection wrote them: a rule reads them through their strides (the
        # fused kernels, one stack in write_kv), not after a copy per tensor (two kernels a layer and step)
        y, size = self.rule.step(layer.context, layer, self.cores[layer.layer_idx], q.reshape(R, G, D), k[:, :, 0],
                                 v[:, :, 0], pos, x)  # fmt: skip
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
            raise RuntimeError(f"{self.who}: made with track=False, it has no area / peak record")
        per = [(layer, layer.fractions()) for layer in self.layers]
        return {key: self._per_layer((layer, f[key]) for layer, f in per) for key in ("area", "peak")}

    def counts_types(self) -> bool:
        """Whether the rule counts token types while tracking (NAtS; `type_fractions`)."""
        layer = self.layers[0]
        return self.track and layer.ready and getattr(layer, "type_counts", None) is not None

    def type_fractions(self) -> Tensor:
        """NAtS: fractions of global, local and sliding tokens so far (the prompt's real tokens and the decoded
        ones), float64 ``[n_layer, B, Hkv, 3]``; counted while tracking."""
        if not self.track:
            raise RuntimeError(f"{self.who}: made with track=False, it has no type counts")
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
        """True if more tokens were decoded than the reserve planned after the prompt or the last continuation (the
        rule's overflow bound: NAtS kept a global or local token of a full segment as a sliding one, the appending
        rules stopped admitting)."""
        layer = self.layers[0]
        if not layer.ready or self.reserve is None:
            return False
        planned = layer.prompt_width if self._continued_to is None else self._continued_to  # the last prefill's end
        return layer.t - planned > self.reserve


class LayerPort:
    """One layer of an `EngineCache` as a model's attention layer calls it (the GPT model of `nats.models.gpt`):
    ``prefill`` of the prompt from an empty layer, ``step`` of one token at a device position."""

    __slots__ = ("cache", "layer_idx")

    def __init__(self, cache: EngineCache, layer_idx: int):
        self.cache, self.layer_idx = cache, layer_idx

    def prefill(self, q: Tensor, k: Tensor, v: Tensor, x: Tensor | None = None) -> Tensor:
        if self.cache.layers[self.layer_idx].ready:
            raise RuntimeError(f"{self.cache.who}: prefill() starts from an empty cache (make a new one per prompt)")
        return self.cache.attend(self.layer_idx, q, k, v, x)

    def step(self, q: Tensor, k: Tensor, v: Tensor, x: Tensor | None, pos: Tensor) -> Tensor:
        return self.cache.attend(self.layer_idx, q, k, v, x, pos=pos)
