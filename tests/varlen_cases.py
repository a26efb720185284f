"""Packed (varlen) batches, shared by the CPU tests and the GPU tests (test_varlen.py): inputs,
and one forward + backward checked against the float64 reference (which computes each sequence
on its own) and, as a cross-check, against the padded op run on each sequence alone."""

from __future__ import annotations

import torch
from variant_cases import make_params, op

from flashgen import check
from flashgen.lang import ir

# Cross-check tolerance (packed op vs padded op per sequence): the two may pick other tiles, so
# they agree to a few roundings of the output dtype, not bit for bit.
ULP = {torch.float32: 2.0**-19, torch.bfloat16: 2.0**-6, torch.float16: 2.0**-9}


def cu_seqlens(lengths, device="cpu") -> torch.Tensor:
    """int32 [len(lengths) + 1]: 0 and the running sums of ``lengths``."""
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device=device)


def inputs(lens_q, lens_k, Hq, Hkv, d, dtype, *, device="cpu", seed=0):
    """q [total_q, Hq, d], k, v [total_k, Hkv, d], dout like q (normal, from ``seed``)."""
    g = torch.Generator().manual_seed(seed)
    tq, tk = sum(lens_q), sum(lens_k)
    shapes = ((tq, Hq), (tk, Hkv), (tk, Hkv), (tq, Hq))
    return [torch.randn(n, h, d, generator=g).to(dtype).to(device) for n, h in shapes]


def sequence(t: torch.Tensor, cu: list[int], b: int) -> torch.Tensor:
    """Sequence b of a packed [total, H, d] tensor as a padded [1, H, n, d] view."""
    return t[cu[b]:cu[b + 1]].transpose(0, 1).unsqueeze(0)


def params_of_sequence(spec: ir.Spec, params: dict, b: int, nq: int, nk: int) -> dict:
    """The parameters of a packed call, cut down to sequence b alone as a padded batch of one:
    batch dims keep entry b, seqlen_q / seqlen_k dims (max_seqlen_* long) its first nq / nk."""
    out = {}
    for p in spec.params:
        x = params[p.name]
        if p.is_tensor:
            for dim_index, dim in enumerate(p.shape):
                size = dim.size
                name = size.id if isinstance(size, ir.Name) else None
                if name == "batch" and x.shape[dim_index] != 1:
                    x = x.narrow(dim_index, b, 1)
                elif name in ("seqlen_q", "seqlen_k"):
                    x = x.narrow(dim_index, 0, nq if name == "seqlen_q" else nk)
        out[p.name] = x
    return out


