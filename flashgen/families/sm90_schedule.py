"""The sm90 forward's dynamic schedule on packed (varlen) batches: the work-order table the
kernel's CTAs draw from (args.h FgWorkQueue, sm90/fwd.cuh ``dynamic``), and a model of the
static and dynamic schedules' makespans that the tests check the table by.

Work items are enumerated as the kernel's work index enumerates them (sm90/fwd.cuh ``coord``):
sequence b owns slots [slot(b), slot(b + 1)) with slot(b) = b + cu_seqlens_q[b] // block_m, and
index w = heads_q * slot(b) + h * n_b + r (n_b = slot(b + 1) - slot(b)) is query tile
m = n_b - 1 - r of head h; the slots past the sequence's query tiles are empty. The table lists
every real item once, ranked by descending cost (the key tiles its query tile visits under the
spec's mask; ties by work index), then -1 up to the kernel's heads_q * (batch + total_q //
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


def slots(cu_q: Sequence[int], block_m: int) -> list[int]:
    """slot(b) for b in 0 .. batch (sm90/fwd.cuh ``coord``)."""
    return [b + int(c) // block_m for b, c in enumerate(cu_q)]


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


def work_items(spec: ir.Spec | None, cu_q: Sequence[int], cu_k: Sequence[int], heads_q: int, block_m: int,
               block_n: int) -> dict[int, int]:
    """Every real work item of a packed batch, work index -> cost (key tiles visited)."""
    sl = slots(cu_q, block_m)
    items: dict[int, int] = {}
    memo: dict[tuple[int, int], list[int]] = {}
    for b in range(len(cu_q) - 1):
        len_q, len_k = int(cu_q[b + 1]) - int(cu_q[b]), int(cu_k[b + 1]) - int(cu_k[b])
        n = sl[b + 1] - sl[b]
        costs = memo.get((len_q, len_k))
        if costs is None:
            costs = memo[(len_q, len_k)] = tile_costs(spec, len_q, len_k, block_m, block_n)
        for h in range(heads_q):
            for m, c in enumerate(costs):  # m < ceil(len_q / block_m) <= n
                items[heads_q * sl[b] + h * n + (n - 1 - m)] = c
    return items


def work_order(spec: ir.Spec | None, cu_q: Sequence[int], cu_k: Sequence[int], heads_q: int, block_m: int,
               block_n: int) -> list[int]:
    """The work-order table (args.h FgWorkQueue.order): the real items' work indices by
    descending cost (ties: ascending index), then -1 up to ``total_work`` entries."""
    items = work_items(spec, cu_q, cu_k, heads_q, block_m, block_n)
    ranked = sorted(items, key=lambda w: (-items[w], w))
    n = total_work(heads_q, len(cu_q) - 1, int(cu_q[-1]), block_m)
    return ranked + [-1] * (n - len(ranked))


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
    for w in order:
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
