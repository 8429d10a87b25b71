"""Profile optimizer steps of the real `nats-train` path (Lightning, real data, default callbacks) with
torch.profiler: where the time of a step goes, beside the GPU's busy time.

    python benchmarks/profile_nats_train.py experiment=fig3_nats trainer=gpu compile=true data=pg19_subset
    python benchmarks/profile_nats_train.py --steps 60 --profile 50 55 experiment=fig3_dense ...

Prints, for the profiled steps: wall ms per optimizer step, GPU kernel ms per step (the sum of CUDA kernel time,
i.e. the GPU's busy time), and the top ops by self CUDA time and by self CPU time. A step whose wall time exceeds
its kernel time by much is host-bound or synchronises; `--trace FILE` writes a Chrome trace for a closer look.
"""

from __future__ import annotations

import argparse
import time
import warnings
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback

from nats_kernels import configure_triton


class ProfileSteps(Callback):
    """torch.profiler over optimizer steps [start, stop) of a fit."""

    def __init__(self, start: int, stop: int, trace: str | None = None, sync_debug: bool = False):
        self.start, self.stop, self.trace, self.sync_debug = start, stop, trace, sync_debug
        self.syncs: dict[str, int] = {}
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
            if self.sync_debug and torch.cuda.is_available():
                self._catch_syncs()
            self.t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.prof is not None and self.wall_ms is None and trainer.global_step == self.stop:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.wall_ms = (time.perf_counter() - self.t0) * 1e3
            if self.sync_debug and torch.cuda.is_available():
                torch.cuda.set_sync_debug_mode(0)
                warnings.showwarning = self._old_showwarning
            self.prof.__exit__(None, None, None)
            if self.trace:
                self.prof.export_chrome_trace(self.trace)

    def _catch_syncs(self) -> None:
        """torch.cuda.set_sync_debug_mode("warn"): every host-device synchronisation warns; count them by the
        Python stack that caused them (the last frames outside torch)."""
        import traceback

        warnings.simplefilter("always")
        self._old_showwarning = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if "synchroniz" not in str(message):
                return self._old_showwarning(message, category, filename, lineno, file, line)
            frames = [f for f in traceback.extract_stack()[:-1] if "/torch/" not in f.filename][-6:]
            key = (
                str(message).split("\n")[0][:80]
                + "\n    "
                + "\n    ".join(f"{f.filename.rsplit('/', 2)[-2:]} :{f.lineno} {f.name}" for f in frames)
            )
            self.syncs[key] = self.syncs.get(key, 0) + 1

        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")

    def report(self) -> None:
        if self.prof is None or self.wall_ms is None:
            print("profiler did not run (fewer steps than --profile?)")
            return
        n = self.stop - self.start
        events = self.prof.key_averages()
        kernel_us = sum(
            e.self_device_time_total
            for e in events
            if e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
        )
        print(
            f"profiled steps {self.start}..{self.stop}: wall {self.wall_ms / n:.2f} ms/step, "
            f"GPU kernels {kernel_us / 1e3 / n:.2f} ms/step (busy {kernel_us / 1e3 / self.wall_ms:.1%})"
        )
        if self.sync_debug:
            print(f"\n## host-device synchronisations in steps {self.start}..{self.stop} (count: where)")
            for key, count in sorted(self.syncs.items(), key=lambda kv: -kv[1]):
                print(f"{count:5d}  {key}")
        import sys

        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from bench_train import kernel_table

        print(f"\n## GPU kernels by group, per optimizer step (steps {self.start}..{self.stop})\n")
        print(kernel_table(events, n, top=40))
        print(f"\n## GPU idle gaps per optimizer step (steps {self.start}..{self.stop}), by the kernel after the gap\n")
        print(idle_table(self.prof.events(), n))
        for key, title in (("self_cuda_time_total", "self CUDA"), ("self_cpu_time_total", "self CPU")):
            print(f"\n## top ops by {title} time (totals over {n} steps)")
            print(events.table(sort_by=key, row_limit=25, max_name_column_width=70))


