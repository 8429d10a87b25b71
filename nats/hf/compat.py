"""What differs between the transformers releases that ``pyproject.toml``'s ``hf`` extra admits (5.0 up to 6).

One place for it, so that the rest of `nats.hf` is written once:

* **The cache argument's name.** transformers 5.24 renamed ``past_key_values`` to ``cache`` in the models'
  ``forward`` (and ``generate``); the attention modules receive it under the new name, and passing the old one
  warns. `cache_kwargs(model, cache)` gives ``{name: cache}`` for the model at hand, and `cache_from_kwargs`
  reads the cache an attention module was given under either name.
* **Positions.** Up to ~5.2x the models' ``forward`` takes ``cache_position`` (and computes it from the cache's
  length when absent, which a compiled decode step cannot do from a device tensor); later releases take positions
  only: `takes_cache_position(model)`.
* **Cache layer updates.** Up to 5.22 ``Cache.update`` received ``cache_kwargs`` (with ``cache_position``); from
  5.23 on nothing, or ``kwargs=``: the project's cache layers take ``*args, **kwargs`` and use none of them;
  `update_cache` calls it as the installed release does (the fused attention forward, `nats.hf.fused`).

The tested range is stated once, in ``TESTED`` (and quoted by docs/hf.md); ``tests/test_hf_compat.py`` runs on
whatever a fresh install resolves, so a release that breaks the integration fails the default test suite.
"""

from __future__ import annotations

import inspect
from typing import Any

TESTED = "transformers 5.2 (the kvpress environment), 5.17 (the GPU image) and 5.24 (a fresh install, CPU)"


def cache_argument(model: Any) -> str:
    """The name under which ``model.forward`` / ``model.generate`` take a cache: ``cache`` (5.24+) or
    ``past_key_values``."""
    params = inspect.signature(type(model).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def takes_cache_position(model: Any) -> bool:
    """Whether the model's decoder (``model.model``, else ``model``) takes ``cache_position``."""
    body = getattr(model, "model", model)
    return "cache_position" in inspect.signature(type(body).forward).parameters


def update_cache(cache: Any, key: Any, value: Any, layer_idx: int, kwargs: dict, cos: Any, sin: Any,
                 new_style: bool) -> tuple[Any, Any]:  # fmt: skip
    """``cache.update`` as an attention module of the installed release calls it (``new_style``:
    ``cache_argument(module) == "cache"``, decided once outside a compiled step): ``kwargs=`` the forward's keyword
    arguments (5.23+), else a dict of the rotary tables and ``cache_position``."""
    if new_style:
        return cache.update(key, value, layer_idx, kwargs=kwargs)
    return cache.update(key, value, layer_idx, {"sin": sin, "cos": cos, "cache_position": kwargs.get("cache_position")})


def cache_kwargs(model: Any, cache: Any) -> dict[str, Any]:
    """``{"cache": cache}`` or ``{"past_key_values": cache}``, whichever ``model`` takes."""
    return {cache_argument(model): cache}


def generate_through(model: Any, ids: Any, cache: Any, max_new_tokens: int, *, exact_length: bool = False,
                     **sampling: Any) -> Any:  # fmt: skip
    """``model.generate`` of the prompt ``ids`` (no padding) through ``cache``: greedy unless ``sampling`` says
    ``do_sample=True`` (with ``temperature``, ``top_k``); ``exact_length``: ``max_new_tokens`` tokens even past the
    end token (``min_new_tokens``); padding id: the model's end token. Returns the sequences ``[B, T + new]``."""
    import torch  # noqa: PLC0415

    eos = model.generation_config.eos_token_id
    with torch.no_grad():
        return model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            **({"min_new_tokens": max_new_tokens} if exact_length else {}),
            pad_token_id=eos[0] if isinstance(eos, list) else eos,
            **{"do_sample": False, **sampling},
            **cache_kwargs(model, cache),
        )


def cache_from_kwargs(kwargs: dict[str, Any]) -> Any:
    """The cache an attention module's forward was called with (under either name), or None."""
    cache = kwargs.get("cache")
    return kwargs.get("past_key_values") if cache is None else cache
