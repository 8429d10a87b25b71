"""Decoding a transformers model through a fixed-capacity cache without a host synchronisation per token.

``model.generate`` waits for the GPU at every token (its stopping check reads a device flag), and only then does its
host work for the next one (logits processors, the inputs of the next forward, the compiled graph's guards): at
Llama-3.1-8B's shape, 32k keys, batch 1 on an H200 the compiled step's GPU time was 6.3 ms and ``generate`` took
10-11.7 ms per token, the GPU idle for the rest. `generate` here is the gpt-fast-style loop over the same model and
cache: the prompt through the model (eager), then one compiled step per token (``mode="reduce-overhead"``: a CUDA
graph) that returns the next token on the device; the host queues the next step at once and reads the tokens only
at the end (or every ``check_every`` tokens, to stop early at an end token). ``nats-generate`` decodes through it.

    cache = StaticPolicyCache(model, "nats", max_new_tokens=256)
    out = generate(model, ids, cache, 256)                        # [B, P + 256], as model.generate returns

Tokens equal ``model.generate``'s greedy ones through the same cache (`tests/test_hf_loop.py`). Sampling
(``temperature`` > 0, ``top_k``, ``top_p``) draws on the device outside the compiled step (`nats.sampling`). Takes the
project's `nats.hf.StaticPolicyCache` (any policy it runs, left-padded batches included) and transformers'
``StaticCache`` (unpadded prompts). A `StaticPolicyCache` that holds a conversation continues it: only the tokens after
those it holds are prefilled (docs/hf.md, "A conversation through one cache"). Refused before the prompt's forward, in
one line each (`check_request`): a prompt that does not continue what the cache holds (another cache must be unused),
more new tokens than the cache was made for, a prompt + new tokens beyond the model's context (`nats.hf.limits`).
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor

from nats.hf.compat import cache_kwargs, takes_cache_position
from nats.hf.limits import check_context, check_unused, context_length
from nats.sampling import check_sampling, sample
from nats.utils import settings_key

_STEPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its compiled decode steps, by key

#: inductor settings of the compiled step beside its mode's, by default. ``combo_kernels``: independent small kernels
#: of a layer launched as one (the rotary embedding of the query, of the key and the cache's own bookkeeping: one
#: launch where there were three or four). On one H200 it made the project's full cache 1-8% faster in two runs a
#: setting (Llama-3.2-1B's shape at batch 1, Llama-3.1-8B's at batch 8, 8k and 32k; the runs' spread included) and
#: NAtS' step no faster beyond that spread (docs/results/bench_limit_h200.md). Read only: a caller's own settings go
#: to `decode_step` / `generate` (``inductor=``), e.g. ``benchmarks/bench_hf_decode.py --inductor KEY=VALUE``.
STEP_INDUCTOR: Mapping[str, Any] = MappingProxyType({"combo_kernels": True})


def step_settings(inductor: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The inductor settings of a compiled step given ``inductor``: `STEP_INDUCTOR` with its keys (and others)
    overridden by ``inductor``'s."""
    return {**STEP_INDUCTOR, **(inductor or {})}


def decode_step(
    model, compile: bool | str, mode: str | None = "reduce-overhead", *, inductor: Mapping[str, Any] | None = None
):
    """The model's step ``(token [B, 1], position_ids [B, 1], cache_position [1], cache) -> logits [B, V]`` (float32),
    compiled once per model, mode and settings (``compile``: True, or the name of a torch.compile backend, then
    without a mode or inductor settings), as ``generate`` keeps its compiled forward. ``inductor``: inductor settings
    over `STEP_INDUCTOR`'s (`step_settings`), after the mode's; two calls with different settings get two compiled
    steps, with the same settings one."""
    mode = None if isinstance(compile, str) else mode
    settings = step_settings(inductor) if compile and not isinstance(compile, str) else {}
    key = (compile, mode, settings_key(settings))
    steps = _STEPS.setdefault(model, {})
    if key not in steps:
        with_position = takes_cache_position(model)

        def step(token: Tensor, position_ids: Tensor, cache_position: Tensor, cache) -> Tensor:
            extra = {"cache_position": cache_position} if with_position else {}
            kw = {**extra, **cache_kwargs(model, cache)}
            out = model(input_ids=token, position_ids=position_ids, use_cache=True, **kw)
            return out.logits[:, -1].float()

        if isinstance(compile, str):
            steps[key] = torch.compile(step, fullgraph=True, backend=compile)
        else:
            options = {**torch._inductor.list_mode_options(mode or "default"), **settings}
            steps[key] = torch.compile(step, fullgraph=True, options=options) if compile else step
    return steps[key]


