"""Fine-tune the NAtS type scorers of a pretrained Hugging Face model by distillation.

`LitNAtSDistill` loads a pretrained Llama-family model (`nats.hf.pretrained.load_pretrained`, from an ``hf_model``
config node), attaches NAtS scorers (`nats.hf.attach_nats`: the backbone frozen, the scorers trainable) and trains
them so that the NAtS model (the student) reproduces the same model with dense attention (the teacher):

    loss = MSE(student final hidden states, teacher final hidden states; answer span) + lambda * mean(rho)

The hidden states are the decoder's output after its final norm (``model.model(...).last_hidden_state``, not the
logits); the answer span is the positions that predict the answer tokens (`nats.finetune.datamodule.answer_mask`); the
sparsity term is the native model's, `nats.attention.nats.sparsity_loss` summed over the layers: lambda times the
mean KV density rho (the area fraction, differentiable in the scorers) over sequences, layers and KV heads, which is
`nats.hf.nats_density` (logged as ``train/density``). ``sparsity_lambda`` has no default here: the experiment config
sets it (conf/experiment/finetune_smollm2_nats.yaml; the default of lambda is documented once, in
conf/model/attention/nats.yaml). The teacher is the same backbone run with ``config._attn_implementation`` set to
``teacher_attn_implementation`` ("sdpa": the original model's dense attention, exact and cheaper than NAtS with
every token forced global) under ``torch.no_grad``.

The optimiser (conf/optim/nats_finetune.yaml) is AdamW over the scorer weights only with the paper's schedule
(`finetune_lr_at`): a linear warm-up from ``min_lr`` to ``lr`` over the first ``warmup_frac`` of the steps, ``lr``,
then a linear decay back to ``min_lr`` over the last ``cooldown_frac``. Checkpoints hold the scorer weights only
(and the optimizer, scheduler and loop state); the backbone always comes from the pretrained model. See
docs/hf_finetune.md.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from torch import nn

from nats.attention.nats import sparsity_loss
from nats.hf.hooks import SCORER_NAME
from nats.hf.scorers import attach_nats, nats_density, nats_state_dict, nats_stats, scorers
from nats.lightning_compat import attached_trainer
from nats.optim import check_optim_keys, optimizer_node, optimizer_partial
from nats.step_logging import host_scalar, logs_written_now
from nats.utils import atomic_write

log = logging.getLogger(__name__)

__all__ = ["OPTIM_KEYS", "finetune_optim_config", "finetune_lr_at", "masked_mse", "LitNAtSDistill"]

#: the keys of `optim` (conf/optim/nats_finetune.yaml)
OPTIM_KEYS = ("optimizer", "lr", "min_lr", "warmup_frac", "cooldown_frac", "max_steps", "grad_clip")
#: the run folder's files
SCORERS_FILE = "scorers.pt"
STATS_FILE = "nats_stats.json"


def finetune_optim_config(optim: Mapping[str, Any]) -> dict[str, Any]:
    """`optim` checked: known keys only, an optimizer partial config whose lr is ``optim.lr``, a schedule whose
    warm-up and cool-down fit in the run."""
    optim = dict(optim)
    check_optim_keys(optim, OPTIM_KEYS)
    for key in ("optimizer", "lr"):
        if optim.get(key) is None:
            raise ValueError(f"optim.{key} is required (conf/optim/nats_finetune.yaml)")
    optim.setdefault("min_lr", optim["lr"])
    optim.setdefault("warmup_frac", 0.0)
    optim.setdefault("cooldown_frac", 0.0)
    if not 0 < optim["min_lr"] <= optim["lr"]:
        raise ValueError(f"need 0 < optim.min_lr <= optim.lr, got {optim['min_lr']} and {optim['lr']}")
    w, c = optim["warmup_frac"], optim["cooldown_frac"]
    if w < 0 or c < 0 or w + c > 1:
        raise ValueError(f"need optim.warmup_frac, optim.cooldown_frac >= 0 with a sum <= 1, got {w} and {c}")
    optim["optimizer"] = optimizer_node(optim["optimizer"], optim["lr"])
    return optim


def finetune_lr_at(
    step: int, *, lr: float, min_lr: float, max_steps: int, warmup_frac: float = 0.2, cooldown_frac: float = 0.2
) -> float:
    """The learning rate of optimizer step ``step`` (0-based) of ``max_steps``: ``min_lr`` at step 0, rising
    linearly to ``lr`` over the first ``round(warmup_frac * max_steps)`` steps, ``lr``, then falling linearly to
    ``min_lr`` at the last step over the last ``round(cooldown_frac * max_steps)`` (the mirror image of the
    warm-up); ``min_lr`` after ``max_steps``."""
    warm, cool = round(warmup_frac * max_steps), round(cooldown_frac * max_steps)
    if step >= max_steps:
        return min_lr
    if step < warm:
        return min_lr + (lr - min_lr) * step / warm
    left = max_steps - 1 - step  # optimizer steps after this one
    if left < cool:
        return min_lr + (lr - min_lr) * left / cool
    return lr


def masked_mse(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean squared error over the positions where ``mask`` [B, N] is True and the hidden size (float32, no host
    synchronisation: the mask weights the rows instead of selecting them)."""
    sq = (student.float() - teacher.float()).pow(2).mean(-1)  # [B, N]
    w = mask.to(sq.dtype)
    return (sq * w).sum() / w.sum()


