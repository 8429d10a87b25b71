"""`nats`: the NAtS KV cache (spec section 5), batched, per KV head, with per-head lengths.

At step i the new token's type t_i (argmax of the layer's scorer on the block's normalised input, token 0
global) is computed per KV head, its key/value admitted, and query i attends to exactly ``{j <= i : M_ij = 1}``
(spec section 2). Then: sliding tokens older than W - 1 steps are evicted, a head's locals are evicted once one
of its globals has been queried, globals stay.

Storage (one layer; row r = sequence b, KV head h):

* **ring** ``[R, W, D]`` (+ valid flags ``[R, W]``): token i is written to slot ``i % W`` of every row, valid
  where its type is sliding. The slot held token i - W, whose window ended at query i - 1, so sliding tokens
  expire by being overwritten; after query i the slot of token i - W + 1 is marked invalid (its window ends).
* **pool** ``[P + 1, D]`` with a segment ``[start[r], start[r] + cap[r])`` per row, holding ``length[r]`` tokens: the
  row's globals (``n_global[r]`` of them) followed by its live locals (those after its last global). Global or local
  tokens are appended at ``start + length`` (a scatter; rows whose token is sliding write to the scratch slot P).
  After query i, in the rows where t_i is global, the token is moved from ``start + length - 1`` to ``start +
  n_global`` and ``length = n_global + 1`` (the fused kernels write it there at once): the locals are dropped by
  truncation, so segments never hold holes. Each step costs O(B * Hkv * D), never a copy of the cache.
* **planned capacity** (``reserve`` = the number of tokens the caller will decode, as `generate` passes its
  ``max_new_tokens``): the prefill (:meth:`load`) gives row r ``cap = length + reserve`` slots. A step adds at
  most one token per row, so for ``reserve`` steps no row can overflow and :meth:`maintain` returns False
  without looking at the device (a captured CUDA graph is replayed as is). **Overflow rule**: when the
  guarantee runs out (more tokens decoded than reserved), ``maintain`` reads the lengths once; rows with free
  slots extend the guarantee to the fewest free slots, and only when a row is full is the pool compacted (as
  below: a reallocation, ``maintain`` returns True and a captured graph is captured again).
* **periodic compaction** (``reserve=None``: callers that do not say how many tokens they decode, e.g. an
  open-ended loop of steps; :meth:`maintain`, host side, every ``check_every`` steps, one synchronisation): if
  some row has fewer than ``check_every`` free slots (it could overflow before the next check), or the pool is
  larger than ``shrink_above`` times what the rows need (e.g. after many locals were dropped), the pool is laid
  out again: row r gets ``cap = length + max(check_every, ceil(slack * length))`` slots and the segments are
  copied over (O(kept tokens)). Between compactions everything runs on the device with fixed shapes, so a
  decode step is CUDA-graph capturable; a compaction reallocates the pool (``maintain`` returns True).

Memory is therefore the kept tokens plus a slack of ``max(check_every, slack * length)`` per row plus W ring
slots per row (the paper's Algorithm 3 keeps per-head buffers with valid lengths and compacts them
periodically in the same spirit). Attention reads each segment and the valid ring slots once
(:func:`nats.cache.attention.pool_attention`; Triton on CUDA).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from nats import functional as NF
from nats.cache.attention import pool_attention, resolve_backend
from nats.cache.base import LayerCache
from nats.cache.engine import FixedRule, Plan, PromptState, RuleContext, SegmentStorage, plan_rows, pool_fill
from nats.cache.registry import register_cache

GLOBAL, LOCAL, SLIDING = NF.TOKEN_GLOBAL, NF.TOKEN_LOCAL, NF.TOKEN_SLIDING


def kept_after_prompt(types: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What a NAtS cache keeps of a prompt in its pool, from integer types ``[R, N]`` (-1: no token, e.g. left
    padding): every global and the locals after the row's last global (the sliding tokens live in the ring).
    Returns (keep, is_global), both bool ``[R, N]``."""
    pos = torch.arange(types.shape[-1], device=types.device)
    isg = types == GLOBAL
    last_g = torch.where(isg, pos, torch.full_like(pos, -1)).amax(-1, keepdim=True)
    return isg | ((types == LOCAL) & (pos > last_g)), isg


