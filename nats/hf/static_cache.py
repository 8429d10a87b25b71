"""`StaticPolicyCache`: a transformers cache of fixed-capacity buffers that ``generate`` compiles and replays as a
CUDA graph, for NAtS and the baselines users compare it with.

``model.generate(ids, attention_mask=mask, max_new_tokens=n, cache=StaticPolicyCache(model, "nats",
max_new_tokens=n))`` (``past_key_values=`` before transformers 5.24; `nats.hf.compat.cache_kwargs` picks the name).

How a sequence goes through it (one decoder layer; row ``r = b * Hkv + h`` is sequence b, KV head h):

* **Prefill** (the prompt, eager): the layer's attention over the prompt under the policy's rule (NAtS: the
  fused Triton kernel with the scorer's types; ``full`` / ``snapkv`` / ``pyramidkv``: causal SDPA;
  ``streaming_llm``: its mask), then the tokens the policy keeps are written, per row, into one flat pool
  ``[P, D]`` (keys and values) in which row r owns the segment ``[start[r], start[r] + cap[r])``. The capacity
  is planned here, per row: ``cap[r] = kept after the prompt + max_new_tokens`` (``streaming_llm``: its
  budget), so a segment never overflows while at most ``max_new_tokens`` tokens are generated; NAtS' sliding
  tokens live in a ring of W slots per row besides. Memory is therefore the kept tokens plus the new ones, per
  KV head, not the longest row times the rows. Left-padded prompts (``attention_mask`` with zeros on the left,
  ``tokenizer.padding_side = "left"``) are prefilled row by row over their real tokens: padding is never kept
  nor counted, and a row's first real token is its position 0 (NAtS: global).
* **Decode** (one token per row, compiled): device tensors only, fixed shapes, no host synchronisation: the
  new token is admitted and the query attends over exactly what the row keeps (``nats::pool_attention``: the
  Triton split-K kernel reading each KV head once for its GQA group). NAtS does its bookkeeping in one launch
  before the attention (``nats::nats_step``): the previous token's eviction (the locals of a row whose token was
  global; its expired ring slot is the new token's), the new token's type from the scorer, ring write and
  segment append. Deferring the eviction to the next step changes nothing that a query sees. ``full`` /
  ``snapkv`` / ``pyramidkv`` append, ``streaming_llm`` overwrites the oldest non-sink slot of its ring.
* **Overflow** (more new tokens than planned): NAtS keeps a global or local token of a full segment as a sliding
  one (visible for W steps); the appending policies stop admitting the row's new tokens (they are attended to
  in their own step only). `overflowed` says whether it happened. Plan ``max_new_tokens`` as for ``generate``.

Limits: greedy or sampled decoding (beam search and ``num_return_sequences > 1`` are refused: a row's cache
cannot be duplicated or reordered); one ``generate`` call per cache (make a new one per batch); H2O is not
offered (its eviction reads each step's attention probabilities: use `nats.hf.PolicyCache(model, "h2o")`).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.cache_utils import Cache

from nats import functional as NF
from nats.cache import get_cache_class
from nats.cache import static_ops as ops
from nats.cache.policies.nats import kept_after_prompt
from nats.hf.cache import FixedRowsLayer
from nats_kernels.nats_attention import reference as _ref

POLICIES = ("full", "nats", "streaming_llm", "snapkv", "pyramidkv")
_RULE = {"full": "append", "snapkv": "append", "pyramidkv": "append", "streaming_llm": "ring", "nats": "nats"}
_ROUND = 1024  # pool sizes are rounded up to a multiple of this many slots (fewer distinct shapes to compile) ...


def _rounded(n: int) -> int:
    """... or of an eighth of the size's power of two when that is smaller (small pools stay small)."""
    step = max(256, min(_ROUND, 1 << max(0, n.bit_length() - 4)))
    return (n + step - 1) // step * step


