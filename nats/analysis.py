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

`measure` goes further, per layer and head, on a set of windows: the first-token share over the queries i >= skip,
the gate, and for NAtS layers the KV area / peak, the global / local / sliding fractions and the share of the
global tokens that sit at position 0. `LayerAnalysis` runs it on the first validation windows at the end of
training and writes ``analysis.json`` into the run folder (the gate study, docs/gate_study_gpt2.md).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable
from pathlib import Path

import lightning as L
import torch

from nats.attention.nats import kv_stats
from nats.functional import TOKEN_GLOBAL

log = logging.getLogger(__name__)


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


def first_token_share(p0: torch.Tensor, skip: int = 0) -> torch.Tensor:
    """p0 [B, H, N]: the attention probability that query i puts on key 0. Returns [H]: its mean over the batch
    and the queries i >= skip (the first queries see few keys, query 0 only key 0, and are left out)."""
    if not 0 <= skip < p0.shape[-1]:
        raise ValueError(f"skip={skip} must be in [0, N) with N = {p0.shape[-1]}")
    return p0[..., skip:].double().mean(dim=(0, 2))


def uniform_first_token_share(n: int, skip: int = 0) -> float:
    """first_token_share of uniform causal attention (query i puts 1 / (i + 1) on key 0): the no-sink level."""
    return sum(1.0 / (i + 1) for i in range(skip, n)) / (n - skip)


