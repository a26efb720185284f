"""The CPU family's tile sizes: the one implementation of the rule, decided per call on the host
and handed to the kernels in the argument blocks (args.h: FgFwdArgs / FgBwdArgs ``tile_q``,
``tile_kv``; templates/include/flashgen/cpu/tiles.h only reads and checks them). The runtime's
launches (flashgen/runtime/launch.py, through ``CpuTiles``) and explain's CPU model
(flashgen/explain/cpu_model.py) call the same functions.

Forward (``fwd_tiles``). Per (q tile, kv tile) the kernel pays fixed costs that do not scale with
qb · kvb · d: packing K^T, the micro-kernels' accumulator loads and stores, per-row softmax
bookkeeping. Relative to the gemm work they shrink like a/qb + a/kvb; a ≈ 5 was measured on Zen 3
(a 64 × 256 tile runs ~7–10% slower than 256 × 512). The S/P tile (qb × kvb fp32) is written by
the QK gemm, swept by the softmax and read back by the PV gemm, so it should stay in the per-core
L2, and so should the K and V tiles (kvb × d each):

- kvb = 512 (torch's CPU flash kernel uses 512 too), halved (down to 128) while 2 · kvb · d · 4 B
  exceeds the L2 (d = 256 → 256), capped by seqlen_k rounded up to 8;
- qb_max = L2 / (4 · kvb) clamped to [32, 256]: 256 for a 512 KiB L2 at d ≤ 128;
- among qb in {qb_max, qb_max/2, ..., 32} (each capped by seqlen_q) the one minimising
  makespan(qb) · (1 + a/qb + a/kvb), ties to the larger tile (a candidate must be 0.1% cheaper);
  makespan is the largest per-thread sum, over the contiguous chunks of tasks at::parallel_for
  hands the ``threads`` threads, of the score entries each task (batch · head, query tile)
  computes: rows × (its key range [kv_lo, kv_hi) + 8 for the per-row epilogue). This trades the
  efficiency of big query tiles against the work a diagonal mask wastes and against load
  imbalance when batch · heads is small. Only for seqlen_q > 32; else qb = seqlen_q.

Backward (``bwd_tiles``). A step (q tile × kv tile) touches the qb × kvb P/dS tile (plus the G
tile on the score-mod path, one more with dropout), per kv tile ~5 · kvb · d floats (K^T, V^T
panels, fp32 K, dK/dV accumulators) and per q tile ~3 · qb · d (Q, dO, dQ rows), all of which
should stay in half of the L2: kvb = 128 halved (down to 32) while 5 · kvb · d · 4 B > L2 / 2,
capped by seqlen_k rounded up to 8; qb_max = 128 halved (down to 32) while (t · qb · kvb +
3 · qb · d) · 4 B > L2 / 2; qb the candidate minimising area(qb) · (1 + a/qb + a/kvb), area the
sum over query tiles of rows × |[kv_lo, kv_hi)| (the score entries computed).

The key ranges are the kernels' own kv_lo / kv_hi hooks (flashgen/lang/keyrange.py's symbolic
bounds, folded per tile by ``keyrange.fold_tile_bound`` and clamped to [0, seqlen_k] as the
generated hooks do), evaluated at b = h = 0 with the call's parameters: a model of the work, not
a visit list. Packed batches size the tiles from max_seqlen_q / max_seqlen_k and batch · heads
from the sequence count.

Block lists (``sparse_fwd_tiles``, ``sparse_bwd_tiles``) take the lists' block sizes: forward qb
= block_r and kvb (the widest step: adjacent listed tiles of one kind in one aligned kvb-key
chunk are visited together) the forward's L2 kvb made a multiple of block_c (rounded up when it
covers all of seqlen_k, else down); backward kv tiles of block_r keys, q tiles of block_c
queries.

Overrides, for tuning experiments only: FLASHGEN_CPU_TILES="qb,kvb" and FLASHGEN_CPU_BWD_TILES
(flashgen.env; read once per process, at the first CPU launch) replace the choice of a padded or
packed call: qb when in [1, 1024], kvb (rounded up to 8) when in [8, 8192] (backward: [8, 1024]);
then qb is capped by seqlen_q and kvb by seqlen_k rounded up to 8.

L2 (``l2_bytes``): the C library's _SC_LEVEL2_CACHE_SIZE (glibc), else the level-2 cache of cpu0
in sysfs, kept if within [256 KiB, 8 MiB], else 512 KiB. Threads: torch.get_num_threads() of the
calling thread (the pool at::parallel_for runs the kernel on).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from .. import env, reference
from ..caches import Bounded
from ..lang import expr, ir, keyrange
from .base import LaunchFields

ALPHA = 5.0  # fixed per-tile costs, in score entries per row or column (see the module docstring)
_SC_LEVEL2_CACHE_SIZE = 191  # glibc's sysconf name (bits/confname.h)


@functools.cache
def l2_bytes() -> int:
    """The per-core L2 size the tiles are sized from (bytes; see the module docstring)."""
    size = -1
    try:
        libc = ctypes.CDLL(None)
        if hasattr(libc, "gnu_get_libc_version"):
            libc.sysconf.restype, libc.sysconf.argtypes = ctypes.c_long, [ctypes.c_int]
            size = int(libc.sysconf(_SC_LEVEL2_CACHE_SIZE))
    except (OSError, AttributeError):
        size = -1
    if size <= 0:
        try:
            for idx in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
                if (idx / "level").read_text().strip() == "2":
                    text = (idx / "size").read_text().strip().upper()
                    size = int(text.rstrip("KMG")) * {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
                    break
        except (OSError, ValueError):
            size = -1
    return size if (256 << 10) <= size <= (8 << 20) else 512 << 10


@functools.cache
def overrides() -> tuple[tuple[int, int] | None, tuple[int, int] | None]:
    """(FLASHGEN_CPU_TILES, FLASHGEN_CPU_BWD_TILES) as flashgen.env parses them, read once per
    process (``overrides.cache_clear()`` reads them again)."""
    return env.cpu_tiles(), env.cpu_bwd_tiles()


def round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _key_reads(rng: keyrange.KeyRange) -> tuple[tuple[str, ...], tuple[ir.Index, ...]]:
    """The scalar parameters and the tensor reads (Index nodes) the key range's bounds contain:
    what a tile choice depends on besides the sizes. The indices of every read are free of q (the
    bounds' monotonicity requires it), so at b = h = 0 each read is one element."""
    names: list[str] = []
    reads: list[ir.Index] = []

    def exprs(b):
        if isinstance(b, keyrange.RowBound):
            yield b.f
        elif isinstance(b, keyrange.SwitchBound):
            yield b.cond
        elif isinstance(b, keyrange.JoinBound):
            yield from exprs(b.a)
            yield from exprs(b.b)

    for bound in (rng.lo, rng.hi):
        for e in exprs(bound):
            for n in expr.walk(e):
                if isinstance(n, ir.Index) and n not in reads:
                    reads.append(n)
                elif isinstance(n, ir.Name) and n.id not in names:
                    names.append(n.id)
    return tuple(names), tuple(reads)


def tile_key_ranges(spec: ir.Spec, q_lo: torch.Tensor, q_hi: torch.Tensor, nq: int, nk: int, values: dict,
                    rng: keyrange.KeyRange | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(kv_lo, kv_hi) int64 [T] of the query tiles [q_lo, q_hi) (int64 [T]) at b = h = 0, as the
    generated hooks compute them (the folded tile bound clamped to [0, nk]; 0 / nk where the
    mask has no bound on that side). ``values``: the spec's parameters by name (scalars and
    tensors); tensor indices are clamped as the kernels clamp them."""
    rng = keyrange.key_range(spec) if rng is None else rng
    base = {"b": 0, "h": 0, "seqlen_q": nq, "seqlen_k": nk}
    ends = {"first": q_lo, "last": q_hi - 1}

    def ev(e: ir.Expr, q) -> torch.Tensor:
        out = reference.evaluate(e, spec, base | {"q": q}, values, torch.float64, check_bounds=False)
        return torch.broadcast_to(torch.as_tensor(out), q_lo.shape)

    def fold(bound, side: str) -> torch.Tensor:
        value = keyrange.fold_tile_bound(
            bound, side, lambda f, offset, end: ev(f, ends[end]).to(torch.int64) + offset,
            lambda cond: torch.where(ev(cond, q_lo).to(torch.bool), nk, 0),
            lambda op, a, b: torch.maximum(a, b) if op == "max" else torch.minimum(a, b))
        return value.clamp(0, nk)

    lo = fold(rng.lo, "lo") if rng.lo is not None else torch.zeros_like(q_lo)
    hi = fold(rng.hi, "hi") if rng.hi is not None else torch.full_like(q_lo, nk)
    return lo, hi


def _spans(spec, nq, nk, qc, values, rng) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, key span) int64 per query tile of ``qc`` rows."""
    q_lo = torch.arange(0, nq, qc, dtype=torch.int64)
    q_hi = (q_lo + qc).clamp(max=nq)
    lo, hi = tile_key_ranges(spec, q_lo, q_hi, nq, nk, values, rng)
    return q_hi - q_lo, (hi - lo).clamp(min=0)


def derived_fwd_tiles(spec: ir.Spec, batch_heads: int, nq: int, nk: int, head_dim: int, values: dict, *,
                      threads: int, l2: int, rng: keyrange.KeyRange | None = None) -> tuple[int, int]:
    """(qb, kvb) of the forward by the rule of the module docstring, without the override."""
    rng = keyrange.key_range(spec) if rng is None else rng
    nk8 = round_up(max(nk, 1), 8)
    kvb = 512
    while kvb > 128 and 2 * kvb * head_dim * 4 > l2:
        kvb //= 2
    kvb = min(kvb, nk8)
    qb_max = min(max(l2 // (4 * kvb), 32), 256)
    qb = min(qb_max, nq)
    if nq > 32:
        threads = max(threads, 1)
        best = -1.0
        cand = qb_max
        while cand >= 32:
            qc = min(cand, nq)
            nqt = -(-nq // qc)
            rows, span = _spans(spec, nq, nk, qc, values, rng)
            prefix = [0, *torch.cumsum(rows * (span + 8), 0).tolist()]
            ntasks = batch_heads * nqt
            nthr = min(threads, ntasks)
            chunk = -(-ntasks // nthr)
            total = prefix[nqt]

            def upto(x: int, prefix=prefix, nqt=nqt, total=total) -> int:
                return (x // nqt) * total + prefix[x % nqt]

            makespan = 0
            for i in range(nthr):
                b0, b1 = i * chunk, min(i * chunk + chunk, ntasks)
                if b0 >= b1:
                    break
                makespan = max(makespan, upto(b1) - upto(b0))
            cost = makespan * (1.0 + ALPHA / qc + ALPHA / kvb)
            if best < 0.0 or cost < best * 0.999:  # ties: keep the larger tile
                best, qb = cost, qc
            cand //= 2
    return qb, kvb


def derived_bwd_tiles(spec: ir.Spec, nq: int, nk: int, head_dim: int, dropout: bool, values: dict, *, l2: int,
                      rng: keyrange.KeyRange | None = None) -> tuple[int, int]:
    """(qb, kvb) of the backward by the rule of the module docstring, without the override;
    ``dropout``: the call regenerates a dropout mask (one more q × kv tile)."""
    rng = keyrange.key_range(spec) if rng is None else rng
    mod_path = spec.score is not None or bool(expr.grad_params(spec))  # cpu/bwd.h bwd_mod_path
    tiles_qk = (2 if mod_path else 1) + (1 if dropout else 0)
    kvb = 128
    while kvb > 32 and 5 * kvb * head_dim * 4 > l2 // 2:
        kvb //= 2
    qb_max = 128
    while qb_max > 32 and (tiles_qk * qb_max * kvb + 3 * qb_max * head_dim) * 4 > l2 // 2:
        qb_max //= 2
    kvb = min(kvb, round_up(max(nk, 1), 8))
    qb = qb_max if qb_max < nq else max(nq, 1)
    if nq > 32:
        best = -1.0
        cand = qb_max
        while cand >= 32:
            qc = min(cand, nq)
            rows, span = _spans(spec, nq, nk, qc, values, rng)
            cost = int((rows * span).sum()) * (1.0 + ALPHA / qc + ALPHA / kvb)
            if best < 0.0 or cost < best * 0.999:  # ties: keep the larger tile
                best, qb = cost, qc
            cand //= 2
    return qb, kvb


def override_fwd(tiles: tuple[int, int], nq: int, nk: int, forced: tuple[int, int] | None) -> tuple[int, int]:
    """``tiles`` with FLASHGEN_CPU_TILES' ``forced`` (qb, kvb) applied (None: unchanged)."""
    if forced is None:
        return tiles
    qb, kvb = tiles
    if 1 <= forced[0] <= 1024:
        qb = forced[0]
    if 8 <= forced[1] <= 8192:
        kvb = round_up(forced[1], 8)
    return min(qb, nq), min(kvb, round_up(max(nk, 1), 8))


def override_bwd(tiles: tuple[int, int], nq: int, nk: int, forced: tuple[int, int] | None) -> tuple[int, int]:
    """``tiles`` with FLASHGEN_CPU_BWD_TILES' ``forced`` (qb, kvb) applied (None: unchanged)."""
    if forced is None:
        return tiles
    qb, kvb = tiles
    if 1 <= forced[0] <= 1024:
        qb = forced[0]
    if 8 <= forced[1] <= 1024:
        kvb = round_up(forced[1], 8)
    return (qb if qb < nq else max(nq, 1)), min(kvb, round_up(max(nk, 1), 8))


DERIVED, FORCED = "derived (L2 cache)", "env"  # where a call's tiles came from (explain's origin)


def fwd_tiles(spec: ir.Spec, batch_heads: int, nq: int, nk: int, head_dim: int, values: dict, *,
              threads: int | None = None, l2: int | None = None) -> tuple[tuple[int, int], str]:
    """((qb, kvb), origin): the CPU forward's tiles for a padded or packed call of ``batch_heads``
    (batch or sequence count × query heads) work rows of ``nq`` queries over ``nk`` keys (packed:
    the max_seqlen bounds) at ``head_dim``, with the spec's parameters ``values`` (by name),
    ``threads`` (default torch.get_num_threads()) and ``l2`` bytes (default ``l2_bytes()``),
    FLASHGEN_CPU_TILES applied; origin ``FORCED`` when the override changed them, else
    ``DERIVED``."""
    threads = torch.get_num_threads() if threads is None else threads
    tiles = derived_fwd_tiles(spec, batch_heads, nq, nk, head_dim, values, threads=threads,
                              l2=l2_bytes() if l2 is None else l2)
    final = override_fwd(tiles, nq, nk, overrides()[0])
    return final, FORCED if final != tiles else DERIVED


def bwd_tiles(spec: ir.Spec, nq: int, nk: int, head_dim: int, values: dict, *, dropout: bool = False,
              l2: int | None = None) -> tuple[tuple[int, int], str]:
    """((qb, kvb), origin): the CPU backward's tiles for a padded or packed call (sizes as
    ``fwd_tiles``; ``dropout``: the call regenerates a dropout mask), FLASHGEN_CPU_BWD_TILES
    applied."""
    tiles = derived_bwd_tiles(spec, nq, nk, head_dim, dropout, values, l2=l2_bytes() if l2 is None else l2)
    final = override_bwd(tiles, nq, nk, overrides()[1])
    return final, FORCED if final != tiles else DERIVED


def sparse_fwd_tiles(block_r: int, block_c: int, nk: int, head_dim: int, l2: int | None = None) -> tuple[int, int]:
    """(qb, kvb) of a forward with block lists of block_r × block_c tiles (module docstring)."""
    l2 = l2_bytes() if l2 is None else l2
    nk8 = round_up(max(nk, 1), 8)
    kvb = 512
    while kvb > 128 and 2 * kvb * head_dim * 4 > l2:
        kvb //= 2
    kvb = round_up(nk8, block_c) if kvb >= nk8 else max(block_c, kvb // block_c * block_c)
    return block_r, kvb


def sparse_bwd_tiles(block_r: int, block_c: int) -> tuple[int, int]:
    """(qb, kvb) of a backward with q lists of block_r keys × block_c queries."""
    return block_c, block_r


class CpuTiles(LaunchFields):
    """The CPU family's per-call decision for one spec (``CpuFamily.launch_fields``): fills the
    tile fields of the argument blocks, caching the derived tiles per (sizes, thread count, the
    values the key range reads), so a repeated call pays a dictionary lookup."""

    fills_fwd = True

    def __init__(self, spec: ir.Spec):
        self.spec = spec
        self.rng = keyrange.key_range(spec)
        names, self.reads = _key_reads(self.rng)
        pos = {p.name: i for i, p in enumerate(spec.params)}
        self.scalars = tuple(pos[n] for n in names if n in pos and not spec.params[pos[n]].is_tensor)
        self.read_pos = tuple(pos[r.base.id] for r in self.reads)  # each read's tensor in the values
        self.names = tuple(p.name for p in spec.params)
        self.cache: dict[tuple, tuple[int, int]] = Bounded()
        self.indices: dict[tuple, tuple[int, ...]] = Bounded()  # (read, sizes, scalars, shape) -> its element

    def _index(self, n: int, tensor: torch.Tensor, nq: int, nk: int, scalars: tuple, values) -> tuple[int, ...]:
        """The element of tensor read ``n`` at b = h = 0, clamped (and broadcast dims at 0) as the
        kernels index it; cached per sizes, scalar values and the tensor's shape."""
        key = (n, nq, nk, scalars, tensor.shape)
        idx = self.indices.get(key)
        if idx is None:
            read, decl = self.reads[n], self.spec.params[self.read_pos[n]]
            named = dict(zip(self.names, values, strict=True))
            at = {"b": 0, "h": 0, "q": 0, "seqlen_q": nq, "seqlen_k": nk}
            idx = []
            for dim, e in enumerate(read.indices):
                size = tensor.shape[dim]
                i = int(reference.evaluate(e, self.spec, at, named, torch.float64, check_bounds=False))
                idx.append(0 if size == 1 and decl.shape[dim].broadcast else min(max(i, 0), size - 1))
            idx = self.indices[key] = tuple(idx)
        return idx

    def key_values(self, values, nq: int, nk: int) -> tuple:
        """The parameter values the key range reads at b = h = 0, for the cache key: the scalars,
        then per tensor read its whole content when the tensor is a short vector (a per-batch
        length, say: cheaper to read than one element), else the element it reads."""
        if not self.scalars and not self.reads:
            return ()
        scalars = tuple(values[i] for i in self.scalars)
        if not self.reads:
            return scalars
        reads = []
        for n, pos in enumerate(self.read_pos):
            tensor = values[pos]
            if tensor.dim() == 1 and tensor.numel() <= 64:
                reads.append(tuple(tensor.tolist()))
            else:
                reads.append(tensor[self._index(n, tensor, nq, nk, scalars, values)].item() if tensor.numel() else None)
        return scalars + tuple(reads)

    def fwd(self, args, values) -> None:
        """Set ``args.tile_q`` / ``args.tile_kv`` (FgFwdArgs) for the call (``values``: the spec's
        parameters in declaration order)."""
        nk, d = args.seqlen_k, args.head_dim
        if args.kv_blocks.data:
            args.tile_q, args.tile_kv = sparse_fwd_tiles(args.kv_blocks.block_r, args.kv_blocks.block_c, nk, d)
            return
        nq, bh, threads = args.seqlen_q, args.batch * args.heads_q, torch.get_num_threads()
        key = ("fwd", bh, nq, nk, d, threads, self.key_values(values, nq, nk))
        tiles = self.cache.get(key)
        if tiles is None:
            named = dict(zip(self.names, values, strict=True))
            tiles = self.cache[key] = derived_fwd_tiles(self.spec, bh, nq, nk, d, named, threads=threads,
                                                        l2=l2_bytes(), rng=self.rng)
        qb, kvb = override_fwd(tiles, nq, nk, overrides()[0])
        if args.kv_cache.seqlens:  # a decode call: a tile even without queries (it may append)
            qb = max(qb, 1)
            ps = args.kv_cache.page_size if args.kv_cache.block_table else 0
            if ps >= 64 and ps % 8 == 0:  # tiles within pages read the cache in place (cpu/kvcache.h)
                kvb = max(t for t in range(8, min(kvb, ps) + 1, 8) if ps % t == 0)
        args.tile_q, args.tile_kv = qb, kvb

    def bwd(self, args, values, config=None) -> None:
        """Set ``args.tile_q`` / ``args.tile_kv`` (FgBwdArgs) for the call (``config``, the library's,
        does not enter: the CPU libraries take any tiles)."""
        if args.q_blocks.data:
            args.tile_q, args.tile_kv = sparse_bwd_tiles(args.q_blocks.block_r, args.q_blocks.block_c)
            return
        nq, nk, d = args.seqlen_q, args.seqlen_k, args.head_dim
        dropout = bool(self.spec.dropout and args.dropout_state)
        key = ("bwd", nq, nk, d, dropout, self.key_values(values, nq, nk))
        tiles = self.cache.get(key)
        if tiles is None:
            named = dict(zip(self.names, values, strict=True))
            tiles = self.cache[key] = derived_bwd_tiles(self.spec, nq, nk, d, dropout, named, l2=l2_bytes(),
                                                        rng=self.rng)
        args.tile_q, args.tile_kv = override_bwd(tiles, nq, nk, overrides()[1])
