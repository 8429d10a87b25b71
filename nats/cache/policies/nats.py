"""`nats`: the NAtS KV cache (spec section 5), batched, per KV head, with per-head lengths.

At step i the new token's type t_i (argmax of the layer's scorer on the block's normalised input, token 0
global) is computed per KV head, its key/value admitted, and query i attends to exactly ``{j <= i : M_ij = 1}``
(spec section 2). Then: sliding tokens older than W - 1 steps are evicted, a head's locals are evicted once one
of its globals has been queried, globals stay.

Storage (one layer; row r = sequence b, KV head h):

* **ring** ``[R, W, D]`` (+ valid flags ``[R, W]``): token i is written to slot ``i % W`` of every row, valid
  where its type is sliding. The slot held token i - W, whose window ended at query i - 1, so sliding tokens
  expire by being overwritten; after query i the slot of token i - W + 1 is marked invalid (its window ends).
* **pool** ``[P + 1, D]`` with a segment ``[start[r], start[r] + cap[r])`` per row, holding ``length[r]``
  tokens: the row's globals (``n_global[r]`` of them) followed by its live locals (those after its last
  global). Global or local tokens are appended at ``start + length`` (a scatter; rows whose token is sliding
  write to the scratch slot P). After query i, in the rows where t_i is global, the token is moved from
  ``start + length - 1`` to ``start + n_global`` and ``length = n_global + 1``: the locals are dropped by
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

import torch

from nats import functional as NF
from nats.cache.attention import pool_attention
from nats.cache.base import LayerCache
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


@register_cache("nats")
class NAtSCache(LayerCache):
    requires_core = "nats"  # the types come from the layer's NAtS scorer
    """Args (besides LayerCache's, ``reserve`` among them): window W (default: the core's), check_every, slack,
    shrink_above, init_capacity (initial segment length per row, default check_every, or reserve if given)."""

    def __init__(
        self,
        *,
        window: int | None = None,
        check_every: int = 16,
        slack: float = 1 / 32,
        shrink_above: float = 1.15,
        init_capacity: int | None = None,
        **kwargs,
    ):
        super().__init__(**kwargs)
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
        self.ring_k = torch.zeros(R, W, D, device=dev, dtype=self.dtype)
        self.ring_v = torch.zeros(R, W, D, device=dev, dtype=self.dtype)
        self.ring_valid = torch.zeros(R, W, device=dev, dtype=torch.bool)
        self.length = torch.zeros(R, device=dev, dtype=torch.long)
        self.n_global = torch.zeros(R, device=dev, dtype=torch.long)
        self.type_counts = torch.zeros(R, 3, device=dev, dtype=torch.long)
        self._t = torch.zeros(R, device=dev, dtype=torch.long)  # the current token's types (fused path)
        if init_capacity is not None:
            cap0 = int(init_capacity)
        else:
            cap0 = self.check_every if self.reserve is None else self.reserve
        self._free_steps: int | None = None  # with a reserve: steps that cannot overflow any row
        self._layout(torch.full((R,), max(cap0, 1), device=dev, dtype=torch.long))
        self._since_check = 0
        self.compactions = 0
        self.max_nbytes = self.nbytes()

    # ------------------------------------------------------------------ storage
    def _layout(self, cap: torch.Tensor, old: tuple | None = None) -> None:
        """(Re)allocate the pool with per-row capacities `cap` [R]; copy the old segments over."""
        start = torch.zeros_like(cap)
        start[1:] = cap.cumsum(0)[:-1]
        P = int(cap.sum())
        k_pool = torch.zeros(P + 1, self.head_dim, device=self.device, dtype=self.dtype)
        v_pool = torch.zeros(P + 1, self.head_dim, device=self.device, dtype=self.dtype)
        if old is not None:
            old_k, old_v, old_start = old
            n = self.length
            total = int(n.sum())
            if total:
                rows = torch.repeat_interleave(torch.arange(self.rows, device=self.device), n)
                first = torch.cumsum(n, 0) - n
                off = torch.arange(total, device=self.device) - first[rows]
                k_pool[start[rows] + off] = old_k[old_start[rows] + off]
                v_pool[start[rows] + off] = old_v[old_start[rows] + off]
        self.k_pool, self.v_pool, self.start, self.cap = k_pool, v_pool, start, cap
        self.scratch = torch.full((self.rows,), P, device=self.device, dtype=torch.long)
        self.max_cap = int(cap.max())
        if self.reserve is not None:
            self._free_steps = int((cap - self.length).min())

    def _wanted(self, length: torch.Tensor) -> torch.Tensor:
        extra = torch.clamp(torch.ceil(length.to(torch.float64) * self.slack).to(torch.long), min=self.check_every)
        return length + extra

    def compact(self) -> None:
        """Lay the pool out again with `length + slack` slots per row (drops unused capacity)."""
        old = (self.k_pool, self.v_pool, self.start)
        self._layout(self._wanted(self.length), old)
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
        """One token; `types` ([B, Hkv] or [R]) overrides the scorer (tests, synthetic benchmarks)."""
        if self.auto_maintain:
            self.maintain()
        if self.backend == "triton":
            return self._step_fused(q, k, v, x, pos, types)
        t = self.types_of(x, pos) if types is None else types.reshape(self.rows).to(torch.long)
        kr, vr = self._kv_rows(k), self._kv_rows(v)
        W = self.window
        append_token(t, pos, kr, vr, self.ring_k, self.ring_v, self.ring_valid, self.k_pool, self.v_pool,
                     self.start, self.length, self.scratch)  # fmt: skip
        if self.track:
            self._record(self.length + self.ring_valid.sum(1))
            self.type_counts.scatter_add_(1, t[:, None], torch.ones_like(t)[:, None])
        self.t += 1
        # query i over the segment and the valid ring slots
        max_len = self.max_cap if self.backend == "triton" else int(self.length.max())
        y = pool_attention(
            self._q_rows(q),
            self.k_pool,
            self.v_pool,
            self.start,
            self.length,
            max_len,
            ring_k=self.ring_k,
            ring_v=self.ring_v,
            ring_valid=self.ring_valid,
            backend=self.backend,
        )
        drop_locals(t == GLOBAL, self.k_pool, self.v_pool, self.start, self.length, self.n_global, self.scratch)
        # the sliding token i - W + 1 has now been seen by W queries
        self.ring_valid.index_fill_(1, (pos + 1) % W, False)
        return self._out(y)

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
        """The same step with the Triton backend in three launches per layer: ``nats_append`` (the type from the
        core's scorer, computed in the kernel, then the ring write and the segment append; k and v are read where
        the projection wrote them), the pool attention and ``nats_evict``.

        Types that replace the scorer's argmax come from ``types`` or, for synthetic benchmarks, from the core's
        ``forced_types``: a pair (table [T, R] int64 on the device, first position p0) whose row ``pos - p0``
        holds the types of position ``pos`` (-1: the scorer's), read by the kernel at the device position. The
        scorer runs whenever the core has one, so an override leaves the step's work as it is."""
        from nats_kernels.nats_attention.decode import nats_append, nats_evict  # noqa: PLC0415

        if k.shape[2] != 1:
            raise ValueError(f"step() takes one token, got {k.shape[2]}")
        scorer = self._scorer() if x is not None else None
        types_from = None
        if types is not None:
            types = types.reshape(self.rows).to(device=self.device, dtype=torch.long)
        elif getattr(self.core, "forced_types", None) is not None:
            types, types_from = self.core.forced_types
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
        nats_append(
            x if scorer is not None else None,
            w_s,
            bias,
            types,
            pos,
            self._t,
            k,
            v,
            self.ring_k,
            self.ring_v,
            self.ring_valid,
            self.k_pool,
            self.v_pool,
            self.start,
            self.length,
            types_from=types_from,
        )
        if self.track:
            self._record(self.length + self.ring_valid.sum(1))
            self.type_counts.scatter_add_(1, self._t[:, None], torch.ones_like(self._t)[:, None])
        self.t += 1
        y = pool_attention(
            self._q_rows(q),
            self.k_pool,
            self.v_pool,
            self.start,
            self.length,
            self.max_cap,
            ring_k=self.ring_k,
            ring_v=self.ring_v,
            ring_valid=self.ring_valid,
            backend="triton",
        )
        nats_evict(self._t, pos, self.k_pool, self.v_pool, self.start, self.length, self.n_global, self.ring_valid)
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
        B, H, N, D = k.shape
        R, W = self.rows, self.window
        t = types.reshape(R, N).to(torch.long)
        keep, isg = kept_after_prompt(t)
        length = keep.sum(1)
        self.length.copy_(length)
        self.n_global.copy_(isg.sum(1))
        self._layout(self._wanted(length) if self.reserve is None else length + self.reserve)
        rows, j = keep.nonzero(as_tuple=True)  # row-major: positions ascending within a row
        first = torch.cumsum(length, 0) - length
        off = torch.arange(rows.numel(), device=self.device) - first[rows]
        kr, vr = k.reshape(R, N, D), v.reshape(R, N, D)
        self.k_pool[self.start[rows] + off] = kr[rows, j]
        self.v_pool[self.start[rows] + off] = vr[rows, j]
        # ring: sliding tokens still inside their window after query N-1, i.e. positions > N - W
        lo = max(0, N - W + 1)
        ring_pos = torch.arange(lo, N, device=self.device)
        slots = ring_pos % W
        self.ring_k[:, slots] = kr[:, ring_pos]
        self.ring_v[:, slots] = vr[:, ring_pos]
        self.ring_valid[:, slots] = t[:, ring_pos] == SLIDING
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