class LitNAtSDistill(L.LightningModule):
    """Distillation of a pretrained model's NAtS scorers (module docstring).

    Args:
        model: the ``hf_model`` node (conf/hf_model/*.yaml: name_or_path, gguf_file, dtype, local_files_only).
        optim: conf/optim/nats_finetune.yaml (`finetune_optim_config`).
        window: the NAtS sliding window W.
        sparsity_lambda: lambda of `nats.attention.nats.sparsity_loss` (required; the experiment config sets it).
        tau, noise_scale, init_std, backend, mask_grad: passed to `nats.hf.attach_nats` (noise_scale: the
            Gumbel noise's scale s, 1 = the spec; callbacks/noise_schedule.yaml anneals it).
        teacher_attn_implementation: the dense attention of the teacher forward ("sdpa" or "eager").
        seed: the Gumbel noise of a training batch is drawn from ``(seed, its sample numbers)``, so a resumed run
            draws what the uninterrupted one did.
        compile, compile_mode, compile_split_ddp: not supported (``compile`` must be false); taken so that
            conf/train.yaml's module node applies unchanged.
    """

    loss_is_cross_entropy = False  # nats-train: val/loss is an MSE + density, no perplexity
    adapter_file, stats_file = SCORERS_FILE, STATS_FILE  # the run folder's files of the trained weights, the stats

    def __init__(
        self,
        model: Mapping[str, Any],
        optim: Mapping[str, Any],
        window: int = 256,
        *,
        sparsity_lambda: float,
        tau: float = 1.0,
        init_std: float | None = None,
        backend: str = "auto",
        mask_grad: str = "dense",
        noise_scale: float = 1.0,
        **training: Any,
    ):
        super().__init__()
        if sparsity_lambda < 0:
            raise ValueError(f"module.sparsity_lambda must be >= 0, got {sparsity_lambda}")
        self.save_hyperparameters()
        self.sparsity_lambda = float(sparsity_lambda)
        hf = self._setup("NAtS fine-tuning", model, optim, **training)
        self.model = attach_nats(
            hf,
            window=int(window),
            tau=tau,
            noise_scale=noise_scale,
            backend=backend,
            mask_grad=mask_grad,
            init_std=init_std,
            freeze=True,
        )
        # the attention modules whose pre-hook stashes the scorer input (cleared after each teacher forward)
        self._attn_modules = [m for m in self.model.modules() if hasattr(m, "_nats_hidden")]
        self._val_sums: dict[str, torch.Tensor] = {}
        self._val_count: torch.Tensor | None = None

    def _setup(
        self,
        method: str,
        model: Mapping[str, Any],
        optim: Mapping[str, Any],
        teacher_attn_implementation: str = "sdpa",
        seed: int = 0,
        compile: bool | str = False,
        compile_mode: str | None = None,
        compile_split_ddp: bool = False,  # conf/train.yaml's module node sets it; nothing here compiles
    ) -> nn.Module:
        """What every retrofit of a pretrained model sets up before attaching its method (the class docstring's
        ``teacher_attn_implementation``, ``seed`` and compile keys): checks them, reads ``optim``, and returns
        the pretrained model of ``model`` in training mode."""
        if compile not in (False, None, "false", "False") or compile_mode is not None:
            raise ValueError(
                f"{method} of a transformers model does not support torch.compile: set compile=false "
                "(and compile_mode=null)"
            )
        if teacher_attn_implementation == "nats":
            raise ValueError("module.teacher_attn_implementation must be a dense attention (sdpa or eager), not nats")
        self.optim_cfg = finetune_optim_config(optim)
        self.teacher_attn_implementation = teacher_attn_implementation
        self.seed = int(seed)
        return self._load(model)

    @staticmethod
    def _load(model: Mapping[str, Any]) -> nn.Module:
        """The pretrained model of the ``hf_model`` node, in training mode: load_pretrained returns it in eval mode,
        and Lightning keeps submodules' modes (it does not call .train() at fit start), where the scorers would take
        argmax types, which have no gradient."""
        from nats.hf.pretrained import load_pretrained, pretrained_kwargs

        hf, _ = load_pretrained(**pretrained_kwargs(model))
        return hf.train()

    # ------------------------------------------------------------------ what the method trains and measures
    def kv_density(self, argmax: bool = False) -> torch.Tensor:
        """The KV area fraction of the last student forward (`nats.hf.nats_density`; ``argmax``: of the inference
        types)."""
        return nats_density(self.model, argmax=argmax)

    def layer_stats(self) -> dict[str, torch.Tensor]:
        """The last forward's KV statistics per layer and KV head ``[n_layer, Hkv]`` (``density`` and ``peak``
        among them)."""
        return nats_stats(self.model)

    def trained_state(self) -> dict[str, torch.Tensor]:
        """The trained weights, by their keys in the model (the scorers: `nats.hf.nats_state_dict`)."""
        return nats_state_dict(self.model)

    # ------------------------------------------------------------------ forwards
    def scorer_parameters(self) -> list[nn.Parameter]:
        """The trainable parameters: the NAtS scorers' weights (attach_nats froze everything else)."""
        params = [p for n, p in self.model.named_parameters() if p.requires_grad]
        names = [n for n, p in self.model.named_parameters() if p.requires_grad and f".{SCORER_NAME}." not in n]
        if names or not params:
            raise RuntimeError(f"expected the NAtS scorer weights alone to be trainable; other trainable: {names}")
        return params

    @torch.no_grad()
    def teacher_hidden(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The final hidden states [B, N, C] of the backbone with dense attention (no gradient)."""
        config = self.model.config
        nats_impl = config._attn_implementation
        config._attn_implementation = self.teacher_attn_implementation
        try:
            return self.model.base_model(input_ids=input_ids, use_cache=False).last_hidden_state
        finally:
            config._attn_implementation = nats_impl
            for m in self._attn_modules:  # what the pre-hook stashed and no NAtS attention read
                m._nats_hidden = None
                if hasattr(m, "_nats_cache"):
                    m._nats_cache = None

    def student_hidden(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The final hidden states [B, N, C] with NAtS attention (records the density on the scorers)."""
        return self.model.base_model(input_ids=input_ids, use_cache=False).last_hidden_state

    @contextlib.contextmanager
    def _gumbel_noise_of(self, samples: Sequence[int]) -> Iterator[None]:
        """Draw this batch's Gumbel noise from a seed of ``(seed, sample numbers)``, leaving the global random
        state as it was: the noise is a function of the data alone, as resuming from a checkpoint needs (the
        DataLoader draws from the global generator whenever an iterator starts, which a resumed run does at a
        different point)."""
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(int(np.random.SeedSequence([self.seed, *map(int, samples)]).generate_state(1)[0]))
            yield

    def distill(self, input_ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mse, density)`` of a batch: the teacher, then the student (in the module's train/eval mode)."""
        teacher = self.teacher_hidden(input_ids)
        student = self.student_hidden(input_ids)
        return masked_mse(student, teacher, mask), self.kv_density()

    def sparsity(self) -> torch.Tensor:
        """lambda * mean(rho) of the last student forward: `nats.attention.nats.sparsity_loss` of every layer,
        summed, as the native model's auxiliary loss (the same value as ``lambda * nats_density(model)``)."""
        layers = scorers(self.model)
        return sum(sparsity_loss(s.last_density.float(), self.sparsity_lambda, len(layers)) for s in layers)

    # ------------------------------------------------------------------ steps
    def training_step(self, batch, batch_idx):
        input_ids, mask, samples = batch
        with self._gumbel_noise_of(samples):
            mse, density = self.distill(input_ids, mask)
        loss = mse + self.sparsity()
        # not prog_bar (a host sync per micro-batch): nats.callbacks.StepProgressBar reads train/loss itself
        self.log("train/loss", loss)
        if logs_written_now(attached_trainer(self)):  # the rest only on the steps whose logs are written
            self.log("train/mse", mse)
            self.log("train/density", density)
            # the density of the argmax types of the same batch (inference's; the sampled ones' is train/density)
            self.log("train/density_argmax", self.kv_density(argmax=True))
            self.log("lr", host_scalar(self.optimizers().param_groups[0]["lr"]))  # no device sync
        return loss

    def on_validation_epoch_start(self) -> None:
        self._val_sums, self._val_count = {}, None

    def validation_step(self, batch, batch_idx):
        input_ids, mask, _ = batch
        mse, density = self.distill(input_ids, mask)  # eval mode: argmax types, the inference KV area
        loss = mse + self.sparsity()
        b = input_ids.size(0)
        self.log("val/loss", loss, batch_size=b, prog_bar=True, sync_dist=True)
        self.log("val/mse", mse, batch_size=b, sync_dist=True)
        self.log("val/density", density, batch_size=b, sync_dist=True)
        for name, value in self.layer_stats().items():  # [n_layer, Hkv], batch means
            self._val_sums[name] = self._val_sums.get(name, 0) + value * b
        n = torch.tensor(float(b), device=input_ids.device)
        self._val_count = n if self._val_count is None else self._val_count + n
        return loss

    def on_validation_epoch_end(self) -> None:
        """Per-layer KV area and peak fractions over the validation examples (all ranks): logged as
        ``val_layers/layer<i>/{density,peak}`` (mean over KV heads) and ``val/peak``, and written per layer and
        KV head to ``<run folder>/nats_stats.json``."""
        if self._val_count is None:
            return
        reduce = self.trainer.strategy.reduce
        count = reduce(self._val_count, reduce_op="sum")
        means = {name: reduce(v, reduce_op="sum") / count for name, v in self._val_sums.items()}
        self.log("val/peak", means["peak"].mean())
        for name in ("density", "peak"):
            for i, value in enumerate(means[name].mean(-1)):
                self.log(f"val_layers/layer{i}/{name}", value)
        if self.trainer.is_global_zero and not self.trainer.sanity_checking:
            self.write_stats(means, int(count.item()))

    def write_stats(self, means: Mapping[str, torch.Tensor], count: int) -> Path:
        """``<run folder>/nats_stats.json``: the validation KV statistics per layer and KV head."""
        path = Path(self.trainer.default_root_dir) / self.stats_file
        payload = {
            "step": int(self.trainer.global_step),
            "window": int(self.model._nats_hf["window"]),
            "examples": count,
            "mean": {name: float(v.mean()) for name, v in means.items()},
            "per_layer": {name: v.mean(-1).tolist() for name, v in means.items()},
            "per_layer_head": {name: v.tolist() for name, v in means.items()},
        }
        return atomic_write(path, json.dumps(payload, indent=1) + "\n")

    # ------------------------------------------------------------------ optimisation
    def configure_optimizers(self):
        """The `optim.optimizer` partial over the scorer weights, and the `finetune_lr_at` schedule per step."""
        o = self.optim_cfg
        optimizer = optimizer_partial(o["optimizer"])(self.scorer_parameters())
        max_steps = o.get("max_steps") or self.trainer.max_steps
        if max_steps is None or max_steps < 1:
            raise ValueError("set trainer.max_steps (or optim.max_steps) to a positive number for the schedule")
        schedule = dict(
            lr=o["lr"],
            min_lr=o["min_lr"],
            max_steps=int(max_steps),
            warmup_frac=o["warmup_frac"],
            cooldown_frac=o["cooldown_frac"],
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: finetune_lr_at(s, **schedule) / o["lr"])
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_before_optimizer_step(self, optimizer) -> None:
        """Clip the scorers' gradient norm to ``optim.grad_clip`` (None: off), on the device; log the pre-clip norm
        as ``train/grad_norm`` on the steps whose logs are written."""
        clip = self.optim_cfg.get("grad_clip")
        logged = logs_written_now(attached_trainer(self))
        if not clip and not logged:
            return
        params = [p for p in self.scorer_parameters() if p.grad is not None]
        if not params:
            return
        if clip:
            norm = torch.nn.utils.clip_grad_norm_(params, clip)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        if logged:
            self.log("train/grad_norm", norm)

    # ------------------------------------------------------------------ checkpoints: the scorers only
    def scorer_keys(self) -> set[str]:
        """The scorer weights' keys in this module's state dict (``model.model.layers.<i>.self_attn.nats_scorer.*``)."""
        return {f"model.{k}" for k in self.trained_state()}

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """Keep the scorer weights alone: the backbone is the pretrained model's, loaded by ``__init__``."""
        keys = self.scorer_keys()
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k in keys}

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False):
        """Load a checkpoint's scorer weights (and backbone weights if it has any): with ``strict``, every scorer
        key must be there and no key may be foreign to the model; missing backbone keys are expected."""
        if strict:
            missing = sorted(self.scorer_keys() - set(state_dict))
            unexpected = sorted(set(state_dict) - set(self.state_dict()))
            if missing or unexpected:
                raise KeyError(
                    f"not a checkpoint of this model's NAtS scorers: missing scorer keys {missing[:4]}"
                    f"{' ...' if len(missing) > 4 else ''}, unexpected keys {unexpected[:4]}"
                    f"{' ...' if len(unexpected) > 4 else ''} (was it written for another model or hf_model?)"
                )
        return super().load_state_dict(state_dict, strict=False, assign=assign)

    def on_train_end(self) -> None:
        """Write the scorer weights alone (`nats.hf.nats_state_dict`) to ``<run folder>/scorers.pt``, atomically;
        load them into an attached model with `nats.hf.load_nats_state_dict`."""
        if not self.trainer.is_global_zero:
            return
        buf = io.BytesIO()
        torch.save({k: v.detach().cpu() for k, v in self.trained_state().items()}, buf)
        path = atomic_write(Path(self.trainer.default_root_dir) / self.adapter_file, buf.getvalue())
        log.info(f"scorer weights: {path}")
