"""Decode benchmarks (``flashgen bench --decode``, scripts/bench_decode.py): ``op.with_kvcache``
next to SDPA on the same queries and cache, and next to a read-only pass over the same K and V
bytes (the practical ceiling of a kernel that reads them once), measured in one run.

Each shape is (batch B, cache length L, head dim d): every sequence holds L cached keys
(``cache_seqlens`` = L = the capacity), Sq queries (the last Sq positions), no append.

Bytes: for each sequence and KV head, the K and V positions inside the spec's closed-form key
range of its Sq query rows (flashgen/lang/keyrange.py, evaluated as explain does: the hull
over those rows and the KV head's GQA group, clamped to [0, L)), times 2 (K and V) · d ·
the element size. That is every position the rows attend for masks with an exact range
(no mask and causal at Sq = 1: all L; a sliding window: min(L, window)), and the positions the
kernels walk for masks without one (document ids: all L). Positions, not tiles: a kernel that
reads whole key tiles at the range's edges reads up to a tile more. GB/s = bytes / time.

Rows:
  * ``flashgen[-paged<P>][-s<n>]``: op.with_kvcache on the contiguous cache [B, Hkv, L, d], or a
    paged copy (page size P, pages shuffled in the pool), with num_splits n (0: the family's
    choice, printed in the note where the family splits);
  * the peers: cuda ``sdpa-flash``, ``sdpa-cudnn``, ``sdpa-efficient`` (SDPA under that backend),
    cpu ``sdpa``; on q [B, H, Sq, d] and the contiguous cache with ``enable_gqa=True`` (where a
    backend refuses GQA, k and v expanded to H heads outside the timing: the note says so and
    the bytes stay those of the Hkv heads), given the spec's mask at the decode positions
    (none where every row keeps every key, torch's ``causal_lower_right`` for a causal spec,
    else the materialised mask or additive bias, built outside the timing);
  * ``read-only``: torch.sum (fp32 accumulation) over K and V at the attended positions (one
    slice when every sequence and KV head attends the same range, else the hull of the ranges,
    with its own bytes and a note).
Ours rows carry ``ratios``: ours GB/s over each other row's (> 1: ours moves more bytes per
second; over read-only: the fraction of the ceiling reached).

Mixed lengths (``run_mixed``, scripts/bench_decode.py --mixed B:MAX): ours on one batch of B
sequences whose cache lengths are drawn log-uniformly from 1 to MAX (``mixed_lengths``, a fixed
seed) in a cache of capacity MAX, next to a uniform batch (B sequences at the mean length,
rounded, same capacity): rows ``flashgen-mixed[...]`` and ``flashgen-uniform[...]``, each with
the bytes of its own lengths (``sequence_bytes``: the attended positions of each sequence at
L = its length), and the ratio mixed GB/s / uniform GB/s.

Timing: CUDA: an L2 flush (zeroing 256 MiB) before each timed call, CUDA events around the call,
the median of ``reps`` calls after 3 warm-up calls (so the cache is read from HBM, not from L2);
CPU: perf_counter around each call, median (no cache flush). ``graphs=True`` (--graphs): on
CUDA each row's call is captured once in a CUDA graph and its replays are timed the same way,
for ours, the peers and the read-only pass alike: the kernels' rate without the host's per-call
work (a batch-1 call of ~50 µs of kernels is otherwise host-bound in eager mode); the note says
"CUDA graph".
"""

from __future__ import annotations

import argparse
import math
from contextlib import nullcontext
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

from . import bench
from .abi import FgFwdArgs
from .errors import did_you_mean
from .explain.geometry import closed_form_bounds
from .lang import ir
from .ops import TORCH_DTYPE, AttentionOp
from .params import example_params
from .runtime import launch
from .runtime.decode import key_span
from .sparsity import mask_extents

# The peers timed next to ours on each device type.
PEERS = {"cuda": ("sdpa-flash", "sdpa-cudnn", "sdpa-efficient"), "cpu": ("sdpa",)}
READ_ONLY = "read-only"


