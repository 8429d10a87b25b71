"""Decoding a `nats.models.gpt.GPT` through per-layer KV caches: parallel prefill, token steps, `generate`.

A decode step is the model's own forward with the layers' caches: ``model(idx, caches=caches)`` prefills a
prompt (each layer's attention core replaced by its cache's ``prefill``), ``model(token[:, None], caches=caches,
pos=pos)`` is one token (the cache's ``step``), so a policy that keeps everything (``full``) or the NAtS cache
with the model's own types reproduces the model's parallel forward. The functions here are thin wrappers:

    caches = make_caches(model, "nats", batch=B, max_len=N)
    logits = prefill(model, caches, idx[:, :P])              # [B, P, V], the caches hold the state after P
    step_logits = decode_step(model, caches, idx[:, P], P)   # [B, V]
    out = generate(model, idx, 50, policy="h2o", budget=256) # [B, T + 50]

`generate` plans the caches for its `max_new_tokens` (``reserve``: the NAtS cache lays its pool out at the
prefill with room for them, so nothing is reallocated while decoding) and, on CUDA with graph-safe policies,
replays one captured CUDA graph of the step (`GraphDecoder`); eager elsewhere.

Supported models: causal language models whose attention core declares a ``decode_policy`` (``dense``,
``nats``: see `nats.attention.registry.AttentionCore`; any output gate, RoPE or learned positions, GQA).
Positions are the original ones, so a sequence cannot outgrow the model's block_size.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from functools import partial
from typing import Any

import torch
from torch import Tensor

from nats.attention.registry import ATTENTIONS, decodable_attention
from nats.cache.engine_cache import EngineCache
from nats.cache.registry import get_cache_class
from nats.cache.rule import FixedRule
from nats.sampling import check_sampling, sample

__all__ = [
    "check_model",
    "make_caches",
    "prefill",
    "decode_step",
    "policy_logits",
    "generate",
    "eval_mode",
    "resolve_policy",
    "graph_capturable",
    "GraphDecoder",
]


def check_model(model) -> None:
    """Raise a clear error unless `model` is a GPT that the caches can decode."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "blocks"):
        raise TypeError(f"expected a nats.models.gpt.GPT, got {type(model).__name__}")
    name = config.attention.get("name")
    if not ATTENTIONS.get(name).decodable():
        supported = decodable_attention()
        raise ValueError(
            f"KV-cache decoding supports GPT models with attention {supported}; this model uses "
            f"attention {name!r}, whose attention the cache policies cannot reproduce (train with "
            f"{' or '.join(f'model/attention={n}' for n in supported)})"
        )
    if not config.causal or config.n_out is not None:
        raise ValueError("KV-cache decoding needs a causal language model (model.causal=true, model.n_out=null)")


