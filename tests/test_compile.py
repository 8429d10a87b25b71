"""NAtS under torch.compile: the Triton attention and the O(N) scans are opaque custom ops.

A compiled NAtS model must trace as one graph (``fullgraph=True``: no graph break at the attention, the
density or the statistics) and give the eager values and gradients. On the CPU the Triton kernels run in
the interpreter and the graphs are compiled with ``aot_eager`` (tracing, fake tensors and the autograd
formula are what is tested; inductor's code generation is exercised on the GPU by
``benchmarks/bench_train.py --attention nats``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from nats import functional as NF  # noqa: E402
from nats import ops  # noqa: E402
from nats.models.gpt import GPT, GPTConfig  # noqa: E402
from nats_kernels.nats_attention import reference as R  # noqa: E402
from nats_kernels.nats_attention.autograd import attention_fwd, triton_nats_attention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def st_weights(B, H, N, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(B, H, N, 3, generator=gen, dtype=dtype).to(DEVICE).requires_grad_()
    y = torch.softmax(z, -1)
    return z, F.one_hot(y.argmax(-1), 3).to(dtype) + y - y.detach()


def test_density_op_matches_autograd_reference():
    for dtype in (torch.float32, torch.float64):
        z, w = st_weights(2, 3, 57, seed=1, dtype=dtype)
        c = torch.randn(2, 3, dtype=dtype, device=DEVICE)
        a, b = NF.nats_density(w, 6), R.nats_density(w, 6)
        assert a.dtype == b.dtype == dtype
        (ga,) = torch.autograd.grad((a * c).sum(), z, retain_graph=True)
        (gb,) = torch.autograd.grad((b * c).sum(), z)
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
        torch.testing.assert_close(ga, gb, rtol=1e-5, atol=1e-7)
        assert ga.abs().max() > 0


def test_kv_stats_op_matches_masks():
    types = torch.randint(0, 3, (2, 3, 45), generator=torch.Generator().manual_seed(0))
    got = ops.kv_stats(types, 4)
    for b in range(2):
        for h in range(3):
            area, peak = NF.kv_fractions(NF.nats_mask(types[b, h], 4))
            frac = NF.type_fractions(types[b, h])
            want = torch.tensor([area, peak, *frac.tolist()])
            torch.testing.assert_close(got[b, h], want, rtol=0, atol=1e-6)


def test_density_and_stats_in_one_pass():
    z, w = st_weights(2, 3, 50, seed=9)
    rho, stats = ops.density_and_stats(w, 7)
    torch.testing.assert_close(stats, ops.kv_stats(w.argmax(-1), 7))
    torch.testing.assert_close(rho, NF.nats_density(w, 7))
    assert stats.shape == (2, 3, len(ops.KV_STAT_NAMES))


def test_density_compiles_without_graph_break():
    z, _ = st_weights(2, 2, 40, seed=2)

    def f(z):
        y = torch.softmax(z, -1)
        w = F.one_hot(y.argmax(-1), 3).to(y.dtype) + y - y.detach()
        return NF.nats_density(w, 5).sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    a = compiled(z)
    (ga,) = torch.autograd.grad(a, z)
    b = f(z)
    (gb,) = torch.autograd.grad(b, z)
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(ga, gb)


def test_attention_custom_op_opcheck():
    """torch.library's own checks: schema, fake tensors (shapes and strides), autograd registration."""
    gen = torch.Generator().manual_seed(3)
    B, HQ, HKV, N, D = 1, 2, 1, 37, 16
    q = torch.randn(B, N, HQ, D, generator=gen).to(DEVICE).transpose(1, 2).requires_grad_()  # a [B,N,H,D] view
    k = torch.randn(B, HKV, N, D, generator=gen).to(DEVICE).requires_grad_()
    v = torch.randn(B, HKV, N, D, generator=gen).to(DEVICE).requires_grad_()
    _, w = st_weights(B, HKV, N, seed=4)
    for mask_grad in ("dense", "exact"):
        torch.library.opcheck(
            attention_fwd,
            (q, k, v, w.detach().requires_grad_(), 5, mask_grad),
            test_utils=("test_schema", "test_autograd_registration", "test_faketensor"),
        )