@dataclass
class DecodeRow:
    impl: str
    batch: int
    cache_len: int
    heads: int
    kv_heads: int
    seqlen_q: int
    head_dim: int
    dtype: str
    mask: str
    page_size: int  # ours: 0 contiguous; peers and read-only: 0 (they read the contiguous cache)
    device: str
    bytes: int  # K and V bytes counted for GB/s
    ms: float | None
    gbps: float | None
    note: str = ""
    ratios: dict = field(default_factory=dict)  # ours rows: ours GB/s / each other row's GB/s

    def as_dict(self) -> dict:
        return asdict(self)


def check_peers(include, device: torch.device) -> None:
    """Raise ValueError (starting 'include:') for a name in ``include`` that is no decode peer,
    or no decode peer on ``device``; names starting with 'flashgen' and 'read-only' are always
    timed."""
    here = PEERS.get(device.type, ())
    listed = ", ".join(here) or "none"
    decode_peers = {n for names in PEERS.values() for n in names}
    prefill_peers = {n for names in bench.PEERS.values() for n in names}
    for name in include or ():
        if name.startswith("flashgen") or name == READ_ONLY or name in here:
            continue
        if name in decode_peers:
            raise ValueError(f"include: peer {name!r} runs on {'cuda' if name in PEERS['cuda'] else 'cpu'}, not "
                             f"{device.type} (the decode peers on {device.type}: {listed})")
        if name in prefill_peers:
            raise ValueError(f"include: {name!r} is a prefill peer, not a decode one (the decode peers on "
                             f"{device.type}: {listed})")
        hint = did_you_mean(name, here) or did_you_mean(name, decode_peers)
        raise ValueError(f"include: unknown peer {name!r} (the decode peers on {device.type}: {listed})"
                         + (f"; {hint}" if hint else ""))


