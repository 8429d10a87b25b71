"""Fused linear + cross-entropy (nats_kernels.cross_entropy): the Triton kernel (in the interpreter without a
GPU), the custom op against autograd through F.cross_entropy, and the GPT's fused_cross_entropy option."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nats.models.gpt import GPT, GPTConfig
from nats_kernels.cross_entropy import cross_entropy_rows, fused_linear_cross_entropy, linear_cross_entropy


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("M, V, block_v", [(7, 1000, 128), (7, 257, 64), (5, 100, 256)])
def test_kernel_matches_reference(dtype, M, V, block_v):
    pytest.importorskip("triton")
    from nats_kernels.cross_entropy.kernel import cross_entropy_rows_

    gen = torch.Generator().manual_seed(M * V)
    logits = torch.randn(M, V, generator=gen) * 4
    logits[2] += 100  # exp(100) overflows fp32: only the running max keeps it finite
    logits = logits.to(dtype)
    targets = torch.randint(0, V, (M,), generator=gen)
    targets[[1, 4]] = -100
    targets[0] = V - 1  # the last column, in the last (partial) block
    want_loss, want_g = cross_entropy_rows(logits.double(), targets)  # exact for these logits
    buf = torch.full((M, V + 3), 7.0, dtype=dtype)  # rows of stride V + 3; the padding must stay 7
    buf[:, :V] = logits
    row_loss = torch.full((M,), float("nan"))  # an unwritten row loss fails
    device = "cuda" if torch.cuda.is_available() else "cpu"
    buf, row_loss = buf.to(device), row_loss.to(device)
    cross_entropy_rows_(buf[:, :V], targets.to(device), block_v=block_v, out=row_loss)
    buf, row_loss = buf.cpu(), row_loss.cpu()
    torch.testing.assert_close(row_loss, want_loss.float(), rtol=1e-6, atol=1e-5)
    assert (row_loss[[1, 4]] == 0).all() and (row_loss[[0, 2, 3]] > 0).all()
    tol = 1e-6 if dtype == torch.float32 else 1e-3
    torch.testing.assert_close(buf[:, :V], want_g.to(dtype), rtol=tol, atol=tol)  # every element rewritten
    assert (buf[[1, 4], :V] == 0).all() and (buf[:, V:] == 7).all()


def _inputs(M=11, C=16, V=37, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, C, generator=gen, dtype=dtype).requires_grad_()
    w = torch.randn(V, C, generator=gen, dtype=dtype).requires_grad_()
    t = torch.randint(0, V, (M,), generator=gen)
    t[::4] = -100
    return x, w, t


@pytest.mark.parametrize("ignore_index", [-100, 5])
def test_op_matches_autograd(ignore_index):
    x, w, t = _inputs()
    t[t == -100] = ignore_index
    loss = linear_cross_entropy(x, w, t, ignore_index=ignore_index)
    (loss * 0.25).backward()  # a non-unit upstream gradient
    ref = F.cross_entropy(x @ w.t(), t, ignore_index=ignore_index)
    dx, dw = torch.autograd.grad(ref * 0.25, (x, w))
    assert loss.dtype == torch.float64
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x.grad, dx, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(w.grad, dw, rtol=1e-10, atol=1e-12)
    assert x.grad[t == ignore_index].abs().max() == 0 and x.grad.abs().max() > 0


def test_op_outputs_and_all_ignored_rows():
    x, w, t = _inputs(dtype=torch.float32)
    loss, g, n = fused_linear_cross_entropy(x, w, t, -100)
    assert loss.dtype == n.dtype == torch.float32 and g.shape == (11, 37) and g.dtype == x.dtype
    assert n.item() == (t != -100).sum().item() and not g.requires_grad
    torch.testing.assert_close(g, cross_entropy_rows(x.detach() @ w.detach().t(), t)[1])
    # no valid row: loss 0 and zero gradients, no NaN
    loss = linear_cross_entropy(x, w, torch.full_like(t, -100))
    loss.backward()
    assert loss.item() == 0 and (x.grad == 0).all() and (w.grad == 0).all()


def test_op_opcheck():
    x, w, t = _inputs()
    torch.library.opcheck(fused_linear_cross_entropy, (x, w, t, -100))


def test_op_errors():
    x, w, t = _inputs()
    with pytest.raises(ValueError, match="same C"):
        linear_cross_entropy(x, w[:, :8], t)
    with pytest.raises(ValueError, match="same C"):
        linear_cross_entropy(x[None], w, t)
    with pytest.raises(ValueError, match="same dtype"):
        linear_cross_entropy(x, w.float(), t)
    with pytest.raises(ValueError, match="int64"):
        linear_cross_entropy(x, w, t.int())
    with pytest.raises(ValueError, match="int64"):
        linear_cross_entropy(x, w, t[:-1])


def tiny(**kw) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=67, block_size=24, n_layer=2, n_head=2, n_embd=32, **kw)).train()


def _batch(n_classes=67):
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 67, (2, 19), generator=gen)
    targets = torch.randint(0, n_classes, (2, 19), generator=gen)
    targets[:, :3] = -100
    return idx, targets


def test_compiled_fused_gpt_matches_eager_default():
    fused, plain = tiny(fused_cross_entropy=True), tiny()
    idx, targets = _batch()
    compiled = torch.compile(fused, fullgraph=True, backend="aot_eager")
    results = []
    for m in (compiled, plain):
        out = m(idx, targets)
        results.append((out.loss, torch.autograd.grad(out.loss, list(m.parameters())), out.logits))
    (a, ga, logits_a), (b, gb, logits_b) = results
    assert logits_a is None and logits_b is not None
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    for u, v in zip(ga, gb):
        torch.testing.assert_close(u, v, rtol=1e-4, atol=1e-6)
    with torch.no_grad():  # validation: the plain path, logits for the metrics
        out = compiled(idx, targets)
    assert out.logits.shape == (2, 19, 67)
    torch.testing.assert_close(out.loss, b.detach(), rtol=1e-6, atol=1e-6)


def test_fused_gpt_classifier_head_and_autocast():
    kw = dict(n_out=5, tie_embeddings=False)
    fused, plain = tiny(fused_cross_entropy=True, **kw), tiny(**kw)
    idx, targets = _batch(n_classes=5)
    for autocast in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            a, b = fused(idx, targets), plain(idx, targets)
        ga = torch.autograd.grad(a.loss, fused.lm_head.weight)[0]
        gb = torch.autograd.grad(b.loss, plain.lm_head.weight)[0]
        assert a.logits is None and ga.dtype == torch.float32
        # under autocast both take bf16 logits (the fused op in fp32 would be off by ~1e-5 and ~3e-3 here)
        torch.testing.assert_close(a.loss, b.loss, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(ga, gb, rtol=0, atol=1e-4 * gb.abs().max().item())
