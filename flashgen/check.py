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