def globals_at_position0(types: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """types [B, H, N] (NAtS hard types). Returns per head [H], summed over the batch: (the global tokens at
    position 0, all global tokens). Their ratio is the share of the globals that are the sink token (token 0
    is global by the NAtS rule, so the share is 1 / the mean number of globals of a head and window)."""
    is_global = types == TOKEN_GLOBAL
    return is_global[..., 0].sum(0).double(), is_global.sum(dim=(0, 2)).double()


@torch.no_grad()
def layer_probes(model, idx: torch.Tensor) -> list[dict[str, torch.Tensor]]:
    """One eval forward of `model` (a nats GPT) on idx [B, N]; per layer a dict with

    * "p0" [B, Hq, N]: the attention probability of query i on key 0, read as attention_diagnostics does: the layer's
      core is called again on its own q, k with a probe value (v_j = 1 for j = 0, else 0), so its output is
      P[i, 0] in every channel (exact for dense/SDPA and for NAtS, whose mask does not depend on v);
    * "gate" [B, N, Hq] (gated layers): sigmoid(x W_g), per head (elementwise: the mean over the head's channels);
    * "types" [B, Hkv, N] (NAtS layers): the hard types (argmax of the scorer, token 0 global)."""
    records: list[dict[str, torch.Tensor]] = [{} for _ in model.blocks]

    def hook_of(layer: int):
        def hook(attn, args, output):
            x, rope, positions = args[:3]
            q, k, v = attn.project(x, rope, positions)
            probe = torch.zeros_like(v)
            probe[:, :, 0, :] = 1.0
            rec = records[layer]
            rec["p0"] = attn.core(q, k, probe, x).y[..., 0].float()
            if attn.gate is not None:
                g = torch.sigmoid(attn.gate(x).float())  # [B, N, H] or [B, N, C]
                if attn.gate.kind == "elementwise":
                    g = g.view(*g.shape[:2], attn.n_head, -1).mean(-1)
                rec["gate"] = g
            if hasattr(attn.core, "hard_types"):
                rec["types"] = attn.core.hard_types(x)

        return hook

    handles = [block.attn.register_forward_hook(hook_of(i)) for i, block in enumerate(model.blocks)]
    was_training = model.training
    model.eval()
    try:
        model(idx)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return records


@torch.no_grad()
def measure(model, batches, skip: int) -> dict:
    """layer_probes over (x, y) batches; per layer the sink (first-token share, per head and mean), the gate mean
    and, for NAtS layers, KV area / peak, type fractions and the globals at position 0 (per head and per layer)."""
    device = next(model.parameters()).device
    sums: list[dict[str, torch.Tensor]] = []
    n = 0
    N = None
    for x, _ in batches:
        B, N = x.shape
        for layer, rec in enumerate(layer_probes(model, x.to(device))):
            s = {"sink": first_token_share(rec["p0"], skip).cpu() * B}
            if "gate" in rec:
                s["gate"] = rec["gate"].double().mean(dim=(0, 1)).cpu() * B
            if "types" in rec:
                t = rec["types"]
                s["pos0"], s["globals"] = (v.cpu() for v in globals_at_position0(t))
                stats = kv_stats(t, model.blocks[layer].attn.core.window)
                s["area"] = stats["density"].double().sum(0).cpu()
                s["peak"] = stats["peak"].double().sum(0).cpu()
                s["types"] = torch.nn.functional.one_hot(t, 3).double().sum(dim=(0, 2)).cpu()  # [Hkv, 3]
            if layer == len(sums):
                sums.append(s)
            else:
                sums[layer] = {k: sums[layer][k] + v for k, v in s.items()}
        n += B
    if n == 0:
        raise ValueError("measure() got no windows")
    layers = []
    for s in sums:
        sink = s["sink"] / n
        out = {"first_token_share": float(sink.mean()), "first_token_share_heads": sink.tolist()}
        if "gate" in s:
            gate = s["gate"] / n
            out.update(gate_mean=float(gate.mean()), gate_heads=gate.tolist())
        if "types" in s:
            types = s["types"] / s["types"].sum(-1, keepdim=True)
            out.update(
                area=float((s["area"] / n).mean()),
                peak=float((s["peak"] / n).mean()),
                area_heads=(s["area"] / n).tolist(),
                peak_heads=(s["peak"] / n).tolist(),
                type_fractions=types.mean(0).tolist(),  # [global, local, sliding], mean over heads
                type_fractions_heads=types.tolist(),
                globals_total=float(s["globals"].sum()),
                globals_pos0=float(s["pos0"].sum()),
                global_pos0_share=float(s["pos0"].sum() / s["globals"].sum()),
                global_pos0_share_heads=(s["pos0"] / s["globals"]).tolist(),
                globals_per_head=float(s["globals"].sum() / (n * len(s["globals"]))),
            )
        layers.append(out)
    return {"windows": n, "N": N, "skip": skip, "uniform_share": uniform_first_token_share(N, skip), "layers": layers}


class LayerAnalysis(L.Callback):
    """At the end of training: `measure` on the first `windows` validation windows of the run's data (the trained
    model in eval mode, float32, on the device it trained on), written to ``<run_dir>/<file>`` (JSON). Only rank 0
    measures."""

    def __init__(
        self, run_dir: str, windows: int = 64, batch_size: int = 8, skip: int = 16, file: str = "analysis.json"
    ):
        super().__init__()
        if windows < 1 or batch_size < 1:
            raise ValueError(f"windows and batch_size must be >= 1, got {windows} and {batch_size}")
        self.path = Path(run_dir) / file
        self.windows, self.batch_size, self.skip = windows, batch_size, skip

    def on_train_end(self, trainer, pl_module) -> None:
        # not on_fit_end: Lightning calls that after its teardown, which has moved the model to the CPU
        if not trainer.is_global_zero:
            return
        dataset = trainer.datamodule.eval_dataset("validation")
        windows = torch.utils.data.Subset(dataset, range(min(self.windows, len(dataset))))
        loader = torch.utils.data.DataLoader(windows, batch_size=self.batch_size, shuffle=False)
        model = pl_module.model
        t0 = time.time()
        result = measure(model, loader, self.skip)
        attention = model.config.attention
        result = {
            "step": int(trainer.global_step),
            "split": "validation",
            "attention": attention.get("name"),
            "output_gate": attention.get("output_gate", "none"),
            "device": str(next(model.parameters()).device),
            "seconds": round(time.time() - t0, 2),
            **result,
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=1))
        tmp.replace(self.path)
        log.info(f"wrote {self.path}: {result['windows']} validation windows in {result['seconds']} s")
