"""Triton decode attention over a KV pool with per-row segments and an optional ring (flash-decoding): a split kernel
and the merge of its partials (`triton_pool_attention`). The exact PyTorch reference is ``decode_reference.py`` beside
it (``torch_pool_attention``); ``nats.cache.attention.pool_attention`` picks one of the two (tests/test_cache.py
compares them). NAtS' decode step (``nats_step.py``) launches the same split kernel (`launch_split`) and a merge of
its own that also admits the new token.

Each program takes the G query heads of one KV row r (GQA: the heads sharing that KV head) over a share of the
row's segment ``[start[r], start[r] + length[r])``. Three splits of the keys over the programs:

* ``"stream"`` (rows of uneven lengths, NAtS' heads keeping different shares; stream-K, as FlashInfer's planner
  balances its decode): the rows' blocks of BLOCK_N keys laid end to end, and a fixed grid of P programs (one wave:
  the SMs times the programs that fit one, `stream_programs`), program p taking blocks ``[p U / P, (p + 1) U / P)``
  of the U in all, across row boundaries. Every program reads as many blocks (to one) and the wave ends at once.
* ``"balanced"``: chunks of one size for all rows (their mean length over SPLITS, rounded up to BLOCK_N), a
  program per chunk, grid ``(R * (SPLITS + 1),)``; each program finds its chunk from the lengths.
* ``"rows"``: grid ``(R, SPLITS)``, SPLITS equal chunks of each row (rows of one length: the full cache).

``start``/``length`` are read on the device (each program finds its row and share from the lengths), so launches
need no host synchronisation and can be captured in CUDA graphs. Each key and value block is read once for the
whole group: scores ``[G, BLOCK_N]`` and the weighted values are two small ``tl.dot`` (the G heads padded to 16
rows). A row's first share also takes the ring slots (NAtS' sliding tokens) whose valid flag is set. Each program
keeps an online softmax per head (max, sum, weighted V) in float32 and writes it to a partial buffer; a second
kernel merges the partials of every (r, g).

Without a CUDA GPU the kernels run in Triton's CPU interpreter (chosen in one place for every kernel, before
triton is imported: ``_env.py``): slow, for tests only.
"""

from __future__ import annotations

import functools
import math
import os

import torch

# chooses Triton's CPU interpreter when there is no GPU (before any @triton.jit runs)
from nats_kernels.nats_attention._env import INTERPRET, tl, triton

# Programmatic dependent launch (Hopper and later): the decode step's kernels (the attention and its merge) are launched
# while the kernel before them finishes, and wait for it (``griddepcontrol.wait``) before they read anything it writes
# (NAtS' merge reads the new token, written before the attention, first: ``nats_step.py``); the attention lets the merge
# launch at once (``griddepcontrol.launch_dependents``). It hides a launch's latency between the kernels of a CUDA
# graph, which pays for few rows and not for many (H200, docs/results/bench_limit_h200.md: Llama-3.2-1B's shape at 32k
# and batch 1, NAtS 761.7 tokens/s with it, 720.4 without; Llama-3.1-8B's at 32k and batch 8, 1106.2 with it, 1153.1
# without), so the launches use it up to PDL_ROWS KV rows (batch x KV heads). NATS_KERNELS_PDL=0 (read at import)
# launches them plainly, e.g. to time both.
PDL = os.environ.get("NATS_KERNELS_PDL", "1") != "0"
PDL_ROWS = 16

BLOCK_N = 64
MAX_SPLITS = 64  # SPLITS is a runtime argument (no recompilation per split count); the combine reads up to 64
ROW_BLOCK = 128  # rows the balanced split reads at a time to find a program's chunk (fixed: no compile per batch)


