"""Triton decode attention over a KV pool with per-row segments and an optional ring (flash-decoding), and NAtS' decode
step fused into its two launches (`nats_decode`). The exact PyTorch reference is ``decode_reference.py`` beside it
(``torch_pool_attention``); ``nats.cache.attention.pool_attention`` picks one of the two (tests/test_cache.py
compares them).

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
from nats_kernels.nats_attention.plan import first_max

# Programmatic dependent launch (Hopper and later): the decode step's kernels (the attention and its merge) are launched
# while the kernel before them finishes, and wait for it (``griddepcontrol.wait``) before they read anything it writes
# (the merge reads NAtS' new token, written before the attention, first); the attention lets the merge launch at once
# (``griddepcontrol.launch_dependents``). It hides a launch's latency between the kernels of a CUDA graph, which pays
# for few rows and not for many (H200, docs/results/bench_limit_h200.md: Llama-3.2-1B's shape at 32k and batch 1, NAtS
# 761.7 tokens/s with it, 720.4 without; Llama-3.1-8B's at 32k and batch 8, 1106.2 with it, 1153.1 without), so the
# launches use it up to PDL_ROWS KV rows (batch x KV heads). NATS_KERNELS_PDL=0 (read at import) launches them plainly,
# e.g. to time both.
PDL = os.environ.get("NATS_KERNELS_PDL", "1") != "0"
PDL_ROWS = 16

BLOCK_N = 64
MAX_SPLITS = 64  # SPLITS is a runtime argument (no recompilation per split count); the combine reads up to 64
ROW_BLOCK = 128  # rows the balanced split reads at a time to find a program's chunk (fixed: no compile per batch)
# the split kernel `triton_pool_attention` launched last (Triton's compiled kernel, with its registers and spills on a
# GPU; None in the interpreter), for benchmarks/sweep_pool_attention.py
LAST_KERNELS: dict = {}


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
def _new_token(KNEW, VNEW, r, HKV, skb, skh, svb, svh, offs_d, dmask):
    """Row r's new key and value ``[BLOCK_D]`` (row r = b * HKV + h), read where the projection wrote them."""
    b = r // HKV
    h = r % HKV
    knew = tl.load(KNEW + b * skb + h * skh + offs_d, mask=dmask, other=0.0)
    vnew = tl.load(VNEW + b * svb + h * svh + offs_d, mask=dmask, other=0.0)
    return knew, vnew


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
    ADMIT: tl.constexpr,
    Q,
    qk_scale,
    X,
    stride_xb,
    WS,
    BIAS,
    TYPES,
    types_stride,
    types_from,
    POS,
    TOUT,
    KNEW,
    VNEW,
    HKV,
    skb,
    skh,
    svb,
    svh,
    RK,
    RV,
    RVALID,
    KP,
    VP,
    START,
    NGLOBAL,
    CAP,
    C: tl.constexpr,
    BLOCK_C: tl.constexpr,
    HAS_SCORER: tl.constexpr,
    HAS_TYPES: tl.constexpr,
    HAS_CAP: tl.constexpr,
    W: tl.constexpr,
):
    """Program pid = r * G + g < R * G: the partials of query head g of row r merged (`_merge`). With ADMIT (NAtS'
    step, `nats_decode`) the merge starts from the new token (query ``Q`` ``[R, G, D]`` against row r's new key),
    and programs R * G + r admit row r's new token (`_step_type`, `_admit`): the split kernel that read the rows
    has finished, and the merge programs read no row's keys or lengths (MODE 0 or 2)."""
    pid = tl.program_id(0)
    if ADMIT:
        if pid >= R * G:
            r = pid - R * G
            pos = tl.load(POS)
            # the type first: it reads what the kernels before the split kernel wrote (x; the lengths, written by the
            # last step), so with dependent launches it overlaps the split kernel's end
            t = _step_type(r, pos, X, stride_xb, WS, BIAS, TYPES, types_stride, types_from, LEN, CAP, HKV, C, BLOCK_C,
                           HAS_SCORER, HAS_TYPES, HAS_CAP)  # fmt: skip
            offs_d = tl.arange(0, BLOCK_D)
            dmask = offs_d < D
            k, v = _new_token(KNEW, VNEW, r, HKV, skb, skh, svb, svh, offs_d, dmask)
            if USE_PDL:  # the split kernel has finished reading the rows
                tl.extra.cuda.gdc_wait()
            _admit(r, t, pos, k, v, TOUT, RK, RV, RVALID, KP, VP, START, LEN, NGLOBAL, offs_d, dmask, W, D)
        else:
            _merge(pid, M, L, ACC, OUT, SPLITS, D, BLOCK_D, BLOCK_S, LEN, R, FIRST, LAST, G, BLOCK_N, MODE, BLOCK_R,
                   USE_PDL, True, Q, qk_scale, KNEW, VNEW, HKV, skb, skh, svb, svh)  # fmt: skip
    else:
        _merge(pid, M, L, ACC, OUT, SPLITS, D, BLOCK_D, BLOCK_S, LEN, R, FIRST, LAST, G, BLOCK_N, MODE, BLOCK_R,
               USE_PDL, False, Q, qk_scale, KNEW, VNEW, HKV, skb, skh, svb, svh)  # fmt: skip


