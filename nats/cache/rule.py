"""What a KV-cache policy declares to run in the engine (`nats.cache.engine`): its rule (:class:`FixedRule`: what it
keeps of a prompt, how a decode step admits and evicts, its flags and its budget check), where the engine runs it (a
:class:`RuleContext` per layer), and what its prompt hands to the engine (:class:`PromptState`, :class:`Plan`).
:class:`AppendRule` is written here (keep the whole prompt, append every new token: ``full``, and the base of the
selecting policies); every other policy's rule lives in its own file of `nats.cache.policies`, registered by name.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from nats.cache.attention import resolve_backend
from nats.cache.engine import (
    GROW_STEPS,
    append_chunk,
    attend,
    chunk_attention,
    plan_rows,
    pool_fill,
    segment_kv,
    write_kv,
)

__all__ = ["RuleContext", "PromptState", "Plan", "FixedRule", "AppendRule", "fixed_policies"]


@dataclass(frozen=True)
class RuleContext:
    """Where a rule runs (`FixedRule`): what the engine tells it besides the tensors. The policy's own options are
    bound to the rule itself (``FixedRule.rule(**options)``)."""

    layer_idx: int  # the decoder layer
    n_layer: int  # the model's decoder layers (PyramidKV's per-layer budgets)
    # tokens to decode after the prompt: planned per row on top of what the prompt leaves; None: unknown (the rows
    # get `GROW_STEPS` free slots and an eager caller grows the pool when they run out, `EngineLayer.maintain`)
    reserve: int | None
    track: bool  # record the cache sizes c_i of the queries (spec section 6; NAtS: and count the types)
    prefill_kernel: str = "auto"  # how NAtS' prompt writes the cache: "auto", "torch" or "triton"
    backend: str = "auto"  # the decode attention's kernels (both custom ops): "torch", "triton" or "auto"

    @property
    def room(self) -> int:
        """Free slots planned per row after the prompt: the reserve, or `GROW_STEPS` where it is unknown."""
        return GROW_STEPS if self.reserve is None else self.reserve


@dataclass
class PromptState:
    """What a rule's `FixedRule.prompt` returns for unpadded rows: the attention output ``y`` ``[b, Hq, n, D]``, and
    either the keep mask ``[b, Hkv, n]`` or (NAtS) the integer types ``[b, Hkv, n]``; ``sizes``: the cache sizes c_i
    of the prompt's queries (spec section 6) ``[b, Hkv, n]`` where tracked and known here."""

    y: Tensor
    keep: Tensor | None = None
    types: Tensor | None = None
    sizes: Tensor | None = None
    extra: dict | None = None  # a rule's own state per row (tensors whose first axis is the rows [b * Hkv])


@dataclass
class Plan:
    """A layer's planned storage: its rows' bookkeeping ``[6, R]``, the pool's size on the device ``end`` ``[1]``,
    ``fill(size)`` making the pool, the ring (``(ring_kv, ring_valid, W)``) where the rule has one, and the prompt's
    cache sizes ``[R, N]`` where tracked."""

    rows: Tensor
    end: Tensor
    fill: Any
    ring: tuple | None = None
    sizes: Tensor | None = None
    extra: dict | None = None  # the rule's own buffers, set on the layer under these names (see FixedRule.buffers)


