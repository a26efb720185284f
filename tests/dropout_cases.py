"""Shared by the dropout tests of the CPU family (test_dropout.py) and of the CUDA family
(test_gpu_dropout.py): specs with dropout, inputs, and one forward + backward checked against the
float64 reference computed with the regenerated keep mask."""

from __future__ import annotations

import torch
from variant_cases import SPECS, alibi_slopes

import flashgen
from flashgen import check

# Dropout with a score modification: ALiBi takes the backward's score-mod path with a parameter
# gradient, window + softcap the one that multiplies dscore in the gemm epilogue.
ALIBI = """
attention alibi_dropout {
    param slopes: f32[heads]
    mask  = causal
    score = score + slopes[h] * (kv - q - (seqlen_k - seqlen_q))
    dropout
}
"""
WINDOW_SOFTCAP = """
attention window_softcap_dropout {
    param window: int
    param softcap: float
    mask  = kv <= q + (seqlen_k - seqlen_q) and kv > q + (seqlen_k - seqlen_q) - window
    score = softcap * tanh(score / softcap)
    dropout
}
"""


TEXT = {"alibi": ALIBI, "window_softcap": WINDOW_SOFTCAP}


def spec_op(name: str) -> flashgen.AttentionOp:
    """'dropout' (specs/dropout.attn: causal), 'alibi' or 'window_softcap'."""
    return flashgen.compile(TEXT.get(name) or SPECS / f"{name}.attn")


def make_params(name: str, Hq: int, device, g: torch.Generator) -> dict:
    if name == "alibi":
        return {"slopes": alibi_slopes(Hq, device)}
    if name == "window_softcap":
        return {"window": int(torch.randint(1, 200, (1,), generator=g)), "softcap": 5.0}
    return {}


def run_case(name, B, Hq, Hkv, Nq, Nk, d, dtype, p, *, seed=0, dropout_seed=1234, device="cpu"):
    """Forward and backward of spec ``name`` with dropout, checked against the float64 reference
    with the regenerated mask (and against the same reference without dropout: it must differ)."""
    op = spec_op(name)
    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(B, h, n, d, generator=g).to(dtype).to(device)
                     for h, n in ((Hq, Nq), (Hkv, Nk), (Hkv, Nk), (Hq, Nq)))
    params = make_params(name, Hq, device, g)
    where = f"{name} B={B} Hq={Hq} Hkv={Hkv} Nq={Nq} Nk={Nk} d={d} {dtype} p={p}"
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    call = {n: (x.clone().requires_grad_() if n in op.grad_params else x) for n, x in params.items()}
    out, lse = op(qq, kk, vv, return_lse=True, dropout_p=p, dropout_seed=dropout_seed, **call)
    drop = {"dropout_p": p, "dropout_seed": dropout_seed}
    cmp = check.compare(op.spec, q, k, v, out.detach(), lse.detach(), **drop, **params)
    assert cmp.ok, f"{where}: forward {cmp}"
    assert not check.compare(op.spec, q, k, v, out.detach(), lse.detach(), **params).ok, f"{where}: no dropout?"
    out.backward(dout)
    pgrads = {n: call[n].grad for n in op.grad_params}
    gc = check.compare_grads(op.spec, q, k, v, dout, (qq.grad, kk.grad, vv.grad), params=params,
                             param_grads=pgrads, out=out, **drop)
    assert gc.ok, f"{where}: backward {gc}"


def inputs(B=2, Hq=4, Hkv=2, N=129, d=32, dtype=torch.float32, seed=0):
    """q, k, v, dout (seqlen_q = seqlen_k = N) on the CPU."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, h, N, d, generator=g).to(dtype) for h in (Hq, Hkv, Hkv, Hq)]


def fwd_bwd(op, q, k, v, dout, **kw):
    """(out, dq, dk, dv) of one call with keywords ``kw``."""
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    out = op(qq, kk, vv, **kw)
    out.backward(dout)
    return out.detach(), qq.grad, kk.grad, vv.grad
