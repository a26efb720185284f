"""The FLOP count of an attention call, in one place (explain, bench, run, tune and the scripts
import it).

Convention (FlashAttention-2, Dao 2023, §4, and its benchmarks): the forward does two matmuls
of 2 · d FLOPs per visible (query, key) pair — Q·Kᵀ and P·V —, so 4 · d per pair; the backward
does five (recomputing S, then dV, dP, dQ, dK), counted as 2.5× the forward; forward +
backward is 3.5× the forward. Only visible pairs count (the spec's mask: a causal mask halves
the work); masked entries a tile computes anyway do not.
"""

from __future__ import annotations

from . import reference
from .lang import ir

# Half-multiples of the forward's 2 · d FLOPs per pair: kept integral so that integer pair
# counts give integer FLOPs.
_HALVES = {"fwd": 2, "bwd": 5, "fwd+bwd": 7}
KINDS = tuple(_HALVES)


def attention_flops(pairs: int | float, head_dim: int, kind: str = "fwd") -> int | float:
    """FLOPs of ``pairs`` visible (query, key) pairs — summed over every batch element and query
    head — at head dim ``head_dim``: 4 · d · pairs for ``kind`` 'fwd', 2.5× that for 'bwd', 3.5×
    for 'fwd+bwd'. An int for an int ``pairs``.

    Raises:
        ValueError: an unknown ``kind``.
    """
    halves = _HALVES.get(kind)
    if halves is None:
        raise ValueError(f"kind: expected one of {', '.join(KINDS)}, got {kind!r}")
    return 2 * head_dim * pairs * halves


def call_flops(spec: ir.Spec, seqlen_q: int, seqlen_k: int, head_dim: int, *, batch: int = 1, heads: int = 1,
               kind: str = "fwd", **params) -> float:
    """FLOPs of one call of ``spec`` (q [batch, heads, seqlen_q, head_dim], k and v with
    seqlen_k keys): ``attention_flops`` of the pairs flashgen.reference.visible_pairs counts
    with the call's parameter values ``params`` (the mask's; tensors on any device).

    Raises:
        ValueError: an unknown ``kind``; IndexError: the mask reads a parameter out of bounds.
    """
    pairs = reference.visible_pairs(spec, seqlen_q, seqlen_k, batch=batch, heads=heads, **params)
    return attention_flops(batch * heads * pairs, head_dim, kind)