def _mark_static(*tensors: Tensor) -> None:
    if not torch.compiler.is_compiling():
        for t in tensors:
            torch._dynamo.mark_static_address(t)


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_sms(index: int) -> int:  # read once per GPU: the prefill asks at every layer
    return torch.cuda.get_device_properties(index).multi_processor_count


def _plan_rows(keep: Tensor, cap: Tensor, n_global: Tensor | None = None, count: Tensor | None = None):
    """The segments of rows keeping the positions where ``keep`` (``[..., N]`` bool, rows flattened to ``[R, N]``),
    ``cap`` ``[R]`` slots planned each: (the flat keep mask; ``rank`` ``[R, N]``, each kept position's 1-based rank
    in its row; the rows' bookkeeping ``[6, R]`` (start, length, cap (at least the length), ``n_global``, -1 (no
    eviction pending), ``count``; zeros where not given); ``end`` ``[1]``, the slots all segments take)."""
    keep = keep.reshape(-1, keep.shape[-1])
    rank = keep.cumsum(1)
    length = rank[:, -1]
    cap = torch.maximum(cap, length)
    end = cap.cumsum(0)
    start = end - cap
    zero = torch.zeros_like(start)
    n_global, count = (zero if t is None else t for t in (n_global, count))
    return keep, rank, torch.stack((start, length, cap, n_global, zero - 1, count)), end[-1:]


def _nats_rows(types: Tensor, k: Tensor, v: Tensor, window: int, max_new: int):
    """A NAtS layer's state after the prompt from its integer types ``[B, Hkv, N]`` (-1 on left padding), keys and
    values ``[B, Hkv, N, D]`` (rows r = b * Hkv + h): what is kept (`kept_after_prompt`) and its segments
    (`_plan_rows`, ``cap`` = kept + ``max_new``); the ring of the last W - 1 positions (slot = position mod W,
    valid where sliding)."""
    N, D = types.shape[-1], k.shape[-1]
    types, k, v = types.reshape(-1, N), k.reshape(-1, N, D), v.reshape(-1, N, D)
    R = types.shape[0]
    keep, isg = kept_after_prompt(types)
    keep, rank, rows, end = _plan_rows(keep, keep.sum(1) + max_new, n_global=isg.sum(1))
    lo = max(0, N - window + 1)
    slots = torch.arange(lo, N, device=types.device) % window  # the last W - 1 positions' ring slots (distinct)
    ring_kv = k.new_zeros(2, R, window, D)
    ring_kv[0].index_copy_(1, slots, k[:, lo:])
    ring_kv[1].index_copy_(1, slots, v[:, lo:])
    ring_valid = torch.zeros(R, window, dtype=torch.bool, device=types.device)
    ring_valid.index_copy_(1, slots, types[:, lo:] == NF.TOKEN_SLIDING)
    return keep, rank, rows, end, ring_kv, ring_valid


def _pool_fill(keep: Tensor, rank: Tensor, rows: Tensor, k: Tensor, v: Tensor, size: int) -> Tensor:
    """The pool ``[2, size, D]`` (keys, values) holding row r's kept positions (``keep``, ``rank``, ``rows``:
    `_plan_rows`; k, v ``[B, Hkv, N, D]``) in order from its start; dropped positions go to the scratch slot, the
    last one. The rest is zeros: readers may touch unused slots."""
    R, N = keep.shape
    D = k.shape[-1]
    dest = torch.where(keep, rows[0, :, None] + rank - 1, size - 1)  # [R, N]
    pool = k.new_zeros(2, size, D)
    pool[0].index_put_((dest,), k.reshape(R, N, D))
    pool[1].index_put_((dest,), v.reshape(R, N, D))
    return pool


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