@torch.no_grad()
def generate(
    model,
    ids: Tensor,
    cache,
    max_new_tokens: int,
    *,
    attention_mask: Tensor | None = None,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    compile: bool | str | None = None,
    check_every: int = 32,
    streamer: Any = None,
    on_prefill: Callable[[], None] | None = None,
    inductor: Mapping[str, Any] | None = None,
) -> Tensor:
    """``ids`` ``[B, P]`` (left-padded where ``attention_mask`` has zeros) and up to ``max_new_tokens`` tokens after
    them, ``[B, P + n]``: greedy (``temperature`` 0) or sampled on the device (`nats.sampling.sample`: ``top_k``,
    ``top_p``, ``generator``). With ``eos_token_id``, a row's tokens after its end token are ``pad_token_id`` and
    decoding stops once every row has ended (checked every ``check_every`` tokens, the only host reads before the
    end). ``compile``: the step compiled with CUDA graphs (default: on CUDA with a cache planned for its tokens; a
    backend's name: compiled by it, without CUDA graphs). ``on_prefill``: called once, after the prompt's forward and
    the first token's choice are queued and before the first decode step is (a benchmark synchronises there and
    times the decode steps alone). ``inductor``: inductor settings of the compiled step over `STEP_INDUCTOR`'s
    (`decode_step`; default: those alone).

    **A conversation**: through a `nats.hf.StaticPolicyCache` that holds one already (an earlier call's prompt and
    tokens), ``ids`` is the conversation so far followed by the new text (as the chat template renders it); only the
    tokens after those the cache holds are prefilled, onto what it kept (`nats.hf.StaticPolicyCache.check_history`
    refuses ids that do not extend them, in one line). ``streamer``: an object with transformers' streamer interface
    (``put(tokens)``, ``end()``; e.g. ``TextStreamer``): it gets ``ids`` first, then the new tokens ``[B, k]`` every
    ``check_every`` tokens (one host read per ``check_every`` tokens, none per token) and ``end()``."""
    check_sampling(temperature, top_k, top_p)
    if max_new_tokens < 1:
        return ids
    B, P = ids.shape
    past = check_request(model, P, cache, max_new_tokens, attention_mask, ids)
    device = ids.device
    grows = bool(getattr(cache, "auto_maintain", False))  # made without max_new_tokens: eager steps, growth
    if grows and compile:
        raise ValueError(
            "nats.hf.loop.generate: a cache made without max_new_tokens grows its pools between eager steps and "
            "cannot run the compiled step: make it with max_new_tokens=N (or pass compile=False)"
        )
    compile = device.type == "cuda" and not grows if compile is None else compile
    if attention_mask is not None and bool((attention_mask == 1).all()):
        attention_mask = None
    position = None if attention_mask is None else (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    if streamer is not None:
        streamer.put(ids.cpu())
    if hasattr(cache, "history"):  # while the call runs the cache's tokens are not those of a finished call
        cache.history = None
    new = ids[:, past:]
    out = model(input_ids=new, attention_mask=attention_mask, use_cache=True, logits_to_keep=1,
                position_ids=(torch.arange(past, P, device=device)[None].expand(B, -1) if position is None
                              else position[:, past:]),
                **({"cache_position": torch.arange(past, P, device=device)} if takes_cache_position(model) else {}),
                **cache_kwargs(model, cache))  # fmt: skip
    tokens = torch.empty(B, max_new_tokens, dtype=ids.dtype, device=device)
    cur = sample(out.logits[:, -1].float(), temperature, top_k, top_p, generator)[:, None].to(ids.dtype)  # [B, 1]
    tokens[:, :1] = cur
    del out
    eos = None if eos_token_id is None else torch.tensor(eos_token_id, device=device).reshape(-1)
    first = eos_token_id[0] if isinstance(eos_token_id, (list, tuple)) else eos_token_id
    pad = first if pad_token_id is None else pad_token_id  # the first end token, as generate pads
    done = None if eos is None else torch.isin(cur[:, 0], eos)
    if on_prefill is not None:
        on_prefill()
    step = decode_step(model, compile, inductor=inductor)
    if compile:  # one compiled step for every batch and prompt: the sizes that change are dynamic from the start
        for layer in getattr(cache, "layers", ()):
            for t, dims in layer.dynamic_dims() if hasattr(layer, "dynamic_dims") else ():
                for d in dims:
                    torch._dynamo.maybe_mark_dynamic(t, d)
    # the next token's position per row (its real tokens so far) and in the cache (padding included)
    pos = (torch.full((B, 1), P, device=device) if position is None else position[:, -1:] + 1).long()
    cache_pos = torch.full((1,), P, dtype=torch.long, device=device)
    n = max_new_tokens
    streamed = 0  # new tokens handed to the streamer
    graphs = compiled_graphs()
    for t in range(1, max_new_tokens):
        if t % check_every == 0:  # one host read every check_every tokens: the streamer's tokens, the end tokens
            if streamer is not None:
                streamer.put(tokens[:, streamed:t].cpu())
                streamed = t
            if eos is not None and bool(done.all()):
                n = t
                break
        if compile is True:  # CUDA graphs: a new replay; its inputs are copied into the graph's own buffers
            torch.compiler.cudagraph_mark_step_begin()
        # the token as a tensor of its own (a column of `tokens` would carry its row stride, max_new_tokens, into
        # the compiled step's guards: a new length, a recompile)
        if compile and t == 1:
            torch._dynamo.maybe_mark_dynamic(cur, 0)
            torch._dynamo.maybe_mark_dynamic(pos, 0)
        logits = step(cur, pos, cache_pos, cache)
        nxt = sample(logits, temperature, top_k, top_p, generator)
        if done is not None:
            nxt = torch.where(done, torch.full_like(nxt, pad), nxt)
            done |= torch.isin(nxt, eos)
        cur = nxt[:, None].to(ids.dtype)
        tokens[:, t : t + 1] = cur
        pos += 1
        cache_pos += 1
    if compiled_graphs() != graphs:  # the compiler's garbage (reference cycles) holds the cache it traced: free it
        gc.collect()
    result = torch.cat([ids, tokens[:, :n]], dim=1)
    if hasattr(cache, "history"):  # the tokens it holds: all but the last chosen one, which no forward has fed
        cache.history = result[:, : P + n - 1]
    if streamer is not None:
        streamer.put(tokens[:, streamed:n].cpu())
        streamer.end()
    return result


def check_request(model, prompt: int, cache, max_new_tokens: int, attention_mask: Tensor | None = None,
                  ids: Tensor | None = None, who: str = "nats.hf.loop.generate") -> int:  # fmt: skip
    """Refuse, before any work, one line each: ``ids`` (the prompt, ``prompt`` tokens padding included) that do not
    extend what a `nats.hf.StaticPolicyCache` holds (`StaticPolicyCache.check_history`; another cache must be
    unused), more ``max_new_tokens`` than it was made for (``max_new_tokens``; another cache's
    ``get_max_cache_shape()`` for prompt + new tokens), ``prompt`` + ``max_new_tokens`` beyond ``model``'s context.
    Returns the tokens the cache holds already (0: a fresh cache)."""
    check = getattr(cache, "check_history", None)
    if check is not None and ids is not None:
        past = check(ids, attention_mask, who)
    else:
        check_unused(cache, who)
        past = 0
    name = type(cache).__name__
    planned = getattr(cache, "max_new_tokens", None)
    if planned is not None and max_new_tokens > planned:
        raise ValueError(
            f"{who}: max_new_tokens={max_new_tokens} exceeds the {planned} new tokens this {name} was made for: "
            f"make it with max_new_tokens={max_new_tokens}"
        )
    shape = getattr(cache, "get_max_cache_shape", None)
    limit = shape() if planned is None and shape is not None else None
    if isinstance(limit, int) and 0 < limit < prompt + max_new_tokens:
        raise ValueError(
            f"{who}: the prompt ({prompt} tokens) + max_new_tokens ({max_new_tokens}) = {prompt + max_new_tokens} "
            f"exceeds the {limit} tokens this {name} was made for: make a larger one"
        )
    check_context(context_length(model.config), prompt, max_new_tokens, who)
    return past


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


_RECORDINGS: list[int] = []  # CUDA graphs recorded so far (a callback of torch's CUDA-graph trees adds to it)


def cudagraph_recordings() -> int:
    """CUDA graphs torch's CUDA-graph trees have recorded in this process since the first call (each costs a warm-up
    run and a capture): the difference of two calls counts the recordings between them."""
    if not _RECORDINGS:
        from torch._dynamo.callback import CallbackTrigger, callback_handler

        def count(args):
            if args.callback_trigger == CallbackTrigger.CUDAGRAPH_RECORDING:
                _RECORDINGS[0] += 1

        _RECORDINGS.append(0)
        callback_handler.register_start_callback(count)
    return _RECORDINGS[0]
