"""What a generate call may ask of a transformers model and of a cache, checked once on the host before any work:
the positions the model was trained for, and a cache that serves one call.

* **The model's context** (`context_length`, `check_context`): prompt + new tokens beyond
  ``config.max_position_embeddings`` run, and give garbage (RoPE positions the model never saw). A config whose
  ``rope_parameters`` (``rope_scaling`` before transformers 5) stretch the positions by a ``factor`` (``linear``,
  ``dynamic``, ``yarn``) allows that factor times its ``original_max_position_embeddings``. To run past the context
  on purpose, raise ``model.config.max_position_embeddings``: the one explicit switch.
* **A used cache** (`held_tokens`, `check_unused`): a cache other than `nats.hf.StaticPolicyCache` (transformers'
  ``StaticCache``) serves one generate call here; a second call through it would continue the first one's sequence
  with a prompt it cannot check. (`StaticPolicyCache` continues a conversation and checks its ids itself:
  `StaticPolicyCache.check_history`.)

Who checks: `nats.hf.loop.generate` (all three, before its prefill: `nats.hf.loop.check_request`), ``nats-generate``
(`nats.hf.generate`: the context, before it makes a cache) and `nats.hf.StaticPolicyCache` (the context at its
prefill, or of its ``max_len`` when made without ``max_new_tokens``, and at each continuation).
"""

from __future__ import annotations

from typing import Any

#: rope types whose ``factor`` stretches the trained positions (``llama3``'s and ``longrope``'s configs state the
#: stretched length in ``max_position_embeddings`` itself)
STRETCHING_ROPE = ("linear", "dynamic", "yarn")


def context_length(config: Any) -> int | None:
    """The most positions (prompt + new tokens) ``config``'s model runs: ``max_position_embeddings``, or a rope
    scaling's ``factor`` x ``original_max_position_embeddings`` where larger; None when the config states none."""
    n = int(getattr(config, "max_position_embeddings", 0) or 0)
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) in STRETCHING_ROPE and rope.get("factor"):
        original = int(rope.get("original_max_position_embeddings") or n)
        n = max(n, int(float(rope["factor"]) * original))
    return n or None


def check_context(context: int | None, prompt: int, new: int, who: str, new_name: str = "max_new_tokens",
                  what: str | None = None) -> None:  # fmt: skip
    """Refuse ``prompt`` + ``new`` tokens beyond ``context`` (`context_length`; None: no bound), one line naming
    ``who``, the lengths (``new_name``: what ``new`` is called; ``what``: the whole length's description instead)
    and the fix."""
    if context is not None and prompt + new > context:
        what = what or f"the prompt ({prompt} tokens) + {new_name} ({new}) = {prompt + new}"
        raise ValueError(
            f"{who}: {what} exceeds the model's context of {context} positions (config.max_position_embeddings), "
            "past which it gives garbage: shorten the prompt or generate fewer tokens (to run past the context on "
            "purpose, raise model.config.max_position_embeddings)"
        )


def held_tokens(cache: Any) -> int:
    """Tokens ``cache`` holds already (0: fresh, or reset). A fresh cache's layers are not initialized: no device
    counter is read then (a used `StaticPolicyCache`'s is, once)."""
    layers = getattr(cache, "layers", None)
    if layers and not getattr(layers[0], "is_initialized", True):
        return 0
    return int(cache.get_seq_length())


def reuse_message(cache: Any, held: int, who: str) -> str:
    """The one line that refuses a cache holding ``held`` tokens of an earlier call."""
    name = type(cache).__name__
    return (
        f"{who}: this {name} already holds {held} tokens of an earlier generate call: make a new cache for each "
        f"call (a new {name}, or reset() it; nats.hf.StaticPolicyCache continues a conversation)"
    )


def check_unused(cache: Any, who: str) -> None:
    """Refuse a cache that holds tokens already (`held_tokens`), one line naming ``who`` and the fix."""
    held = held_tokens(cache)
    if held:
        raise ValueError(reuse_message(cache, held, who))