class StaticPolicyLayer(FixedRowsLayer):
    """One decoder layer's buffers (allocated by the prefill, when the kept tokens are known)."""

    is_compileable = True
    is_sliding = False
    is_croppable = False
    supports_early_init = False

    def __init__(self, owner: StaticPolicyCache, layer_idx: int):
        super().__init__()
        self.owner, self.layer_idx = owner, layer_idx
        self.max_cache_len = owner.max_len
        # tokens per row so far, padding included: one tensor for all layers (layer 0's; the others share it), which
        # layer 0 advances; the compiled step then reads one position counter, not one per layer (each is a guarded
        # graph input, host time at every step)
        self.cumulative_length = torch.tensor(0, dtype=torch.long)
        self.pending: tuple[Tensor, Tensor] | None = None
        self.ready = False  # prefilled

    # ------------------------------------------------------------------ transformers' layer interface
    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        self.batch_size, self.n_kv_head = key_states.shape[:2]
        if self.layer_idx == 0:
            self.cumulative_length = self.cumulative_length.to(self.device)
            _mark_static(self.cumulative_length)
        else:  # the layers run in order: layer 0 holds the counter already
            first = self.owner.layers[0]
            if not first.is_initialized:
                raise RuntimeError("StaticPolicyCache: layer 0 must be updated before the others")
            self.cumulative_length = first.cumulative_length
        self.is_initialized = True

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
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

    # ------------------------------------------------------------------ storage
    def allocate(self, pool: Tensor, rows: Tensor, splits: int, area: Tensor | None, peak: Tensor | None) -> None:
        """Take the layer's pool ``[2, P, D]`` (`_pool_fill`), its rows' bookkeeping ``[6, R]`` and, where the
        cache sizes are tracked, their sum and maximum over the prompt ``[R]`` (advanced by the decode steps)."""
        self.kv_pool, self.rows, self.splits, self.area, self.peak = pool, rows, splits, area, peak
        _mark_static(*(t for t in (self.kv_pool, self.rows, self.area, self.peak) if t is not None))
        self.ready = True

    # The buffers are packed into few tensors, the named ones being views of them: every tensor the compiled decode
    # step reads from the cache is a graph input that dynamo guards before each replay, and the guard check is host
    # time at every step (at batch 1 the step is host-bound). Per layer: kv_pool [2, P, D] (keys, values),
    # rows [6, R] int64 (segment start, length, capacity, NAtS' global count and pending type, the ring rule's
    # count), NAtS' ring_kv [2, R, W, D] and ring_valid [R, W], the position counter (and area / peak with track).
    k_pool = property(lambda self: self.kv_pool[0])
    v_pool = property(lambda self: self.kv_pool[1])
    ring_k = property(lambda self: self.ring_kv[0])
    ring_v = property(lambda self: self.ring_kv[1])
    start = property(lambda self: self.rows[0])
    length = property(lambda self: self.rows[1])
    cap = property(lambda self: self.rows[2])
    n_global = property(lambda self: self.rows[3])
    t = property(lambda self: self.rows[4])  # NAtS: the last token's type, its eviction pending (-1: none)
    count = property(lambda self: self.rows[5])  # the ring rule: tokens written so far

    def tensors(self) -> list[Tensor]:
        """The buffers the decode step reads and writes (the packed tensors themselves)."""
        names = ("kv_pool", "rows", "ring_kv", "ring_valid", "cumulative_length", "area", "peak")
        return [getattr(self, n) for n in names if getattr(self, n, None) is not None]

    def kv_nbytes(self) -> int:
        ts = [getattr(self, n, None) for n in ("kv_pool", "ring_kv")]
        return sum(t.numel() * t.element_size() for t in ts if t is not None)


