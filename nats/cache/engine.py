"""The cache engine's storage: one segmented KV pool per layer, its planning from a prompt, its decode attention, and
the layer that runs a policy's rule in it (`EngineLayer`).

Storage (one decoder layer; row ``r = b * Hkv + h`` is sequence b, KV head h), packed into few tensors because
every tensor a compiled decode step reads is a graph input that dynamo guards at every step:

* ``kv_pool`` ``[2, P, D]`` (keys, values): row r owns the segment ``[start[r], start[r] + cap[r])`` and holds
  ``length[r]`` tokens from its start; the last slot is a scratch slot that skipped writes go to;
* ``rows`` ``[6, R]`` int64: segment start, length, capacity, and three counters a rule may use (NAtS: the global
  count and the last token's type; the ring rule: the tokens written so far);
* optionally a ring ``ring_kv`` ``[2, R, W, D]`` with ``ring_valid`` ``[R, W]`` (NAtS' sliding tokens).

The capacity is planned at the prefill, per row (`plan_rows`): what the policy keeps of the prompt plus the tokens
the caller will decode, so memory follows the kept tokens, not the longest row times the rows. The pool's size is
read by the host without stalling the stream (`PoolLayout`) and rounded (`rounded`) so that few distinct shapes
are compiled. A decode step writes the new token by the policy's rule and attends over exactly what the row holds
(`attend`: the split-K Triton kernel on CUDA, `pool_attention_op`).

A policy is a `nats.cache.rule.FixedRule` subclass in its own file of `nats.cache.policies`: what it keeps of a
prompt and how a step changes its rows. The engine over a model's layers (the prefill across them, left padding,
budgets, the decode step, the cache-level measurements) is `nats.cache.engine_cache.EngineCache`;
`nats.hf.StaticPolicyCache` is its transformers adapter.

An :class:`EngineLayer` is a layer's storage with its rule and context: the measurements every policy shares (kept
tokens, area and peak fractions, bytes, NAtS' type fractions) and, for eager callers, growth: when the tokens to
decode are not known (``RuleContext.reserve=None``) or a row's segment is full, `EngineLayer.maintain` lays the pool
out again with more room (one reallocation, one more CUDA graph for a caller that replays the step as one), counting
on the host the steps that cannot fill a row so that it looks at the device only when they run out.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from nats.cache import attention as _attention

if TYPE_CHECKING:  # the rules import the storage's functions; the layer names their types only
    from nats.cache.rule import FixedRule, Plan, RuleContext

__all__ = [
    "PoolLayout",
    "SegmentStorage",
    "EngineLayer",
    "rounded",
    "grown",
    "plan_rows",
    "pool_fill",
    "mark_static",
    "num_sms",
    "decode_splits",
    "pool_splits",
    "write_kv",
    "segment_kv",
    "chunk_attention",
    "append_chunk",
    "attend",
    "pool_attention_op",
]

_ROUND = 1024  # pool sizes are rounded up to a multiple of this many slots (fewer distinct shapes to compile) ...


GROW_STEPS = 16  # free slots per row at least after a growth (or a prompt planned without a reserve) ...
GROW_SLACK = 1 / 32  # ... or this fraction of the row's tokens when that is more (few growths on long rows)


def grown(length: Tensor) -> Tensor:
    """The capacities ``[R]`` a growth gives rows holding ``length`` ``[R]`` tokens: ``length + max(GROW_STEPS,
    ceil(GROW_SLACK * length))``: the room a growth leaves is a small share of what the rows hold, so growths are
    rare and each copies O(kept tokens)."""
    extra = torch.ceil(length.to(torch.float64) * GROW_SLACK).to(torch.long).clamp(min=GROW_STEPS)
    return length + extra


def rounded(n: int) -> int:
    """... or of an eighth of the size's power of two when that is smaller (small pools stay small)."""
    step = max(256, min(_ROUND, 1 << max(0, n.bit_length() - 4)))
    return (n + step - 1) // step * step