def test_attention_compiles_and_matches_eager():
    gen = torch.Generator().manual_seed(5)
    B, HQ, HKV, N, D, W = 1, 4, 2, 45, 16, 4
    qkv = torch.randn(B, N, HQ + 2 * HKV, D, generator=gen).to(DEVICE).requires_grad_()  # model-like layout
    do = torch.randn(B, HQ, N, D, generator=gen).to(DEVICE)
    z, _ = st_weights(B, HKV, N, seed=6)

    def f(qkv, z):
        q, k, v = qkv.split([HQ, HKV, HKV], dim=2)
        y = torch.softmax(z, -1)
        w = F.one_hot(y.argmax(-1), 3).to(y.dtype) + y - y.detach()
        o = triton_nats_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), w, W)
        return (o * do).sum() + NF.nats_density(w, W).sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    results = []
    for fn in (compiled, f, _reference_version(HQ, HKV, W, do)):
        out = fn(qkv, z)
        results.append((out, *torch.autograd.grad(out, (qkv, z))))
    for got, want in [(results[0], results[1]), (results[1], results[2])]:
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def _reference_version(HQ, HKV, W, do):
    """The test's function with the PyTorch reference in place of the kernel and the op."""

    def g(qkv, z):
        q, k, v = qkv.split([HQ, HKV, HKV], dim=2)
        y = torch.softmax(z, -1)
        w = F.one_hot(y.argmax(-1), 3).to(y.dtype) + y - y.detach()
        o = R.nats_attention_reference(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), w, W)
        return (o * do).sum() + R.nats_density(w, W).sum()

    return g


def nats_gpt(backend: str, length: int, **sizes) -> tuple[GPT, torch.Tensor]:
    """A seeded tiny NAtS GPT in training mode (vocabulary 67, 2 heads, sparsity_lambda 1, the given attention
    backend) and a batch of 2 random sequences of `length` tokens."""
    attention = {"name": "nats", "window": 4, "sparsity_lambda": 1.0, "backend": backend}
    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny(vocab_size=67, n_head=2, attention=attention, **sizes)).train()
    idx = torch.randint(0, 67, (2, length), generator=torch.Generator().manual_seed(1))
    return model, idx


def test_nats_gpt_compiles_as_one_graph():
    """A whole NAtS GPT (Triton backend) compiles with fullgraph=True and trains like the eager model."""
    model, idx = nats_gpt("triton", 41)
    model, idx = model.to(DEVICE), idx.to(DEVICE)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    outs = []
    for m in (compiled, model):
        torch.manual_seed(7)  # the same Gumbel noise
        out = m(idx, idx)
        loss = out.loss + out.aux_loss
        grads = torch.autograd.grad(loss, [p for p in model.parameters()])
        outs.append((loss.detach(), out.stats["layer1/density"].detach(), grads))
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(outs[0][1], outs[1][1])
    scorer_grad = [g for g, (n, _) in zip(outs[0][2], model.named_parameters()) if "scorer" in n]
    assert scorer_grad and all(g.abs().sum() > 0 for g in scorer_grad)
    for a, b in zip(outs[0][2], outs[1][2]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_changing_tau_does_not_recompile():
    """The tau schedule changes the Gumbel temperature every step: a compiled model must not recompile for it
    (tau lives in a buffer), and the new value must take effect (the soft weights, hence the scorer's
    gradient, change)."""
    model, idx = nats_gpt("reference", 29, block_size=32, n_layer=1)
    core = model.blocks[0].attn.core
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")

    def scorer_grad(tau):
        core.tau = tau
        torch.manual_seed(7)
        out = compiled(idx, idx)
        (g,) = torch.autograd.grad(out.loss + out.aux_loss, [core.scorer.weight])
        return g

    g1 = scorer_grad(1.0)
    with torch.compiler.set_stance("fail_on_recompile"):
        g2 = scorer_grad(0.731)
        g3 = scorer_grad(1.0)
    assert core.tau == 1.0 and float(core.tau_buf) == 1.0
    torch.testing.assert_close(g1, g3)
    assert (g1 - g2).abs().max() > 1e-6
