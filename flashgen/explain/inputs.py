"""The arguments of an explain call: the op, the dtype, the sizes and the spec's parameter
values (given ones, the rest filled by flashgen.params.example_params; tensors the mask does
not read only as shapes, never allocated).
"""

from __future__ import annotations

import torch

from .. import ops
from ..lang import ir
from ..lang.expr import MAX_SEQLEN, check_positive
from ..params import example_params, parse_params, shape_of
from ..runtime.checks import PARAM_TORCH_DTYPE
from ..sparsity import mask_names


def as_op(op_or_spec) -> ops.AttentionOp:
    """``op_or_spec`` as a compiled op (an op, an ir.Spec, a path or spec text; SpecError when
    it does not parse)."""
    if isinstance(op_or_spec, ops.AttentionOp):
        return op_or_spec
    return ops.compile(op_or_spec)


def as_dtype(dtype) -> ir.DType:
    """ops.as_dtype, with the error naming explain's argument."""
    try:
        return ops.as_dtype(dtype)
    except ValueError:
        raise ValueError(f"dtype: expected fp16, bf16 or fp32, got {dtype!r}") from None


def check_sizes(seqlen_q, seqlen_k, head_dim, batch, heads, kv_heads) -> None:
    for name, v in (("seqlen_q", seqlen_q), ("seqlen_k", seqlen_k), ("head_dim", head_dim), ("batch", batch),
                    ("heads", heads), ("kv_heads", kv_heads)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name}: expected an int, got {type(v).__name__}")
        if v < 1:
            raise ValueError(f"{name}: {v} is out of range (expected ≥ 1)")
    for name, v in (("seqlen_q", seqlen_q), ("seqlen_k", seqlen_k)):
        if v > MAX_SEQLEN:
            raise ValueError(f"{name}: {v} is out of range (expected ≤ 2^30 = {MAX_SEQLEN}: the kernels' positions "
                             "are 32-bit)")
    if heads % kv_heads:
        raise ValueError(f"kv_heads: {kv_heads} does not divide heads = {heads}")


def given_params(spec: ir.Spec, params) -> dict:
    """``params`` given as {name: value} or as ['NAME=VALUE', ...] (flashgen.params.parse_params, the
    --param syntax), as a dict."""
    if not params:
        return {}
    if isinstance(params, dict):
        return dict(params)
    return parse_params(spec, list(params))


def spec_params(spec: ir.Spec, given: dict, batch: int, heads: int, nq: int, nk: int) -> dict:
    """The spec's parameter values on the CPU: ``given`` ones, the rest filled by
    flashgen.params.example_params with a fixed seed (so a prediction and its measurement see
    the same values). Only the tensors the mask reads get values: the others (a bias read by
    the score alone, say) are 'meta' tensors of their shape, never allocated (a [B, H, N, N]
    fp32 bias is 17 GB at N = 16K); ``materialize`` fills them for a measurement."""
    unknown = set(given) - {p.name for p in spec.params}
    if unknown:
        raise ValueError(f"params: unknown parameter(s) {', '.join(sorted(unknown))} for spec '{spec.name}'")
    sizes = {"batch": batch, "heads": heads, "seqlen_q": nq, "seqlen_k": nk}
    for p in spec.params:  # int params size tensor dims (as example_params fills them)
        if p.kind == "int":
            sizes[p.name] = int(given[p.name]) if given.get(p.name) is not None else max(1, nk // 8)
    read = mask_names(spec)
    shaped = {}
    for p in spec.params:
        if p.is_tensor and p.name not in read and not isinstance(given.get(p.name), torch.Tensor):
            shape = shape_of(p, sizes)
            if any(n < 1 for n in shape):
                raise ValueError(f"params: {p.name}: its shape {shape} for these sizes and parameters has a dim "
                                 "below 1")
            shaped[p.name] = torch.empty(shape, dtype=PARAM_TORCH_DTYPE[p.dtype], device="meta")
    gen = torch.Generator().manual_seed(0)
    try:
        check_positive(spec, given)
        return example_params(spec, batch, heads, nq, nk, "cpu", gen, **(given | shaped))
    except (TypeError, ValueError) as e:
        raise ValueError(f"params: {e}") from None


def materialize(spec: ir.Spec, values: dict, given: dict, batch: int, heads: int, nq: int, nk: int) -> dict:
    """``values`` with its shape-only ('meta') tensors filled as example_params fills them."""
    if not any(isinstance(x, torch.Tensor) and x.is_meta for x in values.values()):
        return values
    known = {n: x for n, x in values.items() if not (isinstance(x, torch.Tensor) and x.is_meta)}
    gen = torch.Generator().manual_seed(0)
    return example_params(spec, batch, heads, nq, nk, "cpu", gen, **(given | known))
