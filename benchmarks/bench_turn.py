"""The cost of a conversation's next turn through an evicting cache: NAtS' `nats.hf.StaticPolicyCache` that holds the
conversation continues it, against re-prefilling the whole conversation with a fresh cache (full and NAtS).

    python benchmarks/bench_turn.py                              # Llama-3.1-8B's shape: 32k history, turn 512, 128 new
    python benchmarks/bench_turn.py --history 8192 --batch 1 --rows nats_continued full_reprefilled
    python benchmarks/bench_turn.py --smoke                      # a tiny model on the CPU, eager, seconds

A conversation per sequence of the batch: a history of ``--history`` random tokens, its answer (one greedy token),
then the user's turn of ``--turn`` random tokens, after which ``--new`` tokens are decoded greedily through
nats-generate's loop (`nats.hf.loop.generate`: the prefill eager, each decode step compiled and replayed as a CUDA
graph). Rows, per batch size of ``--batch`` (``--rows`` narrows them):

* ``nats, continued``: a NAtS cache (``max_new_tokens=--new``) that holds the history already (the loop over the
  history with one new token, untimed) takes the conversation (history, answer, turn): the loop prefills only the
  tokens after those the cache holds (the answer's token, which no forward has fed yet, and the turn: ``--turn`` + 1)
  onto what it kept (`nats.hf.StaticPolicyCache.check_history`); each layer's pool grows once for them and the new
  tokens (``reallocations``);
* ``nats, re-prefilled``: a fresh NAtS cache over the whole conversation at once;
* ``full, re-prefilled``: a fresh full cache (``StaticPolicyCache(model, "full")``) over the same, what a cache
  that cannot continue costs;
* ``full, continued``: the full cache continued as NAtS' is (the same short prefill; its decode reads every token).

Per row, the median of ``--repeats`` timed turns, each with its own cache (a continued row's history is rebuilt,
untimed, before each): the time to the first token (from the call until the prefill's forward and the first token's
choice are done: the device synchronised in the loop's ``on_prefill``, `bench_hf_decode.timed_request`), decode
tokens/s over the batch (the tokens after the first / the time from the first token to the end, synchronised), the
tokens the prefill fed (measured: the width of the model's first forward in the call), the tokens the cache holds
at the end over those seen, the pools' reallocations, the bytes a decode step reads and their share of the bandwidth
measured in the run (`nats.cache.roofline`, as `bench_hf_decode.py`), and the time to the first token of ``full,
re-prefilled`` over the row's (how much sooner the turn answers).

The model is `bench_hf_decode.py`'s (``--model-shape``, random weights in ``--dtype``, built on the GPU; q/k/v and
gate/up fused, `nats.hf.fused`, as its rows of the project's caches), NAtS' scorers attached with window
``--window`` and their global-type offsets calibrated on the history so that a share ``--kept`` of its tokens is kept
(`bench_hf_decode.calibrate`: random scorers keep about that share). Warm-up: before its timed turns each row runs
one untimed turn of its own kind, at the batch size, of a history of ``--warmup-history`` tokens (default: the
history itself, a discarded first turn: the decode step compiled, the Triton kernels compiled for every size they
specialise on); ``new graphs`` counts the graphs dynamo compiled during the timed turns (0: the warm-up covered
them). A fresh cache's buffers, and a continued cache's pools after their growth, lie at new addresses, so on a
GPU a timed turn records its decode step's CUDA graph again, inside its decode time, in every row alike (``CUDA
graphs recorded / turn``; `bench_hf_decode.py` decodes from fixed buffers for the steady decode speed). A row too
large for the GPU is recorded as failed and the others go on; the tables are written after every row (a run stopped
part way keeps what it measured). Writes ``bench_turn.md`` and ``bench_turn.json`` into ``--out`` (default: the
environment variable OUT, else benchmarks/results) and prints the table last.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_hf_decode as hf  # noqa: E402  (benchmarks/bench_hf_decode.py: the model, calibration, caches, timing)

from nats_kernels import configure_triton  # noqa: E402

# --rows' keys: (the row's label, the policy, whether the cache continues the conversation)
ROWS = {
    "nats_continued": ("nats, continued", "nats", True),
    "nats_reprefilled": ("nats, re-prefilled", "nats", False),
    "full_reprefilled": ("full, re-prefilled", "full", False),
    "full_continued": ("full, continued", "full", True),
}
BASELINE = "full, re-prefilled"  # the TTFT ratio is to this row of the same batch


def say(msg: str) -> None:
    print(f"bench_turn: {msg}", file=sys.stderr, flush=True)


def first_width(model) -> list[int]:
    """A list that gets the token count of the model's next forward (a pre-hook on the embeddings that removes itself
    there: the prefill is eager, and the compiled decode steps never see the hook)."""
    widths: list[int] = []

    def hook(_module, args):
        widths.append(args[0].shape[1])
        handle.remove()

    handle = model.get_input_embeddings().register_forward_pre_hook(hook)
    return widths


def one_turn(model, policy: str, continued: bool, history, answer, turn, args, device):
    """One timed turn of `policy`'s cache over the conversation (history, answer, turn): a continued cache is given the
    history first (untimed; its own greedy answer then replaces `answer`). Returns (the measurements, the answer)."""
    from nats.hf.loop import compiled_graphs, cudagraph_recordings
    from nats.hf.loop import generate as loop

    B, H = history.shape
    make = hf.cache_maker(model, policy, H + 1 + turn.shape[1], args.new, None, B)
    held = None
    if continued:
        held = make()
        answer = loop(model, history, held, 1)[:, H:]
        make = lambda: held  # noqa: E731
    conv = torch.cat([history, answer, turn], dim=1)
    widths = first_width(model)
    g0, r0 = compiled_graphs(), cudagraph_recordings()
    ttft, decode_s, out, cache = hf.timed_request(model, conv, make, args.new, policy, device)
    seen = int(cache.get_seq_length())  # tokens per row the cache has seen: the conversation + new - 1
    tokens_per_s = B * (args.new - 1) / decode_s
    result = {
        "ttft_s": ttft,
        "decode_s": decode_s,
        "tokens_per_s": tokens_per_s,
        "conversation": conv.shape[1],
        "prefilled": widths[0] if widths else None,
        "seen": seen,
        "generated": out.shape[1] - conv.shape[1],
        "kept_share": float(cache.kept().double().mean()) / seen,
        "reallocations": cache.reallocations(),
        "kv_mib": hf.kv_bytes(cache) / 2**20,
        "new_graphs": compiled_graphs() - g0,
        "cudagraphs_recorded": cudagraph_recordings() - r0,
        "step_bytes": hf.step_bytes(model, cache, B, seen),  # (this cache's step, a full cache's)
    }
    del out, cache, make
    held = None  # the lambda's cell: the history cache freed here
    gc.collect()  # the turn's cache freed before the next is made (at 8B, batch 8 x 32k: 32 GiB for the full cache)
    return result, answer


def measure_row(model, key: str, history, answer, turn, args, device) -> tuple[dict, torch.Tensor]:
    """A row: a warm-up turn (untimed) and `--repeats` timed ones, their medians. Returns (the row, the answer the
    history got: a continued row's own, else `answer`)."""
    from nats.cache import roofline

    label, policy, continued = ROWS[key]
    B = history.shape[0]
    warm = args.warmup_history or history.shape[1]
    say(f"batch {B}, {label}: warm-up turn (history {warm})")
    one_turn(model, policy, continued, history[:, :warm], answer, turn, args, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    runs = []
    for i in range(args.repeats):
        r, answer = one_turn(model, policy, continued, history, answer, turn, args, device)
        runs.append(r)
        say(f"batch {B}, {label}: turn {i + 1}/{args.repeats}: first token {r['ttft_s'] * 1e3:.1f} ms, "
            f"{r['tokens_per_s']:.1f} tokens/s, {r['prefilled']} tokens prefilled")  # fmt: skip
    last = runs[-1]
    med = {k: statistics.median(r[k] for r in runs) for k in ("ttft_s", "decode_s")}
    tokens_per_s = B * (args.new - 1) / med["decode_s"]
    nbytes, full = last.pop("step_bytes")  # the same bytes in each turn (the same kept tokens)
    bw = args.bandwidth
    row = {
        **last,  # the counts of the last turn, the same in each
        "row": label,
        "key": key,
        "policy": policy,
        "continued": continued,
        "batch": B,
        "history": history.shape[1],
        "turn": turn.shape[1],
        "new_tokens": args.new,
        "kept_target": args.kept if policy == "nats" else None,
        **med,
        "tokens_per_s": tokens_per_s,
        "ttft_s_runs": [r["ttft_s"] for r in runs],
        "tokens_per_s_runs": [r["tokens_per_s"] for r in runs],
        "new_graphs": sum(r["new_graphs"] for r in runs),
        "cudagraphs_recorded": sum(r["cudagraphs_recorded"] for r in runs) / len(runs),
        "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
        # the decode step against the bandwidth limit (nats.cache.roofline, as bench_hf_decode.limit_columns)
        **roofline.step_stats(nbytes, tokens_per_s, B, bw["measured"], bw["datasheet"]),
        "limit_x_full": roofline.limit_ratio(full, nbytes),
    }
    return row, answer


def ratios(rows: list[dict]) -> None:
    """Each row's ``ttft_x``: the TTFT of ``full, re-prefilled`` of its batch over its own (how much sooner it
    answers)."""
    base = {r["batch"]: r for r in rows if r["row"] == BASELINE and "failed" not in r}
    for r in rows:
        b = base.get(r["batch"])
        r["ttft_x"] = None if b is None or "failed" in r else b["ttft_s"] / r["ttft_s"]


def answer_line(rows: list[dict]) -> str:
    """The opening line: the continued NAtS turn's first token against re-prefilling the conversation, per batch."""
    parts = []
    by = {(r["batch"], r["row"]): r for r in rows if "failed" not in r}
    for B in sorted({r["batch"] for r in rows}):
        cont, full, nats = (by.get((B, k)) for k in ("nats, continued", BASELINE, "nats, re-prefilled"))
        if cont is None or (full is None and nats is None):
            continue
        against = [f"{r['ttft_s'] * 1e3:.1f} ms with {'the full cache' if r is full else 'NAtS'} "
                   f"({r['ttft_s'] / cont['ttft_s']:.1f}x)" for r in (full, nats) if r is not None]  # fmt: skip
        parts.append(
            f"batch {B}: {cont['ttft_s'] * 1e3:.1f} ms ({cont['prefilled']} of {cont['conversation']} tokens "
            f"prefilled), re-prefilling the conversation " + " and ".join(against)
        )
    if not parts:
        return "No continued NAtS turn was measured beside a re-prefilled one."
    return "The next turn's first token through the NAtS cache that holds the conversation: " + "; ".join(parts) + "."


def fmt(x, spec: str) -> str:
    return "" if x is None else format(x, spec)


def table(rows: list[dict]) -> list[str]:
    lines = [
        "| batch | row | conversation | prefilled | TTFT ms | full re-prefilled / this TTFT | decode tokens/s | "
        "step GB | of measured BW | kept / seen | KV MiB | reallocations | new graphs | CUDA graphs recorded / turn |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "failed" in r:
            lines.append(f"| {r['batch']} | {r['row']} | {r['failed']} |" + "|" * 11)
            continue
        lines.append(
            f"| {r['batch']} | {r['row']} | {r['conversation']} | {r['prefilled']} | {r['ttft_s'] * 1e3:.1f} | "
            f"{fmt(r.get('ttft_x'), '.1f')} | {r['tokens_per_s']:.1f} | {r['step_gb']:.4g} | "
            f"{fmt(r.get('share_of_measured'), '.1%')} | {r['kept_share']:.3f} | {r['kv_mib']:.1f} | "
            f"{r['reallocations']} | {r['new_graphs']} | {r['cudagraphs_recorded']:g} |"
        )
    return lines


def write(rows: list[dict], args, argv, device, dtype, final: bool = False) -> None:
    """The table (markdown) and the rows (JSON) into ``args.out``, after every row; the final call prints the table."""
    import transformers

    ratios(rows)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.processor() or 'x86_64'})"
    shape = "a tiny Llama's (bench_hf_decode's smoke model)" if args.smoke else f"{args.model_shape}'s"
    command = "python benchmarks/bench_turn.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    bw = args.bandwidth
    warm = f"a history of {args.warmup_history}" if args.warmup_history else "the same history (a discarded turn)"
    text = (
        "# The next turn of a conversation: continued through NAtS' cache against re-prefilled\n\n"
        f"{answer_line(rows)}\n\n"
        f"{name}, torch {torch.__version__}, transformers {transformers.__version__}, {dtype}, "
        f"{time.strftime('%Y-%m-%d %H:%M')}; {shape} shape, random weights; a history of {args.history} random tokens, "
        f"its answer (one greedy token), a turn of {args.turn} random tokens, {args.new} new tokens (greedy, "
        f"nats.hf.loop); NAtS: W = {args.window}, scorers calibrated to keep {args.kept} of the history's tokens; "
        f"q/k/v and gate/up fused (nats.hf.fused). Median of {args.repeats} timed turns per row, each with its own "
        f"cache, after one untimed turn of the row's kind on {warm}. Bandwidth: {bw['measured'] / 1e9:.0f} GB/s "
        f"measured (a device-to-device copy).\n"
        f"Command: `{command}`\n\n"
        "TTFT: from the generate call to the first token (the prefill's forward and the first token's choice done, "
        "synchronised); prefilled: the tokens the call's prefill fed; full re-prefilled / this TTFT: how much sooner "
        "the row answers than re-prefilling with the full cache; decode tokens/s: the batch's tokens after the first "
        "over the time after the first token (in which, on a GPU, a turn records its decode step's CUDA graph again: "
        "a new cache's buffers, or a continued cache's pools after their growth, lie at new addresses; CUDA graphs "
        "recorded / turn counts it); step GB: the bytes "
        "a decode step reads at the end (weights + the keys and values held); kept / seen: the tokens each row holds "
        "at the end over those it saw; reallocations: the pools laid out again (a continued cache grows once per "
        "layer for the turn and the new tokens); new graphs: graphs compiled during the timed turns.\n\n"
    )
    text += "\n".join(table(rows)) + "\n"
    failed = [f"batch {r['batch']}, {r['row']}: {r['failed']}" for r in rows if "failed" in r]
    if failed:
        text += "\nNot measured: " + "; ".join(failed) + ".\n"
    if not final:
        text += "\n(incomplete: the run is still going, or was stopped)\n"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_turn.md").write_text(text)
    record = {"args": vars(args), "device": name, "torch": torch.__version__, "command": command,
              "complete": final, "rows": rows}  # fmt: skip
    (out / "bench_turn.json").write_text(json.dumps(record, indent=1, default=str))
    if final:
        print(text)


def main(argv: list[str] | None = None) -> int:
    configure_triton()  # Triton's settings before any kernel: the interpreter without a GPU, the cache folder
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--model-shape", choices=sorted(hf.SHAPES), default="llama-3.1-8b", help="the random model's shape")
    ap.add_argument("--history", type=int, default=32768, help="tokens of the conversation before the turn")
    ap.add_argument("--turn", type=int, default=512, help="tokens of the user's new turn")
    ap.add_argument("--new", "--new-tokens", dest="new", type=int, default=128, help="tokens decoded after the turn")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS), help="the rows, in this order")
    ap.add_argument("--kept", type=float, default=0.25, help="NAtS' kept share (the scorers calibrated to it)")
    ap.add_argument("--window", type=int, default=64, help="NAtS' sliding window W")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=2, help="timed turns per row; the median is reported")
    ap.add_argument(
        "--warmup-history",
        type=int,
        default=None,
        help="history tokens of each row's untimed warm-up turn (default: the history's: a discarded turn at full "
        "size; shorter is cheaper, but a Triton kernel specialised on a size may then compile in a timed turn)",
    )
    ap.add_argument("--smoke", action="store_true", help="a tiny model on the CPU, eager: tests the script")
    args = ap.parse_args(argv)
    if args.smoke:
        args.history, args.turn, args.new, args.batch, args.window = 64, 8, 4, [1, 2], 8
    if args.new < 2:
        ap.error("--new must be at least 2 (a decode step after the first token)")
    threads = torch.get_num_threads()
    if args.smoke:  # a tiny model's ops gain nothing from threads, and OpenMP's spinning slows them on shared cores
        torch.set_num_threads(1)
    try:
        return measure(args, argv)
    finally:
        torch.set_num_threads(threads)