def run_case(name, lens_q, lens_k, Hq, Hkv, d, dtype, *, device="cpu", seed=0, variant=0, params=None,
             dropout_p=0.0, dropout_seed=1234, dlse=False, max_seqlen=None, cross_check=True):
    """Forward and backward of spec ``name`` (an example spec's name, or an op) on a packed batch
    with these per-sequence lengths, checked against the float64 reference; the gradient flows
    through out (and through the LSE with ``dlse``). ``params``: the spec's parameters (default:
    variant_cases.make_params for the batch and the max lengths). ``max_seqlen``: (max_seqlen_q,
    max_seqlen_k) to pass (default: the longest sequences, passed explicitly)."""
    fop = op(name) if isinstance(name, str) else name
    cq, ck = cu_seqlens(lens_q, device), cu_seqlens(lens_k, device)
    mq, mk = max_seqlen or (max(lens_q), max(lens_k))
    varlen = {"cu_seqlens_q": cq, "cu_seqlens_k": ck, "max_seqlen_q": mq, "max_seqlen_k": mk}
    q, k, v, dout = inputs(lens_q, lens_k, Hq, Hkv, d, dtype, device=device, seed=seed)
    if params is None and fop.spec.params:
        g = torch.Generator().manual_seed(seed + 1)
        params = make_params(fop.spec.name, len(lens_q), Hq, max(mq, 1), max(mk, 1), device, g, variant)
    params = params or {}
    drop = {"dropout_p": dropout_p, "dropout_seed": dropout_seed} if dropout_p else {}
    where = (f"{fop.spec.name} lens_q={list(lens_q)} lens_k={list(lens_k)} Hq={Hq} Hkv={Hkv} d={d} {dtype} "
             f"p={dropout_p} variant={variant}")

    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    call = {n: (x.clone().requires_grad_() if n in fop.grad_params else x) for n, x in params.items()}
    out, lse = fop(qq, kk, vv, return_lse=True, **varlen, **drop, **call)
    assert out.shape == q.shape and out.dtype == q.dtype, where
    assert lse.shape == (Hq, q.shape[0]) and lse.dtype == torch.float32, where
    cmp = check.compare(fop.spec, q, k, v, out.detach(), lse.detach(), **varlen, **drop, **params)
    assert cmp.ok, f"{where}: forward {cmp}"
    if dropout_p:
        plain = check.compare(fop.spec, q, k, v, out.detach(), lse.detach(), **varlen, **params)
        assert not plain.ok, f"{where}: dropout not applied?"
    g_lse = torch.randn(lse.shape, generator=torch.Generator().manual_seed(seed + 2)).to(device) if dlse else None
    torch.autograd.backward((out, lse) if dlse else (out,), (dout, g_lse) if dlse else (dout,))
    pgrads = {n: call[n].grad for n in fop.grad_params}
    for n, gr in pgrads.items():
        assert gr is not None and gr.shape == params[n].shape, f"{where}: gradient of {n} missing or mis-shaped"
    grads = (qq.grad, kk.grad, vv.grad)
    gc = check.compare_grads(fop.spec, q, k, v, dout, grads, dlse=g_lse, params=params, param_grads=pgrads,
                             out=out.detach(), **varlen, **drop)
    assert gc.ok, f"{where}: backward {gc}"
    # Keys of a sequence without queries (and rows of a sequence without keys) get exact zeros.
    cql, ckl = cq.tolist(), ck.tolist()
    for b in range(len(lens_q)):
        if lens_q[b] == 0:
            assert (kk.grad[ckl[b]:ckl[b + 1]] == 0).all() and (vv.grad[ckl[b]:ckl[b + 1]] == 0).all(), where
        if lens_k[b] == 0:
            rows = slice(cql[b], cql[b + 1])
            assert (out[rows] == 0).all() and torch.isneginf(lse[:, rows]).all(), where
            assert (qq.grad[rows] == 0).all(), where
    if cross_check and not dropout_p:  # the padded op keys dropout by its own batch index: skip
        cross_check_padded(fop, q, k, v, dout, g_lse, cql, ckl, params, out.detach(), lse.detach(), grads, where)
    return out.detach(), lse.detach(), grads


def cross_check_padded(fop, q, k, v, dout, dlse, cql, ckl, params, out, lse, grads, where):
    """The packed results equal, sequence by sequence, those of the padded op on that sequence
    alone (up to a few roundings: the tiles may differ). Sequences without queries or keys are
    left out (the padded op takes no zero-size parameter dims; run_case checks their zeros)."""
    dq, dk, dv = grads
    tol = ULP[q.dtype]
    for b in range(len(cql) - 1):
        nq, nk = cql[b + 1] - cql[b], ckl[b + 1] - ckl[b]
        if nq == 0 or nk == 0:
            continue
        rows = slice(cql[b], cql[b + 1])
        qs, ks, vs = (sequence(t, c, b).detach().clone().requires_grad_() for t, c in ((q, cql), (k, ckl), (v, ckl)))
        pb = params_of_sequence(fop.spec, params, b, nq, nk)
        o, lb = fop(qs, ks, vs, return_lse=True, **pb)
        if dlse is None:
            o.backward(sequence(dout, cql, b))
        else:
            torch.autograd.backward((o, lb), (sequence(dout, cql, b), dlse[:, rows].unsqueeze(0)))
        for label, got, want in (("out", out[rows], o[0].transpose(0, 1)), ("lse", lse[:, rows], lb[0]),
                                 ("dq", dq[rows], qs.grad[0].transpose(0, 1))):
            torch.testing.assert_close(got.float(), want.detach().float(), rtol=0,
                                       atol=tol * (1 + float(want.detach().float().nan_to_num(0, 0, 0).abs().max())),
                                       msg=lambda m, label=label, b=b: f"{where}: sequence {b} {label}: {m}")
        if nk:
            keys = slice(ckl[b], ckl[b + 1])
            for label, got, want in (("dk", dk[keys], ks.grad[0].transpose(0, 1)),
                                     ("dv", dv[keys], vs.grad[0].transpose(0, 1))):
                torch.testing.assert_close(got.float(), want.float(), rtol=0,
                                           atol=tol * (1 + float(want.float().abs().max())),
                                           msg=lambda m, label=label, b=b: f"{where}: sequence {b} {label}: {m}")
