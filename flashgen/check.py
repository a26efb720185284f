"""Checking a kernel's result against the float64 oracle with FlashAttention's tolerance rule.

max|out − ref64| ≤ 2·max|ref_lowp − ref64| + atol, where ref_lowp is the reference run in the
input dtype (see reference.py); plus: no NaN, exact zeros and −inf LSE where a row sees no key.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import reference


@dataclass
class Comparison:
    max_error: float
    bound: float
    lse_error: float
    lse_bound: float
    nan: bool
    empty_rows_ok: bool

    @property
    def ok(self) -> bool:
        return (not self.nan and self.empty_rows_ok and self.max_error <= self.bound
                and self.lse_error <= self.lse_bound)

    def __str__(self) -> str:
        verdict = "ok" if self.ok else "FAILED"
        return (f"{verdict}: max|out-ref64| = {self.max_error:.3e} (bound {self.bound:.3e}), "
                f"max|lse-ref64| - 1e-6|lse| = {self.lse_error:.3e} (bound {self.lse_bound:.3e})"
                + ("" if not self.nan else ", NaN present") + ("" if self.empty_rows_ok else ", empty rows wrong"))


def _max_abs(a: torch.Tensor) -> float:
    return float(a.abs().max()) if a.numel() else 0.0


def _params_as(params: dict, dtype: torch.dtype | None, device=None) -> dict:
    """Float tensor parameters converted to ``dtype`` (others as given), moved to ``device``."""
    out = {}
    for name, x in params.items():
        if isinstance(x, torch.Tensor):
            x = x.detach()
            if dtype is not None and x.is_floating_point():
                x = x.to(dtype)
            if device is not None:
                x = x.to(device)
        out[name] = x
    return out


def _varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> dict:
    """The reference's packed-layout keywords (empty for the padded layout)."""
    if cu_seqlens_q is None and cu_seqlens_k is None:
        return {}
    return {"cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k, "max_seqlen_q": max_seqlen_q,
            "max_seqlen_k": max_seqlen_k}


def compare(spec, q, k, v, out, lse, *, scale=None, atol: float | None = None, dropout_p: float = 0.0,
            dropout_seed: int | None = None, dropout_offset: int = 0, cu_seqlens_q=None, cu_seqlens_k=None,
            max_seqlen_q=None, max_seqlen_k=None, block_mask=None, **params) -> Comparison:
    """Compare a kernel's (out, lse) for inputs q, k, v (and the spec's ``params``) with the
    reference of ``spec``: float64, and in the kernel's precision for the tolerance. With
    ``dropout_p``, the references apply the keep mask regenerated from the kernel's
    ``dropout_seed`` and ``dropout_offset`` (flashgen.dropout_state). With ``cu_seqlens_q`` and
    ``cu_seqlens_k``: the packed layout (q [total_q, Hq, d], out like q, lse [Hq, total_q])."""
    p64, plo = _params_as(params, torch.float64, q.device), _params_as(params, None, q.device)
    drop = {"dropout_p": dropout_p, "dropout_seed": dropout_seed, "dropout_offset": dropout_offset,
            "block_mask": block_mask}
    drop |= _varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    ref64, lse64 = reference.attention(spec, q.double(), k.double(), v.double(), scale=scale, return_lse=True,
                                       **drop, **p64)
    # ref_lowp: the reference computed in the input dtype (fp32 for fp32 inputs: its rounding grows
    # with the size of the scores, which a score expression such as ALiBi's can make large).
    ref_lo, lse_lo = reference.attention(spec, q, k, v, scale=scale, return_lse=True, **drop, **plo)
    atol = 1e-5 if atol is None else atol
    out64, lsek = out.double(), lse.double()
    empty = torch.isneginf(lse64)
    finite = ~empty
    # LSE: the same rule, plus a few fp32 ulps of |lse| (the kernel's m·scale and log(l) round).
    lse_slack = 2 * _max_abs((lse_lo.double() - lse64)[finite]) + 1e-4
    lse_excess = ((lsek - lse64).abs() - 1e-6 * lse64.abs())[finite]
    lse_err = _max_abs(lse_excess.clamp(min=0))
    rows = empty.transpose(0, 1) if cu_seqlens_q is not None else empty  # out's rows: [total_q, Hq]
    empty_ok = bool(torch.isneginf(lsek[empty]).all()) and bool((out64[rows] == 0).all())
    return Comparison(
        max_error=_max_abs(out64 - ref64),
        bound=2 * _max_abs(ref_lo.double() - ref64) + atol,
        lse_error=lse_err,
        lse_bound=lse_slack,
        nan=bool(torch.isnan(out).any() or torch.isnan(lse).any()),
        empty_rows_ok=empty_ok,
    )