def measure(args, argv) -> int:
    """Every row of every batch size, the tables written after each (main)."""
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = getattr(torch, "float32" if device.type == "cpu" else args.dtype)
    torch._dynamo.config.cache_size_limit = 64  # as bench_hf_decode: a limit hit would decode eagerly, unseen
    args.bandwidth = hf.bandwidth(device)
    from nats.hf import attach_nats
    from nats.hf.loop import cudagraph_recordings

    cudagraph_recordings()  # its counter registered now: the turns count their recordings from 0
    conversation = args.history + 1 + args.turn
    # bench_hf_decode's model (RoPE's context raised to the conversation + the new tokens)
    spec = argparse.Namespace(model=None, smoke=args.smoke, model_shape=args.model_shape, prompt=[conversation],
                              new=args.new)  # fmt: skip
    say(f"building {'the tiny model' if args.smoke else args.model_shape} on {device}")
    model = hf.build_model(spec, device, dtype)
    attach_nats(model, window=args.window)
    model.eval()
    gen = torch.Generator().manual_seed(0)
    vocab, top = model.config.vocab_size, max(args.batch)
    history = torch.randint(0, vocab, (top, args.history), generator=gen).to(device)
    turn = torch.randint(0, vocab, (top, args.turn), generator=gen).to(device)
    stand_in = torch.randint(0, vocab, (top, 1), generator=gen).to(device)  # the answer where no continued row ran
    say(f"calibrating the scorers to keep {args.kept} of the history")
    hf.calibrate(model, history, args.kept)
    hf.projections(model, "nats", args)  # fused, as bench_hf_decode's rows of the project's caches
    rows: list[dict] = []
    for B in args.batch:
        answer = stand_in[:B]  # a continued row's own answer, once one ran: the re-prefilled rows take it
        for key in args.rows:
            try:
                row, answer = measure_row(model, key, history[:B], answer, turn[:B], args, device)
            except torch.OutOfMemoryError:  # a row too large for the GPU: said in the table, the others go on
                say(f"batch {B}, {ROWS[key][0]}: out of GPU memory, no row")
                row = {"row": ROWS[key][0], "key": key, "batch": B, "failed": "out of GPU memory"}
                gc.collect()
                torch.cuda.empty_cache()
            rows.append(row)
            write(rows, args, argv, device, dtype)
    write(rows, args, argv, device, dtype, final=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