@contextlib.contextmanager
def eval_mode(model) -> Iterator[None]:
    """Eval mode (no dropout, no Gumbel noise) and no autograd inside; the previous mode restored after."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


def resolve_policy(policy: str | type[FixedRule]) -> type[FixedRule]:
    """The policy class of a registered name (unknown names fail with the registered ones), or the class itself.
    Callers resolve a name once and pass the class on."""
    if isinstance(policy, type) and issubclass(policy, FixedRule):
        return policy
    return get_cache_class(policy)


def make_caches(
    model,
    policy: str | type[FixedRule],
    batch: int,
    max_len: int,
    *,
    budget: int | None = None,
    device: Any = None,
    dtype: torch.dtype | None = None,
    backend: str = "auto",
    track: bool = True,
    budget_check_len: int | None = None,
    reserve: int | None = None,
    **options: Any,
) -> EngineCache:
    """The KV cache of policy `policy` (a name or a registered class) over the layers of `model`, for `batch`
    sequences of up to `max_len` tokens: an `nats.cache.engine_cache.EngineCache` (the engine every path decodes
    through), whose item i is layer i as the model calls it (``model(idx, caches=cache)``).

    `budget` (budgeted policies only) is checked against `budget_check_len` (default `max_len`): B >= N or a
    budget too small for the policy (e.g. StreamingLLM's sinks) fails with a message naming the fix. `reserve`:
    the number of tokens the caller will decode after the prefill, planned per row on top of what the prompt keeps
    (None = unknown: a layer's pool grows when a row may fill, `nats.cache.engine.EngineLayer.maintain`). Extra
    `options` go to the policy's rule (e.g. ``sinks=4`` for streaming_llm, ``recent=`` for h2o, ``type_table=`` for
    nats). ``batch`` and ``dtype`` are those of the prompt the cache is prefilled with."""
    check_model(model)
    cls = resolve_policy(policy)
    policy = cls.name
    c = model.config
    if max_len > c.block_size:
        raise ValueError(
            f"max_len={max_len} tokens exceed the model's block_size={c.block_size} (positions are kept, so the "
            f"RoPE/position tables end there): use shorter sequences"
        )
    if batch < 1 or max_len < 1:
        raise ValueError(f"batch and max_len must be >= 1, got batch={batch}, max_len={max_len}")
    if reserve is not None and (int(reserve) != reserve or reserve < 0):
        raise ValueError(f"reserve (tokens decoded after the prefill) must be an integer >= 0, got {reserve!r}")
    unknown = sorted(set(options) - set(cls.accepted_options(options)))
    if unknown:
        raise TypeError(f"cache policy {policy!r} does not accept the options {unknown}")
    cls.check_use(budget, decode=False)
    if budget is not None:
        cls.rule(**options).check_budget(budget, budget_check_len or max_len)
    for block in model.blocks:
        cls.check_core(block.attn.core.name)
    param = next(model.parameters())
    device = param.device if device is None else device
    cores = [b.attn.core if cls.requires_core is not None else None for b in model.blocks]
    # NAtS' prefill writes its cache with the PyTorch reference: the kernels' bf16 writes are checked against it on
    # the GPU only, and the quality tables are measured on this path
    return EngineCache(policy, cores, reserve=reserve, budget=None if budget is None else int(budget), track=track,
                       prefill_kernel="torch", backend=backend, device=device, decodable=False,
                       who=f"cache policy {policy!r}", **options)  # fmt: skip


def prefill(model, caches: EngineCache, idx: Tensor) -> Tensor:
    """Process idx [B, N] from empty caches (``model(idx, caches=caches)`` in eval mode); returns logits
    [B, N, V]. Each layer's attention is its cache's `prefill` (a parallel masked attention for full,
    streaming_llm and nats; H2O's exact sequential rule run over the positions inside the layer)."""
    with eval_mode(model):
        return model(idx, caches=caches).logits


def decode_step(model, caches: EngineCache, token: Tensor, pos: int | Tensor) -> Tensor:
    """One token per sequence (token [B], position `pos`, an int or a LongTensor [1] on the model's device)
    through all layers (``model(token[:, None], caches=caches, pos=pos)``); returns the logits [B, V]. With a
    device `pos` and graph-safe caches the step runs without host synchronisation (CUDA-graph capturable; the
    caller must be in eval mode and no_grad)."""
    return model(token[:, None], caches=caches, pos=pos).logits[:, 0]


def graph_capturable(cache: EngineCache) -> bool:
    """Whether a decode step through `cache` can be captured in a CUDA graph: CUDA and the Triton backend (whose
    kernels read the lengths on the device; `EngineCache.graph_safe`)."""
    return cache.graph_safe()


class GraphDecoder:
    """Decode steps of `model` through `cache` (an `EngineCache`) as replays of one captured CUDA graph of
    `decode_step`.

    ``decoder(token [B], pos)`` returns the logits [B, V] (a static buffer, overwritten by the next call). The
    first call runs eagerly on a side stream (it compiles the kernels and initialises the libraries before any
    capture); the second captures the step and replays it; later calls only replay. Before each step the cache's
    ``maintain()`` runs on the host (growth, `nats.cache.engine.EngineLayer.maintain`); if a layer's pool was
    reallocated the step is captured again (`captures` counts the captures: 1 when nothing was reallocated). A replay
    skips the cache's host code, so its host counters are advanced by ``EngineCache.replayed()``. With ``compile``
    (default) the step's dense work around the cache is compiled (`nats.models.gpt.GPT.compiled_decode`): fewer,
    fused kernels in the graph; ``inductor``: its inductor settings over the defaults
    (`nats.models.gpt.DECODE_INDUCTOR`)."""

    def __init__(self, model, cache: EngineCache, compile: bool = True, inductor: Mapping[str, Any] | None = None):
        if not graph_capturable(cache):
            raise ValueError(
                "CUDA-graph decoding needs a cache on a CUDA device with the Triton backend (got device "
                f"{cache.device}, backend {cache.backend!r}): decode eagerly (graph=False)"
            )
        self.model, self.cache = model, cache
        self.compile = compile and hasattr(model, "compiled_decode")
        self.inductor = None if inductor is None else dict(inductor)
        self.token: Tensor | None = None
        self.pos = torch.zeros(1, dtype=torch.long, device=cache.device)
        self.graph = None
        self.logits = None
        self.steps = 0
        self.captures = 0
        cache.auto_maintain = False  # maintain() runs here, between replays

    def _step(self) -> Tensor:
        if not self.compile:
            return decode_step(self.model, self.cache, self.token, self.pos)
        # compiled at the warm-up step, its kernels captured after it
        with self.model.compiled_decode(inductor=self.inductor):
            return decode_step(self.model, self.cache, self.token, self.pos)

    def _capture(self) -> None:
        self.graph = None  # free the previous graph's memory first
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.logits = self._step()  # the cache's host code runs here, once: this is the step's bookkeeping
        self.graph = graph
        self.captures += 1

    def __call__(self, token: Tensor, pos: int | Tensor) -> Tensor:
        if self.token is None:
            self.token = torch.zeros_like(token)
        self.token.copy_(token)
        if isinstance(pos, int):
            self.pos.fill_(pos)
        else:
            self.pos.copy_(pos)
        changed = self.cache.maintain()
        self.steps += 1
        if self.steps == 1:  # warm-up, eagerly on a side stream
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                logits = self._step()
            torch.cuda.current_stream().wait_stream(stream)
            return logits
        if self.graph is None or changed:
            self._capture()
        else:
            self.cache.replayed()
        self.graph.replay()
        return self.logits


def check_graph(graph: bool | str) -> None:
    """``graph`` of the decode loops (and nats-eval's key of that name): True, False or "auto"."""
    if graph not in (True, False, "auto"):
        raise ValueError(f"graph={graph!r} must be auto, true or false (how sequential methods decode)")


def decoder(model, caches: EngineCache, graph: bool | str):
    """The decode step through `caches` and whether it replays a CUDA graph: a `GraphDecoder` where ``graph`` is
    True, or "auto" and the caches allow it (`graph_capturable`), else eager `decode_step`."""
    use_graph = graph_capturable(caches) if graph == "auto" else graph
    return (GraphDecoder(model, caches) if use_graph else partial(decode_step, model, caches)), use_graph


def policy_logits(
    model,
    idx: Tensor,
    policy: str | type[FixedRule] = "full",
    *,
    sequential: bool = False,
    prefill_len: int = 0,
    budget: int | None = None,
    backend: str = "auto",
    graph: bool | str = "auto",
    info: dict | None = None,
    **options: Any,
):
    """Logits [B, N, V] of idx [B, N] under a cache policy, and the caches (for their measurements).

    sequential=False: the `prefill` of all N tokens. sequential=True: `prefill` of the first `prefill_len` tokens
    (0 = the first token alone), then one `decode_step` per remaining token (the decode loop; the cache is not
    planned unless ``reserve=`` is passed, so its pools grow as in an open-ended loop): as replays of a captured
    CUDA graph (`GraphDecoder`) where the caches allow it (``graph="auto"``, `graph_capturable`: CUDA, the Triton
    backend, a graph-safe policy; True insists), else eagerly. A dict `info` receives ``decode`` ("cuda_graph" or
    "eager") of a sequential run."""
    check_graph(graph)
    B, N = idx.shape
    cls = resolve_policy(policy)
    caches = make_caches(model, cls, B, N, budget=budget, backend=backend, **options)
    if sequential:
        cls.check_decodes()
    with eval_mode(model):
        if not sequential:
            return prefill(model, caches, idx), caches
        if not 0 <= prefill_len <= N:
            raise ValueError(f"prefill_len must be in [0, {N}], got {prefill_len}")
        step, use_graph = decoder(model, caches, graph)
        if info is not None:
            info["decode"] = "cuda_graph" if use_graph else "eager"
        out = []
        prefill_len = max(prefill_len, 1)  # the first token's step is its prefill (the same for every rule)
        out.append(prefill(model, caches, idx[:, :prefill_len]))
        for i in range(prefill_len, N):
            logits = step(idx[:, i], i)  # a graph's logits are one buffer, overwritten by the next step
            out.append((logits.clone() if use_graph else logits)[:, None])
        return torch.cat(out, dim=1), caches


def _sample(logits: Tensor, temperature: float, top_k: int | None, top_p: float | None, generator,
            vocab_limit: int | None = None) -> Tensor:  # fmt: skip
    """logits [B, V] -> next token [B, 1] (`nats.sampling.sample`); ids >= vocab_limit never."""
    if vocab_limit is not None and vocab_limit < logits.size(-1):
        logits = logits[..., :vocab_limit]
    return sample(logits, temperature, top_k, top_p, generator)[:, None]


def generate(
    model,
    idx: Tensor,
    max_new_tokens: int,
    policy: str | type[FixedRule] = "full",
    *,
    budget: int | None = None,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    vocab_limit: int | None = None,
    generator: torch.Generator | None = None,
    backend: str = "auto",
    graph: bool | str = "auto",
    info: dict | None = None,
    return_caches: bool = False,
    **options: Any,
):
    """Continue idx [B, T] by `max_new_tokens` tokens under a cache policy; returns [B, T + max_new_tokens] (and,
    with ``return_caches``, the caches: one per layer, after the last token fed, for their statistics).

    The prompt is prefilled (`prefill`), then each new token is one `decode_step`: replays of a captured CUDA
    graph on CUDA (``graph="auto"``: when the caches allow it, `graph_capturable`; True insists, False decodes
    eagerly). The caches are planned for the `max_new_tokens` (``reserve``), so none reallocates while
    decoding. Greedy by default (``temperature=0``, as ``nats-generate`` and transformers' ``generate``); a
    temperature > 0 samples softmax(logits / temperature) restricted to the `top_k` largest and the nucleus `top_p`,
    from `generator`, on the device (`nats.sampling.sample`: no host synchronisation).
    Ids >= `vocab_limit` (e.g. the padding of a vocabulary rounded up) are never chosen. A dict `info` receives how
    the steps ran: ``decode`` ("cuda_graph" or "eager") and, for graphs, ``captures``."""
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    check_sampling(temperature, top_k, top_p)
    check_graph(graph)
    check_model(model)
    B, T = idx.shape
    if T < 1:
        raise ValueError("generation needs a prompt of at least one token")
    total = T + max_new_tokens
    if total > model.config.block_size:
        raise ValueError(
            f"prompt ({T} tokens) + max_new_tokens ({max_new_tokens}) = {total} exceeds the model's block_size "
            f"{model.config.block_size}: positions are kept, so shorten the prompt or generate fewer tokens"
        )
    cls = resolve_policy(policy)
    cls.check_decodes()
    caches = make_caches(
        model,
        cls,
        B,
        total,
        budget=budget,
        backend=backend,
        budget_check_len=max(total, (budget or 0) + 1),
        reserve=max_new_tokens,
        **options,
    )
    step, use_graph = decoder(model, caches, graph)
    out = [idx]
    with eval_mode(model):
        logits = prefill(model, caches, idx)[:, -1]
        for s in range(max_new_tokens):
            nxt = _sample(logits, temperature, top_k, top_p, generator, vocab_limit)
            out.append(nxt)
            if s + 1 < max_new_tokens:
                logits = step(nxt[:, 0], T + s)
    if info is not None:
        info["decode"] = "cuda_graph" if use_graph else "eager"
        if use_graph:
            info["captures"] = step.captures
    tokens = torch.cat(out, dim=1)
    return (tokens, caches) if return_caches else tokens
