"""The byte model: HBM (or DRAM) bytes of our kernel with its real tiles (FlashAttention's
Theorem 2 accounting), standard attention's, and the compulsory bytes, per direction, from the
tile visits of explain/geometry.py. FLOPs come from flashgen.flops.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import flops as flop_count
from ..lang import expr, ir
from .geometry import Visits
from .report import Traffic

ELEMENT_BYTES = {ir.DType.FP16: 2, ir.DType.BF16: 2, ir.DType.FP32: 4}


LSE_BYTES = 4  # fp32 LSE and D per row


ACC_BYTES = 4  # fp32 accumulators (dq_accum, dk/dv workspaces)


PARAM_BYTES = {"f32": 4, "i32": 4, "i64": 8, "bool": 1}  # tensor parameters' element sizes


@dataclass(frozen=True)
class TensorParam:
    """A tensor parameter the kernels read: ``numel`` elements of ``elt`` bytes at its actual
    shape; ``per_pair``: indexed by both the query and the key position (read per visited
    element); ``grad_reads``: reads of it in the score when it gets an fp32 gradient (0 if not)."""

    name: str
    numel: int
    elt: int
    per_pair: bool
    grad_reads: int


def tensor_params(spec: ir.Spec, values: dict) -> list[TensorParam]:
    """The spec's tensor parameters that its mask or score reads (see the module docstring)."""
    grads = {p.name for p in expr.grad_params(spec)}
    out = []
    for p in spec.params:
        if not p.is_tensor:
            continue
        reads = [n for e in (spec.mask, spec.score) if e is not None for n in expr.walk(e)
                 if isinstance(n, ir.Index) and n.base.id == p.name]
        if not reads:
            continue

        def pair(n: ir.Index) -> bool:
            uq = [expr.uses(i, "q") and not expr.uses(i, "kv") for i in n.indices]
            uk = [expr.uses(i, "kv") and not expr.uses(i, "q") for i in n.indices]
            return any(uq) and any(uk)

        value = values[p.name]
        numel = value.numel() if isinstance(value, torch.Tensor) else 1
        out.append(TensorParam(p.name, numel, PARAM_BYTES[p.dtype], any(pair(n) for n in reads),
                                max(1, len(expr.param_reads(spec, p))) if p.name in grads else 0))
    return out


def param_terms(tparams: list[TensorParam], elems: int, all_elems: int, backward: bool,
                 terms: dict, comp: dict) -> int:
    """Add the tensor parameters' terms (ours and compulsory) for one direction whose visited
    elements over every work item are ``elems`` (of ``all_elems`` = B · Hq · Nq · Nk); returns
    the bytes standard attention moves for them."""
    standard = 0
    for tp in tparams:
        size = tp.elt * tp.numel
        if tp.per_pair:
            read = tp.elt * elems
            need = min(read, size * elems // all_elems)  # its (q, kv) elements the kernel visits
        else:
            read = need = size
        terms[f"tensor param {tp.name}: reads"] = read
        comp[f"tensor param {tp.name}: read once"] = need
        if not backward:
            standard += size
        elif tp.grad_reads:
            terms[f"tensor param {tp.name}: gradient zero fill (torch.zeros)"] = ACC_BYTES * tp.numel
            terms[f"tensor param {tp.name}: gradient atomics (read + write)"] = \
                2 * ACC_BYTES * elems * tp.grad_reads
            comp[f"tensor param {tp.name}: gradient write"] = ACC_BYTES * tp.numel
            standard += ACC_BYTES * tp.numel
    return standard


def fwd_traffic(B, Hq, Hkv, nq, nk, d, e, pairs_total, v: Visits, scale: int,
                 tparams: list[TensorParam] = ()) -> Traffic:
    flops = flop_count.attention_flops(pairs_total, d, "fwd")
    terms = {
        "Q read": e * d * v.fwd_q_rows * scale,
        "K, V reads": 2 * e * d * v.fwd_kv_rows * scale,
        "O write": e * d * B * Hq * nq,
        "LSE write": LSE_BYTES * B * Hq * nq,
    }
    comp = {
        "Q read": terms["Q read"],
        "K, V reads": min(2 * e * d * v.fwd_kv_union, terms["K, V reads"]),
        "O write": terms["O write"],
        "LSE write": terms["LSE write"],
    }
    standard = B * Hq * e * (2 * nq * d + 2 * nk * d + 4 * nq * nk)
    standard += param_terms(tparams, v.fwd_elems * scale, B * Hq * nq * nk, False, terms, comp)
    return Traffic(flops, sum(terms.values()), standard, sum(comp.values()), terms, comp)


def bwd_traffic(B, Hq, Hkv, nq, nk, d, e, pairs_total, v: Visits, scale: int, kv_scale_num: int,
                 kv_scale_den: int, splits: int, tparams: list[TensorParam] = (), dq_adds: int = 1) -> Traffic:
    flops = flop_count.attention_flops(pairs_total, d, "bwd")
    rows_q = B * Hq * nq
    rows_k = B * Hkv * nk
    kv_rows = v.bwd_kv_rows * kv_scale_num // kv_scale_den
    terms = {
        "preprocess: O, dO read": 2 * e * d * rows_q,
        "preprocess: D write": LSE_BYTES * rows_q,
        "preprocess: dQ accumulator zero": ACC_BYTES * d * rows_q,
        "main: K, V reads": 2 * e * d * kv_rows,
        "main: Q, dO reads": 2 * e * d * v.bwd_q_rows * scale,
        "main: LSE, D reads": 2 * LSE_BYTES * v.bwd_q_rows * scale,
        "main: dQ atomics (read + write)": 2 * ACC_BYTES * d * v.bwd_q_rows * scale * dq_adds,
        "convert: dQ accumulator read, dq write": (ACC_BYTES + e) * d * rows_q,
        "workspace fills (torch.zeros)": ACC_BYTES * d * rows_q + (2 * ACC_BYTES * d * rows_k if Hq != Hkv else 0),
    }
    if splits > 1:
        terms["preprocess: dK, dV workspace zero"] = 2 * ACC_BYTES * d * rows_k
        terms["main: dK, dV atomics (read + write)"] = 2 * 2 * ACC_BYTES * d * rows_k * splits
        terms["convert: dK, dV workspaces read, dk, dv write"] = 2 * (ACC_BYTES + e) * d * rows_k
    else:
        terms["main: dK, dV writes"] = 2 * e * d * rows_k
    comp = {
        "O, dO reads": 2 * e * d * rows_q,
        "Q read": e * d * v.bwd_q_any * scale,
        "LSE read": LSE_BYTES * v.bwd_q_any * scale,
        "K, V reads": min(2 * e * d * v.bwd_kv_union, terms["main: K, V reads"]),
        "dQ write": e * d * rows_q,
        "dK, dV writes": 2 * e * d * rows_k,
    }
    standard = B * Hq * e * (4 * nq * d + 4 * nk * d + 7 * nq * nk)
    standard += param_terms(tparams, v.bwd_elems * scale, B * Hq * nq * nk, True, terms, comp)
    return Traffic(flops, sum(terms.values()), standard, sum(comp.values()), terms, comp)