def mark_static(*tensors: Tensor) -> None:
    """Tell dynamo the buffers keep their addresses (a compiled step then does not copy them into its graph)."""
    if not torch.compiler.is_compiling():
        for t in tensors:
            torch._dynamo.mark_static_address(t)


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_sms(index: int) -> int:  # read once per GPU: the prefill asks at every layer
    return torch.cuda.get_device_properties(index).multi_processor_count


def decode_splits(
    rows: int, bound: int, device: torch.device, sms: int | None = None, most: int = 64, head_dim: int = 128
) -> int:
    """Split-K count of the decode attention: about two programs per SM over the rows at head dim 128, four at 64
    (a program then reads half the bytes per key; `benchmarks/sweep_pool_attention.py` on an H200, 64 rows of 2-8k
    keys at head dim 64: 16 splits 5-7% faster than 8, at 128 no faster), at most ``most`` (a power of two: 64, or
    the kernel's `launch_config` for the rows and head dim), and splits of about 256 keys or more (``bound``: the
    keys a row can hold, known without a host synchronisation: the pool's slots per row, + the ring), rounded up to
    a power of two (at most seven launch shapes of the kernel, each captured in the CUDA graphs of the decode steps
    that use it)."""
    sms = num_sms(device) if sms is None else sms
    per_sm = 2 * max(1, 128 // head_dim)
    n = max(1, min(most, math.ceil(per_sm * sms / rows), math.ceil(bound / 256)))
    return 1 << (n - 1).bit_length()


def pool_splits(rows: int, bound: int, head_dim: int, device: torch.device) -> int:
    """The split-K count the decode attention launches with (`pool_attention_op`): `decode_splits` capped by the
    kernel's launch choice for the rows and head dim (`nats_kernels.nats_attention.pool_decode.launch_config`)."""
    from nats_kernels.nats_attention.pool_decode import launch_config  # noqa: PLC0415

    most = launch_config(rows, head_dim)["max_splits"]
    return decode_splits(rows, bound, device, most=most, head_dim=head_dim)


def plan_rows(keep: Tensor, cap: Tensor, n_global: Tensor | None = None, count: Tensor | None = None):
    """The segments of rows keeping the positions where ``keep`` (``[..., N]`` bool, rows flattened to ``[R, N]``),
    ``cap`` ``[R]`` slots planned each: (the flat keep mask; ``rank`` ``[R, N]``, each kept position's 1-based rank
    in its row; the rows' bookkeeping ``[6, R]`` (start, length, cap (at least the length), ``n_global``, -1 (no
    token typed yet), ``count``; zeros where not given); ``end`` ``[1]``, the slots all segments take)."""
    keep = keep.reshape(-1, keep.shape[-1])
    rank = keep.cumsum(1)
    length = rank[:, -1]
    cap = torch.maximum(cap, length)
    end = cap.cumsum(0)
    start = end - cap
    zero = torch.zeros_like(start)
    n_global, count = (zero if t is None else t for t in (n_global, count))
    return keep, rank, torch.stack((start, length, cap, n_global, zero - 1, count)), end[-1:]


def pool_fill(keep: Tensor, rank: Tensor, rows: Tensor, k: Tensor, v: Tensor, size: int) -> Tensor:
    """The pool ``[2, size, D]`` (keys, values) holding row r's kept positions (``keep``, ``rank``, ``rows``:
    `plan_rows`; k, v ``[B, Hkv, N, D]``) in order from its start; dropped positions go to the scratch slot, the
    last one. The rest is zeros: readers may touch unused slots."""
    R, N = keep.shape
    D = k.shape[-1]
    dest = torch.where(keep, rows[0, :, None] + rank - 1, size - 1)  # [R, N]
    pool = k.new_zeros(2, size, D)
    pool[0].index_put_((dest,), k.reshape(R, N, D))
    pool[1].index_put_((dest,), v.reshape(R, N, D))
    return pool


def write_kv(kv_pool: Tensor, dest: Tensor, k: Tensor, v: Tensor) -> None:
    """Write the rows' new keys and values ``k``, ``v`` (``[R, D]``, or ``[B, Hkv, D]`` views, e.g. of a fused qkv
    product: rows ``r = b * Hkv + h``) into slots ``dest`` ``[R]`` of the pool ``[2, P, D]``: one stack (which reads
    strided views as they are) and one in-place op on the pool itself. Written through its key and value views
    instead, a compiled step's functionalization copies the whole pool back at every layer and step (two copies of the
    cache per token, more bytes than the attention reads; tests/test_hf_static_cache.py inspects the compiled
    step)."""
    kv_pool.index_copy_(1, dest, torch.stack((k, v)).reshape(2, -1, k.shape[-1]))


def segment_kv(layer) -> tuple[Tensor, Tensor, Tensor]:
    """Each row's segment as dense tensors for a continuation's attention: keys and values ``[R, L, D]`` (L: the
    longest row) and the slot index ``[L]`` (slot s of row r is valid where ``s < length[r]``). One host read (L)."""
    L = max(int(layer.length.max()), 0)
    slot = torch.arange(L, device=layer.rows.device)
    idx = (layer.start[:, None] + slot).clamp(max=layer.kv_pool.shape[1] - 1)  # [R, L]
    kv = layer.kv_pool[:, idx]  # [2, R, L, D]
    return kv[0], kv[1], slot


def chunk_attention(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor) -> Tensor:
    """A continuation's attention: queries ``q`` ``[R, G, n, D]`` (a row's GQA group) over its keys and values ``[R,
    S, D]`` where ``mask`` ``[R, n, S]`` (bool; every query sees at least its own key). Returns ``[R, G, n, D]``."""
    G = q.shape[1]
    k = keys[:, None].expand(-1, G, -1, -1)
    v = values[:, None].expand(-1, G, -1, -1)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])