@triton.jit
def _merge(
    pid, M, L, ACC, OUT, SPLITS, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, LEN, R, FIRST, LAST,
    G: tl.constexpr, BLOCK_N: tl.constexpr, MODE: tl.constexpr, BLOCK_R: tl.constexpr, USE_PDL: tl.constexpr,
    NEW: tl.constexpr, Q, qk_scale, KNEW, VNEW, HKV, skb, skh, svb, svh,
):  # fmt: skip
    """Program pid = r * G + g: the partials of query head g of row r merged (online, BLOCK_S partials at a time).
    MODE: the split kernel's (0 each row alike, 1 balanced chunks, 2 streamed). With NEW the merge starts from row
    r's new token (score q . k / sqrt(D), weight 1, value v), which the split kernel left out: one key, in float32,
    read before the wait (the kernels before the split kernel wrote it)."""
    r = pid // G
    g = pid % G
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    if NEW:
        knew, vnew = _new_token(KNEW, VNEW, r, HKV, skb, skh, svb, svh, offs_d, dmask)
        qv = tl.load(Q + pid * D + offs_d, mask=dmask, other=0.0).to(tl.float32)
        mx = tl.sum(qv * knew.to(tl.float32), axis=0) * qk_scale
        den = tl.full([], 1.0, tl.float32)
        num = vnew.to(tl.float32)
    else:
        mx = tl.full([], float("-inf"), tl.float32)
        den = tl.zeros([], dtype=tl.float32)
        num = tl.zeros([BLOCK_D], dtype=tl.float32)
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