class StaticPolicyCache(Cache):
    """A compileable transformers cache running a KV-cache policy in fixed-capacity buffers (module docstring).

    Args:
        model: a supported transformers model with NAtS attached (`nats.hf.attach_nats`) for ``"nats"``, or
            `nats.hf.use_policy_caches(model)` called for the baselines.
        policy: ``"nats"``, ``"full"``, ``"streaming_llm"``, ``"snapkv"`` or ``"pyramidkv"``.
        max_new_tokens: the most tokens ``generate`` will add (the capacity planned per row on top of what the
            prompt leaves; pass the same number to ``generate``).
        budget: budgeted policies: tokens per row and KV head (an int), or a fraction of each row's prompt (a
            float in (0, 1)).
        max_len: the longest sequence (prompt + new tokens); the size of the attention mask ``generate`` builds
            (default ``config.max_position_embeddings``).
        track: record each decode step's cache size for `fractions` (two small device ops per layer and step).
        prefill_kernel: how NAtS' prefill writes the cache: ``"triton"`` (two fused launches per layer,
            `nats_kernels.nats_attention.prefill_cache`), ``"torch"`` (some thirty small PyTorch operations per
            layer, the kernels' reference) or ``"auto"`` (default: Triton for CUDA tensors where the kernels
            import, else PyTorch). On an H100 the Triton writes cut the 8k prefill by 19-45% at batch 1 and
            11-18% at batch 8 (docs/results/bench_hf_decode_h100.md).
        **options: the policy's options (``sinks=`` for streaming_llm; ``window=``, ``kernel=``, ``pooling=`` for
            snapkv / pyramidkv; NAtS' window comes from its scorers).
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
        **options: Any,
    ):
        from nats.hf.hooks import routed_cores  # noqa: PLC0415

        if policy not in POLICIES:
            raise ValueError(
                f"StaticPolicyCache: policy {policy!r} has no fixed-capacity form; choose one of {', '.join(POLICIES)}"
                " (other policies, H2O included: nats.hf.PolicyCache)"
            )
        if int(max_new_tokens) != max_new_tokens or max_new_tokens < 1:
            raise ValueError(f"StaticPolicyCache: max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        config = model.config
        self.cores = routed_cores(model, "StaticPolicyCache")
        if policy == "nats" and any(c is None for c in self.cores):
            raise ValueError("StaticPolicyCache: policy 'nats' needs NAtS scorers: call nats.hf.attach_nats(model)")
        self.policy, self.rule = policy, _RULE[policy]
        self.policy_cls = get_cache_class(policy)
        if self.policy_cls.budgeted and budget is None:
            raise ValueError(f"StaticPolicyCache: policy {policy!r} needs a budget (tokens, or a fraction in (0, 1))")
        if budget is not None and not (budget >= 1 or 0 < budget < 1):
            raise ValueError(f"StaticPolicyCache: budget must be >= 1 tokens or a fraction in (0, 1), got {budget!r}")
        self.budget, self.options = budget, dict(options)
        self.max_new_tokens = int(max_new_tokens)
        self.track = track
        if prefill_kernel not in ("auto", "torch", "triton"):
            raise ValueError(
                f"StaticPolicyCache: prefill_kernel must be 'auto', 'torch' or 'triton', got {prefill_kernel!r}"
            )
        self.prefill_kernel = prefill_kernel
        self.n_head, self.n_layer = config.num_attention_heads, len(self.cores)
        self.max_len = int(max_len or getattr(config, "max_position_embeddings", 0) or 0)
        if self.max_len < 1:
            raise ValueError("StaticPolicyCache: pass max_len (the model config has no max_position_embeddings)")
        self.prompt_lengths: Tensor | None = None  # real tokens per sequence, set by the prefill
        self._real_rows: Tensor | None = None  # the same per row (sequence x KV head)
        self._unallocated: list[tuple] = []  # prefilled layers whose pools are allocated at the next layer
        self._sizes_host: Tensor | None = None  # CUDA: the layers' pool sizes, copied into pinned memory ...
        self._stream = None  # ... on this stream (both set by the first prefilled layer)
        self._budgets: Tensor | None = None  # budgeted policies: tokens per sequence, set by the prefill ...
        self._budgets_host: list[int] = []  # ... and the same on the host
        super().__init__(layers=[StaticPolicyLayer(self, i) for i in range(len(self.cores))])

    # ------------------------------------------------------------------ the attention function's entry point
    def attend(self, layer_idx: int, query: Tensor, hidden: Tensor, attention_mask: Tensor | None) -> Tensor:
        """The layer's attention output ``[B, Hq, N, D]`` for its new queries (after RoPE, scaled for
        1/sqrt(D)); prefill on the first call, then one decode step per token."""
        layer = self.layers[layer_idx]
        k, v = layer.pending
        layer.pending = None
        if not layer.ready:
            return self._prefill(layer, query, k, v, hidden, attention_mask)
        if query.shape[-2] == 1:
            return self._decode(layer, query, k, v, hidden)
        outs = [
            self._decode(layer, query[:, :, i : i + 1], k[:, :, i : i + 1], v[:, :, i : i + 1], hidden[:, i : i + 1])
            for i in range(query.shape[-2])
        ]
        return torch.cat(outs, dim=2)

    # ------------------------------------------------------------------ prefill
    def _row_budget(self, n: Tensor) -> Tensor:
        b = self.budget
        if b is None:
            return n
        return (n.to(torch.float64) * b).round().clamp(min=1).long() if b < 1 else torch.full_like(n, int(b))

    def _prefill(self, layer, q, k, v, hidden, attention_mask) -> Tensor:
        B, Hq, N, D = q.shape
        Hkv = k.shape[1]
        if self.prompt_lengths is None:  # the first layer: the padding, once for every layer
            pads = _left_padding(attention_mask, B, N, q.device)
            self.prompt_lengths, self._pads = N - pads, pads
            self._groups = None if bool((pads == 0).all()) else [(slice(b, b + 1), int(pads[b])) for b in range(B)]
        pads, groups = self._pads, self._groups
        core = self.cores[layer.layer_idx]
        if self.budget is not None and self._budgets is None:  # the rows' budgets, on the device and the host, once
            self._budgets = self._row_budget(self.prompt_lengths)
            self._budgets_host = self._budgets.tolist()
        budgets = self._budgets
        direct = None
        if groups is None and self.rule == "nats":  # NAtS without padding: the direct kernels where they apply
            direct = self._prefill_direct(core, q, k, v, hidden)
        if direct is not None:
            y, types, rows, end, ring_kv, ring_valid, fill = direct
        elif groups is None:  # no padding: every row at once
            top = None if budgets is None else max(self._budgets_host)
            y, keep, types, sizes = self._prefill_rows(layer, core, q, k, v, hidden, top)
        else:  # left padding: row by row over the real tokens
            y = torch.zeros_like(q)
            nats = self.rule == "nats"
            keep = None if nats else torch.zeros(B, Hkv, N, dtype=torch.bool, device=q.device)
            types = torch.full((B, Hkv, N), -1, dtype=torch.long, device=q.device) if nats else None  # -1: padding
            sizes = torch.zeros(B, Hkv, N, dtype=torch.long, device=q.device) if self.track and not nats else None
            for rows, p in groups:
                bb = None if budgets is None else max(self._budgets_host[rows])
                yb, kb, tb, sb = self._prefill_rows(layer, core, q[rows, :, p:], k[rows, :, p:], v[rows, :, p:],
                                                    hidden[rows, p:], bb)  # fmt: skip
                y[rows, :, p:] = yb
                for whole, part in ((keep, kb), (types, tb), (sizes, sb)):
                    if whole is not None:
                        whole[rows, :, p:] = part
        R = B * Hkv
        if self._real_rows is None:  # [R] real prompt tokens per row, the same for every layer
            self._real_rows = self.prompt_lengths.repeat_interleave(Hkv)
        ring = area = peak = rank = None
        if self.rule == "nats" and self.track:
            sizes = _ref.kv_cache_sizes(types.reshape(R, N).long(), core.window)  # 0 on padding (-1: no type)
        if self.track:
            area, peak = sizes.reshape(R, N).sum(-1).double(), sizes.reshape(R, N).amax(-1)
        if direct is not None:  # done by the direct kernels
            ring = (ring_kv, ring_valid, core.window)
        elif self.rule == "nats" and self._triton_prefill(k):  # two launches: prefill_cache.py
            from nats_kernels.nats_attention.prefill_cache import prefill_pool, prefill_rows  # noqa: PLC0415

            rows, end, ring_kv, ring_valid, last_g = prefill_rows(types, k, v, core.window, self.max_new_tokens)
            ring = (ring_kv, ring_valid, core.window)
            fill = lambda size: prefill_pool(types, k, v, rows, last_g, size)  # noqa: E731
        elif self.rule == "nats":  # keep mask, segments, ring
            keep, rank, rows, end, ring_kv, ring_valid = _nats_rows(types, k, v, core.window, self.max_new_tokens)
            ring = (ring_kv, ring_valid, core.window)
        else:
            cap = budgets.repeat_interleave(Hkv) if self.rule == "ring" else keep.sum(-1).view(R) + self.max_new_tokens
            count = self._real_rows if self.rule == "ring" else None  # the ring rule's tokens so far
            keep, rank, rows, end = _plan_rows(keep, cap, None, count)
        if rank is not None:  # the PyTorch plan: its pool fill
            fill = lambda size: _pool_fill(keep, rank, rows, k, v, size)  # noqa: E731
        bound = N + self.max_new_tokens + (core.window if self.rule == "nats" else 0)  # no host sync for the max
        splits = max(1, min(64, math.ceil(2 * _num_sms(q.device) / R), math.ceil(bound / 256)))
        # the pool is allocated one layer later (PoolLayout), all remaining ones at the last layer
        host = stream = None
        if q.is_cuda:  # the sizes' pinned slots and the stream, once per prefill
            if self._sizes_host is None:
                self._sizes_host = torch.empty(self.n_layer, dtype=torch.long, pin_memory=True)
                self._stream = torch.cuda.current_stream(q.device)
            host, stream = self._sizes_host[layer.layer_idx : layer.layer_idx + 1], self._stream
        self._unallocated.append((layer, PoolLayout(rows, end, fill, host, stream), splits, ring, area, peak, N))
        last = layer.layer_idx == self.n_layer - 1
        while len(self._unallocated) > (0 if last else 1):
            self._fill_pool(*self._unallocated.pop(0))
        return y

    def _triton_prefill(self, k: Tensor) -> bool:
        """Whether NAtS' prefill writes the cache with the Triton kernels (``prefill_kernel``)."""
        if self.prefill_kernel != "auto":
            return self.prefill_kernel == "triton"
        return k.is_cuda and NF.triton_available()

    def _scored_prefill(self, q: Tensor, k: Tensor, backend: str) -> bool:
        """Whether NAtS' prefill runs the Triton attention from the scorer's logits (`nats_prefill_scored`): with
        the Triton writes (on the CPU only where asked for, through Triton's interpreter), a head dim and dtype the
        kernels take, and a core that does not insist on the PyTorch reference."""
        from nats_kernels.nats_attention import triton_takes  # noqa: PLC0415

        return self._triton_prefill(k) and backend != "reference" and triton_takes(q)

    def _prefill_direct(self, core, q, k, v, hidden):
        """NAtS' prefill of one unpadded layer by `prefill_cache.PrefillKernels` (where `_scored_prefill` holds and
        the tensors are laid out for it): (output, int8 types, rows, end, ring, ring validity, the pool's fill);
        else None. The scorer's Linear, then four Triton launches whose launch parameters are worked out once per
        kind of layer, and no other operation: at batch 1 the prefill is bound by the host's work per layer."""
        if not self._scored_prefill(q, k, getattr(core, "backend", "auto")):
            return None
        from nats_kernels.nats_attention.prefill_cache import prefill_kernels  # noqa: PLC0415

        B, N, H = q.shape[0], q.shape[2], k.shape[1]
        logits = F.linear(hidden, core.scorer.weight, core.scorer.bias).view(B, N, H, 3).transpose(1, 2)
        kernels = prefill_kernels(q, k, v, logits, core.type_bias, core.window, self.max_new_tokens)
        if kernels is None:
            return None
        y, types, rows, end, ring_kv, ring_valid, last_g = kernels.attend(q, k, v, logits, core.type_bias)
        return y, types, rows, end, ring_kv, ring_valid, lambda size: kernels.pool(types, k, v, rows, last_g, size)

    def _fill_pool(self, layer, layout, splits, ring, area, peak, N) -> None:
        """A prefilled layer's buffers: its pool, its bookkeeping, (NAtS) its ring, (tracking) its sizes so far."""
        size = _rounded(layout.size() + 1)  # + the scratch slot (the last one) where skipped writes go
        pool = layout.fill(size)
        layer.allocate(pool, layout.rows, splits, area, peak)
        if ring is not None:
            layer.ring_kv, layer.ring_valid, layer.window = ring
            _mark_static(layer.ring_kv, layer.ring_valid)
        elif self.rule == "ring":
            layer.sinks = int(self.options.get("sinks", 4))
        layer.real = self._real_rows
        layer.prompt_width = N

    def _prefill_rows(self, layer, core, q, k, v, hidden, budget: int | None):
        """Attention output, keep mask ``[b, Hkv, n]`` and the cache sizes c_i (spec section 6) of unpadded rows,
        or (NAtS) the output and the types; ``budget``: the rows' largest budget in tokens (budgeted policies),
        read by the host once per prefill, not per layer."""
        b_, Hq, n = q.shape[0], q.shape[1], q.shape[2]
        Hkv = k.shape[1]
        gqa = Hq != Hkv

        def seen():  # every prompt token held: the cache size c_i = i + 1 (spec section 6), for `track`
            return torch.arange(1, n + 1, device=q.device).expand(b_, Hkv, n) if self.track else None

        if self.rule == "nats":
            backend = getattr(core, "backend", "auto")
            if self._scored_prefill(q, k, backend):
                # the plan kernel takes the scorer's argmax (hard_types' float, offsets, argmax and token 0 are
                # four launches per layer less, at batch 1 where the prefill is bound by its launches)
                from nats_kernels.nats_attention import nats_prefill_scored  # noqa: PLC0415

                logits = core.scorer(hidden).view(b_, n, Hkv, 3).transpose(1, 2)  # [b, Hkv, n, 3]
                y, types = nats_prefill_scored(q, k, v, logits, core.type_bias, core.window)  # int8 types
                return y, None, types, None
            types = core.hard_types(hidden)  # [b, Hkv, n], token 0 global
            y = NF.nats_attention_types(q, k, v, types, core.window, backend=backend)
            return y, None, types, None  # what is kept follows from the types (`_nats_rows`)
        if self.rule == "ring":
            sinks = int(self.options.get("sinks", 4))
            b = budget
            if b <= sinks:
                raise ValueError(f"StaticPolicyCache: streaming_llm budget {b} must exceed sinks={sinks}")
            from nats.cache.policies.streaming_llm import streaming_mask  # noqa: PLC0415

            mask = streaming_mask(n, b, sinks, device=q.device)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
            pos = torch.arange(n, device=q.device)
            keep = ((pos < sinks) | (pos > n - 1 - (b - sinks))).expand(b_, Hkv, n).contiguous()  # strides as padded
            sizes = seen()
            return y, keep, None, None if sizes is None else sizes.clamp(max=b)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        everything = torch.ones(b_, Hkv, n, dtype=torch.bool, device=q.device)
        if self.policy == "full":
            return y, everything, None, seen()
        b = budget
        opts = {key: val for key, val in self.options.items() if key in ("window", "kernel", "pooling", "beta")}
        if self.policy_cls.needs_n_layer:
            opts["n_layer"] = self.n_layer
        if b >= n:
            return y, everything, None, seen()
        selector = self.policy_cls(
            batch=q.shape[0], n_head=Hq, n_kv_head=Hkv, head_dim=q.shape[-1], max_len=n, device=q.device,
            dtype=q.dtype, layer_idx=layer.layer_idx, budget=b, backend="torch", track=False, **opts,
        )  # fmt: skip
        return y, selector.keep_mask(q, k), None, seen()  # the prefill reads every prompt key

    # ------------------------------------------------------------------ decode (compiled by generate)
    def _decode(self, layer, q, k, v, hidden) -> Tensor:
        B, Hq, _, D = q.shape
        R = layer.start.shape[0]
        G = Hq // (R // B)
        kr, vr = k.reshape(R, D), v.reshape(R, D)
        qr = q.reshape(R, G, D)
        pos = (layer.cumulative_length - 1).reshape(1)  # the new token's position (padding included)
        if self.rule == "nats":
            core = self.cores[layer.layer_idx]
            x = hidden.reshape(B, -1)
            ops.nats_step(x, core.scorer.weight, core.type_bias, pos, layer.rows, kr, vr, layer.ring_kv,
                          layer.ring_valid, layer.kv_pool)  # fmt: skip
            size = layer.length + layer.ring_valid.sum(1)
            y = ops.pool_attention(qr, layer.k_pool, layer.v_pool, layer.start, layer.length, layer.ring_k,
                                   layer.ring_v, layer.ring_valid, layer.splits)  # fmt: skip
        else:
            scratch = layer.k_pool.shape[0] - 1
            if self.rule == "ring":
                c = layer.count
                ring = layer.cap - layer.sinks
                slot = torch.where(c < layer.cap, c, layer.sinks + (c - layer.sinks) % ring)
                dest = layer.start + slot
                layer.count.add_(1)
                layer.length.copy_(torch.minimum(layer.count, layer.cap))
            else:
                full = layer.length >= layer.cap
                dest = torch.where(full, torch.full_like(layer.start, scratch), layer.start + layer.length)
                layer.length.add_((~full).to(layer.length.dtype))
            layer.k_pool.index_copy_(0, dest, kr)
            layer.v_pool.index_copy_(0, dest, vr)
            size = layer.length
            y = ops.pool_attention(qr, layer.k_pool, layer.v_pool, layer.start, layer.length, None, None, None,
                                   layer.splits)  # fmt: skip
        if self.track:
            layer.area.add_(size.to(torch.float64))
            torch.maximum(layer.peak, size, out=layer.peak)
        return y.reshape(B, Hq, 1, D)

    # ------------------------------------------------------------------ measurements
    def kept(self) -> Tensor:
        """Tokens held now per layer, sequence and KV head, ``[n_layer, B, Hkv]``."""
        out = []
        for layer in self.layers:
            n = layer.length
            if self.rule == "nats":  # the last token's eviction is applied by the next step: count it done
                n = torch.where(layer.t == NF.TOKEN_GLOBAL, layer.n_global + 1, n)
                expired = layer.ring_valid[:, int(layer.cumulative_length) % layer.window]
                n = n + layer.ring_valid.sum(1) - expired.long()
            out.append(n.view(layer.batch_size, layer.n_kv_head))
        return torch.stack(out)

    def fractions(self) -> dict[str, Tensor]:
        """Area and peak fractions (spec section 6) over each row's real tokens so far, ``[n_layer, B, Hkv]``."""
        if not self.track:
            raise RuntimeError("StaticPolicyCache: made with track=False, it has no area / peak record")
        area, peak = [], []
        for layer in self.layers:
            n = (layer.real + (int(layer.cumulative_length) - layer.prompt_width)).double()
            area.append((layer.area / (n * (n + 1) / 2)).view(layer.batch_size, layer.n_kv_head))
            peak.append((layer.peak.double() / n).view(layer.batch_size, layer.n_kv_head))
        return {"area": torch.stack(area), "peak": torch.stack(peak)}

    def kv_nbytes(self) -> int:
        """Bytes of the key/value buffers (pools and rings) allocated now."""
        return sum(layer.kv_nbytes() for layer in self.layers if layer.ready)

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
