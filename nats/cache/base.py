"""The per-layer KV-cache interface that every policy implements (:class:`LayerCache`), and :class:`SlotCache`,
the preallocated fixed-slot storage that ``full`` and ``streaming_llm`` share. The policies themselves live in
:mod:`nats.cache.policies`, one file each.

A :class:`LayerCache` holds the keys and values of one attention layer for ``batch`` sequences, per KV head
(GQA: the query heads of a group share their KV head's cache, and a policy that scores keys sums over the
group). Row ``r = b * Hkv + h`` is sequence b, KV head h. All sequences of a batch are at the same position.

Protocol, for the decode loop of :mod:`nats.cache.decode`:

* ``prefill(q, k, v, x) -> y`` from an empty cache: the layer's attention output ``[B, Hq, N, D]`` for the
  N prompt tokens and the cache state after them. ``prefill`` checks that the cache is empty (once, here) and
  calls ``_prefill``, whose default runs ``step`` once per position (exact for any policy, inside one layer);
  policies with a parallel exact form override ``_prefill``.
* ``step(q, k, v, x, pos) -> y``: one new token at position ``pos`` (LongTensor ``[1]`` on the cache's
  device); q ``[B, Hq, 1, D]``, k and v ``[B, Hkv, 1, D]`` (RoPE applied at the original position), x
  ``[B, 1, C]`` the block's normalised input (NAtS scores its type from it). Admits the token, attends over
  exactly the policy's visible set, then evicts. A policy whose ``graph_safe`` is true does this with device
  tensors only (no host synchronisation, fixed shapes), so the step can be captured in a CUDA graph.
* ``maintain() -> bool``: host-side upkeep before each step (e.g. NAtS' compaction); True when the storage
  tensors were reallocated (a captured CUDA graph must then be captured again). ``step`` calls it itself
  unless ``auto_maintain`` is False (`nats.cache.decode.GraphDecoder` sets that and calls ``maintain`` before
  each replay). ``replayed()`` advances the host counters of a step that ran as a graph replay.
* ``reserve``: the number of tokens the caller will decode after the prefill (None: unknown). Policies whose
  storage grows with the decoded tokens plan for it at the prefill (NAtS: ``kept + reserve`` pool slots per
  row, so ``maintain`` never reallocates within the reserve; SnapKV & co.: ``kept + reserve`` slots); the
  others ignore it.

Measurements (spec section 6): with ``track=True`` every step adds its cache size c_i (the keys query i
attended to, before eviction) per row; :meth:`fractions` gives the area fraction ``sum_i c_i / sum_i (i+1)``
and the peak fraction ``max_i c_i / N`` per ``[B, Hkv]``. :meth:`kept` is the number of tokens held now,
:meth:`nbytes` the bytes the cache has allocated (keys, values and metadata).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, ClassVar

import torch
from torch import Tensor

from nats.cache.attention import pool_attention, resolve_backend


class LayerCache:
    """Base class. Subclasses are registered with ``@register_cache("name")``."""

    name: str = "?"
    budgeted: bool = False  # takes a token budget B (spec section 7)
    decodable: bool = True  # False for eval-only approximations (prefill only)
    graph_safe: bool = True  # step() uses device tensors only (CUDA-graph capturable with the Triton backend)
    requires_core: str | None = None  # the attention core a model must have (e.g. "nats"; None: any decodable)
    prefill_time: bool = False  # exact prefill, then compresses the cache once (SnapKV & co.; not budget <= B after)
    needs_n_layer: bool = False  # takes n_layer= (per-layer budgets, PyramidKV); make_caches passes it
    # every row of a layer holds the same number of keys (full, StreamingLLM, SnapKV's one budget per row): the decode
    # attention splits each row alike; otherwise (NAtS, AdaKV, H2O) it streams the rows' keys end to end over one
    # wave of programs in equal shares, so a row that holds more keys takes more programs
    # (`nats_kernels.nats_attention.pool_decode`)
    even_rows: bool = False
    # how the policy runs in the fixed-capacity engine, the storage of `nats.hf.StaticPolicyCache`: a
    # nats.cache.engine.FixedRule class, made with the policy's options by `rule` (None: it has no such form)
    fixed_rule: ClassVar[Any] = None
    no_fixed_rule: ClassVar[str | None] = None  # why a decodable policy has no fixed-capacity rule (the contract asks)

    def __init__(
        self,
        *,
        batch: int,
        n_head: int,
        n_kv_head: int,
        head_dim: int,
        max_len: int,
        device: Any = "cpu",
        dtype: torch.dtype = torch.float32,
        layer_idx: int = 0,
        core=None,
        backend: str = "auto",
        track: bool = True,
        budget: int | None = None,
        reserve: int | None = None,
    ):
        if n_head % n_kv_head:
            raise ValueError(f"n_head={n_head} is not a multiple of n_kv_head={n_kv_head}")
        if max_len < 1 or batch < 1:
            raise ValueError(f"batch and max_len must be >= 1, got batch={batch}, max_len={max_len}")
        self.batch, self.n_head, self.n_kv_head, self.head_dim = batch, n_head, n_kv_head, head_dim
        self.group = n_head // n_kv_head
        self.rows = batch * n_kv_head
        self.max_len = int(max_len)
        self.device = torch.device(device)
        self.dtype = dtype
        self.layer_idx = layer_idx
        self.core = core
        self.backend = resolve_backend(backend, self.device)
        self.track = track
        self.budget = budget
        if reserve is not None and (int(reserve) != reserve or reserve < 0):
            raise ValueError(f"reserve (tokens decoded after the prefill) must be an integer >= 0, got {reserve!r}")
        self.reserve = None if reserve is None else int(reserve)
        self.auto_maintain = True
        self.t = 0  # tokens processed (host counter; not used inside step's device computation)
        self._area = torch.zeros(self.rows, dtype=torch.float64, device=self.device)
        self._peak = torch.zeros(self.rows, dtype=torch.int64, device=self.device)

    # ------------------------------------------------------------------ budgets
    @classmethod
    def check_budget(cls, budget: int | None, n: int, **options: Any) -> None:
        """Raise a clear ValueError unless `budget` suits a sequence of `n` tokens (budgeted policies)."""
        if not cls.budgeted:
            return
        if budget is None:
            raise ValueError(f"cache policy {cls.name!r} needs a token budget (budget=B with 1 <= B < N)")
        if int(budget) != budget or budget < 1:
            raise ValueError(f"cache policy {cls.name!r}: the budget must be a positive integer, got {budget!r}")
        if budget >= n:
            raise ValueError(
                f"cache policy {cls.name!r}: budget B={budget} >= N={n} tokens keeps everything (that is `full`); "
                f"use a budget below N, e.g. N/2 = {n // 2}"
            )

    @classmethod
    def accepted_options(cls, options: dict) -> dict:
        """The entries of `options` that the policy's own constructors take (its options, not the shapes)."""
        names: set[str] = set()
        for klass in cls.__mro__:
            if klass is LayerCache or "__init__" not in vars(klass):
                continue
            names.update(inspect.signature(klass.__init__).parameters)
        names -= set(inspect.signature(LayerCache.__init__).parameters) | {"self", "kwargs"}
        return {key: val for key, val in options.items() if key in names}

    @classmethod
    def rule(cls, **options: Any) -> Any:
        """The policy's fixed-capacity rule (`fixed_rule`) bound to its options, those of `options` its constructors
        take (`accepted_options`; the rest are ignored), and to its ``check_budget`` with them: the rule checks them
        where the policy's own cache does, with the budget, at the prompt."""
        if cls.fixed_rule is None:
            raise ValueError(f"cache policy {cls.name!r} has no fixed-capacity rule")
        opts = cls.accepted_options(options)
        rule = cls.fixed_rule(**opts)
        rule.check_budget = functools.partial(cls.check_budget, **opts)
        return rule

    # ------------------------------------------------------------------ shapes
    def _kv_rows(self, t: Tensor) -> Tensor:
        """k or v [B, Hkv, 1, D] -> [R, D]."""
        if t.shape[2] != 1:
            raise ValueError(f"step() takes one token, got {t.shape[2]}")
        return t.reshape(self.rows, self.head_dim)

    def _q_rows(self, t: Tensor) -> Tensor:
        """q [B, Hq, 1, D] -> [R, G, D] (query head h * G + g uses KV head h)."""
        if t.shape[2] != 1:
            raise ValueError(f"step() takes one token, got {t.shape[2]}")
        return t.reshape(self.rows, self.group, self.head_dim)

    def _out(self, y: Tensor) -> Tensor:
        """[R, G, D] -> [B, Hq, 1, D]."""
        return y.reshape(self.batch, self.n_head, 1, self.head_dim)

    def _attend_slots(self, q: Tensor, k: Tensor, v: Tensor, width: int) -> Tensor:
        """Attention of q ``[B, Hq, 1, D]`` over row r's first ``length[r]`` slots of the stores k, v (``capacity``
        slots per row: ``[B, Hkv, capacity, D]`` or ``[R, capacity, D]``); ``width``: a host bound of the lengths
        (the torch backend's padded width; the Triton kernel reads the lengths on the device)."""
        D = self.head_dim
        width = self.capacity if self.backend == "triton" else min(width, self.capacity)
        y = pool_attention(self._q_rows(q), k.view(-1, D), v.view(-1, D), self.start, self.length, width,
                           row_stride=self.capacity, backend=self.backend, balanced=not self.even_rows)  # fmt: skip
        return self._out(y)

    # ------------------------------------------------------------------ the protocol
    def prefill(self, q: Tensor, k: Tensor, v: Tensor, x: Tensor, **kwargs: Any) -> Tensor:
        """The prompt's attention output [B, Hq, N, D] and the cache state after it, from an empty cache."""
        self._check_empty("prefill()")
        return self._prefill(q, k, v, x, **kwargs)

    def _check_empty(self, what: str) -> None:
        if self.t:
            raise RuntimeError(f"{what} starts from an empty cache")

    def _prefill(self, q: Tensor, k: Tensor, v: Tensor, x: Tensor) -> Tensor:
        """Default: one `step` per position (exact, sequential inside the layer)."""
        N = q.shape[2]
        ys = []
        for i in range(N):
            pos = torch.full((1,), i, dtype=torch.long, device=q.device)
            ys.append(self.step(q[:, :, i : i + 1], k[:, :, i : i + 1], v[:, :, i : i + 1], x[:, i : i + 1], pos))
        return torch.cat(ys, dim=2)

    def step(self, q: Tensor, k: Tensor, v: Tensor, x: Tensor, pos: Tensor) -> Tensor:  # pragma: no cover
        raise NotImplementedError

    def maintain(self) -> bool:
        return False

    def replayed(self) -> None:
        """Host bookkeeping of a step that ran as a CUDA-graph replay (the graph holds only its device work)."""
        self.t += 1

    def kept(self) -> Tensor:  # pragma: no cover - interface
        """Tokens held now (after the last step's eviction), LongTensor [B, Hkv]."""
        raise NotImplementedError

    def tensors(self) -> list[Tensor]:  # pragma: no cover - interface
        """The tensors the cache owns (for `nbytes`)."""
        raise NotImplementedError

    def kv_tensors(self) -> list[Tensor]:  # pragma: no cover - interface
        """The key/value storage tensors (for `kv_nbytes`)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ measurements
    def _record(self, sizes: Tensor) -> None:
        """Add one step's cache sizes c_i (LongTensor [R])."""
        if self.track:
            self._area += sizes.to(torch.float64)
            torch.maximum(self._peak, sizes.to(torch.int64), out=self._peak)

    def _record_many(self, sizes: Tensor) -> None:
        """Add N steps' cache sizes (LongTensor [R, N])."""
        if self.track:
            self._area += sizes.to(torch.float64).sum(-1)
            torch.maximum(self._peak, sizes.to(torch.int64).amax(-1), out=self._peak)

    def fractions(self) -> dict[str, Tensor]:
        """Area and peak fractions so far (spec section 6), float64 [B, Hkv] each."""
        n = self.t
        if n == 0:
            raise RuntimeError("no token processed yet")
        area = self._area / (n * (n + 1) / 2.0)
        peak = self._peak.to(torch.float64) / n
        return {"area": area.view(self.batch, self.n_kv_head), "peak": peak.view(self.batch, self.n_kv_head)}

    def nbytes(self) -> int:
        """Bytes of every tensor the cache owns (keys, values and metadata)."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def kv_nbytes(self) -> int:
        """Bytes of the key/value storage."""
        return sum(t.numel() * t.element_size() for t in self.kv_tensors())

    def kept_nbytes(self) -> int:
        """Bytes of the keys and values of the tokens held now."""
        return int(self.kept().sum()) * 2 * self.head_dim * torch.empty((), dtype=self.dtype).element_size()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(name={self.name!r}, layer={self.layer_idx}, batch={self.batch}, "
            f"kv_heads={self.n_kv_head}, t={self.t}, budget={self.budget}, backend={self.backend!r})"
        )


class SlotCache(LayerCache):
    """Preallocated ``[B, Hkv, capacity, D]`` keys and values, every row holding the same number of keys in
    slots 0..length-1 (`full`: slot = position; `streaming_llm`: sinks, then a ring)."""

    even_rows = True

    def __init__(self, capacity: int, **kwargs):
        super().__init__(**kwargs)
        self.capacity = capacity
        shape = (self.batch, self.n_kv_head, capacity, self.head_dim)
        self.k = torch.zeros(shape, device=self.device, dtype=self.dtype)
        self.v = torch.zeros(shape, device=self.device, dtype=self.dtype)
        self.start = torch.arange(self.rows, device=self.device, dtype=torch.long) * capacity
        self.length = torch.zeros(self.rows, device=self.device, dtype=torch.long)

    def _store_and_attend(self, q, k, v, slot, length):
        """Write the new key/value at `slot`, set every row's length, attend over the held keys."""
        self.k.index_copy_(2, slot, k)
        self.v.index_copy_(2, slot, v)
        self.length.copy_(length.expand(self.rows))
        return self._attend_written(q)

    def _attend_written(self, q):
        """After a step's writes (the new key/value in its slot, every row's length set): record the sizes, count the
        token, attend over the held keys."""
        self._record(self.length)
        self.t += 1
        return self._attend_slots(q, self.k, self.v, self.t)

    def kept(self):
        return self.length.view(self.batch, self.n_kv_head).clone()

    def tensors(self):
        return [self.k, self.v, self.start, self.length]

    def kv_tensors(self):
        return [self.k, self.v]