@triton.jit
def _attend_block(acc, m_i, l_i, q, KB, VB, rows, ok, offs_d, dmask, D, qk_scale, IEEE: tl.constexpr):
    """Online-softmax update of the G query heads ``q [BLOCK_G, BLOCK_D]`` of one KV row (natural base; m_i may
    still be -inf) with the K/V rows ``rows`` where ``ok``: each key and value is read once for the whole group."""
    kv_mask = ok[:, None] & dmask[None, :]
    k = tl.load(KB + rows[:, None] * D + offs_d[None, :], mask=kv_mask, other=0.0)
    if IEEE:
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee") * qk_scale  # [BLOCK_G, BLOCK_N], float32
    else:
        s = tl.dot(q, tl.trans(k)) * qk_scale
    s = tl.where(ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])
    v = tl.load(VB + rows[:, None] * D + offs_d[None, :], mask=kv_mask, other=0.0)
    if IEEE:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    acc = acc * alpha[:, None] + pv
    l_i = l_i * alpha + tl.sum(p, axis=1)
    return acc, m_new, l_i


@triton.jit
def _row_query(Q, heads, gmask, offs_d, dmask, D: tl.constexpr, IEEE: tl.constexpr):
    """The query heads ``heads`` (those of one KV row), ``[BLOCK_G, BLOCK_D]``: rows beyond G zero, float32 under
    IEEE."""
    q = tl.load(Q + heads[:, None] * D + offs_d[None, :], mask=gmask[:, None] & dmask[None, :], other=0.0)
    if IEEE:
        q = q.to(tl.float32)
    return q


@triton.jit
def _attend_keys(
    acc, m_i, l_i, q, KP, VP, start, lo, hi, offs_d, dmask, D, qk_scale, IEEE: tl.constexpr, BLOCK_N: tl.constexpr
):
    """`_attend_block` over the keys ``[lo, hi)`` of the segment that starts at pool row ``start``, BLOCK_N at a
    time."""
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        ok = offs_n < hi
        rows = start + offs_n.to(tl.int64)
        acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, KP, VP, rows, ok, offs_d, dmask, D, qk_scale, IEEE)
    return acc, m_i, l_i


@triton.jit
def _store_partial(M_OUT, L_OUT, ACC_OUT, out, m_i, l_i, acc, gmask, offs_d, dmask, D: tl.constexpr):
    """One program's online softmax of G heads (max, sum, weighted V) into the partial slots ``out``."""
    tl.store(M_OUT + out, m_i, mask=gmask)
    tl.store(L_OUT + out, l_i, mask=gmask)
    tl.store(ACC_OUT + out[:, None] * D + offs_d[None, :], acc, mask=gmask[:, None] & dmask[None, :])


