"""Gradient clipping of the LightningModule (`optim.grad_clip`, `optim.clip_mode`): the attention cores' type
scorers and the backbone as two groups, or all parameters as one, on the device (no host synchronisation), and
the gradient norms it measures. docs/scorer_gradients.md"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

CLIP_MODES = ("global", "separate")


def clip_mode(optim: Mapping[str, Any]) -> str:
    """`optim.clip_mode` checked ("separate" when unset), with optim.scorer_grad_clip only under "separate"."""
    mode = optim.get("clip_mode") or "separate"
    if mode not in CLIP_MODES:
        raise ValueError(f"optim.clip_mode must be one of {CLIP_MODES}, got {mode!r}")
    if optim.get("scorer_grad_clip") is not None and mode != "separate":
        raise ValueError(
            "optim.scorer_grad_clip applies only with optim.clip_mode=separate "
            f"(got clip_mode={mode!r}); set it to null or use separate clipping"
        )
    return mode


def scorer_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of the attention cores' token-type scorers: those of every submodule held as an
    attribute named ``scorer`` (NAtS: ``blocks.<l>.attn.core.scorer.weight``). Empty for models without scorers
    (dense, ANNA, gated). A new core whose type scorer lives elsewhere must hold it as ``self.scorer``
    (or extend this function) to be clipped and logged apart (docs/scorer_gradients.md)."""
    seen: set[int] = set()
    out: list[nn.Parameter] = []
    for module in model.modules():
        scorer = getattr(module, "scorer", None)
        if isinstance(scorer, nn.Module):
            for p in scorer.parameters():
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
    return out


def _scale_(grads: list[torch.Tensor], coef: torch.Tensor) -> None:
    """grads *= coef in place (one foreach launch when they share coef's device)."""
    if all(g.device == coef.device for g in grads):
        torch._foreach_mul_(grads, coef)
    else:
        for g in grads:
            g.mul_(coef.to(g.device))


def _clip_coef(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_'s factor, on the device (no host sync): min(1, max_norm / (norm + 1e-6))."""
    return torch.clamp(max_norm / (norm + 1e-6), max=1.0)


def grad_param_groups(module: nn.Module, model: nn.Module) -> tuple[list[nn.Parameter], list[bool]]:
    """The trainable parameters of `module` in its parameters() order and, for each, whether it belongs to a type
    scorer of `model` (`scorer_parameters`)."""
    ids = {id(p) for p in scorer_parameters(model)}
    params = [p for p in module.parameters() if p.requires_grad]
    return params, [id(p) in ids for p in params]


def clip_gradients(
    params: list[nn.Parameter],
    is_scorer: list[bool],
    *,
    clip: float | None,
    scorer_clip: float | None,
    mode: str,
    measure: bool,
) -> dict[str, torch.Tensor]:
    """Clip the gradients of `params` (`grad_param_groups`) to `clip` (None/0 = off) and, with `measure`, return
    the gradient-norm metrics (device tensors, by name); without either, nothing is computed.

    `mode` (`CLIP_MODES`):
      * ``global``: one norm over all parameters, clipped to clip (torch.nn.utils.clip_grad_norm_, bit for bit);
      * ``separate``: the type scorers' parameters and the backbone's (everything else) are clipped as two
        groups, to scorer_clip (None = clip) and clip, so that a large scorer gradient cannot shrink the
        backbone's update. Without scorers (dense attention) this is the one group of ``global``, bit for bit.

    Measured (pre-clip norms): ``grad_norm`` (all parameters), ``grad_norm_backbone``, ``grad_norm_scorer``
    (models with scorers only), and with clipping on the factor applied to each group's gradient,
    ``grad_clip_coef_backbone`` / ``grad_clip_coef_scorer`` (1 = unclipped)."""
    log = measure
    if not clip and not log:
        return {}
    grads, scorer_mask = [], []
    for p, s in zip(params, is_scorer):
        if p.grad is not None:
            grads.append(p.grad)
            scorer_mask.append(s)
    if not grads:
        return {}
    g_s = [g for g, s in zip(grads, scorer_mask) if s]
    g_b = [g for g, s in zip(grads, scorer_mask) if not s]
    separate = mode == "separate" and bool(g_s)  # without scorer gradients: one group
    # one launch of per-tensor norms; a group's norm is the norm of its stacked per-tensor norms in
    # parameters() order, which is what clip_grad_norm_ computes (one device and dtype)
    norms = torch._foreach_norm(grads)
    dev = norms[0].device
    norms = [n.to(dev) for n in norms]

    def stacked_norm(select: bool | None) -> torch.Tensor | None:
        sel = [n for n, s in zip(norms, scorer_mask) if select is None or s == select]
        return torch.linalg.vector_norm(torch.stack(sel)) if sel else None

    total = stacked_norm(None) if log or not separate else None
    n_s = n_b = None
    if g_s and (log or separate):
        n_s, n_b = stacked_norm(True), stacked_norm(False)
    elif not g_s:
        n_b = total
    coef_s = coef_b = None
    if clip:
        if separate:
            coef_s = _clip_coef(n_s, clip if scorer_clip is None else scorer_clip)
            _scale_(g_s, coef_s)
            if g_b:
                coef_b = _clip_coef(n_b, clip)
                _scale_(g_b, coef_b)
        else:
            coef_b = _clip_coef(total, clip)
            coef_s = coef_b if g_s else None
            _scale_(grads, coef_b)
    if not log:
        return {}
    metrics = {
        "grad_norm": total,
        "grad_norm_backbone": n_b,
        "grad_norm_scorer": n_s,
        "grad_clip_coef_backbone": coef_b,
        "grad_clip_coef_scorer": coef_s,
    }
    return {name: value for name, value in metrics.items() if value is not None}