def triton_pool_attention(
    q, k_pool, v_pool, start, length, max_len, ring_k=None, ring_v=None, ring_valid=None, splits=None, config=None,
    _step=None,
):  # fmt: skip
    """Triton backend of :func:`nats.cache.attention.pool_attention` (same arguments, no host sync); the
    reference is :func:`decode_reference.torch_pool_attention`. ``config``: the split kernel's launch,
    ``{"block_n", "num_warps", "num_stages", "balanced", "split", "programs", "pdl"}`` (default `launch_config`;
    `benchmarks/sweep_pool_attention.py` times the choices). ``split``: "rows" (each row in ``splits`` equal
    chunks: rows of one length), "balanced" (chunks of one size over all rows, ``splits`` per row on average) or
    "stream" (the rows' keys end to end in ``programs`` equal shares, default `stream_programs`); without it,
    ``balanced`` (default True) picks the launch choice's ``uneven`` split, False "rows". ``splits``: without it,
    `default_splits` capped at the launch's ``max_splits``. ``pdl``: programmatic dependent launches where the GPU
    has them (`use_pdl`; default: up to `PDL_ROWS` rows). ``_step``: NAtS' step, the two kernels' extra
    arguments (`nats_decode`)."""
    R, G, D = q.shape
    q = q.contiguous()
    if k_pool.stride(-1) != 1 or v_pool.stride(-1) != 1 or k_pool.stride(0) != D or v_pool.stride(0) != D:
        raise ValueError("k_pool and v_pool must be contiguous [P, D]")
    cfg = {**launch_config(R, D), **(config or {})}
    mode = cfg.get("split") or (cfg["uneven"] if cfg.get("balanced", True) else "rows")
    if mode not in SPLITS_MODES:
        raise ValueError(f"unknown split {mode!r}: choose one of {SPLITS_MODES}")
    if _step is not None and (mode == "balanced" or ring_k is None):
        raise ValueError("NAtS' fused step needs the ring and the split 'stream' or 'rows' (the balanced merge reads "
                         "the lengths the step changes)")  # fmt: skip
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
    out = torch.empty(R, G, D, device=dev, dtype=q.dtype)
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
    if _step is None:  # no new token: placeholders of the step's arguments
        admit = {
            "ADMIT": False, "X": q, "stride_xb": 0, "WS": q, "BIAS": q, "TYPES": start, "types_stride": 0,
            "types_from": 0, "POS": start, "TOUT": start, "KNEW": q, "VNEW": q, "HKV": 1, "skb": 0, "skh": 0, "svb": 0,
            "svh": 0, "RK": q, "RV": q, "RVALID": start, "KP": q, "VP": q, "START": start, "NGLOBAL": start,
            "CAP": start, "C": 1, "BLOCK_C": 1, "HAS_SCORER": False, "HAS_TYPES": False, "HAS_CAP": False, "W": 1,
        }  # fmt: skip
    else:
        admit = _step
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
    LAST_KERNELS["split"] = split
    _combine_kernel[(R * G + (R if _step is not None else 0),)](
        m, l, acc, out, splits, D=D, BLOCK_D=block_d, BLOCK_S=MAX_SPLITS, LEN=length, R=R, FIRST=first_last[0],
        LAST=first_last[1], G=G, BLOCK_N=cfg["block_n"], MODE=SPLITS_MODES.index(mode), BLOCK_R=ROW_BLOCK, Q=q,
        qk_scale=1.0 / math.sqrt(D), **admit, **pdl,
    )  # fmt: skip
    return out


# ----------------------------------------------------------------------------------------------------
# NAtS' decode step fused into the attention's two launches: the split kernel reads the rows (the new token's ring
# slot is not valid), the merge starts from the new token itself, and the merge kernel's extra programs (ADMIT) type
# the token and admit it once every query has been answered
# ----------------------------------------------------------------------------------------------------
@triton.jit
def _type_of(z0, z1, z2, pos):
    """A token's type from its three scorer logits: the first maximum (like torch.argmax); token 0 is global."""
    return tl.where(pos == 0, 0, first_max(z0, z1, z2))


@triton.jit
def _scorer_type(XB, WH, BIAS, pos, C: tl.constexpr, BLOCK_C: tl.constexpr):
    """The type the NAtS scorer gives one token in one KV head (``NAtSAttention.type_logits`` in eval mode, then
    the argmax): XB points at the token's input x [C], WH at the head's three scorer rows W_s[3h : 3h + 3] [3, C].
    Each logit x . w is summed in float32 and rounded to x's dtype, as the Linear's output is, before the offset
    BIAS[j] is added in float32: in bf16 the rounding alone can make two logits equal and so change the argmax."""
    offs_c = tl.arange(0, BLOCK_C)
    cmask = offs_c < C
    x = tl.load(XB + offs_c, mask=cmask, other=0.0).to(tl.float32)
    w0 = tl.load(WH + offs_c, mask=cmask, other=0.0).to(tl.float32)
    w1 = tl.load(WH + C + offs_c, mask=cmask, other=0.0).to(tl.float32)
    w2 = tl.load(WH + 2 * C + offs_c, mask=cmask, other=0.0).to(tl.float32)
    dt = XB.dtype.element_ty
    z0 = _rounded(tl.sum(x * w0, axis=0), dt) + tl.load(BIAS)
    z1 = _rounded(tl.sum(x * w1, axis=0), dt) + tl.load(BIAS + 1)
    z2 = _rounded(tl.sum(x * w2, axis=0), dt) + tl.load(BIAS + 2)
    return _type_of(z0, z1, z2, pos)


@triton.jit
def _rounded(z, dt: tl.constexpr):
    """A float32 scalar rounded to the dtype dt (to nearest, ties to even) and back to float32. For bf16 the
    rounding is written out on the bits (bf16 is float32's upper half): it is what the GPU's conversion does, and
    Triton's CPU interpreter, which runs the tests, truncates in ``.to(tl.bfloat16)`` instead."""
    if dt == tl.bfloat16:
        bits = z.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return z.to(dt).to(tl.float32)


