"""`nats`: the NAtS KV cache (spec section 5), batched, per KV head, with per-head lengths.

At step i the new token's type t_i (argmax of the layer's scorer on the block's normalised input, token 0
global) is computed per KV head, its key/value admitted, and query i attends to exactly ``{j <= i : M_ij = 1}``
(spec section 2). Then: sliding tokens older than W - 1 steps are evicted, a head's locals are evicted once one
of its globals has been queried, globals stay.

Storage (one layer of the engine, `nats.cache.engine`; row r = sequence b, KV head h):

* **ring** ``[R, W, D]`` (+ valid flags ``[R, W]``): token i is written to slot ``i % W`` of every row, valid
  where its type is sliding. The slot held token i - W, whose window ended at query i - 1, so sliding tokens
  expire by being overwritten; after query i the slot of token i - W + 1 is marked invalid (its window ends).
* **segment** of the pool per row, holding ``length[r]`` tokens: the row's globals (``n_global[r]`` of them)
  followed by its live locals (those after its last global). Global or local tokens are appended at ``start +
  length`` (rows whose token is sliding write to the scratch slot). After query i, in the rows where t_i is
  global, the token is moved to ``start + n_global`` and ``length = n_global + 1``: the locals are dropped by
  truncation, so segments never hold holes. Each step costs O(B * Hkv * D), never a copy of the cache.
* **capacity**: what the prompt keeps plus the tokens the caller will decode (the reserve); where that number is
  unknown the engine grows a row's segment before it fills (`nats.cache.engine.EngineLayer.maintain`: one
  reallocation, O(kept tokens)). A fixed-capacity step that finds a full segment keeps a global or local token as a
  sliding one (visible for W steps).

Memory is therefore the kept tokens plus the planned room per row plus W ring slots per row (the paper's Algorithm 3
keeps per-head buffers with valid lengths in the same spirit). Attention reads each segment and the valid ring slots
once (`nats.cache.attention.pool_attention`; Triton on CUDA).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from nats import functional as NF
from nats.cache.attention import pool_attention, resolve_backend
from nats.cache.engine import append_chunk, chunk_attention, plan_rows, pool_fill, segment_kv
from nats.cache.registry import register_cache
from nats.cache.rule import FixedRule, Plan, PromptState, RuleContext

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
def nats_decode(q: Tensor, x: Tensor, w_s: Tensor, bias: Tensor, pos: Tensor, rows: Tensor, k_new: Tensor,
                v_new: Tensor, ring_kv: Tensor, ring_valid: Tensor, kv_pool: Tensor, backend: str = "auto",
                types: Tensor | None = None, types_from: int = 0) -> Tensor:  # fmt: skip
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
    Triton for CUDA tensors where the kernels import; `nats.cache.attention.resolve_backend`). ``types``: a table
    ``[T, R]`` of given types whose row ``pos - types_from`` replaces the scorer's where it is >= 0 (`TypeTable`)."""
    start, length, cap, n_global, t = rows[0], rows[1], rows[2], rows[3], rows[4]
    ring_k, ring_v, k_pool, v_pool = ring_kv[0], ring_kv[1], kv_pool[0], kv_pool[1]
    backend = resolve_backend(backend, k_new.device)
    if backend == "triton":
        from nats_kernels.nats_attention.nats_step import nats_decode as kernel  # noqa: PLC0415

        return kernel(q, k_new, v_new, pos, t, k_pool, v_pool, start, length, n_global, ring_k, ring_v, ring_valid,
                      x=x, w_s=w_s, bias=bias, cap=cap, types=types,
                      types_from=None if types is None else types_from)  # fmt: skip
    k_new, v_new = k_new.reshape(-1, k_new.shape[-1]), v_new.reshape(-1, v_new.shape[-1])  # rows [R, D]
    scratch = torch.full_like(start, k_pool.shape[0] - 1)  # the pool's last slot takes the skipped writes
    new = scorer_types(x, w_s, bias, pos)
    if types is not None:
        given = types.index_select(0, pos.reshape(1) - types_from)[0]  # TypeTable.at, without its checks' syncs
        new = torch.where(given >= 0, given, new)
    new = torch.where((new != SLIDING) & (length >= cap), torch.full_like(new, SLIDING), new)  # a full segment
    t.copy_(new)
    attend = lambda: pool_attention(q, k_pool, v_pool, start, length, max(int(length.max()), 1), ring_k=ring_k,  # noqa: E731
                                    ring_v=ring_v, ring_valid=ring_valid, backend=backend)  # fmt: skip
    return step_torch(new, pos, k_new, v_new, ring_k, ring_v, ring_valid, k_pool, v_pool, start, length, n_global,
                      scratch, attend)  # fmt: skip


@nats_decode.register_fake
def _(q, x, w_s, bias, pos, rows, k_new, v_new, ring_kv, ring_valid, kv_pool, backend="auto", types=None, types_from=0):
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


