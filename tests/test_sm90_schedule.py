"""The sm90 forward's dynamic schedule on packed batches (flashgen/families/sm90_schedule.py,
sm90/fwd.cuh ``dynamic``), on the CPU: the work-order table lists every real work item of the
kernel's enumeration exactly once (decoded here as the kernel decodes a work index, ``coord``),
ranked by descending cost, padded with -1 to the kernel's index count; and a model of the two
schedules' makespans on scripts/bench_varlen.py's mixed lengths, where the static round-robin
leaves multiprocessors idle and the ranked dynamic schedule does not."""

import itertools

import pytest
import torch
from conftest import SPECS

from flashgen.families import sm90, sm90_schedule
from flashgen.lang import frontend, ir
from flashgen.runtime import checks

BENCH_LENGTHS = [1, 0, 1000, 37, 512, 4096, 2048, 3000, 77, 1500, 3500, 200]  # bench_varlen's default
LAYOUTS = [
    (BENCH_LENGTHS, BENCH_LENGTHS),
    ([0, 1, 0, 0, 1, 129, 128, 127, 0], [5, 1, 0, 3, 0, 129, 128, 300, 0]),
    ([700, 64, 1, 129, 0, 300], [7, 0, 1, 128, 5, 300]),
    ([0, 0, 0], [0, 1, 2]),
    ([1] * 40 + [2049], [3] * 40 + [2049]),
]


def cu(lengths):
    return [0, *itertools.accumulate(lengths)]


def decode(cu_q, heads, block_m, num_m_tiles, w):
    """The kernel's work index -> (b, h, m_tile) or None for an empty slot (sm90/fwd.cuh
    ``coord`` and ``item``: the same binary search over slot(b) = b + cu_q[b] // block_m)."""
    batch = len(cu_q) - 1
    slot = lambda b: b + cu_q[b] // block_m  # noqa: E731
    lo, hi = 0, batch - 1
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        if heads * slot(mid) <= w:
            lo = mid
        else:
            hi = mid - 1
    s0, n = slot(lo), slot(lo + 1) - slot(lo)
    r = w - heads * s0
    if n <= 0 or r >= heads * n:
        return None
    h, m = r // n, n - 1 - (r - (r // n) * n)
    if m >= num_m_tiles or m * block_m >= cu_q[lo + 1] - cu_q[lo]:
        return None
    return lo, h, m


