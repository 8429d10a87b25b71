"""nats.cache.roofline: the bytes a decode step reads, counted exactly on tiny models, and what a row's speed makes
of them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nats.cache import roofline


class Tiny(nn.Module):
    def __init__(self, tied: bool):
        super().__init__()
        self.embed = nn.Embedding(10, 4)  # 40 parameters, one row (4) read per sequence
        self.pos = nn.Embedding(6, 4)  # learned positions: one row per sequence too
        self.proj = nn.Linear(4, 4)  # 20
        self.head = nn.Linear(4, 10, bias=False)  # 40, or the embedding table itself
        if tied:
            self.head.weight = self.embed.weight


@pytest.mark.parametrize("tied", [False, True])
def test_weight_bytes_counts_lookups_by_row_and_a_tied_head_once(tied):
    model = Tiny(tied)
    head = 40  # the LM head is read whole, tied or not
    rows = 0 if tied else 4  # an untied embedding: the looked-up rows only
    assert roofline.weight_bytes(model, batch=1) == 4 * (20 + head + rows + 4)
    assert roofline.weight_bytes(model, batch=3) == 4 * (20 + head + 3 * rows + 3 * 4)
    assert roofline.weight_bytes(model.to(torch.bfloat16), batch=1) == 2 * (20 + head + rows + 4)


def test_kv_bytes_step_stats_and_bound():
    assert roofline.kv_bytes(layers=2, rows=3, tokens=5, head_dim=8, elem_size=2) == 2 * 3 * 5 * 2 * 8 * 2
    # Llama-3.1-8B's KV at 32k, batch 1, bf16: 32 layers x 8 KV heads x 32768 x 2 x 128 x 2 bytes = 4 GiB
    assert roofline.kv_bytes(32, 8, 32768, 128, 2) == 4 * 2**30
    s = roofline.step_stats(step_bytes=2e9, tokens_per_s=100.0, batch=4, measured=4e12, datasheet=5e12)
    assert s["step_gb"] == 2.0 and s["achieved_gbps"] == pytest.approx(50.0)  # 2 GB per 40 ms step
    assert s["share_of_measured"] == pytest.approx(0.0125) and s["share_of_datasheet"] == pytest.approx(0.01)
    assert s["limit_tokens_per_s"] == pytest.approx(8000.0)
    none = roofline.step_stats(1e9, 1.0, 1, None, None)
    assert none["share_of_measured"] is None and none["share_of_datasheet"] is None
    assert roofline.limit_ratio(20e9, 16e9) == pytest.approx(1.25)


def test_datasheet_and_measured_bandwidth():
    assert roofline.datasheet_bandwidth("NVIDIA H100 80GB HBM3") == pytest.approx(3.35e12)
    assert roofline.datasheet_bandwidth("NVIDIA H200") == pytest.approx(4.8e12)
    assert roofline.datasheet_bandwidth("NVIDIA H100 PCIe") == pytest.approx(2.0e12)
    assert roofline.datasheet_bandwidth("Some GPU") is None and roofline.datasheet_bandwidth(None) is None
    assert roofline.measured_bandwidth("cpu", nbytes=1 << 20, iters=2) > 0


def test_graph_steps_splits_a_trace_into_replayed_steps():
    """Two graph replays of three kernels each (one overlapping its neighbour), a kernel launched outside a graph:
    the steps, their spans (start to the next step's start), busy time (the union of intervals) and gaps."""

    def kernel(ts, dur, corr, name="k"):
        return {"cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}}

    launch = [{"cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 0, "args": {"correlation": c}} for c in (7, 9)]
    events = [
        *launch,
        kernel(100, 10, 7, "gemv"), kernel(112, 5, 7), kernel(114, 6, 7),  # busy 10 + (120 - 112) = 18
        kernel(150, 10, 9, "gemv"), kernel(160, 10, 9), kernel(175, 5, 9),  # busy 25
        kernel(300, 50, 3, "outside"),  # not replayed: left out
    ]  # fmt: skip
    s = roofline.graph_steps({"traceEvents": events})
    assert s["steps"] == 2 and s["kernels_per_step"] == 3
    assert s["span_us"] == 50  # 100 -> 150
    assert s["busy_us"] == pytest.approx((18 + 25) / 2)
    assert s["idle_us"] == pytest.approx(50 - 21.5) and s["between_us"] == 150 - 120
    assert s["by_kernel"]["gemv"] == 10 and s["launches"]["k"] == 2 and "outside" not in s["by_kernel"]
    assert roofline.graph_steps({"traceEvents": events[2:]}) is None  # no launch: no steps
    line, lines = roofline.steps_report(s, "full L=8")
    assert line.startswith("full L=8: 2 replayed steps, 3 kernels each, 50 us per token, GPU busy 22 us")
    assert lines[1] == line and "| 10.0 | 1 | gemv |" in lines and "| 13.0 | 2 | k |" in lines
