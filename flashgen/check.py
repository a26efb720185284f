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


def compare(spec, q, k, v, out, lse, *, scale=None, atol: float | None = None) -> Comparison:
    """Compare a kernel's (out, lse) for inputs q, k, v with the reference of ``spec``."""
    ref64, lse64 = reference.attention(spec, q.double(), k.double(), v.double(), scale=scale, return_lse=True)
    if q.dtype == torch.float32:  # the input dtype is the compute dtype: ref_lowp is ref64 rounded
        ref_lo, lse_lo = ref64.float(), lse64.float()
    else:
        ref_lo, lse_lo = reference.attention(spec, q, k, v, scale=scale, return_lse=True)
    atol = 1e-5 if atol is None else atol
    out64, lsek = out.double(), lse.double()
    empty = torch.isneginf(lse64)
    finite = ~empty
    # LSE: the same rule, plus a few fp32 ulps of |lse| (the kernel's m·scale and log(l) round).
    lse_slack = 2 * _max_abs((lse_lo.double() - lse64)[finite]) + 1e-4
    lse_excess = ((lsek - lse64).abs() - 1e-6 * lse64.abs())[finite]
    lse_err = _max_abs(lse_excess.clamp(min=0))
    empty_ok = bool(torch.isneginf(lsek[empty]).all()) and bool((out64[empty] == 0).all())
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


def reference_grads(spec, q, k, v, dout, *, scale=None, dlse=None):
    """(dq, dk, dv) of the reference by autograd, in the dtype of q/k/v (float64 for the oracle).

    With fp16/bf16 inputs the products and their gradients run in that dtype (FlashAttention's
    test reference for the backward), softmax in fp32."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = reference.attention(spec, q, k, v, scale=scale, return_lse=True,
                                   lowp_matmuls=q.dtype in (torch.float16, torch.bfloat16))
    loss = (out.to(dout.dtype) * dout).sum()
    if dlse is not None:
        finite = torch.isfinite(lse)
        loss = loss + torch.where(finite, lse, torch.zeros_like(lse)).mul(dlse.to(lse.dtype)).sum()
    dq, dk, dv = torch.autograd.grad(loss, (q, k, v))
    return dq, dk, dv


def compare_grads(spec, q, k, v, dout, grads, *, scale=None, dlse=None, atol: float = 1e-5) -> GradComparison:
    """Compare a kernel's (dq, dk, dv) for loss = Σ out·dout (+ Σ lse·dlse) with the reference's."""
    g64 = reference_grads(spec, q.double(), k.double(), v.double(), dout.double(), scale=scale,
                          dlse=None if dlse is None else dlse.double())
    if q.dtype == torch.float32:
        glo = [g.float() for g in g64]
    else:
        glo = reference_grads(spec, q, k, v, dout, scale=scale, dlse=dlse)
    errors, bounds = {}, {}
    for name, g, ref, lo in zip(("dq", "dk", "dv"), grads, g64, glo, strict=True):
        errors[name] = _max_abs(g.double() - ref)
        bounds[name] = 2 * _max_abs(lo.double() - ref) + atol
    return GradComparison(errors, bounds, nan=any(bool(torch.isnan(g).any()) for g in grads))