def append_chunk(layer, keep: Tensor, k: Tensor, v: Tensor, base: Tensor) -> Tensor:
    """Write the tokens of a continuation that each row keeps (``keep`` ``[R, n]``; k, v ``[R, n, D]``) in order
    after the row's first ``base`` ``[R]`` tokens (its room made beforehand, `EngineLayer.make_room`); the others go to
    the scratch slot. Sets and returns the rows' lengths."""
    R, n, D = k.shape
    rank = keep.long().cumsum(1) - 1
    dest = torch.where(keep, layer.start[:, None] + base[:, None] + rank, layer.kv_pool.shape[1] - 1)
    write_kv(layer.kv_pool, dest.reshape(-1), k.reshape(-1, D), v.reshape(-1, D))
    layer.length.copy_(base + keep.sum(1))
    return layer.length


class SegmentStorage:
    """The storage of a segmented-pool layer, written once for every layer that holds one (`nats.hf.StaticPolicyCache`'s
    layers, those of the GPT path's cache and of the evaluations).

    The buffers are packed into few tensors, the named ones being views of them: every tensor a compiled decode step
    reads from the cache is a graph input that dynamo guards before each replay, and the guard check is host time at
    every step. ``kv_pool`` ``[2, P, D]`` (keys, values; the last slot is the scratch slot), ``rows`` ``[6, R]`` int64
    (segment start, length, capacity, NAtS' global count and the last token's type, the ring rule's count), and for
    rules with a ring ``ring_kv`` ``[2, R, W, D]`` and ``ring_valid`` ``[R, W]``."""

    kv_pool: Tensor
    rows: Tensor  # [6, R]: start, length, capacity, global count, last type, count (the views below)
    ring_kv: Tensor | None = None
    ring_valid: Tensor | None = None

    k_pool = property(lambda self: self.kv_pool[0])
    v_pool = property(lambda self: self.kv_pool[1])
    ring_k = property(lambda self: self.ring_kv[0])
    ring_v = property(lambda self: self.ring_kv[1])
    start = property(lambda self: self.rows[0])
    length = property(lambda self: self.rows[1])
    cap = property(lambda self: self.rows[2])
    n_global = property(lambda self: self.rows[3])
    last_type = property(lambda self: self.rows[4])  # NAtS: the last token's type (-1: none yet)
    count = property(lambda self: self.rows[5])  # the ring rule: tokens written so far

    def storage_tensors(self) -> list[Tensor]:
        """The packed buffers (the views' bases)."""
        return [t for t in (self.kv_pool, self.rows, self.ring_kv, self.ring_valid) if t is not None]

    def storage_dynamic_dims(self) -> list[tuple[Tensor, tuple[int, ...]]]:
        """The packed buffers with the dimensions that depend on the batch and on what the prompt keeps: the
        pool's slots, the rows (the head dim and the ring's width do not change)."""
        dims = [(self.kv_pool, (1,)), (self.rows, (1,))]
        if self.ring_kv is not None:
            dims += [(self.ring_kv, (1,)), (self.ring_valid, (0,))]
        return dims

    def storage_kv_nbytes(self) -> int:
        """Bytes of the key/value buffers (pool and ring)."""
        return sum(t.numel() * t.element_size() for t in (self.kv_pool, self.ring_kv) if t is not None)

    def relayout(self, cap: Tensor) -> None:
        """Lay the pool out again with capacities ``cap`` ``[R]`` (at least the lengths), the segments copied over in
        order (O(kept tokens)); the scratch slot last. The counters are kept."""
        length = self.length
        R = length.shape[0]
        new = self.rows.clone()
        new[2] = torch.maximum(cap, length)
        end = new[2].cumsum(0)
        new[0] = end - new[2]
        size = int(end[-1]) + 1
        kv_pool = self.kv_pool.new_zeros(2, size, self.kv_pool.shape[-1])
        total = int(length.sum())
        if total:
            rows = torch.repeat_interleave(torch.arange(R, device=length.device), length)
            off = torch.arange(total, device=length.device) - (torch.cumsum(length, 0) - length)[rows]
            kv_pool[:, new[0][rows] + off] = self.kv_pool[:, self.start[rows] + off]
        self.kv_pool, self.rows = kv_pool, new


