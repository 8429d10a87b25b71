"""One registry for KV-cache policies: adding a policy is adding one file with `@register_cache`.

A *policy* is a subclass of :class:`nats.cache.base.LayerCache`: the KV cache of one attention layer for a
batch of sequences, per KV head. `build_cache(name, ...)` builds one; `nats.cache.decode.make_caches` builds one
per layer of a model. Unknown names fail with the list of registered ones.
"""
from __future__ import annotations

import importlib
import pkgutil
from typing import Any, Callable

CACHE_POLICIES: dict[str, type] = {}

# modules of nats.cache that hold no policy (skipped when importing every policy file)
_NOT_POLICIES = {"registry", "base", "decode", "attention", "triton_decode"}


def register_cache(name: str) -> Callable[[type], type]:
    """Class decorator: register a `LayerCache` subclass under `name` (sets `cls.name`)."""

    def deco(cls: type) -> type:
        if name in CACHE_POLICIES and CACHE_POLICIES[name] is not cls:
            raise ValueError(f"cache policy {name!r} is registered twice ({CACHE_POLICIES[name]} and {cls})")
        cls.name = name
        CACHE_POLICIES[name] = cls
        return cls

    return deco


def _import_all_policies() -> None:
    """Import every module of `nats.cache` so that their `@register_cache` run."""
    import nats.cache as pkg

    for mod in pkgutil.iter_modules(pkg.__path__):
        if mod.name not in _NOT_POLICIES:
            importlib.import_module(f"nats.cache.{mod.name}")


def available_caches() -> list[str]:
    """Sorted names of the registered policies."""
    _import_all_policies()
    return sorted(CACHE_POLICIES)


def get_cache_class(name: str) -> type:
    """The policy class registered as `name`; a clear error listing the known names otherwise."""
    _import_all_policies()
    if name not in CACHE_POLICIES:
        raise ValueError(
            f"unknown cache policy {name!r}: choose one of {sorted(CACHE_POLICIES)} "
            f"(or add a file to nats/cache/ with @register_cache)"
        )
    return CACHE_POLICIES[name]


def build_cache(name: str, **kwargs: Any):
    """Build the policy `name` with keyword arguments (see `LayerCache.__init__` and the policy's own)."""
    cls = get_cache_class(name)
    try:
        return cls(**kwargs)
    except TypeError as err:
        raise TypeError(f"cache policy {name!r} does not accept the arguments {sorted(kwargs)}: {err}") from err
