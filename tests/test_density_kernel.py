"""The density kernel (kernels/nats_attention/density.py) against its PyTorch reference
(reference.density_terms_reference): rho, coef (the sparsity gradient) and the KV statistics, on awkward lengths,
windows below, at and above N, rows without globals or with only globals, ties in the weights, and bf16 input.
On the CPU the kernel runs in Triton's interpreter; on a GPU for real (the `gpu` test)."""

from __future__ import annotations

import pytest
import torch

from nats_kernels.nats_attention import _env, density
from nats_kernels.nats_attention.reference import density_terms_reference, types_to_weights


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    monkeypatch.setattr(_env, "POISON", True)  # an element the kernel forgets to write is NaN


def random_weights(shape, n, gen, p=(0.2, 0.3, 0.5), dtype=torch.float32):
    types = torch.multinomial(
        torch.tensor(p), int(torch.tensor(shape).prod()) * n, replacement=True, generator=gen
    ).reshape(*shape, n)
    w = types_to_weights(types, dtype)
    return w + 0.01 * torch.rand(w.shape, generator=gen).to(dtype) * w  # not exactly one-hot: argmax decides


def check(w, window, device="cpu"):
    rho, coef, stats = density.density_terms(w.to(device), window)
    r_rho, r_coef, r_stats = density_terms_reference(w, window)
    torch.testing.assert_close(rho.cpu(), r_rho.float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(coef.cpu(), r_coef.float(), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(stats.cpu(), r_stats, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n", [1, 2, 7, 33, 100, 257])
@pytest.mark.parametrize("window", [1, 3, 16, 300])
def test_density_kernel_matches_reference(n, window):
    gen = torch.Generator().manual_seed(n * 1000 + window)
    check(random_weights((2, 3), n, gen), window)


@pytest.mark.parametrize("p", [(0.0, 0.5, 0.5), (1.0, 0.0, 0.0), (0.0, 1.0, 0.0), (0.0, 0.0, 1.0), (0.05, 0.9, 0.05)])
def test_density_kernel_extreme_type_mixes(p):
    gen = torch.Generator().manual_seed(7)
    check(random_weights((3,), 50, gen, p), 4)


def test_density_kernel_ties_and_bf16():
    """Ties resolve to the first maximal type as torch.argmax does; bf16 weights give fp32 outputs."""
    w = torch.tensor([[[1.0, 1.0, 0.0], [0.0, 1.0, 1.0], [1.0, 1.0, 1.0], [0.0, 0.0, 1.0], [0.5, 0.2, 0.5]]])
    check(w, 2)
    gen = torch.Generator().manual_seed(3)
    wb = random_weights((2, 2), 45, gen, dtype=torch.bfloat16)
    rho, coef, stats = density.density_terms(wb, 5)
    assert rho.dtype == coef.dtype == stats.dtype == torch.float32
    check(wb, 5)


def test_density_kernel_refuses_what_it_does_not_cover():
    assert not density.supported(torch.zeros(2, 8, 3, dtype=torch.float64))
    assert not density.supported(torch.zeros(1, density.MAX_N + 1, 3))
    with pytest.raises(ValueError, match="density kernel"):
        density.density_terms(torch.zeros(2, 8, 3, dtype=torch.float64), 2)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 100, 1024, 4097])
def test_density_kernel_on_gpu(n):
    gen = torch.Generator().manual_seed(n)
    check(random_weights((4, 12), n, gen), 16, "cuda")
    check(random_weights((4, 12), n, gen, dtype=torch.bfloat16), 64, "cuda")
