"""The mask's geometry for explain: which keys each query row keeps (from the closed-form
key range of flashgen.lang.keyrange.key_range where the mask has one, else the mask evaluated in chunks
of rows), block occupancy, and the tile visits a kernel with given tiles makes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .. import reference
from ..lang import ir, keyrange
from ..sparsity import mask_extents

CHUNK_ELEMS = 1 << 22  # elements of one evaluated mask chunk (rows x keys x batch x heads)


@dataclass
class Geometry:
    """Which keys each query row keeps, per (b', h') of the mask's extent [Bp, Hp]: ``first`` /
    ``last`` int64 [Bp·Hp, Nq] (the hull of the row's kept keys; first = Nk, last = -1 when it
    keeps none), the kept pairs summed over (b', h') (``pairs``), ``exact`` (each row keeps exactly
    [first, last]), and ``blocks`` {(bm, bn): bool [Bp·Hp, ⌈Nq/bm⌉, ⌈Nk/bn⌉]} (any pair kept in a
    block), for the tile sizes asked for."""

    bp: int
    hp: int
    first: torch.Tensor
    last: torch.Tensor
    pairs: int
    exact: bool
    source: str
    blocks: dict = field(default_factory=dict)


def row_bounds(spec: ir.Spec, nq: int, nk: int, bp: int, hp: int, params: dict):
    """Per query row, the key range [lo, hi) int64 [bp, hp, Nq] of the mask, from the symbolic
    range flashgen.lang.keyrange.key_range derives (the one the kernels print as C++), evaluated here
    over every row at once with flashgen.reference.evaluate and the call's parameter values;
    None when the mask has no closed form (``key_range(spec).exact`` is false). The row keeps
    exactly [lo, hi) ∩ [0, Nk)."""
    rng = keyrange.key_range(spec)
    if not rng.exact:
        return None
    return closed_form_bounds(spec, nq, nk, bp, hp, params)


def closed_form_bounds(spec: ir.Spec, nq: int, nk: int, bp: int, hp: int, params: dict):
    """Per query row, the closed-form key range [lo, hi) int64 [bp, hp, Nq] that the kernels'
    kv_lo / kv_hi hooks bound a tile's visits by, exact or not (a mask without an exact range,
    such as document ids, keeps a subset of it)."""
    rng = keyrange.key_range(spec)
    ar = lambda n: torch.arange(n, dtype=torch.int64)  # noqa: E731
    env = {"b": ar(bp).view(-1, 1, 1), "h": ar(hp).view(1, -1, 1), "q": ar(nq).view(1, 1, -1),
           "seqlen_q": nq, "seqlen_k": nk}
    shape = (bp, hp, nq)

    def val(e: ir.Expr | None, default: int) -> torch.Tensor:
        if e is None:
            return torch.full(shape, default, dtype=torch.int64)
        out = torch.as_tensor(reference.evaluate(e, spec, env, params, torch.float64)).to(torch.int64)
        return torch.broadcast_to(out, shape)

    return val(rng.row_lo(), 0), val(rng.row_hi(), nk)


def compute_geometry(spec: ir.Spec, nq: int, nk: int, batch: int, heads: int, params: dict,
              block_tiles: tuple[tuple[int, int], ...] = ()) -> Geometry:
    """The mask's row hulls (and block occupancy at ``block_tiles``): closed form for no mask,
    the causal masks and any mask with an exact per-row key range (O(Nq) time and memory per
    (b', h') of the mask's extent), else the mask evaluated in chunks of query rows (O(Nq·Nk)
    time, O(CHUNK_ELEMS) memory)."""
    kind = spec.mask_kind
    rows = torch.arange(nq, dtype=torch.int64)
    if kind in (ir.MaskKind.NONE, ir.MaskKind.CAUSAL, ir.MaskKind.CAUSAL_TOP_LEFT):
        first = torch.zeros(1, nq, dtype=torch.int64)
        if kind is ir.MaskKind.NONE:
            last = torch.full((1, nq), nk - 1, dtype=torch.int64)
        else:  # query i keeps keys [0, i + off] (bottom-right: off = Nk - Nq; top-left: 0)
            off = nk - nq if kind is ir.MaskKind.CAUSAL else 0
            last = (rows + off).clamp(max=nk - 1).view(1, nq)
        empty = last < 0
        first = torch.where(empty, torch.full_like(first, nk), first)
        last = torch.where(empty, torch.full_like(last, -1), last)
        pairs = int((last - first + 1).clamp(min=0).sum())
        geo = Geometry(1, 1, first, last, pairs, True, "closed form")
        for bm, bn in block_tiles:
            geo.blocks[(bm, bn)] = blocks_from_hulls(first, last, nq, nk, bm, bn)
        return geo

    per_b, per_h = mask_extents(spec)
    bp, hp = (batch if per_b else 1), (heads if per_h else 1)
    g = bp * hp
    bounds = row_bounds(spec, nq, nk, bp, hp, params)
    if bounds is not None:
        lo, hi = bounds
        first = lo.clamp(min=0).reshape(g, nq)
        last = (hi.clamp(max=nk) - 1).reshape(g, nq)
        empty = last < first
        first = torch.where(empty, torch.full_like(first, nk), first)
        last = torch.where(empty, torch.full_like(last, -1), last)
        pairs = int((last - first + 1).clamp(min=0).sum())
        geo = Geometry(bp, hp, first, last, pairs, True, "closed form (per-row key range)")
        for bm, bn in block_tiles:
            geo.blocks[(bm, bn)] = blocks_from_hulls(first, last, nq, nk, bm, bn)
        return geo
    step = math.lcm(16, *(bm for bm, _ in block_tiles)) if block_tiles else 16
    chunk = max(step, (CHUNK_ELEMS // max(1, g * nk)) // step * step)
    first = torch.empty(g, nq, dtype=torch.int64)
    last = torch.empty(g, nq, dtype=torch.int64)
    blocks = {t: torch.zeros(g, -(-nq // t[0]), -(-nk // t[1]), dtype=torch.bool) for t in block_tiles}
    ar = lambda lo, hi: torch.arange(lo, hi, dtype=torch.int64)
    env = {"b": ar(0, bp).view(-1, 1, 1, 1), "h": ar(0, hp).view(1, -1, 1, 1), "kv": ar(0, nk).view(1, 1, 1, -1),
           "seqlen_q": nq, "seqlen_k": nk}
    pairs = 0
    for q0 in range(0, nq, chunk):
        q1 = min(nq, q0 + chunk)
        m = reference.evaluate(spec.mask, spec, env | {"q": ar(q0, q1).view(1, 1, -1, 1)}, params, torch.float64)
        keep = torch.broadcast_to(m.to(torch.bool), (bp, hp, q1 - q0, nk)).reshape(g, q1 - q0, nk)
        pairs += int(keep.sum())
        has = keep.any(-1)
        u8 = keep.to(torch.uint8)
        first[:, q0:q1] = torch.where(has, u8.argmax(-1), torch.full_like(has, nk, dtype=torch.int64))
        last[:, q0:q1] = torch.where(has, nk - 1 - u8.flip(-1).argmax(-1), torch.full_like(has, -1, dtype=torch.int64))
        for (bm, bn), out in blocks.items():
            rpad, kpad = -(-(q1 - q0) // bm) * bm, out.shape[2] * bn
            buf = torch.zeros(g, rpad, kpad, dtype=torch.bool)
            buf[:, :q1 - q0, :nk] = keep
            occ = buf.view(g, rpad // bm, bm, kpad // bn, bn).any(4).any(2)
            out[:, q0 // bm:q0 // bm + rpad // bm] |= occ
    return Geometry(bp, hp, first, last, pairs, keyrange.key_range(spec).exact, "mask evaluated", blocks)


def mask_geometry(spec: ir.Spec, nq: int, nk: int, batch: int, heads: int, values: dict, given: dict,
                   block_tiles=()) -> Geometry:
    """compute_geometry, with a mask that indexes a parameter out of its bounds at these sizes (say a
    document-id mask [batch, seqlen_k] indexed by q with seqlen_q > seqlen_k) reported as a
    ValueError naming what to change: the parameter when it was given as a tensor, else
    seqlen_k (when it differs from seqlen_q) or params."""
    try:
        return compute_geometry(spec, nq, nk, batch, heads, values, block_tiles)
    except IndexError as err:
        name, _, detail = str(err).partition(": ")
        if isinstance(given.get(name), torch.Tensor) or nq == nk:
            what = f"params: {name}"
        else:
            what = f"seqlen_k: {nk} with seqlen_q = {nq}"
        raise ValueError(f"{what}: the mask of spec '{spec.name}' reads parameter {name} out of its bounds at these "
                         f"sizes ({detail})") from None


def blocks_from_hulls(first, last, nq, nk, bm, bn) -> torch.Tensor:
    """Block occupancy of an exact (interval-per-row) mask from its row intervals."""
    lo, hi, _ = tile_hulls(first, last, nq, bm)
    j = torch.arange(-(-nk // bn), dtype=torch.int64)
    return (hi > lo).unsqueeze(-1) & (lo.unsqueeze(-1) < (j + 1) * bn) & (hi.unsqueeze(-1) > j * bn)


def tile_hulls(first, last, nq, bm):
    """Per query tile of ``bm`` rows: the hull [lo, hi) of its rows' kept keys ([G, T] each; 0, 0
    when empty) and its rows inside [0, Nq) ([T])."""
    g = first.shape[0]
    t = -(-nq // bm)
    pad = t * bm - nq
    big = torch.iinfo(torch.int64).max // 4
    f = torch.cat([first, torch.full((g, pad), big, dtype=torch.int64)], 1).view(g, t, bm)
    la = torch.cat([last, torch.full((g, pad), -1, dtype=torch.int64)], 1).view(g, t, bm)
    lo, hi = f.amin(-1), la.amax(-1) + 1
    empty = hi <= lo
    lo = torch.where(empty, torch.zeros_like(lo), lo)
    hi = torch.where(empty, torch.zeros_like(hi), hi)
    rows = (nq - torch.arange(t, dtype=torch.int64) * bm).clamp(max=bm)
    return lo, hi, rows


def widths(nk: int, bn: int) -> torch.Tensor:
    """Keys of each key tile inside [0, Nk)."""
    return (nk - torch.arange(-(-nk // bn), dtype=torch.int64) * bn).clamp(max=bn)


@dataclass
class Visits:
    """Tile visits summed over the geometry's (b', h'): forward K/V rows loaded, Q rows read and
    key tiles visited, the elements (query row, key) of the visited tiles; backward (query tile,
    key tile) visits as query rows, the K/V rows loaded per key tile, the visited elements and
    the rows of query tiles that visit any key tile. ``fwd_kv_union`` / ``bwd_kv_union``: the
    keys read at all, per (batch, kv head), summed over the whole batch and every kv head."""

    fwd_kv_rows: int
    fwd_q_rows: int
    fwd_tiles: int
    bwd_q_rows: int
    bwd_blocks: int
    bwd_kv_rows: int
    fwd_elems: int = 0
    bwd_elems: int = 0
    bwd_q_any: int = 0
    fwd_kv_union: int = 0
    bwd_kv_union: int = 0


def interval_union(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """[G]: the length of the union of the intervals [lo, hi) of each row of [G, T] (empty ones,
    hi ≤ lo, add nothing)."""
    order = lo.argsort(-1)
    lo, hi = lo.gather(-1, order), hi.gather(-1, order)
    hi = torch.maximum(hi, lo)
    reach = torch.cummax(hi, -1).values  # the furthest end among the intervals so far
    before = torch.cat([torch.full_like(reach[:, :1], torch.iinfo(torch.int64).min // 4), reach[:, :-1]], 1)
    return (hi - torch.maximum(lo, before)).clamp(min=0).sum(-1)


def kv_union(geo: Geometry, lo=None, hi=None, blk=None, widths=None, *, batch: int, heads: int,
              hkv: int) -> int:
    """Keys read at all, summed over every (batch, kv head): the union over the query tiles (and
    over the query heads of the kv head's group, when the mask depends on the head) of the key
    ranges [lo, hi) [G, T], or of the occupied key tiles ``blk`` [G, T, J] of ``widths`` keys."""
    bp, hp = geo.bp, geo.hp
    group = heads // hkv
    if blk is not None:
        occ = blk.any(1)  # [G, J]
        if hp > 1:
            occ = occ.view(bp, hkv, group, -1).any(2).reshape(bp * hkv, -1)
        u = int((occ.to(torch.int64) * widths).sum())
    else:
        if hp > 1:
            lo = lo.reshape(bp, hkv, group * lo.shape[-1]).reshape(bp * hkv, -1)
            hi = hi.reshape(bp, hkv, group * hi.shape[-1]).reshape(bp * hkv, -1)
        u = int(interval_union(lo, hi).sum())
    return u * (batch // bp) * (hkv if hp == 1 else 1)


def count_visits(geo: Geometry, nq: int, nk: int, fwd: tuple[int, int], bwd: tuple[int, int] | None,
            listed: bool, batch: int = 1, heads: int = 1, hkv: int = 1) -> Visits:
    """Count the loads of the forward tile (bm, bn) and backward tile (bm, bn): by ranges (the
    hull of each query tile's kept keys) or, with ``listed``, by occupied blocks (block lists)."""
    sizes = {"batch": batch, "heads": heads, "hkv": hkv}
    bm, bn = fwd
    if listed:
        blk = geo.blocks[fwd]
        w = widths(nk, bn)
        kv = (blk.to(torch.int64) * w).sum(-1)
        ntile = blk.sum(-1)
        rows = (nq - torch.arange(blk.shape[1], dtype=torch.int64) * bm).clamp(max=bm)
        f_union = kv_union(geo, blk=blk, widths=w, **sizes)
    else:
        lo, hi, rows = tile_hulls(geo.first, geo.last, nq, bm)
        kv = hi - lo
        ntile = torch.where(hi > lo, (hi - 1) // bn - lo // bn + 1, torch.zeros_like(lo))
        f_union = kv_union(geo, lo, hi, **sizes)
    f_kv, f_q, f_t = int(kv.sum()), int(((ntile > 0) * rows).sum()), int(ntile.sum())
    f_el = int((kv * rows).sum())
    if bwd is None:
        return Visits(f_kv, f_q, f_t, 0, 0, 0, fwd_elems=f_el, fwd_kv_union=f_union)
    bm, bn = bwd
    w = widths(nk, bn)
    nkt = w.numel()
    if listed:
        blk = geo.blocks[bwd]
        rows = (nq - torch.arange(blk.shape[1], dtype=torch.int64) * bm).clamp(max=bm)
        b_q = int((blk.to(torch.int64) * rows.view(1, -1, 1)).sum())
        b_n = int(blk.sum())
        b_kv = int((blk.any(1).to(torch.int64) * w).sum())
        b_el = int(((blk.to(torch.int64) * w).sum(-1) * rows).sum())
        b_any = int((blk.any(-1) * rows).sum())
        return Visits(f_kv, f_q, f_t, b_q, b_n, b_kv, f_el, b_el, b_any, f_union,
                       kv_union(geo, blk=blk, widths=w, **sizes))
    lo, hi, rows = tile_hulls(geo.first, geo.last, nq, bm)
    nonempty = hi > lo
    count = torch.where(nonempty, (hi - 1) // bn - lo // bn + 1, torch.zeros_like(lo))
    b_q = int((count * rows).sum())
    b_n = int(count.sum())
    b_el = int(((hi - lo) * rows).sum())
    b_any = int((nonempty * rows).sum())
    # K/V rows of key tile j: the tile inside [min lo, max hi) of the query tiles visiting it.
    g, t = lo.shape
    big = torch.iinfo(torch.int64).max // 4
    vlo = torch.full((g, nkt), big, dtype=torch.int64)
    vhi = torch.zeros((g, nkt), dtype=torch.int64)
    j = torch.arange(nkt, dtype=torch.int64)
    step = max(1, CHUNK_ELEMS // max(1, g * nkt))
    for i0 in range(0, t, step):
        l, h, ne = lo[:, i0:i0 + step, None], hi[:, i0:i0 + step, None], nonempty[:, i0:i0 + step, None]
        vis = ne & (l < (j + 1) * bn) & (h > j * bn)
        vlo = torch.minimum(vlo, torch.where(vis, l, torch.full_like(l, big)).amin(1))
        vhi = torch.maximum(vhi, torch.where(vis, h, torch.zeros_like(h)).amax(1))
    b_kv = int((torch.minimum(vhi, j * bn + w) - torch.maximum(vlo, j * bn)).clamp(min=0).sum())
    return Visits(f_kv, f_q, f_t, b_q, b_n, b_kv, f_el, b_el, b_any, f_union, kv_union(geo, lo, hi, **sizes))
