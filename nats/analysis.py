"""Per-layer attention diagnostics of a `GPT`, computed from a model and a batch without changing the model:
the attention share of the first token (the attention-sink measure) and the mean output-gate value.

first_token_share (layer l) = mean over heads, batch and queries i of P_l[i, 0], the attention probability
that query i puts on key 0. Causal queries at position 0 can only attend to key 0 (P = 1) and are counted like
every other query; `skip_first=True` leaves them out.

How P[i, 0] is read from any core: the module wraps every block's `attn` in a forward hook that re-runs the
layer's own projections (`attn.project`, RoPE included) and calls the layer's core with a *probe* value
tensor, v[j] = 1 for j = 0 and 0 otherwise. A core that computes y = P(q, k, x) v (dense, softmax_surrogate,
anna, and any sparse-mask core whose mask does not depend on v) then returns y_i = P[i, 0] in every channel.
This works for cores whose probabilities are not materialised (SDPA, FlashAttention, Triton kernels). Run the
model in eval mode so that stochastic cores (e.g. Gumbel noise) use their deterministic path.

gate_mean (layer l) = mean of sigmoid(x W_g) over batch, positions and heads (or channels), the gate of the
gated-attention output gate (`attention.output_gate`), computed by calling the layer's gate Linear on the
block's normalised input; NaN for layers without a gate.

`AttentionSinkMonitor` logs both, per layer and averaged, during validation.
"""

from __future__ import annotations

from collections.abc import Iterable

import lightning as L
import torch


@torch.no_grad()
def attention_diagnostics(model, idx: torch.Tensor, skip_first: bool = False) -> dict[str, list[float]]:
    """Run `model` (a `nats.models.gpt.GPT`) on idx [B, N] and return, per layer,
    {"first_token_share": [...], "gate_mean": [...]} (floats; gate_mean is NaN where there is no gate)."""
    shares: list[float] = []
    gates: list[float] = []
    handles = []

    def hook(attn, args, output):
        x, rope, positions = args[:3]
        q, k, v = attn.project(x, rope, positions)
        probe = torch.zeros_like(v)
        probe[:, :, 0, :] = 1.0
        out = attn.core(q, k, probe, x)
        p0 = out.y[..., 0].float()  # [B, Hq, N]: P[i, 0]
        if skip_first:
            p0 = p0[..., 1:]
        shares.append(float(p0.mean()))
        if getattr(attn, "output_gate", "none") != "none":
            gates.append(float(torch.sigmoid(attn.gate(x).float()).mean()))
        else:
            gates.append(float("nan"))

    for block in model.blocks:
        handles.append(block.attn.register_forward_hook(hook))
    try:
        model(idx)
    finally:
        for h in handles:
            h.remove()
    return {"first_token_share": shares, "gate_mean": gates}


@torch.no_grad()
def dataset_diagnostics(
    model, batches: Iterable, max_batches: int | None = None, skip_first: bool = False
) -> dict[str, list[float]]:
    """`attention_diagnostics` averaged (weighted by batch size) over (x, y) batches."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total: dict[str, torch.Tensor] = {}
    n = 0
    try:
        for b, batch in enumerate(batches):
            if max_batches is not None and b >= max_batches:
                break
            x = batch[0] if isinstance(batch, (tuple, list)) else batch
            d = attention_diagnostics(model, x.to(device), skip_first=skip_first)
            for key, values in d.items():
                t = torch.tensor(values, dtype=torch.float64) * x.size(0)
                total[key] = total[key] + t if key in total else t
            n += x.size(0)
    finally:
        model.train(was_training)
    if n == 0:
        raise ValueError("dataset_diagnostics got no batches")
    return {key: (t / n).tolist() for key, t in total.items()}


class AttentionSinkMonitor(L.Callback):
    """Logs first-token attention share and mean output gate per layer (`val_layers/layer{l}/...`) and
    their mean over layers (`val/first_token_share`, `val/gate_mean`), from the first `max_batches`
    validation batches of every validation run. Expects `pl_module.model` to be a GPT."""

    def __init__(self, max_batches: int = 2, skip_first: bool = False):
        super().__init__()
        self.max_batches = max_batches
        self.skip_first = skip_first
        self._sums: dict[str, torch.Tensor] = {}
        self._n = 0

    def on_validation_epoch_start(self, trainer, pl_module) -> None:
        self._sums, self._n = {}, 0

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if batch_idx >= self.max_batches:
            return
        x = batch[0]
        d = attention_diagnostics(pl_module.model, x, skip_first=self.skip_first)
        for key, values in d.items():
            t = torch.tensor(values, dtype=torch.float64) * x.size(0)
            self._sums[key] = self._sums[key] + t if key in self._sums else t
        self._n += x.size(0)

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        if self._n == 0:
            return
        for key, t in self._sums.items():
            mean = t / self._n
            if torch.isnan(mean).all():
                continue  # no gate anywhere
            for layer, value in enumerate(mean.tolist()):
                pl_module.log(f"val_layers/layer{layer}/{key}", value, sync_dist=True)
            pl_module.log(f"val/{key}", float(mean[~torch.isnan(mean)].mean()), sync_dist=True)
