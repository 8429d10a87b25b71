"""GPT-2-small training throughput (tokens/s and MFU) on one GPU.

    python benchmarks/bench_train.py                         # dense, micro-batches 16 and 32, compiled
    python benchmarks/bench_train.py --attention nats --batch 16

Measures the same step the Lightning module runs (forward with CE + auxiliary loss, backward, gradient
clipping, fused AdamW, bf16 autocast; with --accum k, k micro-batches per optimizer step) on random tokens,
after warm-up, with CUDA events. MFU uses the
nanoGPT/PaLM count of 6N + 12*L*C*T FLOPs per token and the bf16 dense peak of the GPU (H100 SXM: 989 TFLOP/s).
Writes a markdown table to --out.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from nats.models.gpt import GPT, GPTConfig
from nats_kernels import configure_triton

PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


def peak_flops() -> float:
    if not torch.cuda.is_available():
        return float("nan")
    name = torch.cuda.get_device_name()
    for key, value in PEAK_BF16.items():
        if key in name:
            return value
    return float("nan")


KERNEL_GROUPS = [  # (group, substrings of CUDA kernel names), first match wins
    (
        "attention (nats triton)",
        ["_nats_", "_bwd_dq_kernel", "_bwd_dkdv_kernel", "_type_grad_kernel", "_plan_kernel", "_causal_lse_kernel"],
    ),
    ("nats density (triton)", ["_density_kernel"]),
    ("attention (sdpa)", ["flash", "fmha", "cudnn", "sdpa"]),
    ("matmul", ["gemm", "sm90_xmma", "cutlass", "nvjet", "matmul"]),
    ("inductor fused", ["triton_"]),
    ("optimizer", ["adam", "multi_tensor", "foreach"]),
]


def group_of(kernel: str) -> str:
    low = kernel.lower()
    return next((g for g, keys in KERNEL_GROUPS if any(k.lower() in low for k in keys)), "other")


def profile_table(step, n_steps: int = 3) -> str:
    """CUDA time per kernel group and the top kernels over n_steps steps (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n_steps):
            step()
        torch.cuda.synchronize()
    return kernel_table(prof.key_averages(), n_steps)


def kernel_table(events, n_steps: int, top: int = 60) -> str:
    """Markdown: CUDA time per kernel group and the top kernels, per step, from profiler key averages."""
    cuda = torch.autograd.DeviceType.CUDA  # the kernels themselves, not the CPU ops that launched them
    rows = [
        (e.key, e.self_device_time_total / 1e3 / n_steps, e.count / n_steps)
        for e in events
        if e.device_type == cuda and e.self_device_time_total > 0
    ]
    rows.sort(key=lambda r: -r[1])
    total = sum(r[1] for r in rows)
    groups: dict[str, float] = {}
    for name, ms, _ in rows:
        groups[group_of(name)] = groups.get(group_of(name), 0.0) + ms
    lines = [f"CUDA time per step: {total:.2f} ms", "", "| group | ms/step | share |", "|---|---|---|"]
    lines += [f"| {g} | {ms:.2f} | {100 * ms / total:.1f}% |" for g, ms in sorted(groups.items(), key=lambda x: -x[1])]
    lines += ["", "| kernel | group | ms/step | calls/step |", "|---|---|---|---|"]
    lines += [f"| {name[:100]} | {group_of(name)} | {ms:.3f} | {calls:g} |" for name, ms, calls in rows[:top]]
    return "\n".join(lines)


def bench(
    attention: dict,
    batch: int,
    seq: int,
    steps: int,
    warmup: int,
    compile: bool,
    pos_emb: str = "rope",
    compile_mode: str | None = None,
    clip: bool = True,
    profile: bool = False,
    accum: int = 1,
    fused_ce: bool = False,
    model_cfg: dict | None = None,
    device: str | None = None,
) -> dict:
    """One configuration's isolated step. `model_cfg`: a whole `GPTConfig` as a dict (e.g. an experiment's
    `model` node; then attention, seq, pos_emb and fused_ce are taken from it, block_size = seq).
    `device`: cuda (default when present; bf16 autocast, fused AdamW, CUDA events) or cpu (fp32, wall clock)."""
    torch.manual_seed(0)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device == "cuda"
    if model_cfg is not None:
        config = GPTConfig.from_dict({**model_cfg, "block_size": max(seq, model_cfg.get("block_size", seq))})
        attention, pos_emb = dict(config.attention), config.pos_emb
        fused_ce = config.fused_cross_entropy
    else:
        config = GPTConfig(
            attention=attention,
            block_size=seq,
            pos_emb=pos_emb,  # GPT-2-small defaults
            fused_cross_entropy=fused_ce,
        )
    model = GPT(config).to(device)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=6e-4,
        betas=(0.9, 0.95),
        fused=cuda or None,
    )
    fwd = torch.compile(model, mode=compile_mode) if compile else model
    x = torch.randint(0, min(50257, config.vocab_size), (batch, seq + 1), device=device)
    inp, tgt = x[:, :-1].contiguous(), x[:, 1:].contiguous()

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def step():
        for _ in range(accum):  # gradient accumulation: `accum` micro-batches per optimizer step
            with torch.autocast(device, dtype=torch.bfloat16, enabled=cuda):
                out = fwd(inp, tgt)
                loss = out.loss if out.aux_loss is None else out.loss + out.aux_loss
            (loss / accum).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    t0 = time.time()
    first_s = None
    for i in range(warmup):
        step()
        if i == 0:
            sync()
            first_s = time.time() - t0  # the first step: compilation
    sync()
    compile_s = time.time() - t0
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t1 = time.perf_counter()
    for _ in range(steps):
        loss = step()
    if cuda:
        end.record()
    sync()
    elapsed_ms = start.elapsed_time(end) if cuda else (time.perf_counter() - t1) * 1e3
    ms = elapsed_ms / steps / accum  # per micro-batch
    tokens_per_s = batch * seq / (ms / 1e3)
    mfu = tokens_per_s * model.flops_per_token(seq) / peak_flops()
    prof = profile_table(step) if profile else None
    return dict(
        profile=prof,
        attention=attention["name"]
        + ("" if pos_emb == "rope" else f"/{pos_emb}")
        + (f"/{compile_mode}" if compile_mode else "")
        + ("" if clip else "/noclip")
        + ("/fused-ce" if fused_ce else "")
        + (f"/accum{accum}" if accum > 1 else ""),
        batch=batch,
        seq=seq,
        ms_per_step=ms,
        tokens_per_s=tokens_per_s,
        mfu=mfu,
        loss=float(loss.detach()),
        warmup_s=compile_s,
        first_step_s=first_s,
        max_mem_gb=torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan"),
        params_m=model.num_params() / 1e6,
    )


