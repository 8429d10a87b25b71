"""`InterruptCheckpoint`: SIGTERM, Ctrl-C and SLURM's requeue signal end the optimizer step and save the state
(conf/callbacks/interrupt_checkpoint.yaml)."""

from __future__ import annotations

from lightning.pytorch.callbacks import Callback

from nats.lightning_compat import (
    batches_that_stepped_shifted,
    received_sigterm,
    set_received_sigterm,
    should_accumulate,
)


class InterruptCheckpoint(Callback):
    """Lightning's :class:`~lightning.pytorch.callbacks.OnExceptionCheckpoint`, for SIGTERM and Ctrl-C only: a fit
    that gets SIGTERM or a first Ctrl-C (Lightning's signal handler, or ours for SIGINT, sets
    ``trainer.received_sigterm`` and the loop raises ``SIGTERMException``) ends its current optimizer step (the rest
    of a gradient accumulation, so that the saved state resumes exactly), stops, and the state is saved to
    ``<dirpath>/<filename>.ckpt`` (default ``checkpoints/last.ckpt``, what ``ckpt_path=auto`` and ``nats-train
    resume=<run>`` continue from); nats-train then says where it stopped and exits non-zero. Other exceptions
    (errors) save nothing. (A plain Callback, not an OnExceptionCheckpoint: with one of those Lightning turns every
    ``fit(ckpt_path=None)`` into ``ckpt_path="last"`` and warns when there is none; nor a Checkpoint, which
    ``enable_checkpointing=false`` forbids.)

    Under SLURM (``slurm_requeue``, on by default) SLURM's requeue signal (USR2 before a pre-emption or the time
    limit, `nats.runs.requeue_signal`) is handled the same way, and once the state is saved the job is requeued
    (`nats.runs.requeue_job`, rank 0): it restarts in the same run folder from that checkpoint."""

    def __init__(self, dirpath: str, filename: str = "last", slurm_requeue: bool = True) -> None:
        super().__init__()
        if not filename:
            raise ValueError("InterruptCheckpoint: filename must not be empty")
        self.dirpath, self.filename = str(dirpath), filename
        self.slurm_requeue = bool(slurm_requeue)
        self._deferred = False
        self._requeue: str | None = None  # the SLURM job to requeue once the state is saved

    @property
    def ckpt_path(self) -> str:
        import os

        return os.path.join(self.dirpath, self.filename + ".ckpt")

    def on_train_start(self, trainer, pl_module) -> None:
        """Ctrl-C (SIGINT) in the main thread stops the fit as SIGTERM does: at the end of the current optimizer
        step, with the state saved (``reason`` says which signal); a second Ctrl-C stops at once."""
        import signal
        import threading

        from nats.runs import requeue_signal, slurm_job_to_requeue

        self.reason, self._restore = "SIGTERM", []
        if threading.current_thread() is not threading.main_thread():
            return

        def stop(reason: str) -> None:  # as SIGTERM: at the end of the current optimizer step
            self.reason = reason
            set_received_sigterm(trainer)

        def on_sigint(signum, frame) -> None:
            signal.signal(signal.SIGINT, previous)  # the next Ctrl-C interrupts at once
            stop("Ctrl-C")

        previous = self._handle(signal.SIGINT, on_sigint)
        job = slurm_job_to_requeue() if self.slurm_requeue else None
        if job is not None:  # SLURM's requeue signal: save at the end of the step, then requeue

            def on_requeue(signum, frame) -> None:
                self._requeue = job
                stop(f"SLURM's {signal.Signals(signum).name}: requeued")

            self._handle(requeue_signal(), on_requeue)

    def _handle(self, sig, handler):
        """Install ``handler`` for ``sig`` until teardown; returns the handler it replaces."""
        import signal

        previous = signal.getsignal(sig)
        self._restore.append((sig, previous))
        signal.signal(sig, handler)
        return previous

    def teardown(self, trainer, pl_module, stage: str) -> None:
        import signal

        for sig, previous in reversed(getattr(self, "_restore", [])):
            signal.signal(sig, previous)
        self._restore = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if received_sigterm(trainer) and should_accumulate(trainer):
            set_received_sigterm(trainer, False)  # Lightning would stop in mid-step
            self._deferred = True
        elif self._deferred:
            set_received_sigterm(trainer)  # the step is complete: stop now
            self._deferred = False

    def on_validation_end(self, trainer, pl_module) -> None:
        self._validated_step = trainer.global_step

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        from lightning.pytorch.utilities.exceptions import SIGTERMException

        if isinstance(exception, SIGTERMException):
            # The loop stops after the step's validation and its count of stepped batches. Lightning restarts a
            # checkpoint of a step that validated by skipping that validation and counting the step once more
            # (it expects the count from before, as a checkpoint saved at the validation's end has it), which
            # would shift the logged steps of the resumed run by one: save the count it expects.
            shift = int(getattr(self, "_validated_step", None) == trainer.global_step and trainer.global_step > 0)
            with batches_that_stepped_shifted(trainer, shift):
                trainer.save_checkpoint(self.ckpt_path, weights_only=False)
            if self._requeue is not None and trainer.is_global_zero:
                from nats.runs import requeue_job

                requeue_job(self._requeue)