@dataclass(frozen=True)
class TypeTable:
    """Types given for a run of positions, in place of the scorer's (a NAtS cache's ``type_table``): ``table``
    ``[T, R]`` integer, row ``i`` the types of position ``first_pos + i`` for the cache's rows ``r = b * Hkv + h``
    (0 global, 1 local, 2 sliding; -1 keeps the scorer's type, for a cache whose core has one). A step reads the
    row of its position on the device (graph-safe: the fused Triton step in its append kernel, the PyTorch step by an
    index), so the steps decode at the positions ``first_pos .. first_pos + T - 1`` only; the scorer still runs, so
    the step's work is the same. The use: decoding with chosen types, e.g. a benchmark at a chosen kept share with a
    model whose scorer is untrained."""

    table: Tensor
    first_pos: int = 0

    def __post_init__(self):
        t = self.table
        if not isinstance(t, Tensor) or t.dim() != 2 or t.dtype.is_floating_point or t.dtype == torch.bool:
            raise ValueError(f"TypeTable: table must be an integer tensor [T, R], got {getattr(t, 'shape', t)!r}")
        if t.numel() and (int(t.min()) < -1 or int(t.max()) > SLIDING):
            raise ValueError(
                f"TypeTable: types must be in -1..{SLIDING} (-1: the scorer's), got {int(t.min())}..{int(t.max())}"
            )
        if int(self.first_pos) != self.first_pos or self.first_pos < 0:
            raise ValueError(f"TypeTable: first_pos must be an integer >= 0, got {self.first_pos!r}")

    def to(self, rows: int, device) -> TypeTable:
        """The table as int64 on `device`, checked against a cache of `rows` rows."""
        if self.table.shape[1] != rows:
            raise ValueError(f"TypeTable: the table has {self.table.shape[1]} columns, the cache {rows} rows (B * Hkv)")
        return TypeTable(self.table.to(device=device, dtype=torch.long).contiguous(), int(self.first_pos))

    def at(self, pos: Tensor) -> Tensor:
        """The given types of position ``pos`` (a device tensor [1]): int64 ``[R]``, -1 where the scorer's stay."""
        return self.table.index_select(0, pos.reshape(1) - self.first_pos)[0]


def append_token(t, pos, k_new, v_new, ring_k, ring_v, ring_valid, k_pool, v_pool, start, length, scratch) -> None:
    """Admit one token per row r (types ``t [R]``, key/value ``[R, D]``): every row writes ring slot ``pos % W``
    (valid where sliding; the old occupant's window has ended), and global / local tokens are appended to their
    row's segment (rows whose token is sliding write to the ``scratch`` slots ``[R]``). The PyTorch form of the
    fused kernels' append."""
    slot = pos % ring_k.shape[1]
    ring_k.index_copy_(1, slot, k_new[:, None])
    ring_v.index_copy_(1, slot, v_new[:, None])
    ring_valid.index_copy_(1, slot, (t == SLIDING)[:, None])
    keep = t != SLIDING
    dest = torch.where(keep, start + length, scratch)
    k_pool.index_copy_(0, dest, k_new)
    v_pool.index_copy_(0, dest, v_new)
    length.add_(keep.to(length.dtype))


def drop_locals(isg, k_pool, v_pool, start, length, n_global, scratch) -> None:
    """In the rows where ``isg`` (their last token is global) the locals go: the token moves from
    ``start + length - 1`` down to ``start + n_global`` and ``length = n_global + 1`` (other rows touch only the
    ``scratch`` slots)."""
    src = torch.where(isg, start + length - 1, scratch)
    dst = torch.where(isg, start + n_global, scratch)
    k_pool.index_copy_(0, dst, k_pool.index_select(0, src))
    v_pool.index_copy_(0, dst, v_pool.index_select(0, src))
    n_global.add_(isg.to(n_global.dtype))
    length.copy_(torch.where(isg, n_global, length))


def step_torch(t, pos, k_new, v_new, ring_k, ring_v, ring_valid, k_pool, v_pool, start, length, n_global, scratch,
               attend) -> Tensor:  # fmt: skip
    """One NAtS decode step in PyTorch (spec section 5), the form the fused kernels (`nats_decode`) are tested
    against: the tokens of types ``t [R]`` are admitted (`append_token`), query ``pos`` answered (``attend()``, which
    returns the output), then the locals of the rows whose token was global dropped (`drop_locals`) and the ring slot
    of token ``pos - W + 1``, whose window this query closed, marked invalid."""
    append_token(t, pos, k_new, v_new, ring_k, ring_v, ring_valid, k_pool, v_pool, start, length, scratch)
    y = attend()
    drop_locals(t == GLOBAL, k_pool, v_pool, start, length, n_global, scratch)
    ring_valid.index_fill_(1, (pos + 1) % ring_k.shape[1], False)
    return y


