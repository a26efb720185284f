"""The ``cpu`` kernel family's model for explain: its tiles, ported from the kernels'
own choice (templates/include/flashgen/cpu/tiles.h ``choose_tiles`` and ``bwd_choose_tiles``:
sized from the L2 cache, the query tile by a load-balance cost model over
torch.get_num_threads() threads), and this CPU's measured peaks.
"""

from __future__ import annotations

import functools
import math
import platform
import time
from pathlib import Path

import torch

from ..lang import expr, ir
from .geometry import Geometry, mask_geometry, tile_hulls
from .inputs import as_op, check_sizes, given_params, spec_params
from .report import TileReport, fmt_bytes
from .target import FamilyPart, ModelCall


def cpu_l2_bytes() -> int:
    """The L2 size the CPU kernels size their tiles from (bytes): the level-2 cache of cpu0 from
    /sys/devices/system/cpu/cpu0/cache, kept if within [256 KiB, 8 MiB], else 512 KiB — the
    clamp and fallback of templates/include/flashgen/cpu/fwd.h ``l2_bytes``."""
    size = -1
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    try:
        for idx in sorted(base.glob("index*")):
            if (idx / "level").read_text().strip() == "2":
                text = (idx / "size").read_text().strip().upper()
                mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
                size = int(text.rstrip("KMG")) * mult
                break
    except (OSError, ValueError):
        size = -1
    return size if (256 << 10) <= size <= (8 << 20) else 512 << 10


def round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def spans(geo: Geometry, nq: int, qc: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, key span) per query tile of ``qc`` rows at b = h = 0 (the kernels' cost models
    evaluate kv_lo / kv_hi there)."""
    lo, hi, rows = tile_hulls(geo.first[:1], geo.last[:1], nq, qc)
    return rows, (hi - lo)[0]


def cpu_fwd_tiles(geo: Geometry, batch_heads: int, nq: int, nk: int, d: int, l2: int, threads: int) -> tuple[int, int]:
    """(qb, kvb) of the CPU forward: ``choose_tiles`` of cpu/tiles.h — kvb the largest power of two
    ≤ 512 (≥ 128) whose K and V panels (2 · kvb · d fp32) fit L2, qb the candidate in
    {qb_max, qb_max/2, ..., 32} (qb_max = L2 / (4 · kvb) in [32, 256]) minimising the makespan of
    the B·Hq·⌈Nq/qb⌉ tasks over ``threads`` threads times (1 + 5/qb + 5/kvb)."""
    nk8 = round_up(max(nk, 1), 8)
    kvb = 512
    while kvb > 128 and 2 * kvb * d * 4 > l2:
        kvb //= 2
    kvb = min(kvb, nk8)
    qb_max = min(max(l2 // (4 * kvb), 32), 256)
    qb = min(qb_max, nq)
    if nq > 32:
        best = -1.0
        cand = qb_max
        while cand >= 32:
            qc = min(cand, nq)
            nqt = -(-nq // qc)
            rows, span = spans(geo, nq, qc)
            cost_t = (rows * (span.clamp(min=0) + 8)).to(torch.float64)
            prefix = [0.0] + torch.cumsum(cost_t, 0).tolist()
            ntasks = batch_heads * nqt
            nthr = min(threads, ntasks)
            chunk = -(-ntasks // nthr)

            def upto(x, prefix=prefix, nqt=nqt):
                return (x // nqt) * prefix[nqt] + prefix[x % nqt]

            makespan = 0.0
            for i in range(nthr):
                b0, b1 = i * chunk, min(i * chunk + chunk, ntasks)
                if b0 >= b1:
                    break
                makespan = max(makespan, upto(b1) - upto(b0))
            cost = makespan * (1.0 + 5.0 / qc + 5.0 / kvb)
            if best < 0.0 or cost < best * 0.999:
                best, qb = cost, qc
            cand //= 2
    return qb, kvb


def cpu_bwd_tiles(geo: Geometry, nq: int, nk: int, d: int, l2: int, mod_path: bool, dropout: bool = False) -> tuple[int, int]:
    """(qb, kvb) of the CPU backward: ``bwd_choose_tiles`` of cpu/tiles.h — kvb ≤ 128 with its five
    kvb × d fp32 panels in half of L2, qb_max ≤ 128 with its q × kv tiles (2 with a score mod or
    parameter gradient, +1 with dropout) and three q × d panels in half of L2, qb the candidate
    minimising the visited area × (1 + 5/qb + 5/kvb)."""
    tiles_qk = (2 if mod_path else 1) + (1 if dropout else 0)
    kvb = 128
    while kvb > 32 and 5 * kvb * d * 4 > l2 // 2:
        kvb //= 2
    qb_max = 128
    while qb_max > 32 and (tiles_qk * qb_max * kvb + 3 * qb_max * d) * 4 > l2 // 2:
        qb_max //= 2
    kvb = min(kvb, round_up(max(nk, 1), 8))
    qb = qb_max if qb_max < nq else max(nq, 1)
    if nq > 32:
        best = -1.0
        cand = qb_max
        while cand >= 32:
            qc = min(cand, nq)
            rows, span = spans(geo, nq, qc)
            area = float((rows * span.clamp(min=0)).sum())
            cost = area * (1.0 + 5.0 / qc + 5.0 / kvb)
            if best < 0.0 or cost < best * 0.999:
                best, qb = cost, qc
            cand //= 2
    return qb, kvb


def tiles_for(spec: ir.Spec, geo: Geometry, batch: int, heads: int, nq: int, nk: int, d: int, l2: int,
              threads: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """((qb, kvb) forward, (qb, kvb) backward) of the CPU kernels for this call's geometry."""
    mod_path = spec.score is not None or bool(expr.grad_params(spec))
    return (cpu_fwd_tiles(geo, batch * heads, nq, nk, d, l2, threads),
            cpu_bwd_tiles(geo, nq, nk, d, l2, mod_path))


