"""Semantics of flashgen.reference, pinned against independent constructions and torch SDPA."""

import math

import pytest
import torch
import torch.nn.functional as F

from flashgen import reference
from flashgen.lang import frontend

DENSE = frontend.parse("attention d {}")
CAUSAL = frontend.parse("attention c { mask = causal }")
TOP_LEFT = frontend.parse("attention t { mask = causal_top_left }")


def rand(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("nq, nk", [(3, 5), (5, 3), (4, 4), (1, 6)])
def test_causal_alignment(nq, nk):
    ones = torch.ones(nq, nk, dtype=torch.bool)
    assert torch.equal(reference.keep_mask(CAUSAL, nq, nk)[0, 0], ones.tril(diagonal=nk - nq))  # bottom-right
    assert torch.equal(reference.keep_mask(TOP_LEFT, nq, nk)[0, 0], ones.tril(diagonal=0))
    assert reference.keep_mask(DENSE, nq, nk) is None


@pytest.mark.parametrize("spec, causal", [(DENSE, False), (CAUSAL, True)])
def test_matches_sdpa_float64(spec, causal):
    q, k, v = rand(2, 3, 37, 16, seed=1), rand(2, 3, 37, 16, seed=2), rand(2, 3, 37, 16, seed=3)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    torch.testing.assert_close(reference.attention(spec, q, k, v), ref, rtol=1e-12, atol=1e-12)


def test_top_left_matches_sdpa_is_causal_when_lengths_differ():
    q, k, v = rand(1, 2, 9, 8, seed=1), rand(1, 2, 13, 8, seed=2), rand(1, 2, 13, 8, seed=3)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # SDPA aligns top-left
    torch.testing.assert_close(reference.attention(TOP_LEFT, q, k, v), ref, rtol=1e-12, atol=1e-12)


def test_lse_and_scale():
    q, k, v = rand(1, 1, 5, 8, seed=1), rand(1, 1, 7, 8, seed=2), rand(1, 1, 7, 8, seed=3)
    out, lse = reference.attention(DENSE, q, k, v, scale=0.3, return_lse=True)
    s = (q @ k.transpose(-1, -2)) * 0.3
    torch.testing.assert_close(lse, torch.logsumexp(s, -1))
    torch.testing.assert_close(out, torch.softmax(s, -1) @ v)
    assert reference.default_scale(DENSE, 64) == 1 / math.sqrt(64)
    assert reference.default_scale(frontend.parse("attention s { scale = 0.25 }"), 64) == 0.25


def test_empty_rows_zero_output_and_neg_inf_lse():
    q, k, v = rand(1, 2, 6, 8, seed=1), rand(1, 2, 2, 8, seed=2), rand(1, 2, 2, 8, seed=3)
    out, lse = reference.attention(CAUSAL, q, k, v, return_lse=True)  # rows 0..3 see no key
    assert torch.equal(out[:, :, :4], torch.zeros_like(out[:, :, :4]))
    assert torch.isneginf(lse[:, :, :4]).all() and torch.isfinite(lse[:, :, 4:]).all()
    assert not out.isnan().any()


def test_zero_length_keys():
    out, lse = reference.attention(DENSE, rand(1, 1, 3, 8), rand(1, 1, 0, 8), rand(1, 1, 0, 8), return_lse=True)
    assert torch.equal(out, torch.zeros(1, 1, 3, 8, dtype=torch.float64)) and torch.isneginf(lse).all()


def test_gqa_is_repeat_interleave_not_tiling():
    q, k, v = rand(1, 4, 5, 8, seed=1), rand(1, 2, 5, 8, seed=2), rand(1, 2, 5, 8, seed=3)
    got = reference.attention(DENSE, q, k, v)
    interleave = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1))
    tiling = F.scaled_dot_product_attention(q, k.repeat(1, 2, 1, 1), v.repeat(1, 2, 1, 1))
    torch.testing.assert_close(got, interleave)
    assert not torch.allclose(got, tiling)
    with pytest.raises(ValueError, match="kv heads"):
        reference.attention(DENSE, rand(1, 3, 5, 8), k, v)


def test_low_precision_emulation_rounds_p():
    q, k, v = (rand(1, 1, 64, 32, seed=s).bfloat16() for s in (1, 2, 3))
    lo = reference.attention(DENSE, q, k, v)
    hi = reference.attention(DENSE, q.double(), k.double(), v.double())
    assert lo.dtype == torch.bfloat16
    err = (lo.double() - hi).abs().max()
    assert 0 < err < 2e-2