def scorer_types(x: Tensor, w_s: Tensor, bias: Tensor, pos: Tensor) -> Tensor:
    """The types NAtS' scorer gives one token per row ``[R]`` (row r = b * Hkv + h): ``x [B, C] . w_s [3 Hkv, C]``
    rounded to x's dtype (the Linear's output), ``+ bias [3]`` in float32, argmax; token 0 global."""
    z = (x @ w_s.t()).to(x.dtype).float().reshape(-1, 3) + bias  # [B, Hkv * 3] -> [R, 3]
    new = z.argmax(-1)
    return torch.where(pos == 0, torch.full_like(new, GLOBAL), new)


# NAtS' step in the fixed-capacity engine as a ``torch.library`` custom op (compiled with the decode step, replayed as
# a CUDA graph): on CUDA the attention's two Triton launches with the step fused into them
# (``nats_kernels.nats_attention.nats_step.nats_decode``), elsewhere the PyTorch form (`step_torch`), which the kernels
# are tested against. It mutates the cache's buffers in place (``mutates_args``), so they keep their addresses across
# replays.
@torch.library.custom_op("nats::nats_decode", mutates_args=("rows", "ring_kv", "ring_valid", "kv_pool"))
def nats_decode(
    q: Tensor,
    x: Tensor,
    w_s: Tensor,
    bias: Tensor,
    pos: Tensor,
    rows: Tensor,
    k_new: Tensor,
    v_new: Tensor,
    ring_kv: Tensor,
    ring_valid: Tensor,
    kv_pool: Tensor,
    backend: str = "auto",
) -> Tensor:
    """Query ``pos`` (``q`` ``[R, G, D]``) over each row's segment, its valid ring slots and the new token itself,
    then the new token's type from the scorer (``x [B, C] . w_s[3 Hkv, C]``, rounded to x's dtype as the Linear's
    output, ``+ bias``; argmax; a full segment keeps a global or local token as sliding) and its admission: ring
    write, append, or for a global token its row's locals dropped. Returns the attention ``[R, G, D]``.

    The buffers come packed, as the cache holds them: ``rows`` ``[6, R]`` (segment start, length, capacity, global
    count, the last token's type, -), ``ring_kv`` ``[2, R, W, D]``, ``kv_pool`` ``[2, P, D]`` (keys, values). Each is
    one mutated argument: an op that mutated several views of one tensor would break the functionalization of a
    compiled step (inductor copies each mutated argument back, and the copies of aliasing views overwrite each
    other's writes).

    ``backend``: the fused Triton kernels (``"triton"``), the PyTorch form (``"torch"``) or ``"auto"`` (the default:
    Triton for CUDA tensors where the kernels import; `nats.cache.attention.resolve_backend`)."""
    start, length, cap, n_global, t = rows[0], rows[1], rows[2], rows[3], rows[4]
    ring_k, ring_v, k_pool, v_pool = ring_kv[0], ring_kv[1], kv_pool[0], kv_pool[1]
    backend = resolve_backend(backend, k_new.device)
    if backend == "triton":
        from nats_kernels.nats_attention.nats_step import nats_decode as kernel  # noqa: PLC0415

        return kernel(q, k_new, v_new, pos, t, k_pool, v_pool, start, length, n_global, ring_k, ring_v, ring_valid,
                      x=x, w_s=w_s, bias=bias, cap=cap)  # fmt: skip
    scratch = torch.full_like(start, k_pool.shape[0] - 1)  # the pool's last slot takes the skipped writes
    new = scorer_types(x, w_s, bias, pos)
    new = torch.where((new != SLIDING) & (length >= cap), torch.full_like(new, SLIDING), new)  # a full segment
    t.copy_(new)
    attend = lambda: pool_attention(q, k_pool, v_pool, start, length, max(int(length.max()), 1), ring_k=ring_k,  # noqa: E731
                                    ring_v=ring_v, ring_valid=ring_valid, backend=backend)  # fmt: skip
    return step_torch(new, pos, k_new, v_new, ring_k, ring_v, ring_valid, k_pool, v_pool, start, length, n_global,
                      scratch, attend)  # fmt: skip