def cpu_tiles(op_or_spec, seqlen_q: int, seqlen_k: int | None = None, *, head_dim: int, batch: int = 1,
              heads: int = 1, params=None, l2_bytes: int | None = None,
              threads: int | None = None) -> tuple[tuple[int, int], tuple[int, int]]:
    """((qb, kvb) forward, (qb, kvb) backward): the CPU family's tiles for a call (the padded
    layout, no block mask, no dropout), as its kernels choose them (``cpu_fwd_tiles``,
    ``cpu_bwd_tiles``) with ``l2_bytes`` (default: this machine's, ``cpu_l2_bytes``) and
    ``threads`` (default torch.get_num_threads()). ``params`` as in ``explain``."""
    op = as_op(op_or_spec)
    nk = seqlen_q if seqlen_k is None else seqlen_k
    check_sizes(seqlen_q, nk, head_dim, batch, heads, heads)
    given = given_params(op.spec, params)
    values = spec_params(op.spec, given, batch, heads, seqlen_q, nk)
    geo = mask_geometry(op.spec, seqlen_q, nk, batch, heads, values, given)
    return tiles_for(op.spec, geo, batch, heads, seqlen_q, nk, head_dim,
                      cpu_l2_bytes() if l2_bytes is None else l2_bytes,
                      torch.get_num_threads() if threads is None else threads)


@functools.cache
def cpu_peaks() -> tuple[float, float]:
    """(fp32 matmul TFLOP/s, copy bandwidth GB/s) measured on this machine (best of ~0.15 s of
    2048² matmuls and of 128 MiB copies, read + write counted), once per process."""
    n = 2048
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.matmul(a, b)
    best = math.inf
    t_end = time.perf_counter() + 0.15
    while time.perf_counter() < t_end or best == math.inf:
        t0 = time.perf_counter()
        torch.matmul(a, b)
        best = min(best, time.perf_counter() - t0)
    tflops = 2 * n**3 / best / 1e12
    src = torch.empty(32 << 20, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = math.inf
    t_end = time.perf_counter() + 0.15
    while time.perf_counter() < t_end or best == math.inf:
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    gbps = 2 * src.numel() * 4 / best / 1e9
    return tflops, gbps


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe(call: ModelCall) -> FamilyPart:
    """The cpu family's tiles (the kernels' own choice from the L2 cache and the thread count),
    the mask geometry and this machine's measured peaks."""
    spec, nq, nk, d = call.spec, call.nq, call.nk, call.head_dim
    geo = mask_geometry(spec, nq, nk, call.batch, call.heads, call.values, call.given)
    l2 = cpu_l2_bytes()
    threads = torch.get_num_threads()
    (qb, kvb), (bqb, bkvb) = tiles_for(spec, geo, call.batch, call.heads, nq, nk, d, l2, threads)
    origin = "derived (L2 cache)"
    tile_rep = {
        "fwd": TileReport(qb, kvb, None, origin, None, None, "n/a (CPU family)", f"{qb}x{kvb}"),
        "bwd": TileReport(bqb, bkvb, None, origin, None, None, "n/a (CPU family)", f"{bqb}x{bkvb}"),
    }
    peak, bw = cpu_peaks()
    call.notes.append("CPU family: bytes follow the same tile model with the CPU kernel's tiles; 'hbm' means DRAM")
    gpu = f"CPU: {cpu_name()}"
    return FamilyPart(geo, False, tile_rep, (qb, kvb), (bqb, bkvb), {"l2_bytes": l2, "threads": threads}, 1, peak,
                      bw, "measured on this machine (fp32 matmul, memory copy)", gpu, l2, threads,
                      "key ranges: each query tile loads the hull of its kept keys (the CUDA kernels' model, CPU "
                      "tiles)", f"{gpu} ({call.target.arch}, {threads} threads, L2 {fmt_bytes(l2)})")