@triton.jit
def _pool_decode_kernel(
    Q,
    KP,
    VP,
    START,
    LEN,
    RK,
    RV,
    RVALID,
    M_OUT,
    L_OUT,
    ACC_OUT,
    qk_scale,
    SPLITS,
    G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_RING: tl.constexpr,
    W: tl.constexpr,
    BLOCK_W: tl.constexpr,
    IEEE: tl.constexpr,
    R,
    BALANCED: tl.constexpr,
    BLOCK_R: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:  # the kernels before (the step's projections) have finished; the merge may launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if BALANCED:  # grid (R * (SPLITS + 1),): chunks of one size over all rows, program p the p-th chunk
        p = tl.program_id(0)
        # the grid's last programs may have no chunk (n_r = 0): no keys, no ring; their partials go to slots no
        # row's merge reads
        r, split, n_r, per = _balanced_chunk(LEN, R, p, SPLITS, BLOCK_N, BLOCK_R)
        out = p * G  # partial results in chunk order, G heads each
    else:  # grid (R, SPLITS): row r's segment in SPLITS equal chunks
        r = tl.program_id(0)
        split = tl.program_id(1)
        n_r = SPLITS
    offs_g = tl.arange(0, BLOCK_G)
    gmask = offs_g < G
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    heads = r * G + offs_g  # the query heads of KV row r
    q = _row_query(Q, heads, gmask, offs_d, dmask, D, IEEE)
    start = tl.load(START + r).to(tl.int64)  # pool offsets in int64; positions inside a segment in int32
    length = tl.load(LEN + r).to(tl.int32)
    if not BALANCED:
        per = tl.cdiv(tl.cdiv(length, SPLITS), BLOCK_N) * BLOCK_N
        out = heads * SPLITS + split
    lo = split * per
    hi = tl.where(split < n_r, tl.minimum(lo + per, length), lo)

    m_i = tl.zeros([BLOCK_G], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    acc, m_i, l_i = _attend_keys(acc, m_i, l_i, q, KP, VP, start, lo, hi, offs_d, dmask, D, qk_scale, IEEE, BLOCK_N)
    if HAS_RING:
        if (split == 0) & (n_r > 0):
            offs_w = tl.arange(0, BLOCK_W)
            okw = offs_w < W
            valid = tl.load(RVALID + r * W + offs_w, mask=okw, other=0) != 0
            rrows = r.to(tl.int64) * W + offs_w
            acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, RK, RV, rrows, valid, offs_d, dmask, D, qk_scale, IEEE)
    if BALANCED:
        out = out + offs_g
    _store_partial(M_OUT, L_OUT, ACC_OUT, out, m_i, l_i, acc, gmask, offs_d, dmask, D)


@triton.jit
def _balanced_chunk(LEN, R, p, SPLITS, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    """The work-balanced split of R rows (lengths ``LEN``, read on the device) into chunks of one size ``per``
    (`_chunk_size`). Row i takes ``n_i = max(1, ceil(LEN[i] / per))`` chunks (at least one: its ring), in row order;
    their sum is at most R * (SPLITS + 1). Chunk p is row r's split-th: returns (r, split, n_r, per); past the last
    chunk r = R - 1 and n_r = 0. The rows are read BLOCK_R at a time (a fixed block: one compiled kernel for every
    batch size)."""
    per = _chunk_size(LEN, R, SPLITS, BLOCK_N, BLOCK_R)
    before = tl.zeros([], dtype=tl.int32)  # rows whose chunks end at or before p
    first = tl.zeros([], dtype=tl.int32)  # their chunks
    n_r = tl.zeros([], dtype=tl.int32)  # the chunks of the row chunk p belongs to
    carry = tl.zeros([], dtype=tl.int32)
    for r0 in range(0, R, BLOCK_R):
        offs, ok, n = _block_chunks(LEN, R, r0, per, BLOCK_R)
        ends = carry + tl.cumsum(n, axis=0)  # row i's chunks end at ends[i]
        done = ok & (ends <= p)
        before += tl.sum(done.to(tl.int32), axis=0)
        first += tl.sum(tl.where(done, n, 0), axis=0)
        n_r += tl.sum(tl.where(ok & (ends > p) & (ends - n <= p), n, 0), axis=0)
        carry += tl.sum(n, axis=0)
    return tl.minimum(before, R - 1), p - first, n_r, per


@triton.jit
def _block_chunks(LEN, R, r0, per, BLOCK_R: tl.constexpr):
    """Rows r0 .. r0 + BLOCK_R of the balanced split: (their indices, which exist, their chunks
    ``max(1, ceil(LEN / per))``, 0 past R)."""
    offs = r0 + tl.arange(0, BLOCK_R)
    ok = offs < R
    return offs, ok, tl.where(ok, tl.maximum(tl.cdiv(tl.load(LEN + offs, mask=ok, other=0).to(tl.int32), per), 1), 0)


@triton.jit
def _chunk_size(LEN, R, SPLITS, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    """The balanced split's chunk: the rows' mean length over SPLITS, rounded up to BLOCK_N (at least BLOCK_N)."""
    total = tl.zeros([], dtype=tl.int32)
    for r0 in range(0, R, BLOCK_R):
        offs = r0 + tl.arange(0, BLOCK_R)
        total += tl.sum(tl.load(LEN + offs, mask=offs < R, other=0).to(tl.int32), axis=0)
    return tl.maximum(tl.cdiv(tl.cdiv(total, R * SPLITS), BLOCK_N), 1) * BLOCK_N


@triton.jit
def _row_chunks(LEN, R, r, per, BLOCK_R: tl.constexpr):
    """(the chunks of the rows before row r, row r's chunks) of the balanced split (`_balanced_chunk`)."""
    first = tl.zeros([], dtype=tl.int32)
    n_r = tl.zeros([], dtype=tl.int32)
    for r0 in range(0, R, BLOCK_R):
        offs, _, n = _block_chunks(LEN, R, r0, per, BLOCK_R)
        first += tl.sum(tl.where(offs < r, n, 0), axis=0)
        n_r += tl.sum(tl.where(offs == r, n, 0), axis=0)
    return first, n_r


@triton.jit
def _row_units(LEN, offs, ok, BLOCK_N: tl.constexpr, RING_UNITS: tl.constexpr):
    """The work units (blocks of BLOCK_N keys) of the rows ``offs`` where ``ok`` in the streamed split: the ring's
    RING_UNITS blocks then the segment's, at least one unit per row (0 past the rows)."""
    n = tl.load(LEN + offs, mask=ok, other=0).to(tl.int32)
    return tl.where(ok, tl.maximum(tl.cdiv(n, BLOCK_N) + RING_UNITS, 1), 0)


@triton.jit
def _stream_decode_kernel(
    Q,
    KP,
    VP,
    START,
    LEN,
    RK,
    RV,
    RVALID,
    M_OUT,
    L_OUT,
    ACC_OUT,
    FIRST,
    LAST,
    qk_scale,
    R,
    G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_RING: tl.constexpr,
    W: tl.constexpr,
    RING_UNITS: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """The streamed split (stream-K): the rows' work units laid end to end, U in all, and program p of the P
    launched takes units ``[p U / P, (p + 1) U / P)``, crossing row boundaries, so every program reads the same
    number of blocks (to one) and the grid (a few programs per SM, one wave) ends at once. Program p writes one
    partial per row it touches, in slot p + r (unique: along the programs' walk over the rows p or r grows at each
    step), and records the first and last program of the rows it starts and ends (``FIRST``/``LAST`` [R]), so the
    merge reads them instead of redoing the walk."""
    if USE_PDL:  # the kernels before (the step's append) have finished; the merge may launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    p = tl.program_id(0)
    P = tl.num_programs(0)
    total = tl.zeros([], dtype=tl.int64)
    for r0 in range(0, R, BLOCK_R):
        offs = r0 + tl.arange(0, BLOCK_R)
        total += tl.sum(_row_units(LEN, offs, offs < R, BLOCK_N, RING_UNITS), axis=0).to(tl.int64)
    lo = (p.to(tl.int64) * total // P).to(tl.int32)
    hi = ((p.to(tl.int64) + 1) * total // P).to(tl.int32)
    # the row holding unit lo: the rows that end at or before it are skipped, their units counted
    r = tl.zeros([], dtype=tl.int32)
    rs = tl.zeros([], dtype=tl.int32)  # the units before row r
    carry = tl.zeros([], dtype=tl.int32)
    for r0 in range(0, R, BLOCK_R):
        offs = r0 + tl.arange(0, BLOCK_R)
        ok = offs < R
        n = _row_units(LEN, offs, ok, BLOCK_N, RING_UNITS)
        done = ok & (carry + tl.cumsum(n, axis=0) <= lo)
        r += tl.sum(done.to(tl.int32), axis=0)
        rs += tl.sum(tl.where(done, n, 0), axis=0)
        carry += tl.sum(n, axis=0)
    offs_g = tl.arange(0, BLOCK_G)
    gmask = offs_g < G
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    if (lo == hi) & (lo < total):  # no units (more programs than units), yet maybe amid the programs of row r
        zeros = tl.zeros([BLOCK_G], dtype=tl.float32)  # that the merge reads: a partial without keys
        _store_partial(M_OUT, L_OUT, ACC_OUT, (p + r) * G + offs_g, zeros - float("inf"), zeros,
                       tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32), gmask, offs_d, dmask, D)  # fmt: skip
    u = lo
    while u < hi:  # row r's units [a, b) in this program
        length = tl.load(LEN + r).to(tl.int32)
        units = tl.maximum(tl.cdiv(length, BLOCK_N) + RING_UNITS, 1)
        a = u - rs
        b = tl.minimum(hi - rs, units)
        q = _row_query(Q, r * G + offs_g, gmask, offs_d, dmask, D, IEEE)
        m_i = tl.zeros([BLOCK_G], dtype=tl.float32) - float("inf")
        l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
        if HAS_RING:  # units 0 .. RING_UNITS - 1: the ring's slots, BLOCK_N at a time
            for j in range(a, tl.minimum(b, RING_UNITS)):
                offs_w = j * BLOCK_N + tl.arange(0, BLOCK_N)
                okw = offs_w < W
                valid = tl.load(RVALID + r * W + offs_w, mask=okw, other=0) != 0
                rrows = r.to(tl.int64) * W + offs_w
                acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, RK, RV, rrows, valid, offs_d, dmask, D, qk_scale, IEEE)
        start = tl.load(START + r).to(tl.int64)
        k_lo = (tl.maximum(a, RING_UNITS) - RING_UNITS) * BLOCK_N
        k_hi = tl.minimum((b - RING_UNITS) * BLOCK_N, length)
        acc, m_i, l_i = _attend_keys(acc, m_i, l_i, q, KP, VP, start, k_lo, k_hi, offs_d, dmask, D, qk_scale, IEEE,
                                     BLOCK_N)  # fmt: skip
        _store_partial(M_OUT, L_OUT, ACC_OUT, (p + r) * G + offs_g, m_i, l_i, acc, gmask, offs_d, dmask, D)
        if a == 0:
            tl.store(FIRST + r, p)
        if b == units:
            tl.store(LAST + r, p)
        u = rs + b
        rs += units
        r += 1


@triton.jit
def _combine_kernel(
    M,
    L,
    ACC,
    OUT,
    SPLITS,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    LEN,
    R,
    FIRST,
    LAST,
    G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MODE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Program pid = r * G + g: the partials of query head g of row r merged (`_merge`), from no key."""
    pid = tl.program_id(0)
    mx = tl.full([], float("-inf"), tl.float32)
    den = tl.zeros([], dtype=tl.float32)
    num = tl.zeros([BLOCK_D], dtype=tl.float32)
    _merge(pid, mx, den, num, M, L, ACC, OUT, SPLITS, D, BLOCK_D, BLOCK_S, LEN, R, FIRST, LAST, G, BLOCK_N, MODE,
           BLOCK_R, USE_PDL)  # fmt: skip


@triton.jit
def _merge(
    pid, mx, den, num, M, L, ACC, OUT, SPLITS, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, LEN, R,
    FIRST, LAST, G: tl.constexpr, BLOCK_N: tl.constexpr, MODE: tl.constexpr, BLOCK_R: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    """Program pid = r * G + g: the partials of query head g of row r merged (online, BLOCK_S partials at a time)
    into the online softmax it starts from (max ``mx``, sum ``den``, weighted values ``num [BLOCK_D]``, float32: no
    key, -inf, 0, 0; NAtS' step starts from its new token, `nats_step`), the result written to OUT. MODE: the split
    kernel's (0 each row alike, 1 balanced chunks, 2 streamed). With USE_PDL it waits for the split kernel first:
    what the caller read for the start (written by the kernels before the split kernel) overlaps that kernel's end."""
    r = pid // G
    g = pid % G
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    if USE_PDL:  # the split kernel has finished
        tl.extra.cuda.gdc_wait()
    if MODE == 2:  # slots p + r of the programs p = FIRST[r] .. LAST[r] that took row r's units
        first = tl.load(FIRST + r)
        n_r = tl.load(LAST + r) - first + 1
        base = (first + r) * G + g
        step = G
    elif MODE == 1:  # row r's n_r chunks, from its first, in chunk order
        first, n_r = _row_chunks(LEN, R, r, _chunk_size(LEN, R, SPLITS, BLOCK_N, BLOCK_R), BLOCK_R)
        base = first * G + g
        step = G
    else:
        base = pid * SPLITS
        n_r = SPLITS
        step = 1
    offs_s = tl.arange(0, BLOCK_S)
    for s0 in range(0, n_r, BLOCK_S):
        ok = s0 + offs_s < n_r
        idx = base + (s0 + offs_s) * step
        m = tl.load(M + idx, mask=ok, other=float("-inf"))
        l = tl.load(L + idx, mask=ok, other=0.0)
        acc = tl.load(ACC + idx[:, None] * D + offs_d[None, :], mask=ok[:, None] & dmask[None, :], other=0.0)
        new = tl.maximum(mx, tl.max(m, axis=0))
        safe = tl.where(new == float("-inf"), 0.0, new)
        alpha = tl.where(mx == float("-inf"), 0.0, tl.exp(mx - safe))
        w = tl.where(m == float("-inf"), 0.0, tl.exp(m - safe))
        num = num * alpha + tl.sum(acc * w[:, None], axis=0)
        den = den * alpha + tl.sum(l * w, axis=0)
        mx = new
    tl.store(OUT + pid * D + offs_d, (num / den).to(OUT.dtype.element_ty), mask=dmask)


def launch_config(rows: int, head_dim: int) -> dict:
    """The split kernel's keys per block, warps and pipeline stages, the most splits worth launching, and the split of
    rows of uneven lengths (``uneven``: "stream" or "balanced") and whether to launch dependently (``pdl``: up to
    `PDL_ROWS` rows), for ``rows`` KV rows (batch x KV heads) of head dim D. From
    `benchmarks/sweep_pool_attention.py` on an H200 (docs/results/bench_limit_h200.md): at D = 128 and a few rows
    (batch 1-2 of 8 KV heads) blocks of 128 keys and at most 16 splits (one program per SM: 49 us at 32k keys, 22 us
    at 8k); with more rows or D = 64, blocks of 64 keys (and 2 stages where the rows fill the GPU: 245 us at batch 8,
    32k, D = 128, 104% of the copy bandwidth) with 4 warps at D = 128, 2 at D = 64. Decoding at 8B, 32k, batch 1
    went from 157.7 to 163.3 tokens/s with these choices. The streamed split for uneven rows (NAtS' heads):
    Llama-3.1-8B's shape at 8k, batch 8, NAtS over the full cache 1.20x with the balanced chunks, 1.25x streamed."""
    pdl = rows <= PDL_ROWS
    if head_dim >= 128 and rows <= 16:
        return {"block_n": 128, "num_warps": 4, "num_stages": 3, "max_splits": 16, "uneven": "stream", "pdl": pdl}
    # at D = 128 the streamed kernel takes 230-244 registers a thread with 2 warps (Triton 3.6), 127-144 with 4: 64
    # spread rows of 8k keys with NAtS' ring 72.0 us against 74.4, of 2k keys 27.1 against 28.7; rows of one length
    # (the full cache, split per row) the same either way (32k keys: 245.4 against 245.3 us)
    warps = 4 if head_dim >= 128 else 2
    return {"block_n": BLOCK_N, "num_warps": warps, "num_stages": 3 if rows <= 16 else 2, "max_splits": MAX_SPLITS,
            "uneven": "stream", "pdl": pdl}  # fmt: skip


def default_splits(max_len: int, rows: int) -> int:
    """Split-K count: chunks of about 256 keys, at most 64 splits (rows x splits programs in all)."""
    return int(min(MAX_SPLITS, max(1, math.ceil(max(int(max_len), 1) / 256))))


SPLITS_MODES = ("rows", "balanced", "stream")


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def use_pdl(device: torch.device) -> bool:
    """Whether the decode kernels on ``device`` use programmatic dependent launch (`PDL`): a CUDA GPU of compute
    capability 9.0 or later, not Triton's interpreter, and NATS_KERNELS_PDL not 0."""
    if not PDL or INTERPRET or device.type != "cuda":
        return False
    return _capability(device.index if device.index is not None else torch.cuda.current_device())[0] >= 9


def _pdl_launch(pdl: bool) -> dict:
    """The launch options of a kernel that waits for the one before it (none without PDL: the interpreter)."""
    return {"USE_PDL": pdl, **({"launch_pdl": True} if pdl else {})}


@functools.cache
def _sm_resources(index: int) -> tuple[int, int]:
    """(SMs, shared memory bytes per SM) of CUDA device ``index``, read once."""
    props = torch.cuda.get_device_properties(index)
    return props.multi_processor_count, int(getattr(props, "shared_memory_per_multiprocessor", 228 * 1024))


def stream_programs(device: torch.device, block_n: int, head_dim: int, num_stages: int, itemsize: int) -> int:
    """The streamed split's grid: one wave, as many programs per SM as their pipelined key and value blocks
    (``num_stages`` x 2 x ``block_n`` x D) leave room for in the SM's shared memory (3 at blocks of 64 keys, D = 128,
    2 stages in bf16; 1 at 128 keys, 3 stages), times the SMs. Without a GPU (the interpreter): 4."""
    if device.type != "cuda":
        return 4
    sms, smem = _sm_resources(device.index if device.index is not None else torch.cuda.current_device())
    per_program = num_stages * 2 * block_n * head_dim * itemsize
    return sms * max(1, min(8, (smem - 8 * 1024) // per_program))


def split_config(rows: int, head_dim: int, config: dict | None = None) -> dict:
    """The split kernel's launch for ``rows`` KV rows of head dim ``head_dim``: `launch_config` updated by ``config``,
    with its split named (``"split"``: one of SPLITS_MODES; without it ``balanced``, default True, picks the launch
    choice's ``uneven`` split, False "rows")."""
    cfg = {**launch_config(rows, head_dim), **(config or {})}
    mode = cfg.get("split") or (cfg["uneven"] if cfg.get("balanced", True) else "rows")
    if mode not in SPLITS_MODES:
        raise ValueError(f"unknown split {mode!r}: choose one of {SPLITS_MODES}")
    return {**cfg, "split": mode}


def launch_split(
    q, k_pool, v_pool, start, length, max_len, ring_k=None, ring_v=None, ring_valid=None, splits=None, config=None,
    launched=None,
):  # fmt: skip
    """Launches the split kernel of `triton_pool_attention` (same arguments) and returns what a merge of its partials
    needs: the merge kernels' common arguments (``M``, ``L``, ``ACC``: the partial buffers; their layout: ``MODE``,
    ``SPLITS``, ``FIRST``/``LAST``, ``LEN``; the block sizes; ``USE_PDL`` and the dependent launch's option). The
    caller launches the merge, ``(R * G,)`` programs or more, the next kernel on the stream. ``launched``: a dict that
    receives the compiled split kernel (``"split"``: on a GPU its registers and spills; in the interpreter None)."""
    R, G, D = q.shape
    q = q.contiguous()
    if k_pool.stride(-1) != 1 or v_pool.stride(-1) != 1 or k_pool.stride(0) != D or v_pool.stride(0) != D:
        raise ValueError("k_pool and v_pool must be contiguous [P, D]")
    cfg = split_config(R, D, config)
    mode = cfg["split"]
    splits = int(splits or min(default_splits(max_len, R * G), cfg["max_splits"]))
    if not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"splits must be in [1, {MAX_SPLITS}], got {splits}")
    dev = q.device
    if mode == "stream":
        programs = int(cfg.get("programs") or stream_programs(dev, cfg["block_n"], D, cfg["num_stages"],
                                                               q.element_size()))  # fmt: skip
        chunks = programs + R  # slot p + r for program p's share of row r
    else:
        chunks = R * (splits + 1) if mode == "balanced" else R * splits  # the split kernel's programs, a partial each
    m = torch.empty(chunks * G, device=dev, dtype=torch.float32)
    l = torch.empty(chunks * G, device=dev, dtype=torch.float32)
    acc = torch.empty(chunks * G, D, device=dev, dtype=torch.float32)
    has_ring = ring_k is not None
    if has_ring:
        W = ring_k.shape[1]
        rk, rv = ring_k.contiguous(), ring_v.contiguous()
        rvalid = ring_valid.contiguous()
        rvalid = rvalid.view(torch.int8) if rvalid.dtype == torch.bool else rvalid
    else:
        W, rk, rv, rvalid = 1, k_pool, v_pool, start  # unused placeholders
    block_d = max(16, triton.next_power_of_2(D))
    block_g = max(16, triton.next_power_of_2(G))  # tl.dot's smallest tile; rows beyond G are masked
    ieee = INTERPRET or q.dtype in (torch.float32, torch.float64)  # the interpreter has no bf16 dot
    pdl = _pdl_launch(bool(cfg["pdl"]) and use_pdl(dev))
    launch = {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"], **pdl}
    if mode == "stream":
        first_last = torch.empty(2, R, device=dev, dtype=torch.int32)
        split = _stream_decode_kernel[(programs,)](
            q, k_pool, v_pool, start, length, rk, rv, rvalid, m, l, acc, first_last[0], first_last[1],
            1.0 / math.sqrt(D), R, G=G, D=D, BLOCK_G=block_g, BLOCK_D=block_d, BLOCK_N=cfg["block_n"],
            HAS_RING=has_ring, W=W, RING_UNITS=triton.cdiv(W, cfg["block_n"]) if has_ring else 0, IEEE=ieee,
            BLOCK_R=ROW_BLOCK, **launch,
        )  # fmt: skip
    else:
        first_last = length.view(1, -1).expand(2, -1)  # unused placeholders
        balanced = mode == "balanced"
        split = _pool_decode_kernel[(chunks,) if balanced else (R, splits)](
            q, k_pool, v_pool, start, length, rk, rv, rvalid, m, l, acc, 1.0 / math.sqrt(D), splits, G=G, D=D,
            BLOCK_G=block_g, BLOCK_D=block_d, BLOCK_N=cfg["block_n"], HAS_RING=has_ring, W=W,
            BLOCK_W=max(16, triton.next_power_of_2(W)), IEEE=ieee, R=R, BALANCED=balanced, BLOCK_R=ROW_BLOCK,
            **launch,
        )  # fmt: skip
    if launched is not None:
        launched["split"] = split
    return {"M": m, "L": l, "ACC": acc, "SPLITS": splits, "D": D, "BLOCK_D": block_d, "BLOCK_S": MAX_SPLITS,
            "LEN": length, "R": R, "FIRST": first_last[0], "LAST": first_last[1], "G": G, "BLOCK_N": cfg["block_n"],
            "MODE": SPLITS_MODES.index(mode), "BLOCK_R": ROW_BLOCK, **pdl}  # fmt: skip


def triton_pool_attention(
    q, k_pool, v_pool, start, length, max_len, ring_k=None, ring_v=None, ring_valid=None, splits=None, config=None,
    launched=None,
):  # fmt: skip
    """Triton backend of :func:`nats.cache.attention.pool_attention` (same arguments, no host sync): the split kernel
    (`launch_split`), then the merge of its partials; the reference is :func:`decode_reference.torch_pool_attention`.
    ``config``: the split kernel's launch, ``{"block_n", "num_warps", "num_stages", "balanced", "split", "programs",
    "pdl"}`` (default `launch_config`; `benchmarks/sweep_pool_attention.py` times the choices). ``split``: "rows" (each
    row in ``splits`` equal chunks: rows of one length), "balanced" (chunks of one size over all rows, ``splits`` per
    row on average) or "stream" (the rows' keys end to end in ``programs`` equal shares, default `stream_programs`);
    without it, ``balanced`` (default True) picks the launch choice's ``uneven`` split, False "rows". ``splits``:
    without it, `default_splits` capped at the launch's ``max_splits``. ``pdl``: programmatic dependent launches where
    the GPU has them (`use_pdl`; default: up to `PDL_ROWS` rows). ``launched``: a dict that receives the compiled split
    kernel (``"split"``; `benchmarks/sweep_pool_attention.py` reads its registers and spills)."""
    merge = launch_split(q, k_pool, v_pool, start, length, max_len, ring_k, ring_v, ring_valid, splits, config,
                         launched)  # fmt: skip
    R, G, D = q.shape
    out = torch.empty(R, G, D, device=q.device, dtype=q.dtype)
    _combine_kernel[(R * G,)](OUT=out, **merge)
    return out