def test_visible_pairs():
    for spec in (DENSE, CAUSAL, TOP_LEFT):
        for nq, nk in ((5, 9), (9, 5), (7, 7), (0, 3)):
            mask = reference.keep_mask(spec, nq, nk)
            expected = nq * nk if mask is None else int(mask.sum())
            assert reference.visible_pairs(spec, nq, nk) == expected


def _grads(spec, q, k, v, dout, **params):
    """(out, lse, [grads of q, k, v and the float64 tensor parameters])."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, *params.values())]
    out, lse = reference.attention(spec, *leaves[:3], return_lse=True, **dict(zip(params, leaves[3:], strict=True)))
    grads = torch.autograd.grad((out * dout).sum(), leaves)
    return out, lse, grads


def _oracle(q, k, v, dout, score_fn, keep, **params):
    """The same as ``_grads`` from a hand-written attention whose score modification
    ``score_fn(s, i, j, **params)`` is only ever given safe inputs, masked by ``keep`` [Nq, Nk]."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, *params.values())]
    ql, kl, vl = leaves[:3]
    i = torch.arange(q.shape[2], dtype=torch.float64).view(-1, 1)
    j = torch.arange(k.shape[2], dtype=torch.float64).view(1, -1)
    s = score_fn((ql @ kl.transpose(-1, -2)) / math.sqrt(q.shape[-1]), i, j, *leaves[3:])
    s = torch.where(keep, s, float("-inf"))
    lse = torch.logsumexp(s, -1)
    out = torch.softmax(s, -1) @ vl
    return out, lse, torch.autograd.grad((out * dout).sum(), leaves)


@pytest.mark.parametrize("case", ["sqrt", "log", "divide", "parameter", "where"])
def test_score_non_finite_only_where_unused_leaves_no_nan_gradient(case):
    """A score expression that is non-finite only at keys the mask removes (sqrt or log of
    q - kv, a division by q - kv + 1: negative or zero above the diagonal), or only in the
    branch of a where that is not selected, gives exact outputs and finite, exact gradients:
    the reference substitutes safe operands there (a double where), so its selections never pass
    0 · NaN or 0 · inf back."""
    nq = nk = 7
    q, k, v, dout = (rand(2, 2, nq, 8, seed=s) for s in range(4))
    params = {}
    causal = torch.ones(nq, nk, dtype=torch.bool).tril()
    if case == "sqrt":
        body, keep = "mask = causal; score = score * sqrt(q - kv + 1)", causal
        fn = lambda s, i, j: s * torch.sqrt((i - j + 1).clamp(min=1))  # noqa: E731
    elif case == "log":
        body, keep = "mask = causal; score = score * log(q - kv + 2)", causal
        fn = lambda s, i, j: s * torch.log((i - j + 2).clamp(min=2))  # noqa: E731
    elif case == "divide":
        body, keep = "mask = causal; score = score / (q - kv + 1)", causal
        fn = lambda s, i, j: s / (i - j + 1).clamp(min=1)  # noqa: E731
    elif case == "parameter":  # the parameter's gradient too
        body, keep = "param slopes: f32[heads]; mask = causal; score = score - slopes[h] * sqrt(q - kv)", causal
        params = {"slopes": torch.tensor([0.5, 0.25], dtype=torch.float64)}
        fn = lambda s, i, j, sl: s - sl.view(1, -1, 1, 1) * torch.sqrt((i - j).clamp(min=0))  # noqa: E731
    else:  # no mask: the unselected branch is NaN (sqrt of a negative score) at kept keys
        body, keep = "score = where(score > 0, sqrt(score), score)", torch.ones(nq, nk, dtype=torch.bool)
        fn = lambda s, i, j: torch.where(s > 0, torch.sqrt(torch.where(s > 0, s, 1.0)), s)  # noqa: E731
    spec = frontend.parse(f"attention t {{ {body} }}")
    out, lse, grads = _grads(spec, q, k, v, dout, **params)
    for name, g in zip(("q", "k", "v", *params), grads, strict=True):
        assert torch.isfinite(g).all(), f"{case}: NaN or inf in the gradient of {name}"
    want_out, want_lse, want = _oracle(q, k, v, dout, fn, keep, **params)
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)
    for g, w in zip(grads, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
