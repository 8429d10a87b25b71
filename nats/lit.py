"""The LightningModule: GPT + AdamW + warm-up/cosine schedule + logging of loss, perplexity and KV stats."""

from __future__ import annotations

import difflib
import functools
import inspect
import math
from collections.abc import Mapping
from typing import Any

import lightning as L
import torch
from torch import nn

from nats.lightning_compat import attached_trainer, batches_that_stepped, should_update_logs
from nats.models.gpt import GPT, GPTConfig

CLIP_MODES = ("global", "separate")
# The keys of `optim` (conf/optim/*.yaml): the optimizer as a partial config, then the schedule and the clipping.
OPTIM_KEYS = ("optimizer", "lr", "min_lr", "warmup_steps", "max_steps", "grad_clip", "clip_mode", "scorer_grad_clip")
# Checkpoints saved before the `optimizer` node hold a flat `optim` with AdamW's arguments beside the schedule's;
# such a dict (no `optimizer` key) still builds the AdamW it did, these keys' defaults included.
LEGACY_OPTIMIZER_KEYS = {"weight_decay": 0.1, "betas": (0.9, 0.95), "eps": 1e-8}


def check_optim_keys(optim: Mapping[str, Any], valid: tuple[str, ...], listed: tuple[str, ...] | None = None) -> None:
    """Unknown keys of `optim` are an error that names the closest valid key of each and lists ``listed`` (default:
    ``valid``). Shared by every LightningModule's `optim` node (`optimizer_config`, `nats.finetune.lit`)."""
    unknown = sorted(set(optim) - set(valid))
    if unknown:
        hints = [
            f"{k} (did you mean {close[0]}?)" if (close := difflib.get_close_matches(k, valid, n=1)) else k
            for k in unknown
        ]
        raise ValueError(
            f"unknown optim keys: {', '.join(hints)}; the valid keys: {', '.join(listed or valid)} "
            "(the optimizer's own arguments go under optim.optimizer, e.g. optim.optimizer.weight_decay)"
        )


def optimizer_node(node: Any, lr: float) -> dict[str, Any]:
    """`optim.optimizer` checked: a config with a ``_target_`` (a partial, built here once so that a mistyped class
    or argument fails now, not when training starts) whose lr, if given, is ``optim.lr``, the schedule's peak.
    Returns the node as a dict with ``lr`` set."""
    if isinstance(node, functools.partial) or not isinstance(node, Mapping) or "_target_" not in node:
        raise ValueError(
            f"optim.optimizer must be a config with a _target_ (e.g. torch.optim.AdamW) and "
            f"_partial_: true, got {node!r}; instantiate the LightningModule with _recursive_=False (as "
            "conf/train.yaml's module node does), so that it receives the config and its checkpoints "
            "hold plain data"
        )
    node = dict(node)
    if node.setdefault("lr", lr) != lr:
        raise ValueError(
            f"optim.optimizer.lr={node['lr']} differs from optim.lr={lr}, the schedule's peak: "
            "set optim.lr (conf/optim's optimizer.lr follows it)"
        )
    optimizer_partial(node)
    return node


def optimizer_config(optim: Mapping[str, Any]) -> dict[str, Any]:
    """`optim` checked and in the current form: unknown keys are an error (naming the valid ones), a legacy flat
    dict gets its AdamW `optimizer` node, and the optimizer's lr is the schedule's peak, `optim.lr`."""
    optim = dict(optim)
    check_optim_keys(optim, OPTIM_KEYS + tuple(LEGACY_OPTIMIZER_KEYS), listed=OPTIM_KEYS)
    if "lr" not in optim:
        raise ValueError("optim.lr (the peak learning rate of the schedule) is required")
    legacy = {k: optim.pop(k) for k in LEGACY_OPTIMIZER_KEYS if k in optim}
    node = optim.get("optimizer")
    if node is None:  # a flat dict (an older checkpoint's hyper_parameters, or a hand-made one)
        node = {
            "_target_": "torch.optim.AdamW",
            "_partial_": True,
            "lr": optim["lr"],
            **LEGACY_OPTIMIZER_KEYS,
            **legacy,
        }
    elif legacy:
        raise ValueError(
            f"optim.{', optim.'.join(legacy)}: with an optim.optimizer node these are its arguments, "
            f"optim.optimizer.{', optim.optimizer.'.join(legacy)}"
        )
    optim["optimizer"] = optimizer_node(node, optim["lr"])
    return optim


