"""NAtS attention kernels (Triton) beside their exact PyTorch reference (``reference.py``).

- ``triton_nats_attention(q, k, v, type_weights, window)``: fused training attention, differentiable in
  q, k, v and type_weights exactly as NATS_SPEC.md section 3 (forward.py, backward.py, autograd.py).
- ``nats_prefill(q, k, v, types, window)``: inference prefill with hard integer types, cost proportional
  to the kept entries (prefill.py); ``nats_prefill_scored(q, k, v, logits, bias, window)``: the same from a
  scorer's logits, whose argmax the plan kernel takes (the types come back too).

The Triton kernels are imported lazily, on first access of one of these names, so that importing the
reference (``nats_kernels.nats_attention.reference``) needs neither Triton nor a GPU. Without a CUDA GPU
the kernels run in Triton's CPU interpreter (see ``_env.py``). ``docs/kernels.md`` describes them.
"""

import importlib

HEAD_DIMS = (16, 32, 64, 128)  # head dims the Triton kernels are built for


def triton_supports(q) -> bool:
    """Whether the Triton training kernel takes queries like ``q`` (a CUDA tensor, fp16/bf16/fp32, a head dim
    in HEAD_DIMS); ``backend="auto"`` uses the reference otherwise (e.g. float64 checks, tiny heads)."""
    return q.is_cuda and triton_takes(q)


def triton_takes(q) -> bool:
    """Whether the kernels are built for queries of ``q``'s dtype (fp16/bf16/fp32) and head dim (HEAD_DIMS), on
    any device (on the CPU Triton's interpreter runs them)."""
    import torch

    return q.dtype in (torch.float16, torch.bfloat16, torch.float32) and q.shape[-1] in HEAD_DIMS


_LAZY = {
    "triton_nats_attention": ".autograd",
    "nats_prefill": ".prefill",
    "nats_prefill_scored": ".prefill",
    "compact_plan": ".plan",
}

__all__ = list(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