@dataclass
class GradComparison:
    errors: dict[str, float]
    bounds: dict[str, float]
    nan: bool

    @property
    def ok(self) -> bool:
        return not self.nan and all(self.errors[n] <= self.bounds[n] for n in self.errors)

    def __str__(self) -> str:
        verdict = "ok" if self.ok else "FAILED"
        parts = [f"max|{n}-ref64| = {self.errors[n]:.3e} (bound {self.bounds[n]:.3e})" for n in self.errors]
        return f"{verdict}: " + ", ".join(parts) + (", NaN present" if self.nan else "")


def reference_grads(spec, q, k, v, dout, *, scale=None, dlse=None, params=None, wrt=(), dropout=None,
                    varlen=None) -> dict:
    """Gradients of the reference by autograd, in the dtype of q/k/v (float64 for the oracle):
    {"dq", "dk", "dv"} and "d<name>" for each parameter name in ``wrt``, plus its "out" and "lse".
    ``dropout``: the reference's dropout keywords (dropout_p, dropout_seed, dropout_offset);
    ``varlen``: its packed-layout keywords (cu_seqlens_q, cu_seqlens_k, ...).

    With fp16/bf16 inputs the products and their gradients run in that dtype (FlashAttention's
    test reference for the backward), softmax in fp32."""
    params = dict(params or {})
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    leaves = {"dq": q, "dk": k, "dv": v}
    for name in wrt:
        params[name] = params[name].detach().clone().requires_grad_()
        leaves["d" + name] = params[name]
    out, lse = reference.attention(spec, q, k, v, scale=scale, return_lse=True,
                                   lowp_matmuls=q.dtype in (torch.float16, torch.bfloat16), **(dropout or {}),
                                   **(varlen or {}), **params)
    loss = (out.to(dout.dtype) * dout).sum()
    if dlse is not None:
        finite = torch.isfinite(lse)
        loss = loss + torch.where(finite, lse, torch.zeros_like(lse)).mul(dlse.to(lse.dtype)).sum()
    # A batch without a single query (every packed sequence empty) has a loss that depends on
    # nothing: every gradient is zero.
    grads = (torch.autograd.grad(loss, list(leaves.values()), allow_unused=True) if loss.requires_grad
             else [None] * len(leaves))
    return {n: (g if g is not None else torch.zeros_like(leaves[n]))
            for n, g in zip(leaves, grads, strict=True)} | {"out": out.detach(), "lse": lse.detach()}


def _longest_q(q: torch.Tensor, cu_seqlens_q) -> int:
    """seqlen_q, or the longest query sequence of a packed batch."""
    if cu_seqlens_q is None:
        return q.shape[2]
    cu = torch.as_tensor(cu_seqlens_q).to("cpu", torch.int64)
    return int((cu[1:] - cu[:-1]).max())


