"""Backward through the CPU family (recomputation from out and lse) against float64 autograd."""

import pytest
import torch

import flashgen
from flashgen import check
from conftest import SPECS

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def inputs(b, hq, hkv, nq, nk, d, dtype, seed, transposed=False, device="cpu"):
    g = torch.Generator(device=device).manual_seed(seed)

    def one(h, n):
        if transposed:
            return torch.randn(b, n, h, d, generator=g, device=device).to(dtype).transpose(1, 2)
        return torch.randn(b, h, n, d, generator=g, device=device).to(dtype)

    return one(hq, nq), one(hkv, nk), one(hkv, nk), one(hq, nq)


def grads(op, q, k, v, dout, **kw):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = op(q, k, v, **kw)
    out.backward(dout)
    return q.grad, k.grad, v.grad


def check_grads(op, q, k, v, dout, **kw):
    got = grads(op, q, k, v, dout, **kw)
    cmp = check.compare_grads(op.spec, q, k, v, dout, got, scale=kw.get("scale"))
    assert cmp.ok, f"{op.name} q{tuple(q.shape)} k{tuple(k.shape)} {q.dtype}: {cmp}"
    return got


SEQLENS = [(1, 1), (7, 7), (127, 129), (129, 127), (300, 7), (7, 300), (300, 300)]
CASES = [  # (hq, hkv, d, dtype, transposed)
    (2, 2, 32, "fp32", False),
    (4, 1, 64, "bf16", False),
    (4, 2, 32, "bf16", True),
    (2, 2, 64, "fp32", True),
]


@pytest.mark.parametrize("mask", ["dense", "causal"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"h{c[0]}kv{c[1]}-d{c[2]}-{c[3]}{'-T' if c[4] else ''}")
def test_gradients_against_reference(mask, case, dense_op, causal_op):
    op = dense_op if mask == "dense" else causal_op
    hq, hkv, d, dt, transposed = case
    for i, (nq, nk) in enumerate(SEQLENS):
        q, k, v, dout = inputs(2 if i % 2 else 1, hq, hkv, nq, nk, d, DTYPES[dt], seed=i, transposed=transposed)
        check_grads(op, q, k, v, dout)


def test_empty_rows_get_zero_gradients(causal_op):
    q, k, v, dout = inputs(1, 2, 2, 40, 10, 32, torch.float32, seed=1)
    dq, dk, dv = check_grads(causal_op, q, k, v, dout)
    assert torch.equal(dq[:, :, :30], torch.zeros_like(dq[:, :, :30]))  # rows 0..29 see no key
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv))


def test_keys_nobody_sees_get_zero_gradients():
    op = flashgen.compile("attention tl { mask = causal_top_left }")
    q, k, v, dout = inputs(1, 2, 2, 10, 40, 32, torch.float32, seed=2)  # keys 10.. unseen (top-left)
    dq, dk, dv = check_grads(op, q, k, v, dout)
    assert torch.equal(dk[:, :, 10:], torch.zeros_like(dk[:, :, 10:]))
    assert torch.equal(dv[:, :, 10:], torch.zeros_like(dv[:, :, 10:]))


@pytest.mark.parametrize("how", ["sum", "transpose", "slice"])
def test_non_contiguous_dout_matches_contiguous(causal_op, how):
    q, k, v, dout = inputs(2, 4, 2, 65, 70, 32, torch.bfloat16, seed=3)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = causal_op(q, k, v)
    if how == "sum":  # out.sum().backward() hands the op an expanded scalar: every stride 0
        out.sum().backward()
        expected = torch.ones_like(out)
    elif how == "transpose":
        g = torch.randn(2, 65, 4, 32).bfloat16()
        out.backward(g.transpose(1, 2))
        expected = g.transpose(1, 2).contiguous()
    else:
        big = torch.randn(2, 4, 65, 64).bfloat16()
        out.backward(big[..., :32])
        expected = big[..., :32].contiguous()
    got = (q.grad, k.grad, v.grad)
    ref = grads(causal_op, q.detach(), k.detach(), v.detach(), expected)
    for a, b in zip(got, ref, strict=True):
        assert torch.equal(a, b)


def test_gradient_through_lse(causal_op):
    q, k, v, dout = inputs(1, 2, 1, 50, 40, 32, torch.float32, seed=4)
    dlse = torch.randn(1, 2, 50)
    qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
    out, lse = causal_op(qq, kk, vv, return_lse=True)
    finite = torch.isfinite(lse)
    ((out * dout).sum() + torch.where(finite, lse, 0.0).mul(dlse).sum()).backward()
    cmp = check.compare_grads(causal_op.spec, q, k, v, dout, (qq.grad, kk.grad, vv.grad), dlse=dlse)
    assert cmp.ok, str(cmp)