class FixedRule:
    """A KV-cache policy: how it runs in the engine. Subclasses, one per file of `nats.cache.policies` (registered with
    ``@register_cache``), say what a prompt leaves (``prompt``, ``plan``) and how a decode step changes a row
    (``step``), with device tensors only and fixed shapes (compiled, replayed as a CUDA graph), and carry the policy's
    flags. A rule is made with its options (`rule`: those its constructors take, as keywords); ``ctx``, a
    `RuleContext`, says where it runs.

    Per-step state of a rule lives in the layer's ``rows`` (counters 3-5), its ring, or extra buffers it adds in
    ``setup`` (returned by ``buffers`` so that the adapter marks them static and counts them)."""

    name = "?"
    ring = False  # W ring slots per row besides the segment (NAtS)
    # a row's segment grows with the decoded tokens (appending rules and NAtS: a step adds at most one token per row);
    # False where the rule keeps its rows within a fixed size (the ring rule, H2O): `EngineLayer.maintain` never grows
    grows = False
    budgeted = False  # takes a token budget B (spec section 7)
    decodable = True  # False: a prefill-only approximation (its step is refused)
    requires_core: str | None = None  # the attention core a model must have (e.g. "nats"; None: any)
    prefill_time = False  # exact prefill, then compresses the cache once (SnapKV & co.; not budget <= B after)
    # every row of a layer holds the same number of keys (full, StreamingLLM, SnapKV's one budget per row): the decode
    # attention splits each row alike; otherwise (NAtS, AdaKV, H2O) it streams the rows' keys end to end over one
    # wave of programs in equal shares, so a row that holds more keys takes more programs
    # (`nats_kernels.nats_attention.pool_decode`; `attend`'s ``even``)
    even_rows = False
    # the rows of one batch take its largest budget (H2O: its per-row buffers are one width); otherwise a left-padded
    # batch's rows each take their own (a fraction budget resolved per sequence), as each prompt alone would
    shared_budget = False

    def check_budget(self, budget: int | None, n: int) -> None:
        """Raise a clear ValueError unless `budget` suits a sequence of `n` tokens and the rule's options (budgeted
        policies; a policy adds the checks its options need; the options alone are checked when the rule is made)."""
        if not self.budgeted:
            return
        type(self).check_use(budget, decode=False)  # a budget at all
        if int(budget) != budget or budget < 1:
            raise ValueError(f"cache policy {self.name!r}: the budget must be a positive integer, got {budget!r}")
        if budget >= n:
            raise ValueError(
                f"cache policy {self.name!r}: budget B={budget} >= N={n} tokens keeps everything (that is `full`); "
                f"use a budget below N, e.g. N/2 = {n // 2}"
            )

    @classmethod
    def check_use(cls, budget: Any = None, decode: bool = True) -> None:
        """One clear ValueError unless the policy can be used as asked: it decodes (``decode``; the prefill-only
        approximations do not), and it gets a budget if and only if it is budgeted (a budget given to another policy
        would be ignored). Every entry point checks a request here (the budget's value: `check_budget`,
        `nats.cache.budget.check_budget_value`)."""
        if decode:
            cls.check_decodes()
        if cls.budgeted and budget is None:
            raise ValueError(
                f"cache policy {cls.name!r} needs a budget: budget=B (KV entries per layer and KV head, >= 1) or a "
                "fraction in (0, 1) of the prompt"
            )
        if budget is not None and not cls.budgeted:
            budgeted = [n for n in fixed_policies(decode) if _policy_class(n).budgeted]
            raise ValueError(
                f"cache policy {cls.name!r} takes no budget (got budget={budget}): drop the budget or choose a "
                f"budgeted policy ({', '.join(budgeted)})"
            )

    @classmethod
    def check_decodes(cls) -> None:
        """One clear ValueError if the policy is a prefill-only approximation (``decodable = False``)."""
        if not cls.decodable:
            raise ValueError(
                f"cache policy {cls.name!r} is a parallel approximation and cannot decode token by token: use one of "
                f"{', '.join(fixed_policies())}"
            )

    @classmethod
    def check_core(cls, core: str | None) -> None:
        """One clear ValueError unless a model whose attention core is named ``core`` can run the policy
        (``requires_core``: NAtS' cache needs NAtS' scorers)."""
        if cls.requires_core is not None and core != cls.requires_core:
            others = [n for n in fixed_policies() if _policy_class(n).requires_core is None]
            raise ValueError(
                f"cache policy {cls.name!r} needs a model with {cls.requires_core} attention (model.attention.name="
                f"{cls.requires_core}); this model uses attention {core!r}: use one of {', '.join(others)}"
            )

    @classmethod
    def accepted_options(cls, options: dict) -> dict:
        """The entries of `options` that the policy's constructors take."""
        names: set[str] = set()
        for klass in cls.__mro__:
            if klass is FixedRule or "__init__" not in vars(klass):
                continue
            params = inspect.signature(klass.__init__).parameters.values()
            names.update(p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY)
        return {key: val for key, val in options.items() if key in names}

    @classmethod
    def rule(cls, **options: Any) -> FixedRule:
        """The rule made with those of `options` its constructors take (`accepted_options`; the rest are ignored);
        a bad option fails here, in one line. ``rule.options``: the options it was made with."""
        opts = cls.accepted_options(options)
        rule = cls(**opts)
        rule.options = opts
        return rule

    def __init__(self, **unused: Any):
        """``unused``: the options of the subclasses' constructors that this one does not read."""

    # ------------------------------------------------------------------ prompt
    def direct(self, ctx: RuleContext, core, q: Tensor, k: Tensor, v: Tensor, hidden: Tensor) -> Plan | None:
        """A fused prefill of an unpadded layer that plans the storage itself (returns the output and the plan), or
        None (the default): then `prompt` and `plan` run."""
        return None

    def prompt(self, ctx: RuleContext, core, q: Tensor, k: Tensor, v: Tensor, hidden: Tensor, budget: int | None,
               offset: int = 0):  # fmt: skip
        """The attention output of unpadded rows and what they keep (a `PromptState`); ``budget``: the rows'
        largest budget in tokens (budgeted policies); ``offset``: the position of the rows' first token as the decode
        steps count it (their left padding)."""
        raise NotImplementedError

    def plan(self, ctx: RuleContext, core, state: PromptState, k: Tensor, v: Tensor, budgets: Tensor | None,
             real: Tensor) -> Plan:  # fmt: skip
        """The rows' segments and the pool's fill from the prompt's state (all rows; padding excluded from
        ``keep``), ``budgets`` ``[R]`` (budgeted policies), ``real`` ``[R]`` the rows' real prompt tokens."""
        raise NotImplementedError

    def setup(self, ctx: RuleContext, layer) -> None:
        """After the layer's buffers are allocated (e.g. copy options into the layer)."""

    def buffers(self, layer) -> list[Tensor]:
        """Extra device buffers of the rule (marked static, counted by ``tensors``)."""
        return []

    def dynamic_dims(self, layer) -> list[tuple[Tensor, tuple[int, ...]]]:
        """The rule's buffers with the dimensions that change from one generation to the next (default: all of
        them): a decode loop marks them dynamic before its first compile (`nats.hf.loop`)."""
        return [(t, tuple(range(t.dim()))) for t in self.buffers(layer)]

    # ------------------------------------------------------------------ decode
    def step(self, ctx: RuleContext, layer, core, qr: Tensor, kr: Tensor, vr: Tensor, pos: Tensor,
             hidden: Tensor) -> Tensor:  # fmt: skip
        """Admit the new token of every row (``kr``, ``vr`` ``[B, Hkv, D]``, row ``r = b * Hkv + h``, possibly strided
        views: `nats.cache.engine.write_kv` and NAtS' kernels read them as they are; position ``pos`` ``[1]``), attend
        (``qr`` ``[R, G, D]``) and return ``(y [R, G, D], size [R])``: the keys each row's query read (read only
        where the context tracks: a rule may return None otherwise)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ continuation
    def extend(self, ctx: RuleContext, layer, core, q: Tensor, k: Tensor, v: Tensor, hidden: Tensor | None,
               first: int):  # fmt: skip
        """The n tokens that continue a row's sequence at positions ``first`` .. ``first + n - 1`` (a conversation's
        next turn; the rows' room made for n more tokens where the rule grows), in parallel: ``q`` ``[R, G, n, D]``,
        ``k``, ``v`` ``[R, n, D]``, ``hidden`` ``[B, n, C]``. Returns ``(y [R, G, n, D], sizes [R, n] or None)``:
        the same outputs, state and cache sizes as n decode steps in turn. None (the default): the engine runs the
        n steps (`step`) one after the other."""
        return None

    def kept(self, layer) -> Tensor:
        """Tokens each row holds now ``[R]``."""
        return layer.length


class AppendRule(FixedRule):
    """Keep what the rule selects of the prompt (`select`, in budgeted rules: SnapKV's family; everything here,
    ``full``), then append every new token. A full segment stops admitting: the row's new tokens are attended to in
    their own step only (see Overflow in `nats.hf.StaticPolicyCache`; an eager caller grows the segment before it
    fills instead, `EngineLayer.maintain`)."""

    name = "append"
    even_rows = True
    grows = True

    def select(self, ctx: RuleContext, q: Tensor, k: Tensor, budget: int) -> Tensor:
        """The prompt tokens each row keeps, bool ``[b, Hkv, n]``, of a prompt of n > ``budget`` tokens (q ``[b, Hq,
        n, D]``, k ``[b, Hkv, n, D]``; budgeted rules; the budget and options checked already)."""
        raise NotImplementedError

    def prompt(self, ctx, core, q, k, v, hidden, budget, offset=0):
        b_, Hq, n = q.shape[0], q.shape[1], q.shape[2]
        Hkv = k.shape[1]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=Hq != Hkv)
        sizes = torch.arange(1, n + 1, device=q.device).expand(b_, Hkv, n) if ctx.track else None
        if not self.budgeted or budget is None or budget >= n:
            return PromptState(y, torch.ones(b_, Hkv, n, dtype=torch.bool, device=q.device), sizes=sizes)
        self.check_budget(budget, 10**18)
        return PromptState(y, self.select(ctx, q, k, budget), sizes=sizes)  # the prefill reads every prompt key

    def plan(self, ctx, core, state, k, v, budgets, real):
        R = state.keep.shape[0] * state.keep.shape[1]
        cap = state.keep.sum(-1).view(R) + ctx.room
        keep, rank, rows, end = plan_rows(state.keep, cap)
        return Plan(rows, end, lambda size: pool_fill(keep, rank, rows, k, v, size))

    def extend(self, ctx, layer, core, q, k, v, hidden, first):
        # every held token and the chunk's causal part; every token appended (the room was made)
        keys, values, slot = segment_kv(layer)
        n = q.shape[2]
        held = (slot[None, :] < layer.length[:, None])[:, None, :].expand(-1, n, -1)  # [R, n, L]
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        mask = torch.cat((held, causal.expand(held.shape[0], -1, -1)), dim=-1)
        y = chunk_attention(q, torch.cat((keys, k), 1), torch.cat((values, v), 1), mask)
        sizes = layer.length[:, None] + torch.arange(1, n + 1, device=q.device) if ctx.track else None
        append_chunk(layer, torch.ones(k.shape[:2], dtype=torch.bool, device=k.device), k, v, layer.length.clone())
        return y, sizes

    def step(self, ctx, layer, core, qr, kr, vr, pos, hidden):
        compiled = kr.is_cuda and not torch.compiler.is_compiling()
        compiled = compiled and resolve_backend(ctx.backend, kr.device) == "triton"
        (_compiled_append() if compiled else append_step)(layer.kv_pool, layer.rows, kr, vr)
        return attend(layer, qr, even=self.even_rows, backend=ctx.backend), layer.length


def append_step(kv_pool: Tensor, rows: Tensor, k: Tensor, v: Tensor) -> None:
    """An appending step's writes: every row's new key and value after its tokens, its length + 1; a full row's go to
    the scratch slot (the last) and its length stays."""
    start, length, cap = rows[0], rows[1], rows[2]
    full = length >= cap
    dest = torch.where(full, torch.full_like(start, kv_pool.shape[1] - 1), start + length)
    length.add_((~full).to(length.dtype))
    write_kv(kv_pool, dest, k, v)


@functools.cache
def _compiled_append():
    """`append_step` compiled once per process (every layer's buffers are its inputs): inductor's combo kernels launch
    its comparisons, the stack of the strided key and value and the writes as one or two kernels where eager launches
    six, at every layer of a decode step that runs outside an enclosing compile (the GPT path's CUDA graph; the
    transformers step traces it into its own graph)."""
    return torch.compile(append_step, fullgraph=True, dynamic=True, options={"combo_kernels": True})


def _policy_class(name: str) -> type[FixedRule]:
    from nats.cache.registry import get_cache_class  # noqa: PLC0415  (the registry imports policies)

    return get_cache_class(name)


def fixed_policies(decodable: bool = True) -> tuple[str, ...]:
    """The registered policies that declare a fixed-capacity rule (run by `nats.hf.StaticPolicyCache`); with
    ``decodable=False`` also the prefill-only approximations (`nats-eval`'s parallel evaluation)."""
    from nats.cache.registry import available_caches, get_cache_class  # noqa: PLC0415  (the registry imports policies)

    return tuple(n for n in available_caches() if get_cache_class(n).decodable or not decodable)
