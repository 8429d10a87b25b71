"""`EvalAfterTraining`: nats-eval of a run's final checkpoint at the end of training
(conf/callbacks/eval_after.yaml)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback

log = logging.getLogger(__name__)

#: what an EvalAfterTraining entry evaluates (its ``checkpoint`` key)
CHECKPOINTS = ("last", "best")


class EvalAfterTraining(Callback):
    """``nats-eval`` of the run's final checkpoint at the end of training, the same code (``nats.evaluation.run``), once
    per entry of ``evals``, each into ``<run_dir>/eval_<name>/`` (results.json / .md / .csv, kv_fractions.json, the
    plots). A study's training runs thus leave their evaluations in their own folders, whatever launcher ran them
    (conf/callbacks/eval_after.yaml; docs/figure3.md).

    evals: name -> nats-eval settings (keys of conf/eval.yaml: split, methods, budgets, max_windows, batch_size,
        device, precision, ...); ``common`` holds settings for every entry (an entry's own keys win). One more
        key, ``checkpoint``: ``last`` (default, the final state) or ``best`` (the run's best checkpoint by
        validation loss, kept by the ``model_checkpoint`` callback: the point to compare at where a long training
        overfits).
    data: the run's data config (the windows come from the data the model was trained on).
    block_size, attention: the model's N and attention core, to check the evaluations' plans (methods, budgets)
    before the training starts rather than after it.
    The final checkpoint is the run's ``checkpoints/last.ckpt`` (`LastCheckpoint` saves the final step), saved
    first when it does not hold the final step (a run without that callback). An entry whose results.json is newer
    than its checkpoint is skipped (a finished run that is started again does not evaluate again). Only rank 0
    evaluates."""

    def __init__(
        self,
        evals: dict,
        data: dict,
        run_dir: str,
        common: dict | None = None,
        block_size: int | None = None,
        attention: str | None = None,
    ):
        super().__init__()
        self.evals = {str(k): dict(v or {}) for k, v in (evals or {}).items()}
        self.common = dict(common or {})
        self.checkpoints = {}
        for name in self.evals:
            which = {**self.common, **self.evals[name]}.get("checkpoint", "last")
            if which not in CHECKPOINTS:
                raise ValueError(
                    f"callbacks.eval_after.evals.{name}.checkpoint={which!r}: choose {' or '.join(CHECKPOINTS)}"
                )
            self.checkpoints[name] = which
        self.data = dict(data)
        self.run_dir = Path(run_dir)
        from nats.evaluation import compose_eval, plan_runs

        for name in self.evals:  # a mistyped key or an unusable budget fails now, not after the training
            cfg = compose_eval(self.settings(name))
            if block_size is not None:
                n = int(cfg.block_size) if cfg.get("block_size") else int(block_size)
                try:
                    plan_runs(cfg, n, attention == "nats")
                except ValueError as err:
                    raise ValueError(f"callbacks.eval_after.evals.{name}: {err}") from None

    def settings(self, name: str) -> dict:
        """The nats-eval settings of entry ``name`` (its ``checkpoint`` choice is the callback's, not nats-eval's)."""
        merged = {**self.common, **self.evals[name]}
        merged.pop("checkpoint", None)
        return merged

    def checkpoint_for(self, name: str, trainer, final: Path) -> Path:
        """The checkpoint entry ``name`` evaluates: ``final`` (`final_checkpoint`), or the best by validation loss."""
        if self.checkpoints[name] == "last":
            return final
        from lightning.pytorch.callbacks import ModelCheckpoint

        mc = trainer.checkpoint_callback
        best = getattr(mc, "best_model_path", "") if isinstance(mc, ModelCheckpoint) else ""
        if not best or not Path(best).is_file():
            raise ValueError(
                f"callbacks.eval_after.evals.{name}: checkpoint=best needs the run's best checkpoint by validation "
                f"loss, and there is none (keep the model_checkpoint callback, callbacks=[default,eval_after], and "
                f"validate at least once: trainer.val_check_interval); or evaluate checkpoint=last"
            )
        return Path(best)

    def final_checkpoint(self, trainer) -> Path:
        from nats.runs import checkpoint_step

        last = self.run_dir / "checkpoints" / "last.ckpt"
        if not last.is_file() or checkpoint_step(last) != trainer.global_step:
            trainer.save_checkpoint(last)  # every rank takes part; rank 0 writes
        return last

    def on_fit_end(self, trainer, pl_module) -> None:
        if not self.evals:
            return
        final = self.final_checkpoint(trainer)  # every rank takes part in saving it
        if not trainer.is_global_zero:
            return
        from nats.evaluation import compose_eval, run

        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the training's cached blocks, for the evaluation's batches
        for name in self.evals:
            ckpt = self.checkpoint_for(name, trainer, final)
            out = self.run_dir / f"eval_{name}"
            done = out / "results.json"
            if done.is_file() and done.stat().st_mtime > ckpt.stat().st_mtime:
                log.info(f"eval_after {name}: {done} is newer than {ckpt}, skipped")
                continue
            cfg = compose_eval(self.settings(name), data=self.data, ckpt_path=str(ckpt), output_dir=str(out))
            log.info(f"eval_after {name}: nats-eval of {ckpt} into {out}")
            run(cfg)