def idle_table(events, n_steps: int, min_gap_us: float = 5.0, top: int = 25) -> str:
    """Markdown: the GPU's idle time between consecutive kernels (gaps >= min_gap_us), per optimizer step, summed
    by the name of the kernel that ends each gap: where the GPU waits for the host (launch overhead, Python,
    synchronisations) rather than computing."""
    cuda = torch.autograd.DeviceType.CUDA
    # a kernel's id is its CUDA correlation id, shared with the runtime call (cudaLaunchKernel, cudaMemcpyAsync...)
    # on the host that issued it; that call's cpu_parent chain is the op that launched it and its callers
    runtime = {e.id: e for e in events if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith("cu")}
    ks = sorted(
        (e.time_range.start, e.time_range.end, e.name, e.id)
        for e in events
        if e.device_type == cuda
        and not getattr(e, "is_user_annotation", False)
        and e.time_range.end > e.time_range.start
    )
    if not ks:
        return "(no GPU kernels)"
    by_next: dict[str, list[float]] = {}
    by_host: dict[str, list[float]] = {}  # the host op (and its callers) that launched the kernel after a gap
    busy_end = ks[0][1]
    idle = 0.0
    for start, end, name, corr in ks[1:]:
        gap = start - busy_end
        if gap >= min_gap_us:
            idle += gap
            acc = by_next.setdefault(name, [0.0, 0])
            acc[0] += gap
            acc[1] += 1
            chain, op = [], runtime.get(corr)
            while op is not None and len(chain) < 6:
                chain.append(op.name[:40])
                op = op.cpu_parent
            acc = by_host.setdefault(" < ".join(chain) or "?", [0.0, 0])
            acc[0] += gap
            acc[1] += 1
        busy_end = max(busy_end, end)
    span = busy_end - ks[0][0]
    lines = [
        f"kernel span {span / 1e3 / n_steps:.2f} ms/step, idle in gaps >= {min_gap_us:g} us: "
        f"{idle / 1e3 / n_steps:.2f} ms/step ({idle / span:.1%})",
        "",
        "| kernel after the gap | idle ms/step | gaps/step |",
        "|---|---|---|",
    ]
    for name, (us, cnt) in sorted(by_next.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"| {name[:100]} | {us / 1e3 / n_steps:.3f} | {cnt / n_steps:g} |")
    lines += ["", "| host op that launched it < its callers | idle ms/step | gaps/step |", "|---|---|---|"]
    for name, (us, cnt) in sorted(by_host.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"| {name} | {us / 1e3 / n_steps:.3f} | {cnt / n_steps:g} |")
    return "\n".join(lines)


def main() -> None:
    configure_triton()  # Triton's settings before any kernel: the interpreter without a GPU, the cache folder
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60, help="trainer.max_steps")
    ap.add_argument("--profile", type=int, nargs=2, default=[40, 50], metavar=("START", "STOP"))
    ap.add_argument("--trace", default=None, help="write a Chrome trace here")
    ap.add_argument(
        "--sync-debug",
        action="store_true",
        help="count host-device synchronisations by their Python call site (torch sync debug mode)",
    )
    ap.add_argument("overrides", nargs="*", help="nats-train overrides")
    args = ap.parse_args()

    from nats.train import build, compose_config

    cfg = compose_config(
        [
            *args.overrides,
            f"trainer.max_steps={args.steps}",
            f"eval_every={args.steps}",
            "final_validation=false",
            "ckpt_path=null",
            "hydra.run.dir=logs/profile",
            "paths.output_dir=logs/profile",
        ]
    )
    if cfg.get("float32_matmul_precision"):
        torch.set_float32_matmul_precision(cfg.float32_matmul_precision)
    datamodule, module, trainer = build(cfg)
    prof = ProfileSteps(*args.profile, trace=args.trace, sync_debug=args.sync_debug)
    trainer.callbacks.append(prof)
    trainer.fit(module, datamodule=datamodule)
    prof.report()


if __name__ == "__main__":
    main()
