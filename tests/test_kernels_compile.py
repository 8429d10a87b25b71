"""The fused NAtS decode kernels and the split-K decode attention compile for a Hopper GPU (sm_90) here, without a
GPU: Triton's interpreter, which runs them in the other tests, checks their arithmetic but not that the compiler
accepts them, nor that the decode attention's key blocks are pipelined (``cp.async`` into shared memory, with the
pointers specialised as a GPU launch does). The kernels: the pool attention's split kernels and merge
(``pool_decode.py``) and NAtS' merge that admits the new token (``nats_step.py``). The compile runs in a subprocess
(this process has chosen the interpreter) and stops at PTX and the cubin; nothing is launched."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

SCRIPT = textwrap.dedent(
    """
    import importlib
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    pool = importlib.import_module("nats_kernels.nats_attention.pool_decode")
    step = importlib.import_module("nats_kernels.nats_attention.nats_step")
    P, B, L, I8, I = "*fp32", "*bf16", "*i64", "*i8", "i32"
    C = "constexpr"
    kernels = {
        "_pool_decode_kernel": (
            pool,  # the split-K decode attention: balanced chunks or each row alike, with a ring or not
            dict(Q=B, KP=B, VP=B, START=L, LEN=L, RK=B, RV=B, RVALID=I8, M_OUT=P, L_OUT=P, ACC_OUT=P, qk_scale="fp32",
                 SPLITS=I, G=C, D=C, BLOCK_G=C, BLOCK_D=C, BLOCK_N=C, HAS_RING=C, W=C, BLOCK_W=C, IEEE=C, R=I,
                 BALANCED=C, BLOCK_R=C, USE_PDL=C),
            [dict(G=4, D=128, BLOCK_G=16, BLOCK_D=128, BLOCK_N=64, HAS_RING=r, W=64, BLOCK_W=64, IEEE=False,
                  BALANCED=b, BLOCK_R=pool.ROW_BLOCK, USE_PDL=r) for b in (True, False) for r in (True, False)],
        ),
        "_stream_decode_kernel": (
            pool,  # the streamed split: the rows' keys end to end in equal shares
            dict(Q=B, KP=B, VP=B, START=L, LEN=L, RK=B, RV=B, RVALID=I8, M_OUT=P, L_OUT=P, ACC_OUT=P, FIRST="*i32",
                 LAST="*i32", qk_scale="fp32", R=I, G=C, D=C, BLOCK_G=C, BLOCK_D=C, BLOCK_N=C, HAS_RING=C, W=C,
                 RING_UNITS=C, IEEE=C, BLOCK_R=C, USE_PDL=C),
            [dict(G=4, D=d, BLOCK_G=16, BLOCK_D=d, BLOCK_N=n, HAS_RING=r, W=64, RING_UNITS=-(-64 // n) if r else 0,
                  IEEE=False, BLOCK_R=pool.ROW_BLOCK, USE_PDL=r) for d, n in ((128, 64), (128, 128), (64, 64))
             for r in (True, False)],
        ),
        "_combine_kernel": (
            pool,  # the merge of the partials
            dict(M=P, L=P, ACC=P, OUT=B, SPLITS=I, D=C, BLOCK_D=C, BLOCK_S=C, LEN=L, R=I, FIRST="*i32",
                 LAST="*i32", G=C, BLOCK_N=C, MODE=C, BLOCK_R=C, USE_PDL=C),
            [dict(D=128, BLOCK_D=128, BLOCK_S=64, G=4, BLOCK_N=64, MODE=mode, BLOCK_R=pool.ROW_BLOCK, USE_PDL=mode > 0)
             for mode in (0, 1, 2)],
        ),
        "_merge_admit_kernel": (
            step,  # NAtS' step: the merge from the new token, its type (scorer, table of types, capacity), admission
            dict(M=P, L=P, ACC=P, OUT=B, SPLITS=I, D=C, BLOCK_D=C, BLOCK_S=C, LEN=L, R=I, FIRST="*i32",
                 LAST="*i32", G=C, BLOCK_N=C, MODE=C, BLOCK_R=C, USE_PDL=C, Q=B, qk_scale="fp32", X=B,
                 stride_xb=I, WS=B, BIAS=P, TYPES=L, types_stride=I, types_from=I, POS=L, TOUT=L, KNEW=B, VNEW=B,
                 HKV=I, skb=I, skh=I, svb=I, svh=I, RK=B, RV=B, RVALID=I8, KP=B, VP=B, START=L, NGLOBAL=L, CAP=L, C=C,
                 BLOCK_C=C, HAS_SCORER=C, HAS_TYPES=C, HAS_CAP=C, W=C),
            [dict(D=d, BLOCK_D=d, BLOCK_S=64, G=4, BLOCK_N=64, MODE=2, BLOCK_R=pool.ROW_BLOCK, USE_PDL=pdl, C=c,
                  BLOCK_C=bc, HAS_SCORER=s, HAS_TYPES=t, HAS_CAP=cap, W=w)
             for d, c, bc, s, t, cap, w, pdl in ((128, 4096, 4096, True, False, True, 64, True),
                                                  (64, 768, 1024, True, True, False, 16, False),
                                                  (64, 1, 1, False, True, False, 1, False))],
        ),
    }
    for name, (module, signature, variants) in kernels.items():
        # pointers 16-byte aligned, as Triton's launcher specialises them on a GPU (without it: no vector loads)
        attrs = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(signature.values()) if t.startswith("*")}
        for constexprs in variants:
            compiled = triton.compile(
                ASTSource(fn=getattr(module, name), signature=signature, constexprs=constexprs, attrs=attrs),
                target=GPUTarget("cuda", 90, 32),
            )
            assert "ptx" in compiled.asm, name
            # programmatic dependent launch: the kernel waits for the one before it, and only then
            assert ("griddepcontrol.wait" in compiled.asm["ptx"]) == bool(constexprs.get("USE_PDL")), name
            if name in ("_pool_decode_kernel", "_stream_decode_kernel"):  # key blocks pipelined through shared memory
                assert "cp.async" in compiled.asm["ptx"], name
            print(name, "ok")
    """
)


def test_the_fused_decode_kernels_compile_for_sm90():
    # the kernels' helpers imported from the package (plan.first_max) must be compiled too, not interpreted: an
    # explicit TRITON_INTERPRET=0 replaces the interpreter the tests chose on this GPU-less machine (conftest.py)
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if proc.returncode != 0 and "ptxas" in proc.stderr and "not found" in proc.stderr.lower():
        pytest.skip("this Triton install has no ptxas to compile for CUDA")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split().count("ok") == 16