def optimizer_partial(node: Mapping[str, Any]) -> functools.partial:
    """The optimizer class with its configured arguments (betas as a tuple): call it with the parameters."""
    import hydra

    try:
        make = hydra.utils.instantiate(dict(node), _partial_=True, _convert_="all")
    except Exception as err:  # noqa: BLE001 - an import error, an unknown class: one message
        msg = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ValueError(f"optim.optimizer ({node.get('_target_')}) cannot be built: {msg}") from err
    signature = inspect.signature(make.func)
    try:
        signature.bind_partial(**make.keywords)
    except TypeError as err:
        options = ", ".join(n for n in signature.parameters if n != "params")
        raise ValueError(f"optim.optimizer ({node.get('_target_')}): {err}; its arguments: {options}") from None
    if isinstance(make.keywords.get("betas"), list):
        make = functools.partial(make.func, *make.args, **{**make.keywords, "betas": tuple(make.keywords["betas"])})
    return make


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


def logs_written_now(trainer) -> bool:
    """Whether Lightning writes this optimizer step's logs (trainer.log_every_n_steps, fast_dev_run, a stopping
    trainer): the test of its own LearningRateMonitor and ThroughputMonitor. The same answer in every hook of a
    training batch (on_train_batch_start, training_step, on_before_optimizer_step, on_train_batch_end) and for
    every micro-batch of an accumulated optimizer step. No trainer (a bare module): False."""
    if trainer is None:
        return False
    if trainer.fast_dev_run:
        return True
    return should_update_logs(trainer)


def host_scalar(value: float) -> torch.Tensor:
    """A Python number for ``self.log`` without a device synchronisation. Lightning turns a float into a
    tensor on the module's device: a blocking host-to-device copy from pageable memory, which waits for every
    kernel queued before it, so the GPU then idles while the host queues the next work. A CPU tensor stays on the
    CPU (Lightning's metric follows its value's device) and is written as it is; float64, so that the number
    written is the float itself."""
    return torch.tensor(float(value), dtype=torch.float64)


def _compile_backend(compile: bool | str) -> str | None:
    """`compile`: False/None/"false" (eager), True/"true" (inductor) or a torch.compile backend name
    ("aot_eager", used by the CPU tests)."""
    if compile is None or compile is False or (isinstance(compile, str) and compile.lower() in ("false", "none", "")):
        return None
    if compile is True or (isinstance(compile, str) and compile.lower() == "true"):
        return "inductor"
    return str(compile)


