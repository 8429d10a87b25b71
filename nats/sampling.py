"""The next token from a step's logits, on the device, for every decoding path (`nats.cache.decode.generate`, the
transformers loop `nats.hf.loop.generate`, ``nats-generate``, chat).

Greedy at temperature 0 (the argmax). Otherwise a draw from ``softmax(logits / temperature)`` restricted to the
``top_k`` largest logits and to the nucleus of probability ``top_p`` (the smallest set of most likely tokens whose
probability reaches ``top_p``; the most likely token always stays), by the exponential race that gpt-fast uses:
``argmax(p / E)`` with ``E_i ~ Exponential(1)`` independent picks token i with probability ``p_i`` (the ``i`` with the
smallest ``E_i / p_i``, the first arrival of independent exponential clocks of rates ``p_i``). Unlike
``torch.multinomial`` it needs no host synchronisation, so a decode loop queues its next step at once and a CUDA
graph can hold it. ``generator``: a `torch.Generator` on the logits' device; the same seed draws the same tokens.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

__all__ = ["check_sampling", "sample", "sampling_options"]


def check_sampling(temperature: float, top_k: int | None = None, top_p: float | None = None) -> None:
    """One ValueError naming the setting unless ``temperature >= 0``, ``top_k`` a whole number >= 1 (or None) and
    ``top_p`` in (0, 1] (or None)."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not math.isfinite(temperature):
        raise ValueError(f"temperature must be a number >= 0 (0 = greedy), got {temperature!r}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if top_k is not None and (isinstance(top_k, bool) or int(top_k) != top_k or top_k < 1):
        raise ValueError(f"top_k must be a whole number >= 1 or null (no cut), got {top_k!r}")
    if top_p is not None and (isinstance(top_p, bool) or not 0 < float(top_p) <= 1):
        raise ValueError(f"top_p must be in (0, 1] or null (no cut), got {top_p!r}")


def sample(
    logits: Tensor,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """The next token of each row, LongTensor ``[B]``, from ``logits`` ``[B, V]`` (module docstring); no host
    synchronisation."""
    if temperature <= 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, int(top_k), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p is not None and top_p < 1:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p  # the probability of the tokens more likely than each
        outside = before >= top_p  # in sorted order; never the most likely token
        probs = probs.masked_fill(torch.empty_like(outside).scatter_(-1, order, outside), 0.0)
    race = torch.empty_like(probs).exponential_(1, generator=generator)
    return (probs / race).argmax(-1)


def sampling_options(cfg: Any, device: Any) -> dict[str, Any]:
    """The sampling settings of a config node (``temperature``, ``top_k``, ``top_p``, checked) and, where it samples,
    a `torch.Generator` on ``device`` seeded by its ``seed``: the keyword arguments of the decode loops."""
    temperature = float(cfg.get("temperature", 0.0))
    top_k = None if cfg.get("top_k") is None else int(cfg.top_k)
    top_p = None if cfg.get("top_p") is None else float(cfg.top_p)
    check_sampling(temperature, top_k, top_p)
    generator = torch.Generator(device).manual_seed(int(cfg.get("seed", 0))) if temperature > 0 else None
    return {"temperature": temperature, "top_k": top_k, "top_p": top_p, "generator": generator}
