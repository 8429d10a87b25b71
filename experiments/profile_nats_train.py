"""Profile optimizer steps of the real `nats-train` path (Lightning, real data, default callbacks) with
torch.profiler: where the time of a step goes, beside the GPU's busy time (issue 16).

    python experiments/profile_nats_train.py experiment=fig3_nats trainer=gpu compile=true data=pg19_subset
    python experiments/profile_nats_train.py --steps 60 --profile 50 55 experiment=fig3_dense ...

Prints, for the profiled steps: wall ms per optimizer step, GPU kernel ms per step (the sum of CUDA kernel time,
i.e. the GPU's busy time), and the top ops by self CUDA time and by self CPU time. A step whose wall time exceeds
its kernel time by much is host-bound or synchronises; `--trace FILE` writes a Chrome trace for a closer look.
"""
from __future__ import annotations

import argparse
import time

import torch
from lightning.pytorch.callbacks import Callback


class ProfileSteps(Callback):
    """torch.profiler over optimizer steps [start, stop) of a fit."""

    def __init__(self, start: int, stop: int, trace: str | None = None):
        self.start, self.stop, self.trace = start, stop, trace
        self.prof = None
        self.t0 = None
        self.wall_ms = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.prof is None and trainer.global_step == self.start:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                acts.append(torch.profiler.ProfilerActivity.CUDA)
                torch.cuda.synchronize()
            self.prof = torch.profiler.profile(activities=acts)
            self.prof.__enter__()
            self.t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.prof is not None and self.wall_ms is None and trainer.global_step == self.stop:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.wall_ms = (time.perf_counter() - self.t0) * 1e3
            self.prof.__exit__(None, None, None)
            if self.trace:
                self.prof.export_chrome_trace(self.trace)

    def report(self) -> None:
        if self.prof is None or self.wall_ms is None:
            print("profiler did not run (fewer steps than --profile?)")
            return
        n = self.stop - self.start
        events = self.prof.key_averages()
        kernel_us = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
        print(f"profiled steps {self.start}..{self.stop}: wall {self.wall_ms / n:.2f} ms/step, "
              f"GPU kernels {kernel_us / 1e3 / n:.2f} ms/step (busy {kernel_us / 1e3 / self.wall_ms:.1%})")
        for key, title in (("self_cuda_time_total", "self CUDA"), ("self_cpu_time_total", "self CPU")):
            print(f"\n## top ops by {title} time (totals over {n} steps)")
            print(events.table(sort_by=key, row_limit=25, max_name_column_width=70))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60, help="trainer.max_steps")
    ap.add_argument("--profile", type=int, nargs=2, default=[40, 50], metavar=("START", "STOP"))
    ap.add_argument("--trace", default=None, help="write a Chrome trace here")
    ap.add_argument("overrides", nargs="*", help="nats-train overrides")
    args = ap.parse_args()

    from nats.train import build, compose_config

    cfg = compose_config([*args.overrides, f"trainer.max_steps={args.steps}", f"eval_every={args.steps}",
                          "final_validation=false", "ckpt_path=null", "hydra.run.dir=logs/profile",
                          "paths.output_dir=logs/profile"])
    if cfg.get("float32_matmul_precision"):
        torch.set_float32_matmul_precision(cfg.float32_matmul_precision)
    datamodule, module, trainer = build(cfg)
    prof = ProfileSteps(*args.profile, trace=args.trace)
    trainer.callbacks.append(prof)
    trainer.fit(module, datamodule=datamodule)
    prof.report()


if __name__ == "__main__":
    main()