class PoolLayout:
    """A layer's planned pool: its rows' bookkeeping (``rows``, device tensors), ``fill(size)``, which makes the pool
    of that many slots, and the pool's size, read by the host without stopping the stream: the prefill plans layer
    l's pool, goes on with layer l + 1 and allocates layer l's pool then, when the size has long arrived (a blocking
    read per layer would leave the GPU idle while the host waited, at every layer of a host-bound prefill)."""

    def __init__(self, rows: Tensor, end: Tensor, fill, host: Tensor | None, stream):
        """``end`` ``[1]``: the size on the device; for CUDA, ``host``: a slot of pinned memory ``[1]`` the size is
        copied into and ``stream``: the current CUDA stream (the prefill makes both once for all its layers)."""
        self.rows, self.fill = rows, fill
        self._event = None
        if end.device.type == "cuda":  # an asynchronous copy into pinned memory, and an event after it
            self._host = host
            self._host.copy_(end, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(stream)
        else:
            self._host = end

    def size(self) -> int:
        """Slots the segments take (waits for the copy only, not for the work queued after it)."""
        if self._event is not None:
            self._event.synchronize()
        return int(self._host[0])


# The decode attention as a ``torch.library`` custom op, so that a decode step calling it compiles with
# ``torch.compile`` (fullgraph) and replays as a CUDA graph: the Triton split-K kernel on CUDA (each KV head read once
# for its GQA group), the PyTorch reference elsewhere.
@torch.library.custom_op("nats::pool_attention", mutates_args=())
def pool_attention_op(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    start: Tensor,
    length: Tensor,
    ring_k: Tensor | None,
    ring_v: Tensor | None,
    ring_valid: Tensor | None,
    even: bool = False,
    backend: str = "auto",
) -> Tensor:
    """q ``[R, G, D]`` over segment ``[start[r], start[r] + length[r])`` of ``k_pool``/``v_pool`` ``[P, D]`` and the
    valid ring slots (``ring_k``/``ring_v`` ``[R, W, D]``, ``ring_valid`` ``[R, W]``) -> ``[R, G, D]``; ``even``: the
    rows hold the same number of keys (the policy's ``even_rows``: each row split alike; else the rows' keys streamed
    end to end in equal shares); ``backend``: ``"torch"``, ``"triton"`` or ``"auto"`` (the default: Triton for CUDA
    tensors where the kernels import, else PyTorch; `nats.cache.attention.resolve_backend`).

    The split-K count is chosen here, when the op runs, from the rows and the pool's slots per row
    (`pool_splits`), not by the compiled step: as a constant of the graph it made one more graph per value, and a
    process serving changing batches and prompts reached dynamo's recompile limit (then decoding eagerly)."""
    backend = _attention.resolve_backend(backend, q.device)
    max_len = 0 if backend == "triton" else max(int(length.max()), 1)  # Triton reads the lengths on the device
    R = q.shape[0]
    splits = None
    if backend == "triton":
        bound = -(-k_pool.shape[0] // R) + (0 if ring_k is None else ring_k.shape[1])
        splits = pool_splits(R, bound, q.shape[-1], q.device)
    return _attention.pool_attention(q, k_pool, v_pool, start, length, max_len, ring_k=ring_k, ring_v=ring_v,
                                    ring_valid=ring_valid, backend=backend, splits=splits,
                                    balanced=not even)  # fmt: skip


@pool_attention_op.register_fake
def _(q, k_pool, v_pool, start, length, ring_k, ring_v, ring_valid, even=False, backend="auto"):
    return torch.empty_like(q)


def attend(layer, qr: Tensor, ring: bool = False, even: bool = False, backend: str = "auto") -> Tensor:
    """Decode attention of ``qr`` ``[R, G, D]`` over each row's segment of ``layer.kv_pool`` (and its valid ring
    slots where ``ring``): `pool_attention_op`; ``even``: the policy's ``even_rows``; ``backend``: the context's."""
    if ring:
        return pool_attention_op(qr, layer.k_pool, layer.v_pool, layer.start, layer.length, layer.ring_k,
                                  layer.ring_v, layer.ring_valid, even, backend)  # fmt: skip
    return pool_attention_op(qr, layer.k_pool, layer.v_pool, layer.start, layer.length, None, None, None, even,
                             backend)  # fmt: skip


class EngineLayer(SegmentStorage):
    """One layer of the engine: its storage (`SegmentStorage`), the rule that runs in it (``rule``, a `FixedRule`)
    and where (``context``, a `RuleContext`), the measurements every policy shares, and growth for eager callers.
    `nats.hf.StaticPolicyCache`'s layers are EngineLayers; so is a layer driven directly (`prefill`, `step`).

    **Measurements** (spec section 6), the same for every policy: where the context tracks, ``area`` (float64) and
    ``peak`` (int64) ``[R]`` hold the sum and the maximum of the cache sizes c_i of the row's queries (the prompt's
    from the plan, then `record` at each step); `fractions` divides them by the row's real tokens so far (`seen`);
    `kept` is what the rule holds now, `nbytes` / `kv_nbytes` / `kept_nbytes` the bytes of the layer's buffers, of
    its keys and values, and of the kept tokens' keys and values; `type_fractions` the fractions of each token type
    for rules that count them while tracking (NAtS: its ``type_counts`` ``[R, 3]``).

    **Growth** (rules that `FixedRule.grows`): a row's segment holds what the prompt kept plus ``context.room``
    free slots (the reserve, or `GROW_STEPS` when the number of new tokens is unknown). A step adds at most one token
    per row, so the host knows that ``free_steps`` steps cannot fill a row without looking at the device. `maintain`,
    before each eager step, counts them down; when they run out it reads the rows' free slots once (one host
    synchronisation), goes on if every row has room, and otherwise lays the pool out again with `grown` capacities
    (`SegmentStorage.relayout`, O(kept tokens); the counters and the ring stay as they are, so NAtS' globals, locals
    and sliding tokens survive). A growth reallocates the pool: `maintain` returns True, and a caller replaying the
    step as a CUDA graph must capture it again (one reallocation, one more CUDA graph). The compiled fixed-capacity
    path (`nats.hf.StaticPolicyCache`) never calls it: it plans its reserve and keeps the rule's overflow."""

    rule: FixedRule
    context: RuleContext
    core: Any = None  # the layer's attention core (NAtS' scorer), for `prefill` and `step`
    area: Tensor | None = None
    peak: Tensor | None = None
    real: Tensor  # each row's real prompt tokens [R]
    prompt_width: int = 0  # the prompt's tokens, padding included
    t: int = 0  # tokens per row so far, padding included (the position of the next token)
    free_steps: int | None = None  # steps that cannot fill a row, known on the host (None: the layer never grows)
    reallocations: int = 0  # growths so far
    peak_nbytes: int = 0  # the most bytes the layer's buffers took

    def __init__(self, rule: FixedRule, context: RuleContext, core=None):
        """A layer driven directly (`prefill`, then `maintain` and `step` per token)."""
        self.rule, self.context, self.core = rule, context, core

    def install(self, plan: Plan, pool: Tensor, real: Tensor, width: int) -> None:
        """Take a planned layer's buffers: the pool ``[2, P, D]`` (``plan.fill``), the rows' bookkeeping, the ring and
        the rule's own buffers where it has them, the prompt's area and peak where tracked (all marked static); then
        the rule's ``setup``. ``real`` ``[R]``: each row's real prompt tokens, ``width``: the prompt's tokens, padding
        included; the free steps a growing rule has (its planned room) and the bytes taken are known from here."""
        self.kv_pool, self.rows = pool, plan.rows
        self.real, self.prompt_width = real, width
        if self.context.track:
            self.area, self.peak = plan.sizes.sum(-1).double(), plan.sizes.amax(-1)
        if plan.ring is not None:
            self.ring_kv, self.ring_valid, self.window = plan.ring
        for name, value in (plan.extra or {}).items():
            setattr(self, name, value)
        self.rule.setup(self.context, self)
        mark_static(*self.own_tensors())
        self.free_steps = self.context.room if self.rule.grows else None
        self.peak_nbytes = self.nbytes()

    # ------------------------------------------------------------------ driven directly (eager)
    def prefill(self, q: Tensor, k: Tensor, v: Tensor, hidden: Tensor | None = None, budget: int | None = None):
        """The prompt of unpadded rows: q ``[B, Hq, N, D]``, k, v ``[B, Hkv, N, D]``, ``hidden`` ``[B, N, C]`` (NAtS'
        scorer input), ``budget`` tokens per row (budgeted rules). Returns the attention output ``[B, Hq, N, D]``;
        the storage is planned, filled and its free steps known."""
        ctx, rule = self.context, self.rule
        B, Hkv, N = k.shape[:3]
        direct = rule.direct(ctx, self.core, q, k, v, hidden)
        if direct is not None:
            y, plan = direct
        else:
            state = rule.prompt(ctx, self.core, q, k, v, hidden, budget)
            rows = torch.full((B * Hkv,), N, dtype=torch.long, device=k.device)
            # each row's budget whole, as `EngineCache` plans it: the ring rule's capacity is the budget even where
            # the prompt is shorter
            plan = rule.plan(ctx, self.core, state, k, v, None if budget is None else torch.full_like(rows, budget),
                             rows)  # fmt: skip
            y = state.y
            if plan.sizes is None and state.sizes is not None:
                plan.sizes = state.sizes.reshape(B * Hkv, N)
        self.install(plan, plan.fill(rounded(int(plan.end) + 1)), torch.full_like(plan.rows[1], N), N)  # + scratch
        self.t = N
        return y

    def step(self, qr: Tensor, kr: Tensor, vr: Tensor, hidden: Tensor | None = None) -> Tensor:
        """One eager decode step of every row: `maintain` (growth), the rule's step for the token at position ``t``
        (``qr`` ``[R, G, D]``, ``kr``, ``vr`` ``[R, D]``, ``hidden`` ``[B, C]``: NAtS' scorer input), its cache
        sizes recorded. Returns the attention output ``[R, G, D]``."""
        self.maintain()
        pos = torch.full((1,), self.t, dtype=torch.long, device=kr.device)
        y, size = self.rule.step(self.context, self, self.core, qr, kr, vr, pos, hidden)
        if self.context.track:
            self.record(size)
        self.t += 1
        return y

    def maintain(self) -> bool:
        """Host-side upkeep before an eager step (class docstring): True when the pool was reallocated (a captured
        CUDA graph must be captured again), False otherwise; no host synchronisation while ``free_steps`` lasts."""
        if self.free_steps is None:
            return False
        if self.free_steps > 0:
            self.free_steps -= 1
            return False
        free = int((self.cap - self.length).min())  # one synchronisation, once the guarantee ran out
        full = free <= 0
        if full:  # a row is full: grow (at least GROW_STEPS free slots per row after it)
            self.grow()
            free = int((self.cap - self.length).min())
        self.free_steps = free - 1
        return full

    def grow(self, extra: int = 0) -> None:
        """Lay the pool out again with `grown` capacities (every row: its tokens + ``extra`` + their slack)."""
        self.relayout(grown(self.length + extra))
        mark_static(self.kv_pool, self.rows)  # a compiled step's fixed buffers, as install marks them
        self.reallocations += 1
        self.peak_nbytes = max(self.peak_nbytes, self.nbytes())

    def make_room(self, n: int) -> bool:
        """Before a continuation of a growing rule: at least ``n`` free slots in every row (one host read; a growth
        where a row has fewer: True, the pool reallocated). The free steps are counted from what is left after n."""
        if not self.rule.grows:
            return False
        free = int((self.cap - self.length).min())
        grew = free < n
        if grew:
            self.grow(n)
            free = int((self.cap - self.length).min())
        if self.free_steps is not None:
            self.free_steps = max(free - n, 0)
        return grew

    # ------------------------------------------------------------------ measurements
    def record(self, size: Tensor) -> None:
        """Add one step's cache sizes c_i ``[R]`` (the keys each row's query read) to ``area`` and ``peak``."""
        self.area.add_(size.to(torch.float64))
        torch.maximum(self.peak, size, out=self.peak)

    def seen(self) -> Tensor:
        """Real tokens per row so far ``[R]``: the row's prompt (padding excluded) and the decoded ones."""
        return self.real + (self.t - self.prompt_width)

    def kept(self) -> Tensor:
        """Tokens each row holds now ``[R]`` (the rule's count: NAtS' segment and valid ring slots)."""
        return self.rule.kept(self)

    def fractions(self) -> dict[str, Tensor]:
        """Area and peak fractions (spec section 6) over each row's real tokens so far, float64 ``[R]`` each:
        ``sum_i c_i / sum_i (i + 1)`` and ``max_i c_i / n`` (spec section 6)."""
        if self.area is None:
            raise RuntimeError("the layer does not track its cache sizes (its context has track=False)")
        n = self.seen().double()
        return {"area": self.area / (n * (n + 1) / 2), "peak": self.peak.double() / n}

    def type_fractions(self) -> Tensor:
        """Fractions of global, local and sliding tokens so far, float64 ``[R, 3]`` (rules that count token types
        while tracking: NAtS)."""
        counts = getattr(self, "type_counts", None)
        if counts is None:
            raise RuntimeError(f"the {self.rule.name!r} rule counts no token types (NAtS does, while tracking)")
        c = counts.to(torch.float64)
        return c / c.sum(-1, keepdim=True).clamp(min=1)

    def own_tensors(self) -> list[Tensor]:
        """The layer's buffers: the storage's, the rule's, the area and peak where tracked."""
        rows = [t for t in (self.area, self.peak) if t is not None]
        return self.storage_tensors() + self.rule.buffers(self) + rows

    def nbytes(self) -> int:
        """Bytes of every buffer the layer owns (keys, values and bookkeeping)."""
        return sum(t.numel() * t.element_size() for t in self.own_tensors())

    def kv_nbytes(self) -> int:
        """Bytes of the key/value buffers (pool and ring)."""
        return self.storage_kv_nbytes()

    def kept_nbytes(self) -> int:
        """Bytes of the keys and values of the tokens held now."""
        return int(self.kept().sum()) * 2 * self.kv_pool.shape[-1] * self.kv_pool.element_size()
