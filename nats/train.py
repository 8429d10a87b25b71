"""`nats-train`: instantiate what the config names and wire it together (Hydra app).

nats-train                                   # small model on the embedded Gutenberg corpus, CPU
nats-train experiment=pg19_gpt2_dense trainer=ddp data.path=/data/pg19
nats-train resume=logs/train/runs/<run>       # resume an interrupted run in its folder (or resume=latest)
nats-train ckpt_path=/path/to/last.ckpt      # start a new run folder from that checkpoint's exact state
nats-train -m hydra/launcher=submitit_slurm experiment=pg19_gpt2_nats ...   # SLURM (see slurm/README.md)
"""

from __future__ import annotations

import difflib
import inspect
import logging
import math
import os

import hydra
import lightning as L
import torch
from hydra.errors import InstantiationException
from omegaconf import DictConfig, OmegaConf

from nats.checks import check_hf_model, check_trainer
from nats.cli import console, guarded
from nats.data.datamodule import TokenDataModule
from nats.lightning_compat import check_lightning
from nats.runs import (
    AUTO,
    RunInterrupted,
    checkpoint_step,
    clear_failure,
    cluster_plugins,
    resolve_ckpt_path,
    resume_argv,
    write_metrics,
)
from nats.utils import CONF_DIR, grad_accumulation, world_size_of

log = logging.getLogger(__name__)