def lr_at(step: int, *, lr: float, min_lr: float, warmup_steps: int, max_steps: int) -> float:
    """Linear warm-up from 0 to `lr` over `warmup_steps`, then cosine decay to `min_lr` at `max_steps`."""
    if warmup_steps > 0 and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if step >= max_steps:
        return min_lr
    progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)


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
    or "global"), scorer_grad_clip (None = grad_clip; only with "separate"; see `on_before_optimizer_step`).
    Other keys are an error. A flat `optim` without `optimizer` (older checkpoints) means AdamW with its
    weight_decay, betas and eps beside lr (`LEGACY_OPTIMIZER_KEYS`).
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
        self.optim_cfg = optimizer_config(optim)  # also accepts the flat dicts of older checkpoints
        self.clip_mode = self.optim_cfg.get("clip_mode") or "separate"
        if self.clip_mode not in CLIP_MODES:
            raise ValueError(f"optim.clip_mode must be one of {CLIP_MODES}, got {self.clip_mode!r}")
        if self.optim_cfg.get("scorer_grad_clip") is not None and self.clip_mode != "separate":
            raise ValueError(
                "optim.scorer_grad_clip applies only with optim.clip_mode=separate "
                f"(got clip_mode={self.clip_mode!r}); set it to null or use separate clipping"
            )
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
        self._staged_stats: list[tuple] = []  # (step, names, host values, copy event): see _log_stats
        self._compiled = backend is not None
        # CUDA graphs (reduce-overhead) reuse their output memory at the next replay: every call starts a new
        # "step" (the outputs a step keeps, e.g. logged values, are cloned by Lightning's self.log)
        self._cudagraphs = self._compiled and compile_mode is not None and "overhead" in compile_mode

    # ------------------------------------------------------------------ optimisation
    def configure_optimizers(self):
        """The `optim.optimizer` partial called with two parameter groups: the weights of 2+ dims (with the
        optimizer's weight_decay) and the rest (biases, norms, weight_decay 0); `fused=True` on CUDA when the
        optimizer takes it and the config does not set it. Then the warm-up + cosine schedule (`lr_at`), per step."""
        o = self.optim_cfg
        decay = [p for p in self.model.parameters() if p.requires_grad and p.dim() >= 2]
        no_decay = [p for p in self.model.parameters() if p.requires_grad and p.dim() < 2]
        groups = [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]
        make = optimizer_partial(o["optimizer"])
        kwargs = {}
        if "fused" not in make.keywords and "fused" in inspect.signature(make.func).parameters:
            fused = next(self.model.parameters()).is_cuda or (
                (trainer := attached_trainer(self)) is not None and trainer.strategy.root_device.type == "cuda"
            )
            kwargs["fused"] = fused or None
        optimizer = make(groups, **kwargs)
        max_steps = o.get("max_steps") or self.trainer.max_steps
        if max_steps is None or max_steps < 1:
            raise ValueError("set trainer.max_steps (or optim.max_steps) to a positive number for the cosine schedule")
        schedule = dict(
            lr=o["lr"], min_lr=o.get("min_lr", o["lr"] / 10), warmup_steps=o.get("warmup_steps", 0), max_steps=max_steps
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_at(s, **schedule) / o["lr"])
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_before_optimizer_step(self, optimizer) -> None:
        """Gradient clipping (`optim.grad_clip`, every optimizer step) and the gradient-norm metrics (only on
        steps that Lightning writes to the loggers). Done here rather than by the Trainer, whose clipping
        refuses fused optimizers. Lightning calls this once per optimizer step, after gradient accumulation
        and after DDP's all-reduce (every rank clips the same gradient the same way); under bf16-mixed there is
        no loss scaler, and a 16-mixed scaler has unscaled by now, so the gradients are final.

        `optim.clip_mode`:
          * ``global``: one norm over all parameters, clipped to grad_clip (torch.nn.utils.clip_grad_norm_,
            bit for bit);
          * ``separate`` (default): the type scorers' parameters (`scorer_parameters`) and the backbone's
            (everything else) are clipped as two groups, to scorer_grad_clip (None = grad_clip) and grad_clip,
            so that a large scorer gradient cannot shrink the backbone's update. Without scorers (dense
            attention) this is the one group of ``global``, bit for bit.

        Logged (pre-clip norms): ``train/grad_norm`` (all parameters, as before), ``train/grad_norm_backbone``,
        ``train/grad_norm_scorer`` (models with scorers only), and with clipping on the factor applied to each
        group's gradient, ``train/grad_clip_coef_backbone`` / ``train/grad_clip_coef_scorer`` (1 = unclipped).
        """
        o = self.optim_cfg
        clip = o.get("grad_clip")
        log = self._grad_norms_logged_now()
        if not clip and not log:
            return
        params, is_scorer = self._grad_param_groups()
        grads, scorer_mask = [], []
        for p, s in zip(params, is_scorer):
            if p.grad is not None:
                grads.append(p.grad)
                scorer_mask.append(s)
        if not grads:
            return
        g_s = [g for g, s in zip(grads, scorer_mask) if s]
        g_b = [g for g, s in zip(grads, scorer_mask) if not s]
        separate = self.clip_mode == "separate" and bool(g_s)  # without scorer gradients: one group
        # one launch of per-tensor norms; a group's norm is the norm of its stacked per-tensor norms in
        # self.parameters() order, which is what clip_grad_norm_ computes (one device and dtype)
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
                s_clip = o.get("scorer_grad_clip")
                coef_s = _clip_coef(n_s, clip if s_clip is None else s_clip)
                _scale_(g_s, coef_s)
                if g_b:
                    coef_b = _clip_coef(n_b, clip)
                    _scale_(g_b, coef_b)
            else:
                coef_b = _clip_coef(total, clip)
                coef_s = coef_b if g_s else None
                _scale_(grads, coef_b)
        if log:
            for name, value in (
                ("grad_norm", total),
                ("grad_norm_backbone", n_b),
                ("grad_norm_scorer", n_s),
                ("grad_clip_coef_backbone", coef_b),
                ("grad_clip_coef_scorer", coef_s),
            ):
                if value is not None:
                    self.log(f"train/{name}", value)

    def _grad_param_groups(self) -> tuple[list[nn.Parameter], list[bool]]:
        """The trainable parameters in self.parameters() order and, for each, whether it belongs to a type
        scorer (`scorer_parameters`); computed once."""
        if self._grad_groups is None:
            ids = {id(p) for p in scorer_parameters(self.model)}
            params = [p for p in self.parameters() if p.requires_grad]
            self._grad_groups = (params, [id(p) in ids for p in params])
        return self._grad_groups

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
        """Start copying ``stats`` (scalars) to the host, for `_write_layer_stats` at Lightning's logging step."""
        trainer = attached_trainer(self)
        step = self.global_step if trainer is None else batches_that_stepped(trainer)  # the step Lightning's logs carry
        values = torch.stack([v.detach().float().reshape(()) for v in stats.values()])
        event = None
        if values.is_cuda:
            host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            host.copy_(values, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            values = host
        # a later micro-batch of the same step replaces it: Lightning writes a step's last value too
        self._staged_stats = [e for e in self._staged_stats if e[0] != step] + [(step, list(stats), values, event)]

    def _write_layer_stats(self, wait: bool = False) -> None:
        """Write the staged statistics whose host copy has completed (all of them with ``wait``) to the loggers."""
        keep = []
        for step, names, values, event in self._staged_stats:
            if event is not None and not event.query():
                if not wait:
                    keep.append((step, names, values, event))
                    continue
                event.synchronize()
            metrics = dict(zip(names, values.tolist()))
            for logger in self.loggers:
                logger.log_metrics(metrics, step=step)
        self._staged_stats = keep

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