@nats_decode.register_fake
def _(q, x, w_s, bias, pos, rows, k_new, v_new, ring_kv, ring_valid, kv_pool, backend="auto"):
    return torch.empty_like(q)


def nats_rows(types: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, max_new: int, cap_of=None):
    """A NAtS layer's state after the prompt from its integer types ``[B, Hkv, N]`` (-1 on left padding), keys and
    values ``[B, Hkv, N, D]`` (rows r = b * Hkv + h): what is kept (`kept_after_prompt`) and its segments
    (`nats.cache.engine.plan_rows`, ``cap`` = kept + ``max_new``, or ``cap_of(kept)``); the ring of the last W - 1
    positions (slot = position mod W, valid where sliding). The PyTorch form of
    `nats_kernels.nats_attention.prefill_cache`."""
    N, D = types.shape[-1], k.shape[-1]
    types, k, v = types.reshape(-1, N), k.reshape(-1, N, D), v.reshape(-1, N, D)
    R = types.shape[0]
    keep, isg = kept_after_prompt(types)
    kept = keep.sum(1)
    keep, rank, rows, end = plan_rows(keep, kept + max_new if cap_of is None else cap_of(kept), n_global=isg.sum(1))
    lo = max(0, N - window + 1)
    slots = torch.arange(lo, N, device=types.device) % window  # the last W - 1 positions' ring slots (distinct)
    ring_kv = k.new_zeros(2, R, window, D)
    ring_kv[0].index_copy_(1, slots, k[:, lo:])
    ring_kv[1].index_copy_(1, slots, v[:, lo:])
    ring_valid = torch.zeros(R, window, dtype=torch.bool, device=types.device)
    ring_valid.index_copy_(1, slots, types[:, lo:] == SLIDING)
    return keep, rank, rows, end, ring_kv, ring_valid