def compose_config(overrides: list[str], config_name: str = "train") -> DictConfig:
    """The config a Hydra app would see for these command-line overrides, composed from conf/ in-process
    (for scripts and tests that build and run a configuration without going through ``nats-train``)."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose(config_name=config_name, overrides=list(overrides))


def instantiate(node, key: str | None = None, **kwargs):
    """hydra.utils.instantiate, but a configuration mistake raised by our own code (ValueError, TypeError,
    FileNotFoundError: an unknown attention name, a window < 1, ...) surfaces as itself, not wrapped, and an
    option the target does not take (a mistyped `+trainer.max_step=...`) names the valid ones."""
    try:
        return hydra.utils.instantiate(node, **kwargs)
    except InstantiationException as err:
        cause = err.__cause__
        if isinstance(cause, TypeError) and "unexpected keyword argument" in str(cause):
            raise TypeError(_unknown_option_message(node, key, cause, kwargs)) from None
        if isinstance(cause, (ValueError, TypeError, FileNotFoundError)):
            raise cause from None
        raise


def _unknown_option_message(node, key: str | None, cause: TypeError, given: dict) -> str:
    """'trainer has no option max_step (did you mean max_steps?); its options: ...'"""
    target = node.get("_target_") if hasattr(node, "get") else None
    bad = str(cause).rsplit("argument", 1)[-1].strip().strip("'\"")
    options: list[str] = []
    try:
        obj = hydra.utils.get_object(target)
        sig = inspect.signature(obj.__init__ if inspect.isclass(obj) else obj)
        options = [
            n
            for n, p in sig.parameters.items()
            if n != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and n not in given
        ]
    except Exception:  # noqa: BLE001 - the message is still useful without the list
        pass
    where = key or target or "the config"
    close = difflib.get_close_matches(bad, options, n=1)
    hint = f" (did you mean {where}.{close[0]}?)" if close else ""
    listed = f"; its options: {', '.join(options)}" if options else ""
    return (
        f"{where} ({target}) has no option {bad!r}{hint}{listed}. Fix or remove the override "
        f"{where}.{bad}=... (a `+` in front adds a key the config does not have, it does not make the "
        f"target accept it)"
    )


def build(cfg: DictConfig):
    """Instantiate datamodule, module, callbacks, loggers and trainer from a composed config."""
    L.seed_everything(cfg.seed, workers=True, verbose=False)  # the seed is in the run's config (.hydra/)
    world = world_size_of(cfg.trainer)
    accum = grad_accumulation(cfg.global_batch_size, cfg.data.micro_batch_size, world)
    if cfg.eval_every < 1:
        raise ValueError(f"eval_every must be >= 1 optimizer steps, got {cfg.eval_every}")

    # a config without a native model (an hf_model experiment: `override /model: null`) has no model.block_size
    data_len, model_len = cfg.data.get("block_size"), OmegaConf.select(cfg, "model.block_size")
    if data_len is not None and model_len is not None and data_len > model_len:
        raise ValueError(
            f"data.block_size={data_len} is longer than model.block_size={model_len}: the model cannot attend "
            f"that far. Set data.block_size <= {model_len} or train a model with model.block_size={data_len}."
        )
    check_hf_model(cfg)
    check_trainer(cfg)  # a GPU trainer without a GPU, a logger without its package: before anything is built
    datamodule: L.LightningDataModule = instantiate(cfg.data, "data")
    module: L.LightningModule = instantiate(cfg.module, "module", _convert_="all")
    callbacks = [instantiate(c, f"callbacks.{k}") for k, c in (cfg.get("callbacks") or {}).items() if c is not None]
    callbacks.append(_ValidationStep())
    loggers = [instantiate(c, f"logger.{k}") for k, c in (cfg.get("logger") or {}).items() if c is not None]
    plugins = cluster_plugins()  # SLURM: the environment, its requeue signal handled by InterruptCheckpoint
    trainer: L.Trainer = instantiate(
        cfg.trainer,
        "trainer",
        accumulate_grad_batches=accum,
        val_check_interval=cfg.eval_every * accum,  # counted in micro-batches
        check_val_every_n_epoch=None,
        use_distributed_sampler=False,  # the datamodule splits samples across ranks itself (exact resume)
        # Lightning's table (with a FLOPs column of zeros) only when asked for; nats-train prints one line instead
        enable_model_summary=bool(cfg.trainer.get("enable_model_summary", False)),
        callbacks=callbacks,
        logger=loggers or False,
        **({"plugins": plugins} if plugins else {}),
    )
    check_lightning(trainer)  # the private Lightning attributes the callbacks reach: found now, not at a SIGTERM
    return datamodule, module, trainer


def fit_in(cfg: DictConfig, run_dir) -> tuple:
    """For experiment scripts: write cfg to run_dir/config.yaml, build and fit; returns (datamodule, module,
    trainer, fit seconds)."""
    import time
    from pathlib import Path

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    datamodule, module, trainer = build(cfg)
    t0 = time.time()
    trainer.fit(module, datamodule=datamodule)
    return datamodule, module, trainer, time.time() - t0


def run(cfg: DictConfig) -> dict[str, float]:
    """Train (or resume) and validate; returns the final metrics."""
    if cfg.get("float32_matmul_precision"):
        torch.set_float32_matmul_precision(cfg.float32_matmul_precision)
    # the checkpoint first: a missing, truncated or corrupt file stops here, before anything is built
    ckpt_path = resolve_ckpt_path(cfg.get("ckpt_path"), cfg.paths.output_dir)  # "auto": the run folder's newest
    step = checkpoint_step(ckpt_path) if ckpt_path is not None else 0
    datamodule, module, trainer = build(cfg)
    if trainer.local_rank == 0 and isinstance(datamodule, TokenDataModule):
        # the token cache before anything else is said (a missing data folder stops here); Lightning's own call
        # in fit finds it prepared. Processes that DDP launches later find the cache made; others wait in fit
        datamodule.prepare_data()
        datamodule.setup()  # its splits checked (an empty one stops here); fit sets it up again, attached
    if ckpt_path is not None:
        if trainer.is_global_zero:
            log.info(f"resuming from {ckpt_path} at step {step}")
        for logger in trainer.loggers:  # keep the rows logged before (Lightning's CSVLogger deletes them)
            if hasattr(logger, "resuming"):
                logger.resuming()
    elif cfg.get("ckpt_path") == AUTO and trainer.is_global_zero:
        log.info(f"no checkpoint in {cfg.paths.output_dir}: starting fresh")
    if trainer.is_global_zero:
        clear_failure(cfg.paths.output_dir)
        log.info(describe_run(cfg, module, trainer))
    final_validation = bool(cfg.get("final_validation", True))
    _validation_step(trainer).final = final_validation  # within the fit, at its last step
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if torch.is_tensor(v) and v.numel() == 1}
        # a fit that did not validate its final weights: one that trained nothing (resumed at its final step, which
        # the earlier fit validated) or stopped before trainer.max_steps (an epoch limit)
        if final_validation and _validated_at(trainer) != trainer.global_step:
            final = trainer.validate(module, datamodule=datamodule, verbose=False)[0]
            metrics.update({k: float(v) for k, v in final.items()})
    except BaseException as err:
        if _is_sigterm(err):  # SIGTERM or a first Ctrl-C (nats.callbacks.InterruptCheckpoint): the state is saved
            reason = next((cb.reason for cb in trainer.callbacks if hasattr(cb, "reason")), "SIGTERM")
            raise RunInterrupted(int(trainer.global_step), reason) from err
        if isinstance(err, SystemExit) and trainer.interrupted:  # Lightning's exit after a KeyboardInterrupt
            raise RunInterrupted(int(trainer.global_step), "Ctrl-C") from err
        err.nats_steps_run = int(trainer.global_step) - step  # read by report_failure: did this run train?
        raise
    if trainer.is_global_zero:
        lm_loss = getattr(module, "loss_is_cross_entropy", True)  # False: e.g. a distillation MSE (nats.finetune.lit)
        if lm_loss and "val/ppl" not in metrics and "val/loss" in metrics:
            metrics["val/ppl"] = math.exp(metrics["val/loss"])
        if hasattr(datamodule, "unigram_perplexity"):
            log.info(f"unigram_ppl {datamodule.unigram_perplexity('validation'):.2f}")
        log.info(f"val_loss {metrics.get('val/loss', float('nan')):.4f}")
        if lm_loss:
            log.info(f"val_ppl {metrics.get('val/ppl', float('nan')):.2f}")
        write_metrics(
            cfg.paths.output_dir,
            metrics,
            global_step=int(trainer.global_step),
            world_size=int(trainer.world_size),
            accumulate_grad_batches=int(trainer.accumulate_grad_batches),
            micro_batch_size=int(cfg.data.micro_batch_size),
            global_batch_size=int(cfg.global_batch_size),
            tokens_seen=int(trainer.global_step)
            * int(cfg.global_batch_size)
            * int(getattr(datamodule, "block_size", None) or OmegaConf.select(cfg, "model.block_size", default=0)),
            resumed_from=ckpt_path,
        )
    return metrics


def _validation_step(trainer) -> _ValidationStep:
    return next(cb for cb in trainer.callbacks if isinstance(cb, _ValidationStep))


def _validated_at(trainer) -> int | None:
    """The optimizer step of the fit's last validation (None without one): the final validation is skipped when
    it would validate the same weights again."""
    return _validation_step(trainer).step


class _ValidationStep(L.Callback):
    """Remembers the optimizer step at which the fit last validated (``_validated_at``). With ``final`` (nats-train's
    ``final_validation``), the fit also validates after its last step (``trainer.max_steps``) where ``eval_every``
    does not fall on it: the final validation is one of the fit's, so the best checkpoint by validation loss
    (conf/callbacks/model_checkpoint.yaml) is chosen among all the validations the run reports, the final
    ``val_ppl`` included (a trainer.validate after the fit, which checkpoint callbacks do not see, could leave
    the best checkpoint at an earlier step whose loss is higher), and the loggers get it at the step of the
    fit. It is asked for as an early stop is (``trainer.should_stop``, after which Lightning validates)."""

    def __init__(self, final: bool = False) -> None:
        self.step: int | None = None
        self.final = final

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.final and 0 < trainer.max_steps <= trainer.global_step:
            trainer.should_stop = True  # the fit stops here anyway (max_steps): Lightning validates first

    def on_validation_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking and trainer.state.fn == "fit":
            self.step = int(trainer.global_step)


def _is_sigterm(err: BaseException) -> bool:
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    return isinstance(err, SIGTERMException)


def describe_run(cfg: DictConfig, module, trainer) -> str:
    """One line: the model's size and what the fit will do (Lightning's model summary is off by default)."""
    params = sum(p.numel() for p in module.parameters())
    model = OmegaConf.select(cfg, "model")
    arch = ""
    if model is not None and "n_layer" in model:
        arch = (
            f" ({model.n_layer} layers, d={model.n_embd}, context {model.block_size}, attention {model.attention.name})"
        )
    block = OmegaConf.select(cfg, "data.block_size")
    tokens = f" of {cfg.global_batch_size} x {block} tokens" if block else f" of {cfg.global_batch_size} sequences"
    return (
        f"model: {params / 1e6:.1f}M parameters{arch}; {trainer.max_steps} optimizer steps{tokens}, validation "
        f"every {cfg.eval_every} steps, on {trainer.strategy.root_device.type}"
    )


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="train")
def _hydra_main(cfg: DictConfig) -> float | None:
    # one line on the console for any failure; the traceback in failed.json (or HYDRA_FULL_ERROR=1)
    metrics = guarded("nats-train", cfg, run)
    return metrics.get("val/loss")  # for Hydra sweepers that optimise a value


def main() -> float | None:
    """`nats-train`: a Hydra app; ``resume=<run folder>`` (or ``resume=latest``) first becomes that run's own
    overrides + ``hydra.run.dir=<run folder>`` + ``ckpt_path=auto`` (nats.runs.resume_argv)."""
    runs_dir = os.path.join(os.environ.get("PROJECT_ROOT", "."), "logs")  # resume=latest: every task's runs/
    return console("nats-train", "train", _hydra_main, lambda argv, notes: resume_argv(argv, runs_dir, notes))


if __name__ == "__main__":
    main()
