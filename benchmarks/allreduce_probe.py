"""All-reduce bandwidth between the GPUs of one host (what DDP pays per optimizer step), for reading DDP scaling.

    torchrun --nproc_per_node=2 benchmarks/allreduce_probe.py       # prints the topology (rank 0) and GB/s
    torchrun --nproc_per_node=2 benchmarks/allreduce_probe.py --cpu-smoke   # gloo on the CPU, small tensors

Times ``dist.all_reduce`` of a GPT-2-small-sized gradient (124M values) in fp32 and bf16, and of DDP's default
25 MB buckets, after warm-up; reports the algorithm bandwidth (bytes / time) and the bus bandwidth
(x 2 (n-1) / n, the figure nccl-tests print).
"""

import argparse
import os
import subprocess
import time

import torch
import torch.distributed as dist


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu-smoke", action="store_true", help="gloo on the CPU, 1000x smaller tensors: tests the script")
    args = ap.parse_args()
    cuda = not args.cpu_smoke
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = "cuda" if cuda else "cpu"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    if rank == 0 and cuda:
        print(subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True).stdout, flush=True)
    scale = 1 if cuda else 1000
    for dtype, numel in ((torch.float32, 124_000_000), (torch.bfloat16, 124_000_000), (torch.float32, 6_250_000)):
        numel //= scale
        x = torch.ones(numel, device=device, dtype=dtype)
        for _ in range(3):
            dist.all_reduce(x)
        sync()
        reps = 10
        t0 = time.perf_counter()
        for _ in range(reps):
            dist.all_reduce(x)
        sync()
        dt = (time.perf_counter() - t0) / reps
        nbytes = numel * x.element_size()
        if rank == 0:
            algbw = nbytes / dt / 1e9
            print(
                f"all_reduce {nbytes / 1e6:7.1f} MB {str(dtype):15s}: {dt * 1e3:7.2f} ms, algbw {algbw:6.1f} GB/s, "
                f"busbw {algbw * 2 * (world - 1) / world:6.1f} GB/s",
                flush=True,
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