class NAtSRule(FixedRule):
    """NAtS in the fixed-capacity engine (`nats.cache.engine`): per row a segment of its globals and live locals
    (capacity: kept after the prompt + the tokens to decode) and a ring of W slots for the sliding tokens.

    * Prompt: the layer's attention with the mask of the scorer's types (the Triton kernel from the scorer's logits
      where it applies, four launches per layer whose parameters are worked out once, `prefill_cache.PrefillKernels`;
      else `nats.functional.nats_attention_types`), then what the types keep is written (the fused Triton writes on
      CUDA, `nats_rows` elsewhere or with ``prefill_kernel="torch"``).
    * Step: the attention's two launches with the step fused into them (``nats::nats_decode``): the split kernel
      reads the rows, the merge adds the new token itself, and the merge kernel's extra programs then compute the
      new token's type from the scorer, write it to the ring and append it, and for a global token drop its row's
      locals. A full segment keeps a global or local token as a sliding one (visible for W steps); an eager caller
      grows the segment before it fills instead (`nats.cache.engine.EngineLayer.maintain`: the ring, the global count
      and the last type survive the relayout).
    * Types: while the context tracks, ``type_counts`` ``[R, 3]`` (a buffer of the rule) counts each row's global,
      local and sliding tokens, the prompt's (padding excluded) and then one per step
      (`nats.cache.engine.EngineLayer.type_fractions`).
    """

    name = "nats"
    ring = True
    grows = True

    @staticmethod
    def triton_writes(ctx: RuleContext, k: torch.Tensor) -> bool:
        """Whether the prefill writes the cache with the Triton kernels (the context's ``prefill_kernel``)."""
        if ctx.prefill_kernel != "auto":
            return ctx.prefill_kernel == "triton"
        return k.is_cuda and NF.triton_available()

    def scored(self, ctx: RuleContext, q, k, backend: str) -> bool:
        """Whether the prefill runs the Triton attention from the scorer's logits (`nats_prefill_scored`): with the
        Triton writes (on the CPU only where asked for, through Triton's interpreter), a head dim and dtype the
        kernels take, and a core that does not insist on the PyTorch reference."""
        from nats_kernels.nats_attention import triton_takes  # noqa: PLC0415

        return self.triton_writes(ctx, k) and backend != "reference" and triton_takes(q)

    def direct(self, ctx, core, q, k, v, hidden):
        """The prefill of one unpadded layer by `prefill_cache.PrefillKernels` where `scored` holds and the tensors
        are laid out for it: the scorer's Linear, then four Triton launches whose launch parameters are worked out
        once per kind of layer, and no other operation (at batch 1 the prefill is bound by the host's work)."""
        if not self.scored(ctx, q, k, getattr(core, "backend", "auto")):
            return None
        from nats_kernels.nats_attention.prefill_cache import prefill_kernels  # noqa: PLC0415

        B, N, H = q.shape[0], q.shape[2], k.shape[1]
        logits = F.linear(hidden, core.scorer.weight, core.scorer.bias).view(B, N, H, 3).transpose(1, 2)
        kernels = prefill_kernels(q, k, v, logits, core.type_bias, core.window, ctx.room)
        if kernels is None:
            return None
        y, types, rows, end, ring_kv, ring_valid, last_g = kernels.attend(q, k, v, logits, core.type_bias)
        fill = lambda size: kernels.pool(types, k, v, rows, last_g, size)  # noqa: E731
        plan = Plan(rows, end, fill, (ring_kv, ring_valid, core.window), self._sizes(ctx, types, core))
        plan.extra = self._counts(ctx, types)
        return y, plan

    def prompt(self, ctx, core, q, k, v, hidden, budget, offset=0):
        b_, n, Hkv = q.shape[0], q.shape[2], k.shape[1]
        backend = getattr(core, "backend", "auto")
        if self.scored(ctx, q, k, backend):
            # the plan kernel takes the scorer's argmax (hard_types' float, offsets, argmax and token 0 are four
            # launches per layer less, at batch 1 where the prefill is bound by its launches)
            from nats_kernels.nats_attention import nats_prefill_scored  # noqa: PLC0415

            logits = core.scorer(hidden).view(b_, n, Hkv, 3).transpose(1, 2)  # [b, Hkv, n, 3]
            y, types = nats_prefill_scored(q, k, v, logits, core.type_bias, core.window)  # int8 types
            return PromptState(y, types=types)
        types = core.hard_types(hidden)  # [b, Hkv, n], token 0 global
        return PromptState(NF.nats_attention_types(q, k, v, types, core.window, backend=backend), types=types)

    def _sizes(self, ctx, types, core):
        if not ctx.track:
            return None
        R, N = types.shape[0] * types.shape[1], types.shape[-1]
        return NF._ref.kv_cache_sizes(types.reshape(R, N).long(), core.window)  # 0 on padding (-1: no type)

    @staticmethod
    def _counts(ctx, types):
        """While tracking, the rule's buffer: each row's tokens of each type ``[R, 3]`` (-1, padding: none)."""
        if not ctx.track:
            return None
        R = types.shape[0] * types.shape[1]
        t = types.reshape(R, -1)
        return {"type_counts": (t[..., None] == torch.arange(3, device=t.device, dtype=t.dtype)).sum(1)}

    def plan(self, ctx, core, state, k, v, budgets, real):
        types, W = state.types, core.window
        if self.triton_writes(ctx, k):  # two launches: prefill_cache.py
            from nats_kernels.nats_attention.prefill_cache import prefill_pool, prefill_rows  # noqa: PLC0415

            rows, end, ring_kv, ring_valid, last_g = prefill_rows(types, k, v, W, ctx.room)
            fill = lambda size: prefill_pool(types, k, v, rows, last_g, size)  # noqa: E731
        else:  # keep mask, segments, ring
            keep, rank, rows, end, ring_kv, ring_valid = nats_rows(types, k, v, W, ctx.room)
            fill = lambda size: pool_fill(keep, rank, rows, k, v, size)  # noqa: E731
        return Plan(rows, end, fill, (ring_kv, ring_valid, W), self._sizes(ctx, types, core), self._counts(ctx, types))

    def buffers(self, layer):
        counts = getattr(layer, "type_counts", None)
        return [] if counts is None else [counts]

    def dynamic_dims(self, layer):
        return [(t, (0,)) for t in self.buffers(layer)]  # the rows (the three types stay)

    def step(self, ctx, layer, core, qr, kr, vr, pos, hidden):
        size = self.kept(layer) + 1  # the keys query pos reads: its row's and itself
        y = nats_decode(qr, hidden, core.scorer.weight, core.type_bias, pos, layer.seg, kr, vr, layer.ring_kv,
                        layer.ring_valid, layer.kv_pool, ctx.backend)  # fmt: skip
        if ctx.track:  # the new token's type (the step wrote it into the rows' last type)
            t = layer.last_type
            layer.type_counts.scatter_add_(1, t[:, None], torch.ones_like(t)[:, None])
        return y, size

    def kept(self, layer):
        return layer.length + layer.ring_valid.sum(1)


