"""The ``cpu`` kernel family's model for explain: its tiles, from the family's own rule
(flashgen/families/cpu_tiles.py, the function the runtime's launches call: sized from the L2
cache, the query tile by a load-balance cost model over torch.get_num_threads() threads), and
this CPU's measured peaks.
"""

from __future__ import annotations

import functools
import math
import platform
import time
from pathlib import Path

import torch

from ..families import cpu_tiles as family_tiles
from .geometry import mask_geometry
from .inputs import as_op, check_sizes, given_params, spec_params
from .report import TileReport, fmt_bytes
from .target import FamilyPart, ModelCall

cpu_l2_bytes = family_tiles.l2_bytes  # the L2 size the tiles are sized from (explain's name for it)


def cpu_tiles_for(spec, batch: int, heads: int, nq: int, nk: int, head_dim: int, values: dict, l2: int,
                  threads: int) -> dict[str, tuple[tuple[int, int], str]]:
    """{'fwd' | 'bwd': ((qb, kvb), origin)}: the tiles the CPU kernels receive for a padded call
    without block lists or dropout, and where they came from (flashgen.families.cpu_tiles
    fwd_tiles / bwd_tiles, the functions its launches use, overrides included)."""
    return {"fwd": family_tiles.fwd_tiles(spec, batch * heads, nq, nk, head_dim, values, threads=threads, l2=l2),
            "bwd": family_tiles.bwd_tiles(spec, nq, nk, head_dim, values, l2=l2)}


def cpu_tiles(op_or_spec, seqlen_q: int, seqlen_k: int | None = None, *, head_dim: int, batch: int = 1,
              heads: int = 1, params=None, l2_bytes: int | None = None,
              threads: int | None = None) -> tuple[tuple[int, int], tuple[int, int]]:
    """((qb, kvb) forward, (qb, kvb) backward): the CPU family's tiles for a call (the padded
    layout, no block mask, no dropout), as its launches choose them (``cpu_tiles_for``) with
    ``l2_bytes`` (default: this machine's, ``cpu_l2_bytes``) and ``threads`` (default
    torch.get_num_threads()). ``params`` as in ``explain``."""
    op = as_op(op_or_spec)
    nk = seqlen_q if seqlen_k is None else seqlen_k
    check_sizes(seqlen_q, nk, head_dim, batch, heads, heads)
    given = given_params(op.spec, params)
    values = spec_params(op.spec, given, batch, heads, seqlen_q, nk)
    tiles = cpu_tiles_for(op.spec, batch, heads, seqlen_q, nk, head_dim, values,
                          cpu_l2_bytes() if l2_bytes is None else l2_bytes,
                          torch.get_num_threads() if threads is None else threads)
    return tiles["fwd"][0], tiles["bwd"][0]


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
    chosen = cpu_tiles_for(spec, call.batch, call.heads, nq, nk, d, call.values, l2, threads)
    tile_rep = {kind: TileReport(m, n, None, origin, None, None, "n/a (CPU family)", f"{m}x{n}")
                for kind, ((m, n), origin) in chosen.items()}
    (qb, kvb), (bqb, bkvb) = chosen["fwd"][0], chosen["bwd"][0]
    peak, bw = cpu_peaks()
    call.notes.append("CPU family: bytes follow the same tile model with the CPU kernel's tiles; 'hbm' means DRAM")
    gpu = f"CPU: {cpu_name()}"
    return FamilyPart(geo, False, tile_rep, (qb, kvb), (bqb, bkvb), {"l2_bytes": l2, "threads": threads}, 1, peak,
                      bw, "measured on this machine (fp32 matmul, memory copy)", gpu, l2, threads,
                      "key ranges: each query tile loads the hull of its kept keys (the CUDA kernels' model, CPU "
                      "tiles)", f"{gpu} ({call.target.arch}, {threads} threads, L2 {fmt_bytes(l2)})")
