"""`LastCheckpoint`: the newest state of a fit as `checkpoints/last.ckpt` (conf/callbacks/last_checkpoint.yaml)."""

from __future__ import annotations

from lightning.pytorch.callbacks import Checkpoint


class LastCheckpoint(Checkpoint):
    """``<dirpath>/<filename>.ckpt`` (default ``checkpoints/last.ckpt``), the newest state of the fit whatever the
    validation loss does: what ``ckpt_path=auto`` and ``nats-train resume=<run>`` continue from, and the final
    weights that nats-eval of a finished run reads. Saved at the end of every ``every_n_train_steps``-th optimizer
    step, of the fit's final step (``trainer.max_steps``, a multiple or not) and, where a fit ends otherwise (an
    epoch limit, an early stop), at its end; always under the same name, whoever wrote the file before
    (`InterruptCheckpoint` saves it when a run is interrupted). The saves are made at the end of the optimizer step
    (``on_train_batch_end``, before the step's validation) as Lightning's periodic ones are, so a run resumes from
    any of them exactly.

    In place of Lightning's ``ModelCheckpoint(save_last=True, every_n_train_steps=N, save_top_k=0)``, which wrote
    ``last-v1.ckpt`` where it found a ``last.ckpt`` it had not written itself (a run interrupted before its first
    interval, then resumed: ``ckpt_path=auto`` went on resuming from the interrupted state), saved the final step
    only where it had saved nothing before in the process (``max_steps=60``, N=50: ``last.ckpt`` at step 50), and,
    resumed at a multiple of N with gradient accumulation, saved again in the middle of the first step."""

    def __init__(self, dirpath: str, every_n_train_steps: int | None = None, filename: str = "last") -> None:
        super().__init__()
        if not filename:
            raise ValueError("LastCheckpoint: filename must not be empty")
        if every_n_train_steps is not None and every_n_train_steps < 0:
            raise ValueError(f"LastCheckpoint: every_n_train_steps must be >= 0 (got {every_n_train_steps})")
        self.dirpath, self.filename = str(dirpath), filename
        self.every_n_train_steps = int(every_n_train_steps or 0)
        self._saved: int | None = None  # the optimizer step whose state is saved (or resumed from) in this fit

    @property
    def ckpt_path(self) -> str:
        import os

        return os.path.join(self.dirpath, self.filename + ".ckpt")

    @property
    def state_key(self) -> str:
        # the key of the ModelCheckpoint this callback replaces (it has no state of its own): a run checkpointed by
        # it resumes without Lightning's warning that a callback which wrote the checkpoint is missing
        return "ModelCheckpoint" + repr(
            {
                "monitor": None,
                "mode": "min",
                "every_n_train_steps": self.every_n_train_steps,
                "every_n_epochs": 0,
                "train_time_interval": None,
            }
        )

    def on_train_start(self, trainer, pl_module) -> None:
        self._saved = trainer.global_step  # the state the fit starts from: step 0, or the checkpoint resumed from

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step == self._saved:  # saved already, or no optimizer step ended here (the rest of an accumulation)
            return
        final = 0 < trainer.max_steps <= step
        if final or (self.every_n_train_steps and step % self.every_n_train_steps == 0):
            self.save(trainer)

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.global_step != self._saved:  # a fit that stopped before trainer.max_steps
            self.save(trainer)

    def save(self, trainer) -> None:
        if trainer.fast_dev_run:  # as Lightning's checkpoints: none in a fast_dev_run
            return
        trainer.save_checkpoint(self.ckpt_path, weights_only=False)  # every rank takes part; rank 0 writes
        self._saved = trainer.global_step