def main() -> None:
    configure_triton()  # Triton's settings before any kernel: the interpreter without a GPU, the cache folder
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--attention", nargs="+", default=["dense"], help="attention core names")
    ap.add_argument("--nats-lambda", type=float, default=0.0)
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--batch", type=int, nargs="+", default=[16, 32])
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--compile-mode", default=None, help="e.g. max-autotune-no-cudagraphs")
    ap.add_argument("--pos-emb", default="rope", choices=["rope", "learned", "none"])
    ap.add_argument("--no-clip", action="store_true", help="skip gradient clipping (to measure its cost)")
    ap.add_argument(
        "--fused-ce",
        action="store_true",
        help="model.fused_cross_entropy=true (fused lm head + cross-entropy, nats_kernels.cross_entropy)",
    )
    ap.add_argument(
        "--coordinate-descent",
        action="store_true",
        help="inductor coordinate-descent tuning of its generated kernels (longer compile)",
    )
    ap.add_argument(
        "--sdpa",
        default="auto",
        choices=["auto", "cudnn", "flash"],
        help="restrict torch SDPA to one kernel family (dense attention)",
    )
    ap.add_argument(
        "--accum",
        type=int,
        default=1,
        help="micro-batches per optimizer step (the paper setting accumulates to 480 sequences: 15 at "
        "micro-batch 32); ms/step and tokens/s are per micro-batch",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="also profile 3 steps: CUDA time per kernel group and the top kernels (profile_*.md)",
    )
    ap.add_argument("--out", default="experiments/results")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    if args.coordinate_descent:
        import torch._inductor.config as inductor_config

        inductor_config.coordinate_descent_tuning = True
    if args.sdpa == "cudnn":
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        torch.backends.cuda.enable_math_sdp(False)
    elif args.sdpa == "flash":
        torch.backends.cuda.enable_cudnn_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
    rows = []
    for name in args.attention:
        attention = {"name": name}
        if name == "nats":
            attention.update({"window": args.window, "sparsity_lambda": args.nats_lambda})
        for b in args.batch:
            try:
                r = bench(
                    attention,
                    b,
                    args.seq,
                    args.steps,
                    args.warmup,
                    not args.no_compile,
                    args.pos_emb,
                    args.compile_mode,
                    not args.no_clip,
                    args.profile,
                    args.accum,
                    fused_ce=args.fused_ce,
                )
            except Exception as err:  # a compiler failure should not lose the measurement: retry eagerly
                if args.no_compile:
                    raise
                print(f"compiled {name} failed ({type(err).__name__}: {str(err)[:200]}); measuring it eagerly")
                torch._dynamo.reset()
                r = bench(
                    attention,
                    b,
                    args.seq,
                    args.steps,
                    args.warmup,
                    False,
                    args.pos_emb,
                    None,
                    not args.no_clip,
                    args.profile,
                    args.accum,
                    fused_ce=args.fused_ce,
                )
                r["attention"] += "/eager"
            r["attention"] += "" if args.sdpa == "auto" else f"/sdpa-{args.sdpa}"
            rows.append(r)
            prof = r.pop("profile")
            print(json.dumps(r), flush=True)
            if prof:
                Path(args.out).mkdir(parents=True, exist_ok=True)
                tag = r["attention"].replace("/", "_")
                (Path(args.out) / f"profile_{tag}_b{b}.md").write_text(prof + "\n")
                print(prof, flush=True)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    lines = [
        f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, compile={not args.no_compile}",
        "",
        "| attention | micro-batch x seq | ms/step | tokens/s | MFU | peak mem GB |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['attention']} | {r['batch']} x {r['seq']} | {r['ms_per_step']:.1f} | "
            f"{r['tokens_per_s']:,.0f} | {100 * r['mfu']:.1f}% | {r['max_mem_gb']:.1f} |"
        )
    table = "\n".join(lines)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "bench_train.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
