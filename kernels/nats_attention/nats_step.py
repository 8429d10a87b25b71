"""NAtS' decode step of a layer fused into the pool attention's two launches (`nats_decode`): the attention's split
kernel (``pool_decode.launch_split``) reads each row's segment and valid ring slots, as for any cache (the new token's
ring slot is not valid); the merge kernel here starts from the new token itself (`_merge_admit_kernel`: the
attention's `_merge` from the new key), and its extra programs, one a row, type the token (the scorer's argmax, a
table of types, a capacity) and admit it once every query has been answered. The PyTorch form is
``nats.cache.policies.nats.step_torch`` (tests/test_cache.py compares them).

Without a CUDA GPU the kernels run in Triton's CPU interpreter (``_env.py``): slow, for tests only.
"""

from __future__ import annotations

import math

import torch

# chooses Triton's CPU interpreter when there is no GPU (before any @triton.jit runs)
from nats_kernels.nats_attention._env import tl, triton
from nats_kernels.nats_attention.plan import first_max
from nats_kernels.nats_attention.pool_decode import _merge, launch_split, split_config


@triton.jit
def _new_token(KNEW, VNEW, r, HKV, skb, skh, svb, svh, offs_d, dmask):
    """Row r's new key and value ``[BLOCK_D]`` (row r = b * HKV + h), read where the projection wrote them."""
    b = r // HKV
    h = r % HKV
    knew = tl.load(KNEW + b * skb + h * skh + offs_d, mask=dmask, other=0.0)
    vnew = tl.load(VNEW + b * svb + h * svh + offs_d, mask=dmask, other=0.0)
    return knew, vnew


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


@triton.jit
def _merge_admit_kernel(
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
    """Program pid = r * G + g < R * G: the partials of query head g of row r merged (`pool_decode._merge`),
    starting from row r's new token, which the split kernel left out (query ``Q`` ``[R, G, D]`` against the new
    key: score q . k / sqrt(D), weight 1, value v; one key in float32, read before the merge waits for the split
    kernel: the kernels before it wrote the token). Programs R * G + r admit row r's new token (`_step_type`,
    `_admit`): the split kernel that read the rows has finished, and the merge programs read no row's keys or
    lengths (MODE 0 or 2)."""
    pid = tl.program_id(0)
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
        r = pid // G
        offs_d = tl.arange(0, BLOCK_D)
        dmask = offs_d < D
        knew, vnew = _new_token(KNEW, VNEW, r, HKV, skb, skh, svb, svh, offs_d, dmask)
        qv = tl.load(Q + pid * D + offs_d, mask=dmask, other=0.0).to(tl.float32)
        mx = tl.sum(qv * knew.to(tl.float32), axis=0) * qk_scale
        den = tl.full([], 1.0, tl.float32)
        num = vnew.to(tl.float32)
        _merge(pid, mx, den, num, M, L, ACC, OUT, SPLITS, D, BLOCK_D, BLOCK_S, LEN, R, FIRST, LAST, G, BLOCK_N, MODE,
               BLOCK_R, USE_PDL)  # fmt: skip


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
    R, W = ring_k.shape[:2]
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
    G, D = q.shape[1:]
    q = q.contiguous()  # the merge reads the queries [R, G, D] the split kernel read
    config = split_config(R, D, config)
    if config["split"] == "balanced":
        raise ValueError(
            "NAtS' fused step needs the split 'stream' or 'rows' (the balanced merge reads the lengths the step "
            "changes)"
        )
    merge = launch_split(q, k_pool, v_pool, start, length, 0, ring_k, ring_v, ring_valid, splits, config)
    out = torch.empty(R, G, D, device=q.device, dtype=q.dtype)
    _merge_admit_kernel[(R * G + R,)](
        OUT=out, **merge, Q=q, qk_scale=1.0 / math.sqrt(D), X=x, stride_xb=x.stride(0), WS=w_s, BIAS=bias, TYPES=types,
        types_stride=types_stride, types_from=int(types_from), POS=pos, TOUT=t_out, KNEW=k_new, VNEW=v_new, **strides,
        RK=ring_k, RV=ring_v, RVALID=rvalid, KP=k_pool, VP=v_pool, START=start, NGLOBAL=n_global,
        CAP=cap if cap is not None else length, C=C, BLOCK_C=triton.next_power_of_2(C), HAS_SCORER=has_scorer,
        HAS_TYPES=has_types, HAS_CAP=cap is not None, W=W,
    )  # fmt: skip
    return out
