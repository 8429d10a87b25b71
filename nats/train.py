"""`nats-train`: instantiate what the config names and wire it together (Hydra app).

    nats-train                                   # small model on the embedded Gutenberg corpus, CPU
    nats-train experiment=pg19_gpt2_dense trainer=ddp data.path=/data/pg19
    nats-train ckpt_path=/path/to/last.ckpt      # resume exactly
    nats-train -m hydra/launcher=submitit_slurm experiment=pg19_gpt2_nats ...   # SLURM (see slurm/README.md)
"""
from __future__ import annotations

import math

import hydra
from hydra.errors import InstantiationException
import lightning as L
import torch
from omegaconf import DictConfig, OmegaConf

from nats.runs import cluster_plugins, lightning_handles_requeue, resolve_ckpt_path, write_metrics
from nats.utils import CONF_DIR, grad_accumulation, world_size_of



def compose_config(overrides: list[str], config_name: str = "train") -> DictConfig:
    """The config a Hydra app would see for these command-line overrides, composed from conf/ in-process
    (for scripts and tests that build and run a configuration without going through ``nats-train``)."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose(config_name=config_name, overrides=list(overrides))


def instantiate(node, **kwargs):
    """hydra.utils.instantiate, but a configuration mistake raised by our own code (ValueError, TypeError,
    FileNotFoundError: an unknown attention name, a window < 1, ...) surfaces as itself, not wrapped."""
    try:
        return hydra.utils.instantiate(node, **kwargs)
    except InstantiationException as err:
        if isinstance(err.__cause__, (ValueError, TypeError, FileNotFoundError)):
            raise err.__cause__ from None
        raise


def build(cfg: DictConfig):
    """Instantiate datamodule, module, callbacks, loggers and trainer from a composed config."""
    L.seed_everything(cfg.seed, workers=True)
    world = world_size_of(cfg.trainer)
    accum = grad_accumulation(cfg.global_batch_size, cfg.data.micro_batch_size, world)
    if cfg.eval_every < 1:
        raise ValueError(f"eval_every must be >= 1 optimizer steps, got {cfg.eval_every}")

    data_len, model_len = cfg.data.get("block_size"), cfg.model.block_size
    if data_len is not None and data_len > model_len:
        raise ValueError(
            f"data.block_size={data_len} is longer than model.block_size={model_len}: the model cannot attend "
            f"that far. Set data.block_size <= {model_len} or train a model with model.block_size={data_len}."
        )
    datamodule: L.LightningDataModule = instantiate(cfg.data)
    module: L.LightningModule = instantiate(cfg.module, _convert_="all")
    callbacks = [hydra.utils.instantiate(c) for c in (cfg.get("callbacks") or {}).values() if c is not None]
    loggers = [hydra.utils.instantiate(c) for c in (cfg.get("logger") or {}).values() if c is not None]
    plugins = cluster_plugins(cfg.get("auto_requeue", True))  # SLURM: requeue on submitit's signal
    trainer: L.Trainer = hydra.utils.instantiate(
        cfg.trainer,
        accumulate_grad_batches=accum,
        val_check_interval=cfg.eval_every * accum,  # counted in micro-batches
        check_val_every_n_epoch=None,
        use_distributed_sampler=False,  # the datamodule splits samples across ranks itself (exact resume)
        callbacks=callbacks,
        logger=loggers or False,
        **({"plugins": plugins} if plugins else {}),
    )
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
    datamodule, module, trainer = build(cfg)
    ckpt_path = resolve_ckpt_path(cfg.get("ckpt_path"), cfg.paths.output_dir)  # "auto": the run folder's newest
    if ckpt_path is not None and cfg.get("ckpt_path") == "auto" and trainer.is_global_zero:
        print(f"resuming from {ckpt_path} (ckpt_path=auto; ckpt_path=null starts from scratch)")
    with lightning_handles_requeue(trainer):  # SLURM: Lightning saves hpc_ckpt_<n>.ckpt, then requeues
        trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if torch.is_tensor(v) and v.numel() == 1}
        if cfg.get("final_validation", True):
            final = trainer.validate(module, datamodule=datamodule, verbose=False)[0]
            metrics.update({k: float(v) for k, v in final.items()})
    if trainer.is_global_zero:
        if "val/ppl" not in metrics and "val/loss" in metrics:
            metrics["val/ppl"] = math.exp(metrics["val/loss"])
        if hasattr(datamodule, "unigram_perplexity"):
            print(f"unigram_ppl {datamodule.unigram_perplexity('validation'):.2f}")
        print(f"val_loss {metrics.get('val/loss', float('nan')):.4f}")
        print(f"val_ppl {metrics.get('val/ppl', float('nan')):.2f}")
        write_metrics(cfg.paths.output_dir, metrics, global_step=int(trainer.global_step),
                      world_size=int(trainer.world_size), accumulate_grad_batches=int(trainer.accumulate_grad_batches),
                      micro_batch_size=int(cfg.data.micro_batch_size), global_batch_size=int(cfg.global_batch_size),
                      tokens_seen=int(trainer.global_step) * int(cfg.global_batch_size)
                      * int(getattr(datamodule, "block_size", cfg.model.block_size)),
                      resumed_from=ckpt_path)
    return metrics


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="train")
def main(cfg: DictConfig) -> float | None:
    if cfg.get("print_config"):
        print(OmegaConf.to_yaml(cfg, resolve=True))
    metrics = run(cfg)
    return metrics.get("val/loss")  # for Hydra sweepers that optimise a value


if __name__ == "__main__":
    main()
