"""The LightningModule: GPT + AdamW + warm-up/cosine schedule + logging of loss, perplexity and KV stats."""
from __future__ import annotations

import math
from typing import Any, Mapping

import lightning as L
import torch

from nats.models.gpt import GPT, GPTConfig


def lr_at(step: int, *, lr: float, min_lr: float, warmup_steps: int, max_steps: int) -> float:
    """Linear warm-up from 0 to `lr` over `warmup_steps`, then cosine decay to `min_lr` at `max_steps`."""
    if warmup_steps > 0 and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if step >= max_steps:
        return min_lr
    progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)


class LitGPT(L.LightningModule):
    """Language-model training of `nats.models.gpt.GPT`.

    `model` holds the `GPTConfig` fields (with `attention` as a nested dict), `optim` the optimiser and
    schedule: lr, min_lr, warmup_steps, max_steps (None = the trainer's), weight_decay, betas, eps.
    The training loss is cross-entropy plus the attention cores' auxiliary losses (NAtS' sparsity term).
    """

    def __init__(self, model: Mapping[str, Any], optim: Mapping[str, Any], compile: bool = False):
        super().__init__()
        self.save_hyperparameters()
        self.config = GPTConfig.from_dict(model)
        self.model = GPT(self.config)
        self.optim_cfg = dict(optim)
        # a compiled bound method, not a submodule: checkpoints keep the plain `model.*` keys
        self._forward = torch.compile(self.model.forward) if compile else self.model.forward

    # ------------------------------------------------------------------ optimisation
    def configure_optimizers(self):
        o = self.optim_cfg
        decay = [p for p in self.model.parameters() if p.requires_grad and p.dim() >= 2]
        no_decay = [p for p in self.model.parameters() if p.requires_grad and p.dim() < 2]
        groups = [
            {"params": decay, "weight_decay": o.get("weight_decay", 0.1)},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        fused = next(self.model.parameters()).is_cuda or (
            self.trainer is not None and self.trainer.strategy.root_device.type == "cuda"
        )
        optimizer = torch.optim.AdamW(
            groups, lr=o["lr"], betas=tuple(o.get("betas", (0.9, 0.95))), eps=o.get("eps", 1e-8),
            fused=fused or None,
        )
        max_steps = o.get("max_steps") or self.trainer.max_steps
        if max_steps is None or max_steps < 1:
            raise ValueError("set trainer.max_steps (or optim.max_steps) to a positive number for the cosine schedule")
        schedule = dict(lr=o["lr"], min_lr=o.get("min_lr", o["lr"] / 10), warmup_steps=o.get("warmup_steps", 0),
                        max_steps=max_steps)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_at(s, **schedule) / o["lr"])
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_before_optimizer_step(self, optimizer) -> None:
        """Gradient clipping by global norm (`optim.grad_clip`), done here rather than by the Trainer, whose
        clipping refuses fused optimizers; under bf16-mixed there is no loss scaler, so the gradients are final."""
        clip = self.optim_cfg.get("grad_clip")
        if clip:
            norm = torch.nn.utils.clip_grad_norm_(self.parameters(), clip)
            self.log("train/grad_norm", norm)

    # ------------------------------------------------------------------ steps
    def forward(self, idx, targets=None):
        return self._forward(idx, targets)

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.flops_per_batch = self.model.flops_per_token(x.size(1)) * x.numel()  # read by TokenThroughput
        out = self(x, y)
        loss = out.loss if out.aux_loss is None else out.loss + out.aux_loss
        self.log("train/loss", out.loss, prog_bar=True)
        if out.aux_loss is not None:
            self.log("train/aux_loss", out.aux_loss)
        self.log("lr", self.optimizers().param_groups[0]["lr"], prog_bar=True)
        self._log_stats("train", out.stats)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        out = self(x, y)
        n = int((y != -100).sum())
        # weighted by predicted tokens, so that every token counts equally
        self.log("val/loss", out.loss, batch_size=n, prog_bar=True, sync_dist=True)
        correct = (out.logits.argmax(-1) == y)[y != -100].float().mean()
        self.log("val/acc", correct, batch_size=n, sync_dist=True)
        self._log_stats("val", out.stats, batch_size=n)
        return out.loss

    def on_validation_epoch_end(self):
        loss = self.trainer.callback_metrics.get("val/loss")
        if loss is not None:
            self.log("val/ppl", torch.exp(loss.float()), sync_dist=False)

    def test_step(self, batch, batch_idx):
        x, y = batch
        out = self(x, y)
        n = int((y != -100).sum())
        self.log("test/loss", out.loss, batch_size=n, sync_dist=True)
        self.log("test/acc", (out.logits.argmax(-1) == y)[y != -100].float().mean(), batch_size=n, sync_dist=True)
        return out.loss

    def on_test_epoch_end(self):
        loss = self.trainer.callback_metrics.get("test/loss")
        if loss is not None:
            self.log("test/ppl", torch.exp(loss.float()))

    def _log_stats(self, split: str, stats: Mapping[str, torch.Tensor], batch_size: int | None = None) -> None:
        """Per-layer stats ("layer3/density") and their mean over layers ("density")."""
        if not stats:
            return
        per_name: dict[str, list[torch.Tensor]] = {}
        for key, value in stats.items():
            self.log(f"{split}_layers/{key}", value, batch_size=batch_size, sync_dist=split != "train")
            per_name.setdefault(key.split("/", 1)[1], []).append(value)
        for name, values in per_name.items():
            self.log(f"{split}/{name}", torch.stack(values).mean(), batch_size=batch_size,
                     sync_dist=split != "train")

    # ------------------------------------------------------------------ exact resume
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """Torch random-number states, so that a resumed run draws the same noise (e.g. Gumbel) as an uninterrupted one."""
        # tensors only, so that the checkpoint loads with torch.load(weights_only=True)
        checkpoint["rng_states"] = {
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        }

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        states = checkpoint.get("rng_states")
        if states is None:
            return
        torch.set_rng_state(states["torch"])
        if states["cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(states["cuda"])