@register_cache("nats")
class NAtSCache(LayerCache, SegmentStorage):
    requires_core = "nats"  # the types come from the layer's NAtS scorer
    fixed_rule = NAtSRule
    """Args (besides LayerCache's, ``reserve`` among them): window W (default: the core's), check_every, slack,
    shrink_above, init_capacity (initial segment length per row, default check_every, or reserve if given),
    type_table (a `TypeTable`: the decoded tokens' types at its positions in place of the scorer's, read on the
    device by both backends; a step's own ``types=`` wins over it)."""

    def __init__(
        self,
        *,
        window: int | None = None,
        check_every: int = 16,
        slack: float = 1 / 32,
        shrink_above: float = 1.15,
        init_capacity: int | None = None,
        type_table: TypeTable | None = None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        if type_table is not None and not isinstance(type_table, TypeTable):
            raise TypeError(f"nats cache: type_table must be a TypeTable, got {type(type_table).__name__}")
        self.type_table = None if type_table is None else type_table.to(self.rows, self.device)
        if window is None:
            if self.core is None or not hasattr(self.core, "window"):
                raise ValueError("nats cache: pass window=W or the layer's NAtS attention core (core=...)")
            window = self.core.window
        self.window = NF._ref.check_window(window)
        if check_every < 1 or slack < 0 or shrink_above <= 1:
            raise ValueError(
                f"nats cache: need check_every >= 1, slack >= 0, shrink_above > 1; got {check_every}, "
                f"{slack}, {shrink_above}"
            )
        self.check_every, self.slack, self.shrink_above = int(check_every), float(slack), float(shrink_above)
        R, W, D, dev = self.rows, self.window, self.head_dim, self.device
        # the segmented pool of nats.cache.engine.SegmentStorage: kv_pool, seg (start, length, cap, n_global, the
        # current token's types), the ring
        self.ring_kv = torch.zeros(2, R, W, D, device=dev, dtype=self.dtype)
        self.ring_valid = torch.zeros(R, W, device=dev, dtype=torch.bool)
        self.seg = torch.zeros(6, R, device=dev, dtype=torch.long)
        self.kv_pool = torch.zeros(2, 1, D, device=dev, dtype=self.dtype)
        self.type_counts = torch.zeros(R, 3, device=dev, dtype=torch.long)
        if init_capacity is not None:
            cap0 = int(init_capacity)
        else:
            cap0 = self.check_every if self.reserve is None else self.reserve
        self._free_steps: int | None = None  # with a reserve: steps that cannot overflow any row
        self._layout(torch.full((R,), max(cap0, 1), device=dev, dtype=torch.long))
        self._since_check = 0
        self.compactions = 0
        self.max_nbytes = self.nbytes()

    _t = property(lambda self: self.last_type)  # the current token's types (the fused step's append and evict)

    # ------------------------------------------------------------------ storage
    def _layout(self, cap: torch.Tensor) -> None:
        """(Re)allocate the pool with per-row capacities `cap` [R]; copy the segments over."""
        self.relayout(cap)
        self._laid_out()

    def _laid_out(self) -> None:
        self.scratch = torch.full((self.rows,), self.kv_pool.shape[1] - 1, device=self.device, dtype=torch.long)
        if self.reserve is not None:
            self._free_steps = int((self.cap - self.length).min())

    def _wanted(self, length: torch.Tensor) -> torch.Tensor:
        extra = torch.clamp(torch.ceil(length.to(torch.float64) * self.slack).to(torch.long), min=self.check_every)
        return length + extra

    def compact(self) -> None:
        """Lay the pool out again with `length + slack` slots per row (drops unused capacity)."""
        self._layout(self._wanted(self.length))
        self.compactions += 1
        self.max_nbytes = max(self.max_nbytes, self.nbytes())

    def maintain(self) -> bool:
        """Before each step. With a reserve: nothing while the planned capacity guarantees room; then (overflow)
        read the lengths, compact only if a row is full. Without: every `check_every` steps, compact if a row
        could overflow before the next check, or if the pool exceeds `shrink_above` x what the rows need.
        Returns True if the pool was reallocated."""
        if self._free_steps is not None:
            if self._free_steps > 0:
                self._free_steps -= 1
                return False
            free = int((self.cap - self.length).min())  # one synchronisation, once the guarantee ran out
            if free > 0:
                self._free_steps = free - 1
                return False
            self.compact()  # sets the guarantee again (at least check_every steps)
            self._free_steps -= 1
            return True
        self._since_check += 1
        if self._since_check < self.check_every and self.t > 0:
            return False
        self._since_check = 0
        free = self.cap - self.length
        need = self._wanted(self.length)
        if bool((free < self.check_every).any()) or int(self.cap.sum()) > self.shrink_above * int(need.sum()):
            self.compact()
            return True
        return False

    # ------------------------------------------------------------------ types
    def types_of(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Inference types of one token per row: x [B, 1, C] -> LongTensor [R] (token 0 global)."""
        if self.core is None:
            raise ValueError("nats cache: step() without types= needs the layer's NAtS core (core=...)")
        t = self.core.type_logits(x).argmax(-1)[..., 0].reshape(self.rows)  # [B, Hkv, 1] -> [R]
        return torch.where(pos == 0, torch.full_like(t, GLOBAL), t)

    # ------------------------------------------------------------------ the protocol
    def step(self, q, k, v, x, pos, types: torch.Tensor | None = None):
        """One token; `types` ([B, Hkv] or [R]) overrides the scorer (tests), else the cache's `type_table` where it
        gives a type (-1: the scorer's)."""
        if self.auto_maintain:
            self.maintain()
        if self.backend == "triton":
            return self._step_fused(q, k, v, x, pos, types)
        if types is not None:
            t = types.reshape(self.rows).to(torch.long)
        elif self.type_table is not None:
            given = self.type_table.at(pos)
            t = given if self.core is None else torch.where(given >= 0, given, self.types_of(x, pos))
        else:
            t = self.types_of(x, pos)
        self._t.copy_(t)
        self._record_step()
        attend = lambda: pool_attention(self._q_rows(q), self.k_pool, self.v_pool, self.start, self.length,  # noqa: E731
                                        int(self.length.max()), ring_k=self.ring_k, ring_v=self.ring_v,
                                        ring_valid=self.ring_valid, backend=self.backend)  # fmt: skip
        y = step_torch(t, pos, self._kv_rows(k), self._kv_rows(v), self.ring_k, self.ring_v, self.ring_valid,
                       self.k_pool, self.v_pool, self.start, self.length, self.n_global, self.scratch,
                       attend)  # fmt: skip
        self._count_types()
        return self._out(y)

    def _record_step(self) -> None:
        """Before a step: its cache sizes c_i (the row's segment and valid ring slots, and the new token), then the
        step counted."""
        if self.track:
            self._record(self.kept().reshape(-1) + 1)
        self.t += 1

    def _count_types(self) -> None:
        """After a step: its types (``_t``) counted."""
        if self.track:
            t = self._t
            self.type_counts.scatter_add_(1, t[:, None], torch.ones_like(t)[:, None])

    def _scorer(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The core's scorer weight [3 Hkv, C] and type offsets [3] (those of `NAtSAttention.type_logits` in eval
        mode, which the fused step's kernel applies itself), or None when the core has no NAtS scorer."""
        w = getattr(getattr(self.core, "scorer", None), "weight", None)
        bias = getattr(self.core, "type_bias", None)
        if w is None or bias is None:
            return None
        if w.dim() != 2 or w.shape[0] != 3 * self.n_kv_head:
            raise ValueError(
                f"nats cache: the core's scorer must have 3 * n_kv_head = {3 * self.n_kv_head} outputs, "
                f"got a weight of shape {tuple(w.shape)}"
            )
        return w, bias

    def _step_fused(self, q, k, v, x, pos, types):
        """The same step with the Triton backend in the attention's two launches (``nats_decode``: the split kernel
        reads the rows, the merge adds the new token, its extra programs compute the token's type from the core's
        scorer and admit it; k and v are read where the projection wrote them).

        Types that replace the scorer's argmax come from ``types`` or from the cache's `type_table`, whose row
        ``pos - first_pos`` the kernel reads at the device position (-1: the scorer's). The scorer runs whenever the
        core has one, so an override leaves the step's work as it is."""
        from nats_kernels.nats_attention.nats_step import nats_decode as kernel  # noqa: PLC0415

        if k.shape[2] != 1:
            raise ValueError(f"step() takes one token, got {k.shape[2]}")
        scorer = self._scorer() if x is not None else None
        types_from = None
        if types is not None:
            types = types.reshape(self.rows).to(device=self.device, dtype=torch.long)
        elif self.type_table is not None:
            types, types_from = self.type_table.table, self.type_table.first_pos
        if types is None and scorer is None:
            if self.core is None:
                raise ValueError("nats cache: step() without types= needs the layer's NAtS core (core=...)")
            if x is None:
                raise ValueError("nats cache: step() without types= needs the block's input x for the scorer")
            raise ValueError(
                f"nats cache: step() without types= needs a NAtS core with a scorer and type_bias, got "
                f"{type(self.core).__name__}"
            )
        w_s, bias = scorer if scorer is not None else (None, None)
        self._record_step()
        y = kernel(self._q_rows(q), k, v, pos, self._t, self.k_pool, self.v_pool, self.start, self.length,
                   self.n_global, self.ring_k, self.ring_v, self.ring_valid, x=x if scorer is not None else None,
                   w_s=w_s, bias=bias, types=types, types_from=types_from)  # fmt: skip
        self._count_types()
        return self._out(y)

    def _prefill(self, q, k, v, x, types: torch.Tensor | None = None):
        """Parallel prefill: attention with the mask of the scorer's types (the model's own eval forward), then
        the cache state after the N tokens written directly (see :meth:`load`); ``types`` ([B, Hkv, N]) override
        the scorer's."""
        if types is None:
            if self.core is None:
                raise ValueError("nats cache: prefill() without types= needs the layer's NAtS core (core=...)")
            types = self.core.hard_types(x)  # [B, Hkv, N], token 0 global
        y = NF.nats_attention_types(q, k, v, types, self.window, backend=getattr(self.core, "backend", "auto"))
        self.load(k, v, types)
        return y

    def load(self, k: torch.Tensor, v: torch.Tensor, types: torch.Tensor) -> None:
        """Write the state after N tokens directly: k, v [B, Hkv, N, D], types [B, Hkv, N] (token 0 should be
        global). Kept: every global, the locals after the row's last global, and the sliding tokens of the last
        W - 1 positions. Sizes are the spec's c_i (kv_cache_sizes)."""
        self._check_empty("load()")
        R, N, W = self.rows, k.shape[2], self.window
        t = types.reshape(R, N).to(torch.long)
        # the fixed-capacity engine's plan of a NAtS prompt (nats_rows), with the capacity this cache wants
        keep, rank, seg, end, ring_kv, ring_valid = nats_rows(
            t, k, v, W, self.reserve or 0, cap_of=self._wanted if self.reserve is None else None
        )
        self.kv_pool, self.seg = pool_fill(keep, rank, seg, k, v, int(end) + 1), seg
        self.ring_kv, self.ring_valid = ring_kv.to(self.dtype), ring_valid
        self._laid_out()
        if self.track:
            self._record_many(NF.kv_cache_sizes(t, W))
            self.type_counts += torch.nn.functional.one_hot(t, 3).sum(1)
        self.t = N
        self._since_check = 0
        self.max_nbytes = max(self.max_nbytes, self.nbytes())

    # ------------------------------------------------------------------ measurements
    def kept(self):
        return (self.length + self.ring_valid.sum(1)).view(self.batch, self.n_kv_head)

    def type_fractions(self) -> torch.Tensor:
        """Fractions of global, local and sliding tokens so far, float64 [B, Hkv, 3]."""
        c = self.type_counts.to(torch.float64)
        return (c / c.sum(-1, keepdim=True).clamp(min=1)).view(self.batch, self.n_kv_head, 3)

    def tensors(self):
        return [
            self.k_pool,
            self.v_pool,
            self.ring_k,
            self.ring_v,
            self.ring_valid,
            self.length,
            self.n_global,
            self.start,
            self.cap,
            self.scratch,
            self.type_counts,
        ]

    def kv_tensors(self):
        return [self.k_pool, self.v_pool, self.ring_k, self.ring_v]
