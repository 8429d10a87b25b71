"""The LightningModule: GPT + AdamW + warm-up/cosine schedule + logging of loss, perplexity and KV stats."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning as L
import torch
from torch import nn

from nats.clipping import clip_gradients, clip_mode, grad_param_groups
from nats.lightning_compat import attached_trainer, batches_that_stepped
from nats.models.gpt import GPT, GPTConfig
from nats.optim import configure_optimizers, optimizer_config
from nats.step_logging import StagedMetrics, host_scalar, logs_written_now


def _compile_backend(compile: bool | str) -> str | None:
    """`compile`: False/None/"false" (eager), True/"true" (inductor) or a torch.compile backend name
    ("aot_eager", used by the CPU tests)."""
    if compile is None or compile is False or (isinstance(compile, str) and compile.lower() in ("false", "none", "")):
        return None
    if compile is True or (isinstance(compile, str) and compile.lower() == "true"):
        return "inductor"
    return str(compile)


def _eval_forward(model: nn.Module):
    """`model`'s forward as a function of its own (its own code object, hence its own torch.compile cache)."""

    def eval_forward(idx, targets=None):
        return model(idx, targets)

    return eval_forward


class LitGPT(L.LightningModule):
    """Language-model training of `nats.models.gpt.GPT`.

    `model` holds the `GPTConfig` fields (with `attention` as a nested dict), `optim` (conf/optim/*.yaml) the
    optimiser, schedule and clipping: `optimizer`, a partial config (`_target_: torch.optim.AdamW`, `_partial_:
    true`, lr, betas, eps, weight_decay; see `configure_optimizers`); lr (the schedule's peak), min_lr,
    warmup_steps, max_steps (None = the trainer's); grad_clip (None = off), clip_mode ("separate", the default,
    or "global"), scorer_grad_clip (None = grad_clip; only with "separate"; see `nats.clipping.clip_gradients`).
    Other keys are an error (`nats.optim.optimizer_config`); without `optimizer`, the default AdamW
    (`nats.optim.DEFAULT_OPTIMIZER`).
    The training loss is cross-entropy plus the attention cores' auxiliary losses (NAtS' sparsity term).
    """

    def __init__(
        self,
        model: Mapping[str, Any],
        optim: Mapping[str, Any],
        compile: bool | str = False,
        compile_mode: str | None = None,
        compile_split_ddp: bool = False,
    ):
        super().__init__()
        self.save_hyperparameters()
        self.config = GPTConfig.from_dict(model)
        self.model = GPT(self.config)
        self.optim_cfg = optimizer_config(optim)
        self.clip_mode = clip_mode(self.optim_cfg)
        self._grad_groups: tuple[list[nn.Parameter], list[bool]] | None = None
        self._flops_cache: dict[tuple[int, ...], float] = {}
        # Compiled callables, not submodules: checkpoints keep the plain `model.*` keys. Training and evaluation
        # (model.eval(), under no_grad/inference_mode) are two different graphs; compiled as one function the
        # first validation would recompile it (guards on grad_mode and the modules' `training`), so evaluation
        # gets its own compiled function, compiled once at its first call. A batch of another shape
        # than the first evaluation batch (a smaller last batch) runs eagerly rather than compile a third graph.
        backend = _compile_backend(compile)
        if backend is None:
            self._forward = self._forward_eval = self.model.forward
        else:
            # compile_mode: torch.compile's mode; "reduce-overhead" replays CUDA graphs, which takes the host's
            # per-kernel launch cost (the NAtS step is host-bound without it) off the step time
            opts = {"mode": compile_mode} if compile_mode else {}
            # Under DDP, dynamo by default splits the compiled graph at every gradient bucket (DDPOptimizer) so that
            # all-reduces overlap the backward. That split cost NAtS 20% of its per-GPU speed on 2 H200s, while the
            # whole all-reduce takes 1.6 ms there (NVLink; benchmarks/allreduce_probe.py): one graph by default.
            torch._dynamo.config.optimize_ddp = bool(compile_split_ddp)
            self._forward = torch.compile(self.model.forward, backend=backend, **opts)
            self._forward_eval = torch.compile(_eval_forward(self.model), backend=backend, **opts)
        self._eval_shape: torch.Size | None = None
        self._pending_logs: tuple | None = None  # training_step's metrics, logged in on_after_backward
        self._staged = StagedMetrics()  # the per-layer training statistics on their way to the host: _log_stats
        self._compiled = backend is not None
        # CUDA graphs (reduce-overhead) reuse their output memory at the next replay: every call starts a new
        # "step" (the outputs a step keeps, e.g. logged values, are cloned by Lightning's self.log)
        self._cudagraphs = self._compiled and compile_mode is not None and "overhead" in compile_mode

    # ------------------------------------------------------------------ optimisation
    def configure_optimizers(self):
        """`nats.optim.configure_optimizers`: the `optim.optimizer` partial over two parameter groups (decay on
        weights of 2+ dims), fused on CUDA, and the warm-up + cosine schedule, per step."""
        cuda = next(self.model.parameters()).is_cuda or (
            (trainer := attached_trainer(self)) is not None and trainer.strategy.root_device.type == "cuda"
        )
        max_steps = self.optim_cfg.get("max_steps") or self.trainer.max_steps  # the trainer's only when needed
        return configure_optimizers(self.model, self.optim_cfg, cuda=cuda, max_steps=max_steps)

    def on_before_optimizer_step(self, optimizer) -> None:
        """Gradient clipping (`optim.grad_clip`, every optimizer step; `nats.clipping.clip_gradients`, after
        `optim.clip_mode`) and the gradient-norm metrics (only on steps that Lightning writes to the loggers,
        as ``train/<name>``). Done here rather than by the Trainer, whose clipping refuses fused optimizers.
        Lightning calls this once per optimizer step, after gradient accumulation and after DDP's all-reduce
        (every rank clips the same gradient the same way); under bf16-mixed there is no loss scaler, and a
        16-mixed scaler has unscaled by now, so the gradients are final."""
        o = self.optim_cfg
        measure = self._grad_norms_logged_now()
        if not o.get("grad_clip") and not measure:
            return
        if self._grad_groups is None:
            self._grad_groups = grad_param_groups(self, self.model)
        metrics = clip_gradients(
            *self._grad_groups,
            clip=o.get("grad_clip"),
            scorer_clip=o.get("scorer_grad_clip"),
            mode=self.clip_mode,
            measure=measure,
        )
        for name, value in metrics.items():
            self.log(f"train/{name}", value)

    def _grad_norms_logged_now(self) -> bool:
        """`logs_written_now` for this module's trainer."""
        return logs_written_now(attached_trainer(self))

    # ------------------------------------------------------------------ steps
    def forward(self, idx, targets=None):
        if self._cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
        if self.model.training or not self._compiled:
            return self._forward(idx, targets)
        if self._eval_shape is None:
            self._eval_shape = idx.shape
        if idx.shape != self._eval_shape:
            return self.model(idx, targets)  # see __init__: no second evaluation graph for a ragged last batch
        return self._forward_eval(idx, targets)

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.flops_per_batch = self._flops(x)  # read by TokenThroughput
        out = self(x, y)
        loss = out.loss if out.aux_loss is None else out.loss + out.aux_loss
        # Not prog_bar: Lightning turns every progress-bar metric into a Python number after every batch (a
        # host-device sync per micro-batch, stale values included); nats.callbacks.StepProgressBar reads
        # train/loss and the lr itself, only when it refreshes.
        self.log("train/loss", out.loss)
        # The rest is written to the loggers only every trainer.log_every_n_steps optimizer steps: log it only
        # then (the values written are the same; every `self.log` costs host time). It is logged in
        # on_after_backward, where the GPU's queued backward hides that host time: not here, between the forward
        # and the backward, and not in on_train_batch_end, which on these steps runs after the throughput monitor
        # has synchronised the device, so that the GPU would wait for the Python (`_log_stats`).
        self._pending_logs = None
        if self._grad_norms_logged_now():
            self._pending_logs = (out.aux_loss, out.stats, self.optimizers().param_groups[0]["lr"])
        return loss

    def on_after_backward(self) -> None:
        """The metrics that training_step kept for this batch (same step, same values; see there), and the
        per-layer statistics of an earlier written step whose copy to the host has completed."""
        self._write_layer_stats()
        pending, self._pending_logs = self._pending_logs, None
        if pending is None:
            return
        aux_loss, stats, lr = pending
        if aux_loss is not None:
            self.log("train/aux_loss", aux_loss.detach())
        self.log("lr", host_scalar(lr))
        self._log_stats("train", stats)

    def _flops(self, x: torch.Tensor) -> float:
        """Training FLOPs of a batch x [B, N] (`GPT.flops_per_token`), cached per shape."""
        key = tuple(x.shape)
        if key not in self._flops_cache:
            self._flops_cache[key] = self.model.flops_per_token(x.size(1)) * x.numel()
        return self._flops_cache[key]

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
        """Per-layer stats ("layer3/density") and their mean over layers ("density").

        In training, the per-layer values (12 layers x 5 statistics for GPT-2-small) do not go through
        ``self.log``: Lightning would turn each into a Python number, and write it, after the device
        synchronisation that ends a written step, while the GPU waits. They are copied to the host without
        blocking and written to the loggers, at their own step, once the copy has completed (at a later batch's
        backward, at the latest when training ends): the same values and steps in the logs."""
        if not stats:
            return
        per_name: dict[str, list[torch.Tensor]] = {}
        for key, value in stats.items():
            if split != "train":
                self.log(f"{split}_layers/{key}", value, batch_size=batch_size, sync_dist=True)
            per_name.setdefault(key.split("/", 1)[1], []).append(value)
        if split == "train":
            self._stage_layer_stats({f"train_layers/{k}": v for k, v in stats.items()})
        for name, values in per_name.items():
            self.log(f"{split}/{name}", torch.stack(values).mean(), batch_size=batch_size, sync_dist=split != "train")

    def _stage_layer_stats(self, stats: Mapping[str, torch.Tensor]) -> None:
        """Start copying ``stats`` to the host, at the step Lightning's logs carry (`nats.step_logging`)."""
        trainer = attached_trainer(self)
        self._staged.stage(self.global_step if trainer is None else batches_that_stepped(trainer), stats)

    def _write_layer_stats(self, wait: bool = False) -> None:
        """Write the staged statistics whose host copy has completed (all of them with ``wait``) to the loggers."""
        self._staged.write(self.loggers, wait)

    def on_train_end(self) -> None:
        self._write_layer_stats(wait=True)

    # ------------------------------------------------------------------ exact resume
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """Torch random-number states, so that a resumed run draws the same noise (e.g. Gumbel) as an
        uninterrupted one."""
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
