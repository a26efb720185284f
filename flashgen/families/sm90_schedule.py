"""The sm90 forward's dynamic schedule on packed (varlen) batches: the work-order table the
kernel's CTAs draw from (args.h FgWorkQueue, sm90/fwd.cuh ``dynamic``), and a model of the
static and dynamic schedules' makespans that the tests check the table by.

Work items are enumerated as the kernel's work index enumerates them (sm90/fwd.cuh ``coord``):
sequence b owns slots [slot(b), slot(b + 1)) with slot(b) = b + cu_seqlens_q[b] // block_m, and
index w = heads_q * slot(b) + h * n_b + r (n_b = slot(b + 1) - slot(b)) is query tile
m = n_b - 1 - r of head h; the slots past the sequence's query tiles are empty. The table lists
every real item once, ranked by descending cost (the key tiles its query tile visits under the
spec's mask; ties in sequence and query-tile order), then -1 up to the kernel's heads_q * (batch + total_q //
block_m) indices, so any rank the kernel draws is inside it.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import torch

from .. import reference
from ..lang import expr, ir, keyrange

# The names a key range may use for the host to evaluate it per sequence (anything else, a
# parameter or b / h, makes every item of a sequence cost its full key range).
_LENGTH_NAMES = frozenset({"q", "seqlen_q", "seqlen_k"})


def total_work(heads_q: int, batch: int, total_q: int, block_m: int) -> int:
    """The kernel's work indices of a packed batch: heads_q * (batch + total_q // block_m)."""
    return heads_q * (batch + total_q // block_m)


def slots(cu_q: Sequence[int], block_m: int) -> torch.Tensor:
    """slot(b) for b in 0 .. batch (sm90/fwd.cuh ``coord``), int64."""
    cq = torch.as_tensor(cu_q, dtype=torch.int64)
    return torch.arange(cq.numel()) + cq // block_m


def _evaluable(spec: ir.Spec) -> bool:
    """Whether the spec's closed-form key range depends on the sequence lengths and q alone."""
    rng = keyrange.key_range(spec)
    for e in (rng.row_lo(), rng.row_hi()):
        for n in expr.walk(e) if e is not None else ():
            if isinstance(n, ir.Index) or (isinstance(n, ir.Name) and n.id not in _LENGTH_NAMES):
                return False
    return True


def tile_costs(spec: ir.Spec | None, len_q: int, len_k: int, block_m: int, block_n: int) -> list[int]:
    """Per query tile of a sequence of len_q queries and len_k keys: the key tiles of block_n
    keys it visits, from the hull of its rows' closed-form key ranges (the range the kernel's
    kv_lo / kv_hi bound it by); every key tile where the range is not evaluable on the host
    (``spec`` None: no mask)."""
    n_m = -(-len_q // block_m)
    full = -(-len_k // block_n)
    if spec is None or spec.mask is None or len_k == 0 or not _evaluable(spec):
        return [full] * n_m
    rng = keyrange.key_range(spec)
    env = {"q": torch.arange(len_q, dtype=torch.int64), "seqlen_q": len_q, "seqlen_k": len_k}

    def bound(e: ir.Expr | None, default: int) -> torch.Tensor:  # per row, as explain's geometry
        if e is None:
            return torch.full((len_q,), default, dtype=torch.int64)
        out = torch.as_tensor(reference.evaluate(e, spec, env, {}, torch.float64)).to(torch.int64)
        return torch.broadcast_to(out, (len_q,)).clamp(0, len_k)

    lo, hi = bound(rng.row_lo(), 0), bound(rng.row_hi(), len_k)
    out = []
    for m in range(n_m):
        a, b = m * block_m, min((m + 1) * block_m, len_q)
        kv_lo, kv_hi = int(lo[a:b].min()), int(hi[a:b].max())
        out.append((kv_hi - 1) // block_n - kv_lo // block_n + 1 if kv_hi > kv_lo else 0)
    return out


def tiles(spec: ir.Spec | None, cu_q: Sequence[int], cu_k: Sequence[int], block_m: int,
          block_n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every real query tile of a packed batch, in sequence order: (sequence, tile index within
    it, cost) int64 tensors, for all sequences at once. The key range is evaluated at each
    tile's first and last rows, as the kernel's kv_lo / kv_hi fold a tile's bounds from its end
    rows (the closed-form bounds are monotone in q: the hull of its rows' ranges, which
    ``tile_costs`` takes row by row)."""
    cq, ck = torch.as_tensor(cu_q, dtype=torch.int64), torch.as_tensor(cu_k, dtype=torch.int64)
    lq, lk = cq[1:] - cq[:-1], ck[1:] - ck[:-1]
    batch = lq.numel()
    n_m = (lq + block_m - 1) // block_m
    ends = torch.cumsum(n_m, 0)
    tile = torch.arange(int(ends[-1]) if batch else 0)
    # (searchsorted and index_select: repeat_interleave and advanced indexing take milliseconds
    # on the CPU at these sizes)
    tile_b = torch.searchsorted(ends, tile, right=True)
    tile_m = tile - (ends - n_m).index_select(0, tile_b)
    full = ((lk + block_n - 1) // block_n).index_select(0, tile_b)
    if spec is None or spec.mask is None or not _evaluable(spec) or tile_b.numel() == 0:
        return tile_b, tile_m, full
    len_q, len_k = lq.index_select(0, tile_b), lk.index_select(0, tile_b)
    first = tile_m * block_m
    q = torch.cat([first, torch.minimum(first + block_m, len_q) - 1])  # the end rows of each tile
    sq, sk = len_q.repeat(2), len_k.repeat(2)
    rng = keyrange.key_range(spec)
    env = {"q": q, "seqlen_q": sq, "seqlen_k": sk}

    def bound(e: ir.Expr | None, default: torch.Tensor) -> torch.Tensor:  # per row, clamped to [0, len_k]
        if e is None:
            return default
        out = torch.as_tensor(reference.evaluate(e, spec, env, {}, torch.float64)).to(torch.int64)
        return torch.minimum(torch.broadcast_to(out, q.shape).clamp(min=0), sk)

    n = tile_b.numel()
    lo, hi = bound(rng.row_lo(), torch.zeros_like(q)), bound(rng.row_hi(), sk)
    t_lo, t_hi = torch.minimum(lo[:n], lo[n:]), torch.maximum(hi[:n], hi[n:])
    cost = torch.where(t_hi > t_lo, (t_hi - 1) // block_n - t_lo // block_n + 1, torch.zeros_like(t_hi))
    return tile_b, tile_m, cost


def work_index(spec: ir.Spec | None, cu_q: Sequence[int], cu_k: Sequence[int], heads_q: int, block_m: int,
               block_n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every real work item of a packed batch: (work index, cost) int64 tensors, head-major."""
    tile_b, tile_m, cost = tiles(spec, cu_q, cu_k, block_m, block_n)
    slot = slots(cu_q, block_m)
    s0, n = slot[:-1].index_select(0, tile_b), (slot[1:] - slot[:-1]).index_select(0, tile_b)
    h = torch.arange(heads_q).view(-1, 1)
    w = heads_q * s0 + h * n + (n - 1 - tile_m)
    return w.reshape(-1), cost.expand(heads_q, -1).reshape(-1)


def work_items(spec: ir.Spec | None, cu_q: Sequence[int], cu_k: Sequence[int], heads_q: int, block_m: int,
               block_n: int) -> dict[int, int]:
    """Every real work item of a packed batch, work index -> cost (key tiles visited)."""
    w, cost = work_index(spec, cu_q, cu_k, heads_q, block_m, block_n)
    return dict(zip(w.tolist(), cost.tolist(), strict=True))


def work_order(spec: ir.Spec | None, cu_q: Sequence[int], cu_k: Sequence[int], heads_q: int, block_m: int,
               block_n: int) -> torch.Tensor:
    """The work-order table (args.h FgWorkQueue.order), int32 on the CPU: the real items' work
    indices by descending cost (ties: sequence, then query tile; the heads of a query tile
    together, in order), then -1 up to ``total_work`` entries. Sorts query tiles, not items
    (every head of a tile costs the same)."""
    tile_b, tile_m, cost = tiles(spec, cu_q, cu_k, block_m, block_n)
    n_work = total_work(heads_q, len(cu_q) - 1, int(cu_q[-1]), block_m)
    table = torch.full((n_work,), -1, dtype=torch.int32)
    if tile_b.numel():
        perm = torch.argsort(-cost, stable=True)
        slot = slots(cu_q, block_m)
        b, m = tile_b.index_select(0, perm), tile_m.index_select(0, perm)
        s0, n = slot[:-1].index_select(0, b).view(-1, 1), (slot[1:] - slot[:-1]).index_select(0, b).view(-1, 1)
        w = heads_q * s0 + torch.arange(heads_q).view(1, -1) * n + (n - 1 - m.view(-1, 1))
        table[: w.numel()] = w.reshape(-1).to(torch.int32)
    return table


# ---------------------------------------------------------------------------- the model

ITEM_OVERHEAD = 1.0  # an item's fixed cost (Q load, epilogue) in key tiles, for the makespans


def static_loads(items: dict[int, int], n_work: int, grid: int) -> list[float]:
    """Each CTA's work under the static persistent schedule (sm90/fwd.cuh ``work_of``: rounds
    of ``grid`` indices, CTAs in reverse order in odd rounds); empty slots cost nothing."""
    loads = [0.0] * grid
    for w in range(n_work):
        rnd, pos = divmod(w, grid)
        cta = grid - 1 - pos if rnd & 1 else pos
        if w in items:
            loads[cta] += items[w] + ITEM_OVERHEAD
    return loads


def dynamic_loads(items: dict[int, int], order: Sequence[int], grid: int) -> list[float]:
    """Each CTA's work under the dynamic schedule: the items in table order, each taken by the
    CTA that frees up first (list scheduling; ties by CTA index)."""
    heap = [(0.0, c) for c in range(grid)]
    for w in (order.tolist() if isinstance(order, torch.Tensor) else order):
        if w < 0:
            break
        t, c = heapq.heappop(heap)
        heapq.heappush(heap, (t + items[w] + ITEM_OVERHEAD, c))
    loads = [0.0] * grid
    for t, c in heap:
        loads[c] = t
    return loads


def imbalance(loads: Sequence[float]) -> float:
    """max / mean of the CTAs' loads (1.0: perfectly even; the makespan over the ideal)."""
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean else 1.0