def default_shapes(device: torch.device, head_dims: list[int] | None, cache_lens: list[int] | None,
                   batch: int | None) -> list[tuple[int, int, int]]:
    """(B, L, d) rows. CUDA: B · L = 128K cached tokens per row (B = 131072 // L: 537 MB of bf16 K
    and V at 8 KV heads of d 128, far beyond L2), L 1024 4096 8192 32768, d 128; CPU: B = 2,
    L 1024 4096, d 64."""
    if device.type == "cuda":
        ds, ls = head_dims or [128], cache_lens or [1024, 4096, 8192, 32768]
        return [(batch or max(1, 131072 // n), n, d) for d in ds for n in ls]
    ds, ls = head_dims or [64], cache_lens or [1024, 4096]
    return [(batch or 2, n, d) for d in ds for n in ls]


def default_heads(device: torch.device, heads: int | None, kv_heads: int | None) -> tuple[int, int]:
    """Query and KV heads: --heads default 32 on cuda, 8 on cpu; --kv-heads default heads // 4
    (GQA group 4) where 4 divides heads, else heads."""
    h = heads or (32 if device.type == "cuda" else 8)
    return h, kv_heads or (h // 4 if h % 4 == 0 else h)


def attended_ranges(spec: ir.Spec, B: int, Hq: int, Hkv: int, Sq: int, L: int,
                    params: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """[lo, hi) int64 [B, Hkv] on the CPU: per sequence and KV head, the hull of the spec's
    closed-form key ranges over the decode rows (positions L − Sq … L − 1, seqlen_q = seqlen_k
    = L) and the KV head's query heads, clamped to [0, L); hi ≤ lo: none."""
    cpu = {n: (x.cpu() if isinstance(x, torch.Tensor) else x) for n, x in params.items()}
    per_b, per_h = mask_extents(spec)
    bp, hp = (B if per_b else 1), (Hq if per_h else 1)
    lo, hi = closed_form_bounds(spec, L, L, bp, hp, cpu)
    lo, hi = lo[..., L - Sq:].clamp(0, L), hi[..., L - Sq:].clamp(0, L)
    empty = hi <= lo
    lo, hi = torch.where(empty, L, lo), torch.where(empty, 0, hi)
    group = hp // Hkv if hp == Hq else 1
    lo = lo.reshape(bp, hp // group, group * Sq).amin(-1)
    hi = hi.reshape(bp, hp // group, group * Sq).amax(-1)
    return lo.expand(B, Hkv).contiguous(), hi.expand(B, Hkv).contiguous()


def kv_bytes(lo: torch.Tensor, hi: torch.Tensor, head_dim: int, element_size: int) -> int:
    """Bytes of K and V at the positions [lo, hi) of each (sequence, KV head)."""
    return int((hi - lo).clamp(min=0).sum()) * 2 * head_dim * element_size


def read_only(k: torch.Tensor, v: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> tuple[Callable, int, str]:
    """The ceiling: a callable summing K and V (fp32 accumulation) over the attended positions,
    the bytes it reads, and a note (non-empty when it reads the hull of differing ranges)."""
    a, b = int(lo.min()), int(hi.max())
    note = ""
    if not (bool((lo == a).all()) and bool((hi == b).all())):
        note = f"reads positions {a}..{b - 1} of every sequence (the attended ranges differ)"
    b = max(a, b)
    ks, vs = k[:, :, a:b], v[:, :, a:b]
    nbytes = 2 * ks.numel() * ks.element_size()
    return (lambda: (torch.sum(ks, dtype=torch.float32), torch.sum(vs, dtype=torch.float32))), nbytes, note


def paged_copy(k: torch.Tensor, v: torch.Tensor, page_size: int, generator: torch.Generator):
    """Pools [num_pages, page_size, Hkv, d] holding contiguous k and v [B, Hkv, L, d] (page_size
    divides L) with the pages shuffled, and the block table int32 [B, L // page_size]."""
    B, H, L, d = k.shape
    pages = L // page_size
    perm = torch.randperm(B * pages, generator=generator).to(k.device)
    table = perm.view(B, pages).to(torch.int32)

    def pool(t):
        out = torch.empty(B * pages, page_size, H, d, dtype=t.dtype, device=t.device)
        out[perm] = t.view(B, H, pages, page_size, d).permute(0, 2, 3, 1, 4).reshape(B * pages, page_size, H, d)
        return out

    return pool(k), pool(v), table


def peer_mask(spec: ir.Spec, B: int, H: int, Sq: int, L: int, device, dtype, params: dict):
    """The attn_mask an SDPA user passes for decode rows of ``spec``: None where every row keeps
    every key (no mask; causal at Sq = 1), torch's causal_lower_right for a causal spec, else
    flashgen.bench.sdpa_mask at the decode positions (NotImplementedError for a score
    modification SDPA cannot express)."""
    if spec.score is None and spec.mask_kind in (ir.MaskKind.NONE, ir.MaskKind.CAUSAL):
        if spec.mask_kind is ir.MaskKind.NONE or Sq == 1:
            return None
        from torch.nn.attention.bias import causal_lower_right

        return causal_lower_right(Sq, L)
    mask = bench.sdpa_mask(spec, B, H, Sq, L, device, dtype, params, decode=True)
    if mask is not None and mask.dtype == torch.bool and bool(mask.all()):
        return None
    return mask


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def sdpa_peer(backend, q, k, v, mask) -> tuple[Callable | None, str]:
    """A callable running SDPA (under ``backend``; None: the default dispatch) with GQA natively,
    else with k and v expanded to q's heads, and a note; (None, note) when it cannot run."""
    def ctx():
        if backend is None:
            return nullcontext()
        from torch.nn.attention import sdpa_kernel

        return sdpa_kernel(backend)

    def first_line(e: BaseException, n: int) -> str:
        return str(e).splitlines()[0][:n] if str(e) else type(e).__name__

    def native():
        with ctx():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    try:
        native()
        _synchronize(q.device)
        return native, ""
    except (RuntimeError, TypeError, ValueError, NotImplementedError) as e:
        refused = first_line(e, 120)
    group = q.shape[1] // k.shape[1]
    ke, ve = (t.repeat_interleave(group, 1) for t in (k, v))

    def expanded():
        with ctx():
            return F.scaled_dot_product_attention(q, ke, ve, attn_mask=mask)

    try:
        expanded()
        _synchronize(q.device)
        return expanded, f"k, v expanded to {q.shape[1]} heads (GQA refused: {refused})"
    except (RuntimeError, TypeError, ValueError, NotImplementedError) as e:
        return None, f"unavailable: {first_line(e, 160)}"


def split_note(op: AttentionOp, q: torch.Tensor, dtype: ir.DType, Hkv: int, L: int, requested: int,
               params: dict | None = None) -> str:
    """'num_splits N': the split count the decode call's family takes for this shape and the
    call's parameters ``params`` (a sliding window's width bounds it; runtime/decode.py
    key_span) on families with decode kernels of their own (sm80); '' for those that do not split
    (cpu)."""
    B, H, Sq, d = q.shape
    fam = op.choose_family(q.device, dtype, d, False, False, False, decode=True).family
    lib = op.decode_library(fam, q.device, dtype, d, L)
    if lib.decode is None:
        return ""
    a = FgFwdArgs(batch=B, heads_q=H, heads_kv=Hkv, seqlen_q=Sq, num_sms=launch.num_sms(q))
    a.kv_cache.capacity = L
    values = [(params or {}).get(p.name) for p in op.spec.params]
    keys = key_span(op.spec, values, L, Sq)
    return f"num_splits {op.launch_fields(lib).kv_splits(a, lib.instantiation, requested, keys)}"


def shape_list(text: str) -> list[tuple[int, int]]:
    """An argparse type for batch x cache shapes: comma-separated ``BxL`` (B, L >= 1) -> [(B, L)];
    argparse.ArgumentTypeError otherwise (the scripts' --shapes / --decode)."""
    try:
        shapes = [tuple(int(x) for x in s.lower().split("x")) for s in text.split(",")]
    except ValueError:
        shapes = []
    if not shapes or any(len(s) != 2 or min(s) < 1 for s in shapes):
        raise argparse.ArgumentTypeError(f"expected BxL,... (comma-separated, B and L >= 1), got {text!r}")
    return shapes


def _check_sizes(shapes, heads: int, kv_heads: int, seqlen_q: int, variants) -> None:
    """ValueError naming the argument for heads, seqlen_q, a (B, L, d) shape or a (page_size,
    num_splits) variant out of range."""
    if heads < 1 or kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"kv_heads: {kv_heads} kv heads do not divide {heads} query heads")
    if seqlen_q < 1:
        raise ValueError(f"seqlen_q: {seqlen_q} is out of range (expected ≥ 1)")
    for B, L, d in shapes:
        if B < 1 or L < 1 or d < 1:
            raise ValueError(f"shape: batch {B}, cache length {L} and head dim {d} must be ≥ 1")
        if seqlen_q > L:
            raise ValueError(f"seqlen_q: {seqlen_q} queries exceed the cache length {L}")
        for ps, s in variants:
            if ps < 0 or ps > 256 or (ps and L % ps):
                raise ValueError(f"page_size: {ps} must be 0 (contiguous) or 1 to 256 dividing every cache "
                                 f"length (not {L})")
            if s < 0:
                raise ValueError(f"num_splits: {s} is out of range (expected ≥ 0: 0 chooses)")


def _failed(e: BaseException) -> str:
    lines = str(e).splitlines()
    return f"failed: {type(e).__name__}: {lines[0][:80] if lines else ''}"


def graphed(fn: Callable, device: torch.device) -> Callable:
    """``fn`` captured once in a CUDA graph (after warm-up calls on a side stream, as
    torch.cuda.graphs asks); returns the graph's replay, which launches the same kernels on the
    same tensors without the host's per-call work."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def _time_row(row: DecodeRow, fn: Callable | None, device: torch.device, reps: int, graphs: bool = False) -> None:
    """Fill row.ms and row.gbps (row.bytes over the median time) from timing ``fn`` (with
    ``graphs`` on CUDA: the replays of its CUDA graph, ``graphed``); a failure goes into
    row.note, not raised; ``fn`` None: left untimed."""
    if fn is None:
        return
    try:
        if graphs and device.type == "cuda":
            fn = graphed(fn, device)
            row.note = (row.note + "; " if row.note else "") + "CUDA graph"
        row.ms = bench.time_fn(fn, device, reps=reps, flush_l2=True)  # (no flush on the CPU)
        row.gbps = row.bytes / (row.ms * 1e-3) / 1e9
    except Exception as e:  # reported on its row, not fatal
        row.note = _failed(e)


def variant_name(page_size: int, num_splits: int) -> str:
    return "flashgen" + (f"-paged{page_size}" if page_size else "") + (f"-s{num_splits}" if num_splits else "")


def run(op: AttentionOp, shapes: list[tuple[int, int, int]], dtype: ir.DType, device: torch.device, *,
        heads: int, kv_heads: int, seqlen_q: int = 1, variants=((0, 0),), reps: int = 10,
        include: set[str] | None = None, params: dict | None = None, graphs: bool = False,
        log: Callable[[str], None] = print) -> list[DecodeRow]:
    """Time ours (one row per (page_size, num_splits) of ``variants``), the peers (``include``
    limits them; ValueError for a name that is no decode peer here, ``check_peers``) and the
    read-only ceiling on each (B, L, d) of ``shapes``, as the module docstring says. Spec
    parameters come from ``params`` where given, else flashgen.params.example_params (their
    seqlen dims the cache length). A row that fails is reported in its note, not raised."""
    check_peers(include, device)
    _check_sizes(shapes, heads, kv_heads, seqlen_q, variants)
    tdtype = TORCH_DTYPE[dtype]
    H, Hkv, Sq = heads, kv_heads, seqlen_q
    peer_names = [n for n in PEERS.get(device.type, ()) if not include or n in include]
    backends: dict = {"sdpa": None}
    if device.type == "cuda":
        from torch.nn.attention import SDPBackend

        backends = {"sdpa-flash": SDPBackend.FLASH_ATTENTION, "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION,
                    "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION}
    rows: list[DecodeRow] = []
    with torch.inference_mode():
        for B, L, d in shapes:
            gen = torch.Generator(device=device).manual_seed(0)
            perm_gen = torch.Generator().manual_seed(0)
            q = torch.randn(B, H, Sq, d, device=device, dtype=tdtype, generator=gen)
            k, v = (torch.randn(B, Hkv, L, d, device=device, dtype=tdtype, generator=gen) for _ in range(2))
            pv = example_params(op.spec, B, H, L, L, device, gen, **(params or {}))
            seqlens = torch.full((B,), L, dtype=torch.int32, device=device)
            lo, hi = attended_ranges(op.spec, B, H, Hkv, Sq, L, pv)
            nbytes = kv_bytes(lo, hi, d, k.element_size())
            group: list[DecodeRow] = []

            def record(name, fn, nb, note="", page_size=0):
                row = DecodeRow(name, B, L, H, Hkv, Sq, d, dtype.value, op.spec.name, page_size, device.type, nb,
                                None, None, note)
                _time_row(row, fn, device, reps, graphs)
                group.append(row)
                log(format_row(row))

            for ps, s in variants:
                kc, vc, table = paged_copy(k, v, ps, perm_gen) if ps else (k, v, None)

                def ours(kc=kc, vc=vc, table=table, s=s):
                    return op.with_kvcache(q, kc, vc, cache_seqlens=seqlens, block_table=table, num_splits=s, **pv)

                note = ""
                try:
                    ours()  # built and loaded before the timing
                    note = split_note(op, q, dtype, Hkv, L, s, pv)
                except Exception as e:
                    record(variant_name(ps, s), None, nbytes, _failed(e), ps)
                    continue
                record(variant_name(ps, s), ours, nbytes, note, ps)
            if peer_names:
                try:
                    mask = peer_mask(op.spec, B, H, Sq, L, device, tdtype, pv)
                    failed = ""
                except NotImplementedError as e:
                    mask, failed = None, f"unavailable: {e}"
                for name in peer_names:
                    fn, note = sdpa_peer(backends[name], q, k, v, mask) if not failed else (None, failed)
                    record(name, fn, nbytes, note)
            fn, ro_bytes, note = read_only(k, v, lo, hi)
            record(READ_ONLY, fn, ro_bytes, note)
            for r in group:
                if r.impl.startswith("flashgen") and r.gbps:
                    r.ratios = {o.impl: r.gbps / o.gbps for o in group if o is not r and o.gbps
                                and not o.impl.startswith("flashgen")}
                    if r.ratios:
                        log(format_ratios(r))
            rows += group
    return rows


MIXED_SEED = 0
MIXED_DISTRIBUTION = "log-uniform"


def mixed_lengths(batch: int, capacity: int, seed: int = MIXED_SEED) -> list[int]:
    """``batch`` cache lengths drawn log-uniformly from 1 to ``capacity``, reproducibly: n =
    round(exp(u)), u uniform on [0, ln capacity) from torch.Generator().manual_seed(seed) (CPU,
    float64), clamped to [1, capacity] (median about sqrt(capacity), mean about
    capacity / ln capacity: a few long sequences among many short ones)."""
    if batch < 1 or capacity < 1:
        raise ValueError(f"mixed: batch {batch} and capacity {capacity} must be ≥ 1")
    u = torch.rand(batch, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return (u * math.log(capacity)).exp().round().clamp(1, capacity).to(torch.int64).tolist()


def sequence_bytes(spec: ir.Spec, lengths: list[int], Hq: int, Hkv: int, Sq: int, params: dict, head_dim: int,
                   element_size: int) -> int:
    """The module's K and V bytes for a batch whose sequence b holds lengths[b] keys: for each
    sequence, kv_bytes of attended_ranges at L = lengths[b] (its rows at positions L − Sq … L − 1,
    those ≥ 0), summed."""
    total, B = 0, len(lengths)
    for n in sorted(set(lengths)):
        rows = [b for b, x in enumerate(lengths) if x == n]
        lo, hi = attended_ranges(spec, B, Hq, Hkv, min(Sq, n), n, params)
        total += kv_bytes(lo[rows], hi[rows], head_dim, element_size)
    return total


def run_mixed(op: AttentionOp, batch: int, capacity: int, head_dim: int, dtype: ir.DType, device: torch.device, *,
              heads: int, kv_heads: int, seqlen_q: int = 1, variants=((0, 0),), reps: int = 10,
              params: dict | None = None, seed: int = MIXED_SEED, graphs: bool = False,
              log: Callable[[str], None] = print) -> tuple[list[DecodeRow], dict]:
    """Ours on one batch of mixed cache lengths next to a uniform batch of the same total: B
    sequences with cache_seqlens = mixed_lengths(batch, capacity, seed) (``flashgen-mixed...``
    rows), and B sequences all at the mean of those lengths rounded half up
    (``flashgen-uniform...``), both in the same contiguous (or paged) cache of ``capacity`` slots
    per sequence, the same q, keys and parameters (``params`` over example_params at seqlen
    dims = capacity), timed as ``run`` times ours, one pair per (page_size, num_splits) of
    ``variants``. Bytes: sequence_bytes of each batch's lengths (the two totals are equal up to
    the rounding for masks attending every cached key; each row's GB/s counts its own). The
    mixed row's ``ratios`` holds {uniform row's impl: mixed GB/s / uniform GB/s}. Returns the
    rows and a summary: batch, capacity, seqlen_q, seed, distribution, lengths, uniform_length,
    mixed_bytes, uniform_bytes, ratios {variant: mixed / uniform GB/s, None where a row failed}."""
    _check_sizes([(batch, capacity, head_dim)], heads, kv_heads, seqlen_q, variants)
    lengths = mixed_lengths(batch, capacity, seed)
    uniform = min(capacity, (2 * sum(lengths) + batch) // (2 * batch))
    tdtype = TORCH_DTYPE[dtype]
    B, H, Hkv, Sq, d, L = batch, heads, kv_heads, seqlen_q, head_dim, capacity
    summary = {"batch": B, "capacity": L, "seqlen_q": Sq, "seed": seed, "distribution": MIXED_DISTRIBUTION,
               "lengths": lengths, "uniform_length": uniform, "ratios": {}}
    rows: list[DecodeRow] = []
    with torch.inference_mode():
        gen = torch.Generator(device=device).manual_seed(0)
        perm_gen = torch.Generator().manual_seed(0)
        q = torch.randn(B, H, Sq, d, device=device, dtype=tdtype, generator=gen)
        k, v = (torch.randn(B, Hkv, L, d, device=device, dtype=tdtype, generator=gen) for _ in range(2))
        pv = example_params(op.spec, B, H, L, L, device, gen, **(params or {}))
        batches = []
        for label, lens in (("mixed", lengths), ("uniform", [uniform] * B)):
            nbytes = sequence_bytes(op.spec, lens, H, Hkv, Sq, pv, d, k.element_size())
            summary[f"{label}_bytes"] = nbytes
            shown = (f"{MIXED_DISTRIBUTION} 1..{L} seed {seed}: min {min(lens)} median "
                     f"{int(torch.tensor(lens).median())} mean {sum(lens) / B:.1f} max {max(lens)}"
                     if label == "mixed" else f"all {uniform}")
            batches.append((label, torch.tensor(lens, dtype=torch.int32, device=device), nbytes,
                            f"cache_seqlens {shown}"))
        for ps, s in variants:
            kc, vc, table = paged_copy(k, v, ps, perm_gen) if ps else (k, v, None)
            pair = []
            for label, seqlens, nbytes, note in batches:
                name = "flashgen-" + label + variant_name(ps, s).removeprefix("flashgen")
                row = DecodeRow(name, B, L, H, Hkv, Sq, d, dtype.value, op.spec.name, ps, device.type, nbytes,
                                None, None, note)

                def ours(kc=kc, vc=vc, table=table, s=s, seqlens=seqlens):
                    return op.with_kvcache(q, kc, vc, cache_seqlens=seqlens, block_table=table, num_splits=s, **pv)

                try:
                    ours()  # built and loaded before the timing
                    extra = split_note(op, q, dtype, Hkv, L, s, pv)
                    row.note += f"; {extra}" if extra else ""
                    kept = row.note
                    _time_row(row, ours, device, reps, graphs)  # a timing failure replaces the note
                    row.note = kept if row.note == kept else f"{kept}; {row.note}"
                except Exception as e:  # reported on its row, not fatal
                    row.note += f"; {_failed(e)}"
                pair.append(row)
                log(format_row(row))
            mixed, uni = pair
            ratio = mixed.gbps / uni.gbps if mixed.gbps and uni.gbps else None
            summary["ratios"][variant_name(ps, s)] = ratio
            if ratio is not None:
                mixed.ratios = {uni.impl: ratio}
                log(format_ratios(mixed))
            rows += pair
    return rows, summary


def format_row(r: DecodeRow) -> str:
    perf = " " * 27 if r.ms is None else f"{r.ms:9.3f} ms {r.gbps:8.2f} GB/s"
    return (f"{r.impl:18s} B={r.batch:<4d} L={r.cache_len:<6d} H={r.heads}/{r.kv_heads:<3d} Sq={r.seqlen_q:<2d} "
            f"d={r.head_dim:<4d} {r.dtype} {r.mask:14s} {perf} {r.note}").rstrip()


def format_ratios(r: DecodeRow) -> str:
    return f"  {r.impl} GB/s over: " + ", ".join(f"{name} {x:.2f}×" for name, x in r.ratios.items())
