"""``flashgen.merge_attention``: partial attention results merged by their log-sum-exps (the
split-KV combine, shared-prefix / cascade attention, context parallelism), in plain PyTorch with
autograd.

Attention over the union of disjoint key sets K_1 ∪ … ∪ K_n is the LSE-weighted sum of the
attention over each: lse = log Σ_i exp(lse_i) and out = Σ_i exp(lse_i − lse) · out_i. A partial
whose LSE is −inf (its keys are all masked) has weight exactly 0, and a row every partial of
which is −inf gets out 0 and lse −inf, as the kernels write such a row: never NaN, forward or
backward (the guards below select, so no 0 · inf or log 0 enters a gradient).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch


def _describe(t) -> str:
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"{t.dtype} tensor of shape {tuple(t.shape)} on {t.device}"


def merge_attention(outs: Sequence[torch.Tensor] | torch.Tensor,
                    lses: Sequence[torch.Tensor] | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge partial attention results over disjoint key sets into the result over their union.

    Args:
        outs: n ≥ 1 partial outputs, each [..., N, d] (e.g. [B, H, N, d] from ``op(...,
            return_lse=True)``), one shape, dtype and device; or one tensor [n, ..., N, d].
        lses: their log-sum-exps (natural log), each [..., N] = out.shape[:-1], floating point
            (the op's are fp32), on the outputs' device; or one tensor [n, ..., N]. A packed
            call's lse [H, total] passes as ``lse.transpose(0, 1)`` next to its out [total, H, d].

    Returns:
        ``(out, lse)``: out [..., N, d] in the outputs' dtype, lse fp32 [..., N] (float64 when
        an input is); lse = log Σ exp(lse_i), out = Σ exp(lse_i − lse) · out_i computed in fp32
        (float64 when an input is). A partial with
        lse −inf has weight 0 (its out may be anything, even NaN); a row with every lse −inf gets
        out 0 and lse −inf. Differentiable (autograd, also twice) with respect to every out_i
        and lse_i, with zero gradients for −inf partials and no NaN from them.

    Raises:
        TypeError / ValueError naming ``outs`` / ``lses`` (or the entry ``outs[i]`` /
        ``lses[i]``): no partials, different counts, shapes, dtypes or devices.
    """
    for name, x in (("outs", outs), ("lses", lses)):
        if not isinstance(x, torch.Tensor) and (isinstance(x, str | bytes) or not isinstance(x, Iterable)):
            raise TypeError(f"{name}: expected a list or tuple of tensors, or one stacked tensor, got "
                            f"{type(x).__name__}")
    outs = list(outs.unbind(0)) if isinstance(outs, torch.Tensor) else list(outs)
    lses = list(lses.unbind(0)) if isinstance(lses, torch.Tensor) else list(lses)
    if not outs:
        raise ValueError("outs: expected at least one partial result")
    if len(lses) != len(outs):
        raise ValueError(f"lses: {len(lses)} entries for {len(outs)} outs (one lse per partial output)")
    first = outs[0]
    for i, (o, lse) in enumerate(zip(outs, lses, strict=True)):
        if not isinstance(o, torch.Tensor) or not o.is_floating_point() or o.dim() < 1:
            raise TypeError(f"outs[{i}]: expected a floating-point tensor [..., N, d], got {_describe(o)}")
        if o.shape != first.shape or o.dtype != first.dtype or o.device != first.device:
            raise ValueError(f"outs[{i}]: {_describe(o)} differs from outs[0]'s {_describe(first)}")
        if not isinstance(lse, torch.Tensor) or not lse.is_floating_point():
            raise TypeError(f"lses[{i}]: expected a floating-point tensor, got {_describe(lse)}")
        if lse.shape != o.shape[:-1] or lse.device != o.device:
            raise ValueError(f"lses[{i}]: expected shape {tuple(o.shape[:-1])} (outs[{i}].shape[:-1]) on "
                             f"{o.device}, got {_describe(lse)}")
    acc = torch.promote_types(torch.promote_types(first.dtype, lses[0].dtype), torch.float32)
    lse = torch.stack([x.to(acc) for x in lses])  # [n, ..., N]
    m = lse.detach().amax(0)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # all -inf (or a NaN): any finite shift
    w = torch.exp(lse - m)  # exactly 0 for -inf partials
    total = w.sum(0)
    seen = total > 0
    safe = torch.where(seen, total, torch.ones_like(total))
    merged_lse = torch.where(seen, m + torch.log(safe), torch.full_like(total, float("-inf")))
    merged_lse = torch.where(torch.isnan(total), total, merged_lse)  # a NaN partial stays NaN
    weights = w / safe  # [n, ..., N]
    zero = torch.zeros((), dtype=acc, device=first.device)
    # A weight of exactly 0 masks its out to 0 (an unused partial's out, even inf / NaN, never
    # enters the result or the weight's gradient as 0 · NaN); NaN weights (a NaN partial) propagate.
    out = sum(weights[i, ..., None] * torch.where(weights[i, ..., None] == 0, zero, outs[i].to(acc))
              for i in range(len(outs)))
    return out.to(first.dtype), merged_lse