def compare_grads(spec, q, k, v, dout, grads, *, scale=None, dlse=None, atol: float = 1e-5, params=None,
                  param_grads=None, dropout_p: float = 0.0, dropout_seed: int | None = None,
                  dropout_offset: int = 0, out: torch.Tensor | None = None, cu_seqlens_q=None,
                  cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, block_mask=None) -> GradComparison:
    """Compare a kernel's (dq, dk, dv) — and ``param_grads`` {name: gradient} — for
    loss = Σ out·dout (+ Σ lse·dlse) with the reference's (with the kernel's dropout mask, as
    ``compare``). ``out``: the kernel's own forward output, when available; its rounding then
    enters the low-precision reference's D = rowsum(dO ∘ O) exactly as it enters the kernel's
    (otherwise the reference's own rounded output stands in for it). With ``cu_seqlens_q`` and
    ``cu_seqlens_k``: the packed layout (as ``compare``; dlse [Hq, total_q])."""
    params = params or {}
    param_grads = param_grads or {}
    wrt = tuple(param_grads)
    drop = {"dropout_p": dropout_p, "dropout_seed": dropout_seed, "dropout_offset": dropout_offset,
            "block_mask": block_mask}
    varlen = _varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    g64 = reference_grads(spec, q.double(), k.double(), v.double(), dout.double(), scale=scale,
                          dlse=None if dlse is None else dlse.double(),
                          params=_params_as(params, torch.float64, q.device), wrt=wrt, dropout=drop, varlen=varlen)
    if q.dtype == torch.float32:
        glo = {n: g.float() for n, g in g64.items()}
    else:
        # The kernels form D = rowsum(dO ∘ O) from O rounded to the input dtype (FlashAttention-2,
        # Alg. 2): dS then carries P·(D_exact − D_rounded), exactly what a gradient flowing into
        # the LSE adds. The low-precision reference gets that term too, so the tolerance covers
        # it (it matters for parameter gradients, which sum dS over whole rows).
        plo = _params_as(params, None, q.device)
        with torch.no_grad():
            out_lo = out.detach() if out is not None else \
                reference.attention(spec, q, k, v, scale=scale, lowp_matmuls=True, **drop, **varlen, **plo)
        d_shift = (dout.double() * g64["out"]).sum(-1) - (dout.double() * out_lo.double()).sum(-1)
        if varlen:  # rows [total_q, Hq] -> the LSE's [Hq, total_q]
            d_shift = d_shift.transpose(0, 1)
        dlse_lo = d_shift if dlse is None else dlse.double() + d_shift
        glo = reference_grads(spec, q, k, v, dout, scale=scale, dlse=dlse_lo, params=plo, wrt=wrt, dropout=drop,
                              varlen=varlen)
    got = dict(zip(("dq", "dk", "dv"), grads, strict=True)) | {"d" + n: g for n, g in param_grads.items()}
    errors, bounds = {}, {}
    # fp32 inputs: the backward recomputes P = exp(s - lse) in fp32, whose exponent carries an
    # absolute error of a few ulps of |s| ~ |lse| (cancellation), i.e. a relative error of P, and
    # so of every gradient, of ~|lse|·2^-24 -- not visible in ref64 rounded to fp32. A score
    # expression such as `seqlen_q * score` makes |lse| large (the fuzzer found it).
    lse64 = g64["lse"]
    big = _max_abs(lse64[torch.isfinite(lse64)]) if q.dtype == torch.float32 else 0.0
    recompute = 4 * big * 2.0 ** -24
    for name, g in got.items():
        ref, lo = g64[name], glo[name]
        errors[name] = _max_abs(g.double() - ref)
        if name in ("dq", "dk", "dv"):
            # FlashAttention's test rule adds the rounding granularity of the gradient in the input
            # dtype: 2·max|((g + 0.3) − 0.3) − g| (zero for fp32 inputs, where lo is ref64 rounded).
            lo_t = lo.to(q.dtype)
            slack = atol + 2 * _max_abs(((lo_t + 0.3) - 0.3) - lo_t) if q.dtype != torch.float32 else atol
        else:  # parameter gradients sum over many (q, kv) entries: allow for the fp32 summation
            slack = atol + 1e-5 * _max_abs(ref) * max(1, _longest_q(q, cu_seqlens_q))
        bounds[name] = 2 * _max_abs(lo.double() - ref) + slack + recompute * _max_abs(ref)
    return GradComparison(errors, bounds, nan=any(bool(torch.isnan(g).any()) for g in got.values()))