@triton.jit
def _step_type(
    r, pos, X, stride_xb, WS, BIAS, TYPES, types_stride, types_from, LENGTH, CAP, HKV, C: tl.constexpr,
    BLOCK_C: tl.constexpr, HAS_SCORER: tl.constexpr, HAS_TYPES: tl.constexpr, HAS_CAP: tl.constexpr,
):  # fmt: skip
    """Row r's new token's type (int64): the scorer's (row r = b * HKV + h reads x[b] and head h's scorer rows),
    replaced by row ``pos - types_from`` of the table TYPES where given (-1 there keeps the scorer's); with a
    capacity, a global or local token of a full segment is kept as a sliding one."""
    if HAS_SCORER:
        t = _scorer_type(X + (r // HKV) * stride_xb, WS + (3 * (r % HKV)) * C, BIAS, pos, C, BLOCK_C)
    if HAS_TYPES:
        given = tl.load(TYPES + (pos - types_from) * types_stride + r)
        if HAS_SCORER:  # -1 keeps the scorer's type; it also keeps the scorer's work from being compiled away
            t = tl.where(given >= 0, given, t)
        else:
            t = given
    t = t.to(tl.int64)
    if HAS_CAP:
        t = tl.where((t != 2) & (tl.load(LENGTH + r) >= tl.load(CAP + r)), 2, t)
    return t


@triton.jit
def _admit(
    r, t, pos, k, v, TOUT, RK, RV, RVALID, KP, VP, START, LENGTH, NGLOBAL, offs_d, dmask, W: tl.constexpr,
    D: tl.constexpr,
):  # fmt: skip
    """After query ``pos`` has been answered: row r's new token (k, v [BLOCK_D]) of type t goes into its ring slot
    ``pos % W`` (valid while sliding); a local token is appended to the row's segment, a global one is written after
    the row's globals, over its locals (visible up to this query, then dropped: the segment is truncated). The slot
    of token ``pos - W + 1``, whose window this query closed, is marked invalid."""
    tl.store(TOUT + r, t)
    ring = r.to(tl.int64) * W + (pos % W).to(tl.int64)
    tl.store(RK + ring * D + offs_d, k, mask=dmask)
    tl.store(RV + ring * D + offs_d, v, mask=dmask)
    if W > 1:
        tl.store(RVALID + ring, (t == 2).to(tl.int8))
        tl.store(RVALID + r.to(tl.int64) * W + ((pos + 1) % W).to(tl.int64), (t * 0).to(tl.int8))
    else:  # a window of one: a sliding token's only query was this one
        tl.store(RVALID + ring, (t * 0).to(tl.int8))
    if t != 2:
        start = tl.load(START + r)
        length = tl.load(LENGTH + r)
        ng = tl.load(NGLOBAL + r)
        if t == 0:
            dst = start + ng
            n = ng + 1
            tl.store(NGLOBAL + r, n)
        else:
            dst = start + length
            n = length + 1
        tl.store(KP + dst * D + offs_d, k, mask=dmask)
        tl.store(VP + dst * D + offs_d, v, mask=dmask)
        tl.store(LENGTH + r, n)


def _rows_view(t: torch.Tensor, B: int, H: int, what: str) -> torch.Tensor:
    """k or v of one token, [B, H, 1, D], [B, H, D] or [B * H, D], as [B, H, D] with unit stride along D (a view
    when it has)."""
    if t.dim() == 2 and t.shape[0] == B * H:
        t = t.unflatten(0, (B, H))
    if t.dim() == 4:
        if t.shape[2] != 1:
            raise ValueError(f"{what} must hold one token, got {t.shape[2]}")
        t = t[:, :, 0]
    if t.dim() != 3 or tuple(t.shape[:2]) != (B, H):
        raise ValueError(f"{what} must be [B={B}, Hkv={H}, (1,) D], got {tuple(t.shape)}")
    return t if t.stride(-1) == 1 else t.contiguous()


def nats_decode(
    q, k_new, v_new, pos, t_out, k_pool, v_pool, start, length, n_global, ring_k, ring_v, ring_valid, *, x=None,
    w_s=None, bias=None, types=None, types_from=None, cap=None, splits=None, config=None,
):  # fmt: skip
    """One NAtS decode step of a layer (spec section 5) in the attention's two launches; returns ``[R, G, D]``.

    The split kernel reads each row's segment and valid ring slots, as for any cache (the new token's slot ``pos % W``
    holds position pos - W, out of the window, and is not valid: the last step, or the prefill, closed it); the merge
    starts from the new token itself (``k_new``, ``v_new``: ``[B, Hkv, (1,) D]`` or ``[R, D]``, read through their
    strides, e.g. views of a fused qkv product), so query ``pos`` sees what its row holds and itself whatever the new
    token's type. The merge kernel's extra programs, one a row, then type the token and admit it (`_admit`: ring write,
    append, or for a global token its row's locals dropped) and close the expired ring slot: nothing is read and written
    in the same launch. Type: the scorer's (``x [B, C]`` . ``w_s [3 Hkv, C]`` rounded as the Linear's output, ``+ bias
    [3]``, argmax, token 0 global) and/or ``types`` (int64 ``[R]``, or with ``types_from`` a table ``[T, R]`` whose row
    ``pos - types_from`` is read on the device; with the scorer too, -1 keeps the scorer's); with ``cap`` ``[R]`` a
    global or local token of a full segment is kept as sliding. ``t_out [R]`` receives the types. The PyTorch form is
    ``nats.cache.policies.nats.step_torch``."""
    R, W, D = ring_k.shape
    has_scorer, has_types = x is not None, types is not None
    if not (has_scorer or has_types):
        raise ValueError("nats_decode needs the scorer's input x or the types")
    # the batch: x's; without the scorer, k_new's (rows [R, D]: one row a "sequence", the row's own)
    B = x.shape[0] if has_scorer else (k_new.shape[0] if k_new.dim() >= 3 else R)
    if R % B:
        raise ValueError(f"the batch {B} does not divide the cache's {R} rows")
    H = R // B
    k_new, v_new = _rows_view(k_new, B, H, "k_new"), _rows_view(v_new, B, H, "v_new")
    if k_new.dtype != k_pool.dtype or v_new.dtype != v_pool.dtype:
        raise ValueError(f"k_new / v_new must have the pool's dtype {k_pool.dtype}, got {k_new.dtype}")
    if has_scorer:
        x = x.reshape(B, -1)
        x = x if x.stride(-1) == 1 else x.contiguous()
        C = x.shape[1]
        if tuple(w_s.shape) != (3 * H, C):
            raise ValueError(f"the scorer's weight must be [3 * Hkv = {3 * H}, C = {C}], got {tuple(w_s.shape)}")
        w_s = w_s.contiguous()
    else:
        x, w_s, bias, C = k_new, k_new, k_new, 1  # unused placeholders
    if has_types:
        if types_from is None:
            types_stride, types_from = 0, 0
            types = types.reshape(R)
        else:
            types_stride = R
            types = types.reshape(-1, R)
        types = types.contiguous()
    else:
        types, types_stride, types_from = t_out, 0, 0  # unused placeholder
    rvalid = ring_valid.view(torch.int8) if ring_valid.dtype == torch.bool else ring_valid
    strides = {"HKV": H, "skb": k_new.stride(0), "skh": k_new.stride(1), "svb": v_new.stride(0),
               "svh": v_new.stride(1)}  # fmt: skip
    admit = {
        "ADMIT": True, "X": x, "stride_xb": x.stride(0), "WS": w_s, "BIAS": bias, "TYPES": types,
        "types_stride": types_stride, "types_from": int(types_from), "POS": pos, "TOUT": t_out, "KNEW": k_new,
        "VNEW": v_new, **strides, "RK": ring_k, "RV": ring_v, "RVALID": rvalid, "KP": k_pool, "VP": v_pool,
        "START": start, "NGLOBAL": n_global, "CAP": cap if cap is not None else length, "C": C,
        "BLOCK_C": triton.next_power_of_2(C), "HAS_SCORER": has_scorer, "HAS_TYPES": has_types,
        "HAS_CAP": cap is not None, "W": W,
    }  # fmt: skip
    return triton_pool_attention(q, k_pool, v_pool, start, length, 0, ring_k=ring_k, ring_v=ring_v,
                                 ring_valid=ring_valid, splits=splits, config=config, _step=admit)  # fmt: skip
