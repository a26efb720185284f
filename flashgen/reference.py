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
              return_lse: bool = False):
    """Exact attention of ``spec`` (an ``ir.Spec``, spec text, a path or a compiled op).

    Args:
        q: [B, Hq, Nq, d]; k, v: [B, Hkv, Nk, d] with Hq a multiple of Hkv (GQA: query head h
           reads kv head h // (Hq // Hkv)). Any floating dtype, any device.
        scale: softmax scale; default the spec's (1/sqrt(d) unless the spec sets one).
        return_lse: also return the log-sum-exp (natural log, fp32 or float64, [B, Hq, Nq]).

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
    s = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * scale
    keep = keep_mask(spec, Nq, Nk, q.device)
    if keep is not None:
        s = torch.where(keep, s, float("-inf"))
    lse = torch.logsumexp(s, dim=-1) if Nk else torch.full((B, Hq, Nq), float("-inf"), dtype=acc, device=q.device)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse).unsqueeze(-1)
    p = torch.exp(s - safe)
    if keep is not None:
        p = torch.where(keep, p, torch.zeros_like(p))
    out = torch.matmul(p.to(q.dtype).to(acc), v.to(acc)).to(q.dtype)
    return (out, lse) if return_lse else out


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