@pytest.mark.parametrize("block_m, block_n", [(128, 128), (192, 128), (128, 80)])
@pytest.mark.parametrize("layout", range(len(LAYOUTS)))
@pytest.mark.parametrize("name", ["causal", "dense", "sliding_window"])
def test_table_covers_every_item_once_longest_first(name, layout, block_m, block_n):
    spec = frontend.parse(SPECS / f"{name}.attn")
    lq, lk = LAYOUTS[layout]
    cq, ck = cu(lq), cu(lk)
    heads = 3
    table = sm90_schedule.work_order(spec, cq, ck, heads, block_m, block_n)
    assert table.dtype == torch.int32
    order = table.tolist()
    n = sm90_schedule.total_work(heads, len(lq), cq[-1], block_m)
    assert len(order) == n  # every rank the kernel may draw is inside the table
    real = [w for w in order if w >= 0]
    assert order[len(real):] == [-1] * (n - len(real))  # the end only after every real item
    assert len(set(real)) == len(real)
    num_m_tiles = -(-max(lq) // block_m)
    want = {w for w in range(n) if decode(cq, heads, block_m, num_m_tiles, w) is not None}
    assert set(real) == want
    # exactly one item per (sequence, head, query tile)
    coords = sorted(decode(cq, heads, block_m, num_m_tiles, w) for w in real)
    assert coords == sorted((b, h, m) for b, ln in enumerate(lq) for h in range(heads)
                            for m in range(-(-ln // block_m)))
    items = sm90_schedule.work_items(spec, cq, ck, heads, block_m, block_n)
    # longest first; ties by sequence, then query tile, the heads of a tile together
    assert real == sorted(real, key=lambda w: (-items[w], *decode(cq, heads, block_m, num_m_tiles, w)[::2],
                                               decode(cq, heads, block_m, num_m_tiles, w)[1]))
    # the costs of all sequences at once are each sequence's own (tile_costs, row by row)
    for w in real:
        b, _, m = decode(cq, heads, block_m, num_m_tiles, w)
        assert items[w] == sm90_schedule.tile_costs(spec, lq[b], lk[b], block_m, block_n)[m]


def test_costs_are_the_key_tiles_visited():
    causal = frontend.parse(SPECS / "causal.attn")
    dense = frontend.parse(SPECS / "dense.attn")
    assert sm90_schedule.tile_costs(causal, 1000, 1000, 128, 128) == [1, 2, 3, 4, 5, 6, 7, 8]
    assert sm90_schedule.tile_costs(dense, 1000, 1000, 128, 128) == [8] * 8
    # bottom-right aligned: 100 queries on 1000 keys see keys up to 900 + q
    assert sm90_schedule.tile_costs(causal, 100, 1000, 128, 128) == [8]
    assert sm90_schedule.tile_costs(causal, 1000, 100, 128, 128) == [0] * 7 + [1]
    assert sm90_schedule.tile_costs(causal, 5, 0, 128, 128) == [0]
    assert sm90_schedule.tile_costs(causal, 0, 7, 128, 128) == []
    # a range that reads a parameter is not evaluated on the host: every key tile
    window = frontend.parse(SPECS / "sliding_window.attn")
    assert sm90_schedule.tile_costs(window, 300, 300, 128, 128) == [3, 3, 3]
    # document ids within causal: the causal range bounds the visits (ids only mask inside it)
    document = frontend.parse(SPECS / "document.attn")
    assert sm90_schedule.tile_costs(document, 300, 300, 128, 128) == [1, 2, 3]


@pytest.mark.parametrize("grid", [132, 114])
def test_dynamic_makespan_on_mixed_lengths(grid):
    """bench_varlen's lengths at 16 heads, 128-row query tiles: the static serpentine over the
    kernel's enumeration leaves the busiest multiprocessor far above the mean, the ranked
    dynamic schedule within a few percent of it."""
    spec = frontend.parse(SPECS / "causal.attn")
    c = cu(BENCH_LENGTHS)
    items = sm90_schedule.work_items(spec, c, c, 16, 128, 128)
    order = sm90_schedule.work_order(spec, c, c, 16, 128, 128)
    n = sm90_schedule.total_work(16, len(BENCH_LENGTHS), c[-1], 128)
    static = sm90_schedule.imbalance(sm90_schedule.static_loads(items, n, grid))
    dynamic = sm90_schedule.imbalance(sm90_schedule.dynamic_loads(items, order, grid))
    assert sum(sm90_schedule.static_loads(items, n, grid)) == pytest.approx(
        sum(sm90_schedule.dynamic_loads(items, order, grid)))  # the same work, distributed
    assert static > 1.2, static
    assert dynamic < 1.02, dynamic
    # unranked (enumeration order) dynamic is worse than ranked: the order matters
    unranked = sorted(items)
    assert sm90_schedule.imbalance(sm90_schedule.dynamic_loads(items, unranked, grid)) > dynamic


def test_packed_layout_keeps_host_values_and_schedules():
    q = torch.zeros(10, 2, 8)
    cq = torch.tensor([0, 3, 3, 10], dtype=torch.int32)
    packed = checks.packed_layout(q, q, cq, cq)
    assert packed.host_cu_q.tolist() == [0, 3, 3, 10] and packed.host_cu_k.tolist() == [0, 3, 3, 10]
    assert packed.schedules == {}
    again = checks.packed_layout(q, q, cq, cq)  # the cached layout, its tables with it
    assert again == packed and again.schedules is packed.schedules and again.host_cu_q is packed.host_cu_q


def test_cpu_calls_take_no_queue():
    """The sm90 family's queue is for CUDA tensors only; anywhere else the args keep a null
    counter (the kernels' static schedule)."""
    from flashgen.abi import FgFwdArgs

    spec = frontend.parse(SPECS / "causal.attn")
    q = torch.zeros(10, 2, 8)
    cq = torch.tensor([0, 3, 3, 10], dtype=torch.int32)
    packed = checks.packed_layout(q, q, cq, cq)
    args = FgFwdArgs()
    args.heads_q = 2
    cfg = sm90.FAMILY.config(spec, "sm_90a", ir.DType.BF16, 128, packed=True)
    assert sm90.FAMILY.launch_fields(spec).fwd_packed(args, packed, cfg) is None
    assert not args.work.counter and not args.work.order


def test_packed_smem_mirror():
    """The packed instantiations' work ring (sm90/fwd.cuh kWorkBytes) after 16-byte aligned
    mbarriers, and it never changes a tile's legality or the O staging's placement."""
    assert sm90.smem_bytes(128, 128, 2, packed=True) == sm90.smem_bytes(128, 128, 2) + 8 + 64
    for d, bn, st, bm in itertools.product(range(8, 257, 8), range(16, 257, 16), (2, 3, 4), (128, 192)):
        a, b = sm90.smem_layout(d, bn, st, bm), sm90.smem_layout(d, bn, st, bm, packed=True)
        assert a[1] == b[1] and (a[0] <= sm90.SMEM_LIMIT) == (b[0] <= sm90.SMEM_LIMIT)