@register_cache("nats")
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
    * ``type_table`` (a `TypeTable`): the types of its positions in place of the scorer's, in the prompt (unpadded)
      and in the steps (read on the device by both backends); the scorer still runs, so the work is the same.
    """

    name = "nats"
    ring = True
    grows = True
    requires_core = "nats"  # the types come from the layer's NAtS scorer

    def __init__(self, *, type_table: TypeTable | None = None, **unused):
        if type_table is not None and not isinstance(type_table, TypeTable):
            raise TypeError(f"nats cache: type_table must be a TypeTable, got {type(type_table).__name__}")
        self.type_table = type_table

    def _given(self, types: Tensor, offset: int) -> Tensor:
        """The prompt's types ``[b, Hkv, n]`` with the table's where it gives one (positions offset..)."""
        b_, Hkv, n = types.shape
        table = self.type_table.to(b_ * Hkv, types.device)
        lo, hi = max(offset, table.first_pos), min(offset + n, table.first_pos + table.table.shape[0])
        if lo >= hi:
            return types
        given = table.table[lo - table.first_pos : hi - table.first_pos].t().reshape(b_, Hkv, hi - lo)
        types = types.long().clone()
        part = types[..., lo - offset : hi - offset]
        types[..., lo - offset : hi - offset] = torch.where(given >= 0, given, part)
        return types

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
        if self.type_table is not None or not self.scored(ctx, q, k, getattr(core, "backend", "auto")):
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
        if self.type_table is not None:
            types = self._given(core.hard_types(hidden), offset)
            return PromptState(NF.nats_attention_types(q, k, v, types, core.window, backend=backend), types=types)
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

    def setup(self, ctx, layer):
        table = self.type_table
        layer.type_table = None if table is None else table.to(layer.rows.shape[1], layer.rows.device)

    def buffers(self, layer):
        counts = getattr(layer, "type_counts", None)
        return [] if counts is None else [counts]

    def dynamic_dims(self, layer):
        return [(t, (0,)) for t in self.buffers(layer)]  # the rows (the three types stay)

    def step(self, ctx, layer, core, qr, kr, vr, pos, hidden):
        # the keys query pos reads (its row's and itself), recorded only while tracking: untracked, the step is the
        # op's two launches alone
        size = self.kept(layer) + 1 if ctx.track else None
        table = layer.type_table
        y = nats_decode(qr, hidden, core.scorer.weight, core.type_bias, pos, layer.rows, kr, vr, layer.ring_kv,
                        layer.ring_valid, layer.kv_pool, ctx.backend, None if table is None else table.table,
                        0 if table is None else table.first_pos)  # fmt: skip
        if ctx.track:  # the new token's type (the step wrote it into the rows' last type)
            t = layer.last_type
            layer.type_counts.scatter_add_(1, t[:, None], torch.ones_like(t)[:, None])
        return y, size

    def extend(self, ctx, layer, core, q, k, v, hidden, first):
        """A continuation of n tokens at positions P0 = ``first`` .. P1 = P0 + n - 1 in parallel, with what n steps
        would do: the types from the scorer (`scorer_types`' arithmetic; the type table's where it gives one), each
        query over the NAtS mask of spec section 2 (the segment's globals always, its locals until a global of the
        chunk has been queried, the ring's sliding tokens and the chunk's own for W positions, the chunk's globals
        and locals as in a prompt), then the state after the last step: the locals dropped where the chunk has a
        global, the chunk's globals and live locals appended, the ring holding the last W - 1 positions."""
        R, G, n, D = q.shape
        W, dev = layer.window, q.device
        t = self.chunk_types(core, q, hidden)  # [R, n]
        if self.type_table is not None:  # the given types of the chunk's positions within the table
            t = self._given(t.view(hidden.shape[0], -1, n), first).reshape(R, n)
        c = torch.arange(n, device=dev)
        isg = t == GLOBAL
        first_g = torch.where(isg, c, n).amin(1)  # the chunk's first global (n: none)
        last_g = torch.where(isg, c, -1).amax(1)
        keys, values, slot = segment_kv(layer)
        seg = (slot[None, :] < layer.length[:, None])[:, None, :] & (
            (slot[None, :] < layer.n_global[:, None])[:, None, :] | (c[None, :, None] <= first_g[:, None, None])
        )  # [R, n, L]
        w = torch.arange(W, device=dev)
        p_w = (first - 1) - torch.remainder(first - 1 - w, W)  # the position ring slot w holds
        ring = layer.ring_valid[:, None, :] & ((first + c)[:, None] - p_w[None, :] < W)[None]  # [R, n, W]
        own = NF.nats_mask(t, W)  # [R, n, n]
        mask = torch.cat((seg, ring, own), dim=-1)
        y = chunk_attention(q, torch.cat((keys, layer.ring_k, k), 1), torch.cat((values, layer.ring_v, v), 1), mask)
        sizes = mask.sum(-1) if ctx.track else None
        # the state after the last query: the segment, then the ring, then the counters
        keep = isg | ((t == LOCAL) & (c[None, :] > last_g[:, None]))
        base = torch.where(first_g < n, layer.n_global, layer.length)
        append_chunk(layer, keep, k, v, base)
        layer.n_global.add_(isg.sum(1))
        end = first + n - 1
        p_end = end - torch.remainder(end - w, W)  # the position slot w holds after the chunk
        mine = p_end >= first
        idx = (p_end - first).clamp(0, n - 1)
        layer.ring_kv.copy_(torch.where(mine[None, None, :, None], torch.stack((k, v))[:, :, idx], layer.ring_kv))
        alive = p_end >= end - W + 2
        layer.ring_valid.copy_(torch.where(mine[None, :], t[:, idx] == SLIDING, layer.ring_valid) & alive[None, :])
        layer.last_type.copy_(t[:, -1])
        if ctx.track:
            layer.type_counts.add_((t[..., None] == torch.arange(3, device=dev)).sum(1))
        return y, sizes

    @staticmethod
    def chunk_types(core, q: Tensor, hidden: Tensor) -> Tensor:
        """A continuation's types ``[R, n]`` from the scorer (`scorer_types`' arithmetic, no token at position 0)."""
        R, n, B = q.shape[0], q.shape[2], hidden.shape[0]
        z = (hidden @ core.scorer.weight.t()).to(hidden.dtype).float().view(B, n, -1, 3) + core.type_bias
        return z.argmax(-1).transpose(1, 2).reshape(R, n)

    def kept(self, layer):
        return layer.length + layer.ring_valid.sum(1)
