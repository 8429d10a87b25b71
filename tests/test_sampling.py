"""`nats.sampling.sample`: greedy at temperature 0; otherwise draws whose frequencies match the softmax they sample
(top-k and top-p cut where they should), reproducible from a seeded generator, without a host synchronisation."""

from __future__ import annotations

import math

import pytest
import torch

from nats.sampling import check_sampling, sample

LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
DRAWS = 40_000


def frequencies(logits, **kw) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    tokens = sample(logits.expand(DRAWS, -1), generator=gen, **kw)
    return torch.bincount(tokens, minlength=logits.shape[-1]).double() / DRAWS


def close_to(freq: torch.Tensor, p: torch.Tensor) -> None:
    """Each frequency within 5 standard errors of its probability (a chance failure is about 1 in 10^6 a token)."""
    tol = 5 * torch.sqrt(p * (1 - p) / DRAWS) + 1e-12
    assert ((freq - p).abs() <= tol).all(), (freq.tolist(), p.tolist())


def test_greedy_is_the_argmax():
    logits = torch.randn(5, 11, generator=torch.Generator().manual_seed(1))
    assert torch.equal(sample(logits), logits.argmax(-1))


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_draws_follow_the_softmax(temperature):
    close_to(frequencies(LOGITS, temperature=temperature), torch.softmax(LOGITS[0].double() / temperature, -1))


def test_a_wrong_distribution_fails_the_check():
    """The statistical check can fail: the draws at temperature 1 against the softmax at temperature 0.8."""
    with pytest.raises(AssertionError):
        close_to(frequencies(LOGITS, temperature=1.0), torch.softmax(LOGITS[0].double() / 0.8, -1))


def test_top_k_and_top_p_cut_the_tail():
    p = torch.softmax(LOGITS[0].double(), -1)
    top2 = torch.zeros_like(p)
    top2[:2] = p[:2] / p[:2].sum()
    close_to(frequencies(LOGITS, temperature=1.0, top_k=2), top2)
    # top_p: the most likely tokens until their probability reaches top_p (p[0] + p[1] < 0.85 <= p[0] + p[1] + p[2])
    assert p[:2].sum() < 0.85 <= p[:3].sum()
    top3 = torch.zeros_like(p)
    top3[:3] = p[:3] / p[:3].sum()
    close_to(frequencies(LOGITS, temperature=1.0, top_p=0.85), top3)
    tiny = frequencies(LOGITS, temperature=1.0, top_p=1e-6)  # the most likely token always stays
    assert tiny[0] == 1


def test_seeded_draws_are_reproducible():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(2))
    a = sample(logits, 0.9, 20, 0.95, torch.Generator().manual_seed(7))
    b = sample(logits, 0.9, 20, 0.95, torch.Generator().manual_seed(7))
    c = sample(logits, 0.9, 20, 0.95, torch.Generator().manual_seed(8))
    assert torch.equal(a, b) and a.shape == (4,)
    assert not torch.equal(torch.stack([sample(logits, 0.9, generator=torch.Generator().manual_seed(s)) for s in
                                        range(8)]), a.expand(8, -1))  # fmt: skip
    del c


@pytest.mark.parametrize(
    "args,message",
    [
        ((-1.0,), "temperature must be >= 0"),
        ((math.nan,), "temperature must be a number"),
        ((1.0, 0), "top_k must be a whole number >= 1"),
        ((1.0, 2.5), "top_k must be a whole number >= 1"),
        ((1.0, None, 0.0), r"top_p must be in \(0, 1\]"),
        ((1.0, None, 1.5), r"top_p must be in \(0, 1\]"),
    ],
)
def test_bad_settings_are_one_line(args, message):
    with pytest.raises(ValueError, match=message):
        check_sampling(*args)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_sampling_runs_without_a_host_synchronisation_on_the_gpu():
    logits = torch.randn(8, 1000, device="cuda")
    gen = torch.Generator("cuda").manual_seed(0)
    sample(logits, 0.8, 50, 0.9, gen)  # warm-up (kernels loaded outside the check)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(4):
            out = sample(logits, 0.8, 50, 0.9, gen)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.shape == (8,)
