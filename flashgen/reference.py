"""Reference attention in plain PyTorch, from the same IR as the kernels.

Call semantics match the compiled op (``flashgen.compile(spec)(q, k, v, ...)``). It computes in
the dtype of its inputs: pass ``.double()`` tensors for the float64 oracle; with fp16/bf16
inputs it emulates the kernels' precision (scores and softmax in fp32, P cast to the input
dtype before the P·V product, fp32 accumulation), which is what test tolerances are set from.
It materialises the Nq×Nk score matrix: for checking, not for speed.
"""

from __future__ import annotations

import math

import torch

from . import ir
from .frontend import evaluate_scale, parse


def keep_mask(spec: ir.Spec, seqlen_q: int, seqlen_k: int, device=None) -> torch.Tensor | None:
    """Bool [seqlen_q, seqlen_k]: True where query i may see key j (None: every key)."""
    q = torch.arange(seqlen_q, device=device).unsqueeze(1)
    kv = torch.arange(seqlen_k, device=device).unsqueeze(0)
    if spec.mask is ir.MaskKind.NONE:
        return None
    if spec.mask is ir.MaskKind.CAUSAL:
        return kv <= q + (seqlen_k - seqlen_q)
    if spec.mask is ir.MaskKind.CAUSAL_TOP_LEFT:
        return kv <= q
    raise NotImplementedError(spec.mask)


def default_scale(spec: ir.Spec, head_dim: int) -> float:
    """The spec's softmax scale for ``head_dim`` (1/sqrt(head_dim) unless the spec sets one)."""
    return 1.0 / math.sqrt(head_dim) if spec.scale is None else evaluate_scale(spec.scale, head_dim)


def attention(spec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None,
              return_lse: bool = False, lowp_matmuls: bool = False):
    """Exact attention of ``spec`` (an ``ir.Spec``, spec text, a path or a compiled op).

    Args:
        q: [B, Hq, Nq, d]; k, v: [B, Hkv, Nk, d] with Hq a multiple of Hkv (GQA: query head h
           reads kv head h // (Hq // Hkv)). Any floating dtype, any device.
        scale: softmax scale; default the spec's (1/sqrt(d) unless the spec sets one).
        return_lse: also return the log-sum-exp (natural log, fp32 or float64, [B, Hq, Nq]).
        lowp_matmuls: with fp16/bf16 inputs, run the two products (and so their gradients) in
           the input dtype, as FlashAttention's own test reference does; softmax stays fp32.

    Returns:
        out [B, Hq, Nq, d] in q's dtype, or (out, lse). Rows that see no key: out 0, lse -inf.
    """
    spec = _as_spec(spec)
    B, Hq, Nq, d = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    if Hq % Hkv:
        raise ValueError(f"k: {Hkv} kv heads do not divide {Hq} query heads")
    if Hkv != Hq:
        k = k.repeat_interleave(Hq // Hkv, dim=1)
        v = v.repeat_interleave(Hq // Hkv, dim=1)
    scale = default_scale(spec, d) if scale is None else scale
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    mm = q.dtype if lowp_matmuls else acc
    s = torch.matmul(q.to(mm), k.to(mm).transpose(-1, -2)).to(acc)
    if q.dtype != acc:  # the kernels' dQ = dS·K and dK = dSᵀ·Q take dS in the input dtype
        s = _RoundGrad.apply(s, q.dtype)
    s = s * scale
    keep = keep_mask(spec, Nq, Nk, q.device)
    if keep is None:
        keep = torch.ones(Nq, Nk, dtype=torch.bool, device=q.device)
    # Masking by selection ("double where"): rows with no visible key get a finite stand-in for the
    # logsumexp, then LSE −inf and P = 0, so values *and* autograd gradients stay finite there.
    row_any = keep.any(-1)
    s = torch.where(keep, s, float("-inf"))
    lse_raw = torch.logsumexp(torch.where(row_any.unsqueeze(-1), s, torch.zeros_like(s)), dim=-1)
    lse = torch.where(row_any, lse_raw, float("-inf"))
    safe = torch.where(row_any, lse_raw, torch.zeros_like(lse_raw)).unsqueeze(-1)
    p = torch.where(keep, torch.exp(s - safe), torch.zeros_like(s))
    out = torch.matmul(p.to(q.dtype).to(mm), v.to(mm)).to(q.dtype)
    return (out, lse) if return_lse else out


class _RoundGrad(torch.autograd.Function):
    """Identity forward; rounds the incoming gradient to ``dtype`` (a low-precision matmul input)."""

    @staticmethod
    def forward(ctx, x, dtype):
        ctx.dtype = dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g.to(ctx.dtype).to(g.dtype), None


def _as_spec(spec) -> ir.Spec:
    if isinstance(spec, ir.Spec):
        return spec
    if hasattr(spec, "spec") and isinstance(spec.spec, ir.Spec):
        return spec.spec
    return parse(spec)


def visible_pairs(spec: ir.Spec, seqlen_q: int, seqlen_k: int) -> int:
    """How many (query, key) pairs the mask keeps in one (batch, head): the FLOP count's basis."""
    i = torch.arange(seqlen_q, dtype=torch.int64)
    if spec.mask is ir.MaskKind.NONE:
        return seqlen_q * seqlen_k
    last = i + (seqlen_k - seqlen_q) if spec.mask is ir.MaskKind.CAUSAL else i
    return int((last + 1).clamp(0, seqlen_k).sum())