def test_subset_of_inputs_requiring_grad(dense_op):
    q, k, v, dout = inputs(1, 2, 2, 20, 30, 32, torch.float32, seed=5)
    full = grads(dense_op, q, k, v, dout)
    qq = q.detach().requires_grad_()
    dense_op(qq, k, v).backward(dout)
    assert torch.equal(qq.grad, full[0])
    vv = v.detach().requires_grad_()
    dense_op(q, k, vv).backward(dout)
    assert torch.equal(vv.grad, full[2])


@pytest.mark.parametrize("flag", ["argument", "global"])
def test_deterministic_gradients_are_bitwise_repeatable(causal_op, flag):
    q, k, v, dout = inputs(2, 4, 1, 300, 257, 64, torch.bfloat16, seed=6)
    runs = []
    for _ in range(3):
        if flag == "argument":
            runs.append(grads(causal_op, q, k, v, dout, deterministic=True))
        else:
            torch.use_deterministic_algorithms(True)
            try:
                runs.append(grads(causal_op, q, k, v, dout))
            finally:
                torch.use_deterministic_algorithms(False)
    for run in runs[1:]:
        for a, b in zip(run, runs[0], strict=True):
            assert torch.equal(a, b)


def test_opcheck_with_autograd(causal_op):
    q, k, v, _ = inputs(1, 4, 2, 19, 23, 32, torch.float32, seed=7)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    torch.library.opcheck(causal_op.torch_op, (q, k, v, 0.2, False))


def test_backward_under_torch_compile(causal_op):
    q, k, v, dout = inputs(1, 2, 2, 33, 47, 32, torch.float32, seed=8)
    fn = torch.compile(lambda q, k, v: causal_op(q, k, v), fullgraph=True, backend="aot_eager")
    got = grads(fn, q, k, v, dout)
    ref = grads(causal_op, q, k, v, dout)
    for a, b in zip(got, ref, strict=True):
        assert torch.equal(a, b)


def test_zero_length_backward(dense_op):
    for nq, nk in ((0, 5), (5, 0)):
        q, k, v, dout = inputs(1, 2, 2, nq, nk, 32, torch.float32, seed=9)
        dq, dk, dv = grads(dense_op, q, k, v, dout)
        assert torch.equal(dq, torch.zeros_like(dq)) and torch.equal(dk, torch.zeros_like(dk))
        assert torch.equal(dv, torch.zeros_like(dv))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_single_query_with_strongly_negative_scores(dense_op, dtype):
    """edge-cases C12 on the CPU family (the CUDA families: test_gpu_sm90_bwd.py): one query row
    against Sk keys with every score shifted by about -125 through a constant last channel.
    The unshifted call's gradients equal the float64 reference's; the shifted call's are finite
    and the shift changes nothing (metamorphic): dV, and dQ, dK off the shift channel."""
    d = 64
    for i, nk in enumerate((1, 64, 97, 127, 128, 129)):
        q, k, v, dout = inputs(1, 2, 2, 1, nk, d, dtype, 4500 + i)
        q[..., -1], k[..., -1] = 0.0, 0.0
        plain = check_grads(dense_op, q, k, v, dout)
        qs, ks = q.clone(), k.clone()
        qs[..., -1], ks[..., -1] = 32.0, -31.25  # 32 * -31.25 / 8 = -125 added to every score
        # The shift channel's dQ, dK cancel terms of size |32| (the FlashAttention backward's D comes
        # from the rounded O, not from the recomputed P): conditioned by the shift, not by the kernel
        # (fp32: 2.8e-5 there against 1.2e-6 elsewhere); the other channels and dV carry the check,
        # against the plain call, which the reference checked.
        shifted = grads(dense_op, qs, ks, v, dout)
        assert all(torch.isfinite(g).all() for g in shifted)
        tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
        torch.testing.assert_close(shifted[2], plain[2], **tol)
        for a, b in zip(shifted[:2], plain[:2], strict=True):
            torch.testing.assert_close(a[..., :-1], b[..., :-1], **tol)


def test_raw_backward_op_names_a_wrong_need_param_grads():
    """The raw backward op (``flashgen::<spec>_bwd``) takes one need_param_grads flag per
    parameter with a gradient: another count is a ValueError naming the argument and those
    parameters, not an error from inside the launch."""
    for name, params, grads in (("causal", {}, "none"), ("alibi", {"slopes": torch.rand(2)}, "slopes")):
        op = flashgen.compile(SPECS / f"{name}.attn")
        q = torch.randn(1, 2, 8, 16)
        values = [params[p.name] for p in op.spec.params]
        out, lse = op.torch_op(q, q, q, None, False, *values)
        bwd = getattr(torch.ops.flashgen, op.torch_op.name().split("::")[1] + "_bwd")
        wrong = [False] * (len(op.grad_params) + 1)
        with pytest.raises(ValueError, match=rf"need_param_grads: expected {len(op.grad_params)} bools.*{grads}"):
            bwd(q, q, q, out, lse, torch.ones_like(out), None, None, False, *values, wrong)
