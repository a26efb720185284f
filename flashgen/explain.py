"""``flashgen explain``: what a call of a spec costs, and where that comes from.

For one shape (batch B, query heads Hq, kv heads Hkv, Nq queries, Nk keys, head dim d, element
size e bytes) this reports the tiles a call uses and where they came from (environment, tuned,
table, derived), their shared memory and registers per block, the FLOPs, the HBM bytes our
kernel moves with its real tiles next to standard attention's, and the roofline floor on a GPU
(the live one, or an architecture's datasheet figures from flashgen.tiles.ARCHS) or, on a
machine without one, on this CPU (peaks measured here). ``measure=True`` times the call and
reports the achieved fraction of that floor.

Counting rules (all totals are over the whole call, every batch element and head):

FLOPs (FlashAttention-2 convention, Dao 2023, §4): forward 4 · B · Hq · d · P, where P is the
number of visible (query, key) pairs per (batch, query head) — Nq · Nk dense, the kept entries
for a masked spec (as flashgen.reference.visible_pairs counts them, from the mask geometry below;
tensor parameters only the score reads do not change it); backward 2.5× the forward (5 matmuls
instead of 2). Masked entries a tile computes anyway are not counted.

Forward HBM bytes, our kernel (FlashAttention, Dao et al. 2022, Theorem 2: Θ(N² d² / M) — here
with the kernel's actual tiles instead of the asymptotic M): per (batch, query head), Q is read
once (Nq · d · e; query tiles that see no key skip it), O written once (Nq · d · e), the LSE
written once (4 · Nq); K and V are read once per query tile for the keys that tile loads:
Σ_i (keys loaded by query tile i) · d · e · 2. For a mask with a closed-form key range per row
(no mask, causal, windows, prefix-LM, key padding: ``kRowExact``) query tile i loads exactly the
keys of its range [kv_lo, kv_hi), the hull of the keys its rows keep (rows outside the range are
zero-filled, never read). For a mask without one (document ids) the CUDA kernel visits the key
tiles that keep at least one (query, key) pair of the tile (its block lists, built per call) and
loads each whole, clipped to [0, Nk) — an upper bound by at most one tile per query tile where
the spec's closed-form bound cuts a listed tile. K/V are counted per *query* head: each query
head's CTAs load their kv head's K/V (GQA saves capacity, not these loads).

Backward HBM bytes (the non-deterministic CUDA path, FlashAttention-2 Alg. 2):
  preprocess: read O and dO (2 · Nq · d · e), write D (4 · Nq), zero the fp32 dQ accumulator
    (4 · Nq · d);
  main kernel, per (key tile, kv head, split): read K and V once for the rows of the tile inside
    the union of its visiting query tiles' key ranges, write dK and dV (2 · Nk · d · e per kv
    head), or with the GQA split add them into fp32 workspaces with atomics (2 · 2 · 4 · d per
    key row per split; zeroed by the preprocess and converted after: read 2 · 4 · d, write
    2 · d · e per key row); for each query tile it visits, per query head of its share: read Q and
    dO (2 · d · e per row), LSE and D (2 · 4 per row), and add the dQ partial into the fp32
    accumulator with atomics (read + write, 2 · 4 · d per row);
  convert: read the accumulator (4 · Nq · d), write dq (Nq · d · e);
  workspaces: ops._backward allocates the dQ accumulator (and, for GQA, the dK/dV workspaces)
    with torch.zeros (4 · d per row written).
The deterministic path (a dQ kernel instead of atomics) is not modelled.

Tensor parameters (the spec's ``param NAME: T[...]``; each at its actual shape, ``batch|1`` /
``heads|1`` dims at the full size the explain call builds them, element size 4 for f32 / i32, 8
for i64, 1 for bool). A tensor indexed by both the query and the key position (an index using q
but not kv and another using kv but not q, like bias[b, h, q, kv]) is read per visited element:
its element size times the elements of the visited tiles (forward: Σ_i rows of query tile i ·
keys it loads; backward: the same with the backward's query tiles), per (batch, query head) work
item — dims broadcast over batch or heads are re-read by every work item. Other tensors (per
batch or head vectors, small tables, document ids) are read once per kernel. With ``backward``,
each f32 tensor that gets a gradient (flashgen.expr.grad_params: it enters the score) costs a
torch.zeros fill of its fp32 gradient (4 bytes per element) and fp32 atomics (read + write, 2 · 4
bytes) per visited element and read of it in the score. Terms: "tensor param NAME: ...". Only the
parameters the mask reads are evaluated (mask geometry, visible pairs); the others need only their
shape (explain never materialises them, unless ``measure``).

Standard attention (FlashAttention, Alg. 0 and Alg. 3, its standard backward; GQA: K/V
expanded per query head, as standard implementations do), per (batch, query head):
  forward  e · (2 · Nq · d + 2 · Nk · d + 4 · Nq · Nk): read Q, K; write S; read S, write P;
           read P, V; write O;
  backward e · (4 · Nq · d + 4 · Nk · d + 7 · Nq · Nk): read P, dO, write dV; read dO, V, write
           dP; read P, dP, write dS; read dS, K, write dQ; read dS, Q, write dK.
  plus each tensor parameter read once in the forward (S = Q Kᵀ + bias) and, with ``backward``,
  each parameter gradient written once.

Compulsory bytes (``compulsory_terms``): what the kernel reads at all, each byte once, and its
outputs written once. Forward: the Q rows of query tiles that see a key, K and V for the keys
the kernel reads at all — the union over query tiles of their visited key ranges (block lists:
occupied key tiles), per (batch, kv head) (a window or padding mask skips the rest) —, O and the
LSE; each tensor parameter's bytes once (a (q, kv)-indexed one scaled by the fraction of its
(q, kv) elements the kernel visits, all of it when no key is skipped). Backward: O, dO, dQ, dK,
dV once; Q and the LSE for the rows of query tiles that visit a key tile; K and V over the union
of the backward's key ranges; the parameters as in the forward, plus each gradient written once.
K/V are capped at the kernel's own K/V reads (the GQA backward's per-group average can fall
below a per-head mask's union), so compulsory_bytes ≤ hbm_bytes, term by term.

Roofline: floor_ms = max(FLOPs / peak, hbm_bytes / bandwidth); ``bound`` names the larger
term. GPU peaks are vendor datasheet figures (dense bf16/fp16 tensor cores, HBM bandwidth);
the CPU family's are measured once per process (an fp32 matmul, a large copy). The predicted
bytes count every global load the kernel issues: they are what reaches L2; K/V re-reads mostly
hit L2, so DRAM bytes lie between ``compulsory_bytes`` and ``hbm_bytes`` and the floor is an
upper estimate of the memory term (``compulsory_floor_ms`` uses the compulsory bytes: a lower
estimate, ≤ ``floor_ms``).

How the mask is counted: no mask and the causal masks in closed form; a mask with a closed-form
key range per row (``kRowExact``: windows, prefix-LM, key padding, ...) from its per-row bounds
(flashgen.expr.key_range's interval reasoning, evaluated per query row in PyTorch: O(Nq) time
and memory); any other mask evaluated element by element in chunks of query rows (O(Nq · Nk)
time, bounded memory).

The CPU family's tiles are the kernel's own choice (templates/include/flashgen/cpu/fwd.h
``choose_tiles``, bwd.h ``bwd_choose_tiles``) ported here: sized from the L2 cache, query tile by
a load-balance cost model over torch.get_num_threads() threads; its bytes use the same model.
"""

from __future__ import annotations

import functools
import json
import math
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from . import ir, tiles

ELEMENT_BYTES = {ir.DType.FP16: 2, ir.DType.BF16: 2, ir.DType.FP32: 4}
LSE_BYTES = 4  # fp32 LSE and D per row
ACC_BYTES = 4  # fp32 accumulators (dq_accum, dk/dv workspaces)
PARAM_BYTES = {"f32": 4, "i32": 4, "i64": 8, "bool": 1}  # tensor parameters' element sizes
_CHUNK_ELEMS = 1 << 22  # elements of one evaluated mask chunk (rows x keys x batch x heads)


# ---------------------------------------------------------------- report


@dataclass
class TileReport:
    """One kernel's tile: ``block_m`` queries × ``block_n`` keys, ``warps`` (None on CPU),
    ``origin`` ('env', 'tuned', 'table', 'derived', or 'derived (L2 cache)' for the CPU family),
    ``smem_bytes`` dynamic shared memory per block (None on CPU), ``regs`` registers per thread
    and ``regs_source`` (the ptxas figure from cuobjdump, or the model's estimate)."""

    block_m: int
    block_n: int
    warps: int | None
    origin: str
    smem_bytes: int | None
    regs: int | None
    regs_source: str
    shape: str
    tuned_seqlen: int | None = None


@dataclass
class Traffic:
    """One direction's counts: ``flops``, ``hbm_bytes`` (our kernel, bytes), ``standard_hbm_bytes``
    (standard attention), ``compulsory_bytes``, ``terms`` (name → bytes of hbm_bytes) and
    ``compulsory_terms`` (name → bytes of compulsory_bytes)."""

    flops: int
    hbm_bytes: int
    standard_hbm_bytes: int
    compulsory_bytes: int
    terms: dict[str, int] = field(default_factory=dict)
    compulsory_terms: dict[str, int] = field(default_factory=dict)


@dataclass
class Report:
    """What ``explain`` computed. Sizes are elements, bytes are bytes, times milliseconds, rates
    TFLOP/s (1e12 FLOP/s) and GB/s (1e9 B/s). ``flops`` / ``hbm_bytes`` / ``standard_hbm_bytes``
    / ``compulsory_bytes`` cover the forward, or forward + backward with ``backward``; ``fwd`` and
    ``bwd`` hold each direction. ``measured_ms``, ``tflops``, ``fraction_of_floor`` (floor_ms /
    measured_ms) are None unless measured."""

    spec: str
    family: str  # 'cuda' or 'cpu'
    arch: str
    gpu: str
    direction: str  # 'fwd' or 'fwd+bwd'
    batch: int
    heads: int
    kv_heads: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    dtype: str
    params: dict
    visible_pairs: float  # per (batch, query head)
    density: float  # visible_pairs / (Nq · Nk)
    flops: int
    hbm_bytes: int
    standard_hbm_bytes: int
    compulsory_bytes: int
    fwd: Traffic
    bwd: Traffic | None
    tiles: dict[str, TileReport]
    reference_tiles: dict  # derived tiles and the paper's (Br, Bc), for comparison
    model: str  # how tile visits were counted
    peak_tflops: float
    hbm_gbps: float
    peaks_source: str
    arithmetic_intensity: float
    floor_ms: float
    compulsory_floor_ms: float
    bound: str  # 'compute' or 'memory'
    l2_bytes: int | None = None
    threads: int | None = None
    measured_ms: float | None = None
    tflops: float | None = None
    fraction_of_floor: float | None = None
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        """A JSON-able dict of every field (tiles as {'fwd': {...}, 'bwd': {...}})."""
        return asdict(self)


# ---------------------------------------------------------------- arguments


def _as_op(op_or_spec):
    from .ops import AttentionOp
    from .ops import compile as fg_compile

    if isinstance(op_or_spec, AttentionOp):
        return op_or_spec
    return fg_compile(op_or_spec)


def as_dtype(dtype) -> ir.DType:
    """ops.as_dtype, with the error naming explain's argument."""
    from . import ops

    try:
        return ops.as_dtype(dtype)
    except ValueError:
        raise ValueError(f"dtype: expected fp16, bf16 or fp32, got {dtype!r}") from None


def _check_sizes(seqlen_q, seqlen_k, head_dim, batch, heads, kv_heads) -> None:
    for name, v in (("seqlen_q", seqlen_q), ("seqlen_k", seqlen_k), ("head_dim", head_dim), ("batch", batch),
                    ("heads", heads), ("kv_heads", kv_heads)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name}: expected an int, got {type(v).__name__}")
        if v < 1:
            raise ValueError(f"{name}: {v} is out of range (expected ≥ 1)")
    from .expr import MAX_SEQLEN

    for name, v in (("seqlen_q", seqlen_q), ("seqlen_k", seqlen_k)):
        if v > MAX_SEQLEN:
            raise ValueError(f"{name}: {v} is out of range (expected ≤ 2^30 = {MAX_SEQLEN}: the kernels' positions "
                             "are 32-bit)")
    if heads % kv_heads:
        raise ValueError(f"kv_heads: {kv_heads} does not divide heads = {heads}")


def _given_params(spec: ir.Spec, params) -> dict:
    """``params`` given as {name: value} or as ['NAME=VALUE', ...] (flashgen.cli.parse_params, the
    --param syntax), as a dict."""
    if not params:
        return {}
    if isinstance(params, dict):
        return dict(params)
    from .cli import parse_params

    return parse_params(spec, list(params))


def _spec_params(spec: ir.Spec, given: dict, batch: int, heads: int, nq: int, nk: int) -> dict:
    """The spec's parameter values on the CPU: ``given`` ones, the rest filled by
    flashgen.params.example_params with a fixed seed (so a prediction and its measurement see
    the same values). Only the tensors the mask reads get values: the others (a bias read by
    the score alone, say) are 'meta' tensors of their shape, never allocated (a [B, H, N, N]
    fp32 bias is 17 GB at N = 16K); ``_materialize`` fills them for a measurement."""
    from .params import _TORCH, example_params, shape_of
    from .sparsity import mask_names

    unknown = set(given) - {p.name for p in spec.params}
    if unknown:
        raise ValueError(f"params: unknown parameter(s) {', '.join(sorted(unknown))} for spec '{spec.name}'")
    sizes = {"batch": batch, "heads": heads, "seqlen_q": nq, "seqlen_k": nk}
    for p in spec.params:  # int params size tensor dims (as example_params fills them)
        if p.kind == "int":
            sizes[p.name] = int(given[p.name]) if given.get(p.name) is not None else max(1, nk // 8)
    read = mask_names(spec)
    shaped = {}
    for p in spec.params:
        if p.is_tensor and p.name not in read and not isinstance(given.get(p.name), torch.Tensor):
            shape = shape_of(p, sizes)
            if any(n < 1 for n in shape):
                raise ValueError(f"params: {p.name}: its shape {shape} for these sizes and parameters has a dim "
                                 "below 1")
            shaped[p.name] = torch.empty(shape, dtype=_TORCH[p.dtype], device="meta")
    gen = torch.Generator().manual_seed(0)
    try:
        return example_params(spec, batch, heads, nq, nk, "cpu", gen, **(given | shaped))
    except (TypeError, ValueError) as e:
        raise ValueError(f"params: {e}") from None


def _materialize(spec: ir.Spec, values: dict, given: dict, batch: int, heads: int, nq: int, nk: int) -> dict:
    """``values`` with its shape-only ('meta') tensors filled as example_params fills them."""
    from .params import example_params

    if not any(isinstance(x, torch.Tensor) and x.is_meta for x in values.values()):
        return values
    known = {n: x for n, x in values.items() if not (isinstance(x, torch.Tensor) and x.is_meta)}
    gen = torch.Generator().manual_seed(0)
    return example_params(spec, batch, heads, nq, nk, "cpu", gen, **(given | known))


@dataclass(frozen=True)
class _Target:
    family: str  # 'cuda' | 'cpu'
    arch: str
    info: tiles.ArchInfo | None  # CUDA figures
    device_index: int | None  # live CUDA device (tuned/env tiles, measurement)
    device: torch.device | None  # where a measurement runs


def _resolve(arch, device, measure: bool) -> _Target:
    """The family and figures: --arch's table entry (the live device's own figures when it is
    that architecture), else the live GPU, else this CPU."""
    from .build import cpu_arch, cuda_arch_of

    dev = None
    if device is not None:
        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError):
            raise ValueError(f"device: expected cpu or cuda[:N], got {device!r}") from None
        if dev.type not in ("cpu", "cuda"):
            raise ValueError(f"device: '{dev.type}' is not supported (expected cpu or cuda)")
    if arch is not None:
        norm = tiles.normalize_arch(str(arch))
        if dev is not None and dev.type == "cpu":
            raise ValueError(f"device: cpu conflicts with arch {arch!r} (an architecture names a CUDA target)")
        live = None
        if torch.cuda.is_available():
            index = dev.index if dev is not None and dev.index is not None else torch.cuda.current_device()
            if cuda_arch_of(index) == norm:
                live = index
        if live is None and (measure or (dev is not None and dev.type == "cuda")):
            what = "measure" if measure else "device"
            raise ValueError(f"{what}: needs a live CUDA device of arch {norm}, and this machine has none "
                             "(drop it to explain from the tables alone)")
        if live is not None:
            return _Target("cuda", norm, tiles.device_info(live), live, torch.device("cuda", live))
        return _Target("cuda", norm, tiles.arch_info(norm), None, None)
    if dev is None:
        dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device: CUDA is not available in this torch build or machine (pass --arch to "
                             "explain a GPU from the tables)")
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        return _Target("cuda", cuda_arch_of(index), tiles.device_info(index), index, torch.device("cuda", index))
    return _Target("cpu", cpu_arch(), None, None, torch.device("cpu"))


# ---------------------------------------------------------------- mask geometry


@dataclass
class _Geometry:
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


def _row_exact(spec: ir.Spec) -> bool:
    from . import codegen

    return spec.mask is None or bool(codegen.hook_bodies(spec)["row_exact"])


class _NoClosedForm(Exception):
    """The mask's per-row key range is not available in closed form."""


def _row_bounds(spec: ir.Spec, nq: int, nk: int, bp: int, hp: int, params: dict) -> tuple:
    """Per query row, the key range [lo, hi) int64 [bp, hp, Nq] the mask keeps (None: unbounded
    on that side), by the interval reasoning of flashgen.expr.key_range applied to a single row
    (q_lo = q, q_hi = q + 1) and evaluated in PyTorch. Exact when key_range(spec).exact (the
    caller's condition): the row keeps exactly [lo, hi) ∩ [0, Nk). Raises _NoClosedForm for a
    structure key_range leaves unbounded."""
    from . import expr as X
    from . import reference

    ar = lambda n: torch.arange(n, dtype=torch.int64)
    env = {"b": ar(bp).view(-1, 1, 1), "h": ar(hp).view(1, -1, 1), "q": ar(nq).view(1, 1, -1),
           "seqlen_q": nq, "seqlen_k": nk}
    scope = X.Scope({p.name: p for p in spec.params}, allow_score=True)
    shape = (bp, hp, nq)

    def val(e):
        if e is None:
            return 0
        return torch.broadcast_to(torch.as_tensor(reference.evaluate(e, spec, env, params, torch.float64)), shape)

    def both(a, b, fn, none_wins: bool):
        if a is None or b is None:
            return None if none_wins else (b if a is None else a)
        return fn(a, b)

    def go(e: ir.Expr, negate: bool):
        if isinstance(e, ir.Unary) and e.op == "not":
            return go(e.operand, not negate)
        if isinstance(e, ir.BinOp) and e.op in ("and", "or"):
            (alo, ahi), (blo, bhi) = go(e.lhs, negate), go(e.rhs, negate)
            if (e.op == "and") != negate:  # intersection
                return both(alo, blo, torch.maximum, False), both(ahi, bhi, torch.minimum, False)
            return both(alo, blo, torch.minimum, True), both(ahi, bhi, torch.maximum, True)  # union (exact: an interval)
        if not X.uses(e, "kv"):
            if X.uses(e, "q"):
                raise _NoClosedForm
            c = val(e).to(torch.bool)
            c = ~c if negate else c
            return None, torch.where(c, torch.full(shape, nk, dtype=torch.int64), torch.zeros(shape, dtype=torch.int64))
        if not (isinstance(e, ir.BinOp) and e.op in X._FLIP_CMP):
            raise _NoClosedForm
        if X.type_of(e.lhs, scope) != X.INT or X.type_of(e.rhs, scope) != X.INT:
            raise _NoClosedForm
        op = X._NEG_CMP[e.op] if negate else e.op
        lhs, rhs = X.linear_in_kv(e.lhs), X.linear_in_kv(e.rhs)
        if lhs is None or rhs is None:
            raise _NoClosedForm
        c = lhs[0] - rhs[0]
        f = (val(rhs[1]) - val(lhs[1])) * torch.ones(shape, dtype=torch.int64)  # c·kv op f
        if c == -1:
            op, f = X._FLIP_CMP[op], -f
        elif c != 1:
            raise _NoClosedForm
        if op == "<=":
            return None, f + 1
        if op == "<":
            return None, f
        if op == ">=":
            return f, None
        if op == ">":
            return f + 1, None
        if op == "==":
            return f, f + 1
        raise _NoClosedForm  # !=

    return go(spec.mask, False)


def _geometry(spec: ir.Spec, nq: int, nk: int, batch: int, heads: int, params: dict,
              block_tiles: tuple[tuple[int, int], ...] = ()) -> _Geometry:
    """The mask's row hulls (and block occupancy at ``block_tiles``): closed form for no mask,
    the causal masks and any mask with an exact per-row key range (O(Nq) time and memory per
    (b', h') of the mask's extent), else the mask evaluated in chunks of query rows (O(Nq·Nk)
    time, O(_CHUNK_ELEMS) memory)."""
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
        geo = _Geometry(1, 1, first, last, pairs, True, "closed form")
        for bm, bn in block_tiles:
            geo.blocks[(bm, bn)] = _blocks_from_hulls(first, last, nq, nk, bm, bn)
        return geo

    from . import reference
    from .sparsity import mask_extents

    per_b, per_h = mask_extents(spec)
    bp, hp = (batch if per_b else 1), (heads if per_h else 1)
    g = bp * hp
    if _row_exact(spec):
        try:
            lo, hi = _row_bounds(spec, nq, nk, bp, hp, params)
        except _NoClosedForm:
            pass
        else:
            first = (torch.zeros(bp, hp, nq, dtype=torch.int64) if lo is None else lo.clamp(min=0)).reshape(g, nq)
            last = ((torch.full((bp, hp, nq), nk, dtype=torch.int64) if hi is None else hi.clamp(max=nk)) - 1
                    ).reshape(g, nq)
            empty = last < first
            first = torch.where(empty, torch.full_like(first, nk), first)
            last = torch.where(empty, torch.full_like(last, -1), last)
            pairs = int((last - first + 1).clamp(min=0).sum())
            geo = _Geometry(bp, hp, first, last, pairs, True, "closed form (per-row key range)")
            for bm, bn in block_tiles:
                geo.blocks[(bm, bn)] = _blocks_from_hulls(first, last, nq, nk, bm, bn)
            return geo
    step = math.lcm(16, *(bm for bm, _ in block_tiles)) if block_tiles else 16
    chunk = max(step, (_CHUNK_ELEMS // max(1, g * nk)) // step * step)
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
    return _Geometry(bp, hp, first, last, pairs, _row_exact(spec), "mask evaluated", blocks)


def _blocks_from_hulls(first, last, nq, nk, bm, bn) -> torch.Tensor:
    """Block occupancy of an exact (interval-per-row) mask from its row intervals."""
    lo, hi, _ = _tile_hulls(first, last, nq, bm)
    j = torch.arange(-(-nk // bn), dtype=torch.int64)
    return (hi > lo).unsqueeze(-1) & (lo.unsqueeze(-1) < (j + 1) * bn) & (hi.unsqueeze(-1) > j * bn)


def _tile_hulls(first, last, nq, bm):
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


def _widths(nk: int, bn: int) -> torch.Tensor:
    """Keys of each key tile inside [0, Nk)."""
    return (nk - torch.arange(-(-nk // bn), dtype=torch.int64) * bn).clamp(max=bn)


@dataclass
class _Visits:
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


def _interval_union(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """[G]: the length of the union of the intervals [lo, hi) of each row of [G, T] (empty ones,
    hi ≤ lo, add nothing)."""
    order = lo.argsort(-1)
    lo, hi = lo.gather(-1, order), hi.gather(-1, order)
    hi = torch.maximum(hi, lo)
    reach = torch.cummax(hi, -1).values  # the furthest end among the intervals so far
    before = torch.cat([torch.full_like(reach[:, :1], torch.iinfo(torch.int64).min // 4), reach[:, :-1]], 1)
    return (hi - torch.maximum(lo, before)).clamp(min=0).sum(-1)


def _kv_union(geo: _Geometry, lo=None, hi=None, blk=None, widths=None, *, batch: int, heads: int,
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
        u = int(_interval_union(lo, hi).sum())
    return u * (batch // bp) * (hkv if hp == 1 else 1)


def _visits(geo: _Geometry, nq: int, nk: int, fwd: tuple[int, int], bwd: tuple[int, int] | None,
            listed: bool, batch: int = 1, heads: int = 1, hkv: int = 1) -> _Visits:
    """Count the loads of the forward tile (bm, bn) and backward tile (bm, bn): by ranges (the
    hull of each query tile's kept keys) or, with ``listed``, by occupied blocks (block lists)."""
    sizes = {"batch": batch, "heads": heads, "hkv": hkv}
    bm, bn = fwd
    if listed:
        blk = geo.blocks[fwd]
        w = _widths(nk, bn)
        kv = (blk.to(torch.int64) * w).sum(-1)
        ntile = blk.sum(-1)
        rows = (nq - torch.arange(blk.shape[1], dtype=torch.int64) * bm).clamp(max=bm)
        f_union = _kv_union(geo, blk=blk, widths=w, **sizes)
    else:
        lo, hi, rows = _tile_hulls(geo.first, geo.last, nq, bm)
        kv = hi - lo
        ntile = torch.where(hi > lo, (hi - 1) // bn - lo // bn + 1, torch.zeros_like(lo))
        f_union = _kv_union(geo, lo, hi, **sizes)
    f_kv, f_q, f_t = int(kv.sum()), int(((ntile > 0) * rows).sum()), int(ntile.sum())
    f_el = int((kv * rows).sum())
    if bwd is None:
        return _Visits(f_kv, f_q, f_t, 0, 0, 0, fwd_elems=f_el, fwd_kv_union=f_union)
    bm, bn = bwd
    w = _widths(nk, bn)
    nkt = w.numel()
    if listed:
        blk = geo.blocks[bwd]
        rows = (nq - torch.arange(blk.shape[1], dtype=torch.int64) * bm).clamp(max=bm)
        b_q = int((blk.to(torch.int64) * rows.view(1, -1, 1)).sum())
        b_n = int(blk.sum())
        b_kv = int((blk.any(1).to(torch.int64) * w).sum())
        b_el = int(((blk.to(torch.int64) * w).sum(-1) * rows).sum())
        b_any = int((blk.any(-1) * rows).sum())
        return _Visits(f_kv, f_q, f_t, b_q, b_n, b_kv, f_el, b_el, b_any, f_union,
                       _kv_union(geo, blk=blk, widths=w, **sizes))
    lo, hi, rows = _tile_hulls(geo.first, geo.last, nq, bm)
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
    step = max(1, _CHUNK_ELEMS // max(1, g * nkt))
    for i0 in range(0, t, step):
        l, h, ne = lo[:, i0:i0 + step, None], hi[:, i0:i0 + step, None], nonempty[:, i0:i0 + step, None]
        vis = ne & (l < (j + 1) * bn) & (h > j * bn)
        vlo = torch.minimum(vlo, torch.where(vis, l, torch.full_like(l, big)).amin(1))
        vhi = torch.maximum(vhi, torch.where(vis, h, torch.zeros_like(h)).amax(1))
    b_kv = int((torch.minimum(vhi, j * bn + w) - torch.maximum(vlo, j * bn)).clamp(min=0).sum())
    return _Visits(f_kv, f_q, f_t, b_q, b_n, b_kv, f_el, b_el, b_any, f_union, _kv_union(geo, lo, hi, **sizes))


# ---------------------------------------------------------------- the CPU family's tiles


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


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _spans(geo: _Geometry, nq: int, qc: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, key span) per query tile of ``qc`` rows at b = h = 0 (the kernels' cost models
    evaluate kv_lo / kv_hi there)."""
    lo, hi, rows = _tile_hulls(geo.first[:1], geo.last[:1], nq, qc)
    return rows, (hi - lo)[0]


def cpu_fwd_tiles(geo: _Geometry, batch_heads: int, nq: int, nk: int, d: int, l2: int, threads: int) -> tuple[int, int]:
    """(qb, kvb) of the CPU forward: ``choose_tiles`` of cpu/fwd.h — kvb the largest power of two
    ≤ 512 (≥ 128) whose K and V panels (2 · kvb · d fp32) fit L2, qb the candidate in
    {qb_max, qb_max/2, ..., 32} (qb_max = L2 / (4 · kvb) in [32, 256]) minimising the makespan of
    the B·Hq·⌈Nq/qb⌉ tasks over ``threads`` threads times (1 + 5/qb + 5/kvb)."""
    nk8 = _round_up(max(nk, 1), 8)
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
            rows, span = _spans(geo, nq, qc)
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


def cpu_bwd_tiles(geo: _Geometry, nq: int, nk: int, d: int, l2: int, mod_path: bool, dropout: bool = False) -> tuple[int, int]:
    """(qb, kvb) of the CPU backward: ``bwd_choose_tiles`` of cpu/bwd.h — kvb ≤ 128 with its five
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
    kvb = min(kvb, _round_up(max(nk, 1), 8))
    qb = qb_max if qb_max < nq else max(nq, 1)
    if nq > 32:
        best = -1.0
        cand = qb_max
        while cand >= 32:
            qc = min(cand, nq)
            rows, span = _spans(geo, nq, qc)
            area = float((rows * span.clamp(min=0)).sum())
            cost = area * (1.0 + 5.0 / qc + 5.0 / kvb)
            if best < 0.0 or cost < best * 0.999:
                best, qb = cost, qc
            cand //= 2
    return qb, kvb


def _cpu_tiles(spec, geo, batch, heads, nq, nk, d, l2, threads):
    from . import expr as X

    mod_path = spec.score is not None or bool(X.grad_params(spec))
    return (cpu_fwd_tiles(geo, batch * heads, nq, nk, d, l2, threads),
            cpu_bwd_tiles(geo, nq, nk, d, l2, mod_path))


def cpu_tiles(op_or_spec, seqlen_q: int, seqlen_k: int | None = None, *, head_dim: int, batch: int = 1,
              heads: int = 1, params=None, l2_bytes: int | None = None,
              threads: int | None = None) -> tuple[tuple[int, int], tuple[int, int]]:
    """((qb, kvb) forward, (qb, kvb) backward): the CPU family's tiles for a call (the padded
    layout, no block mask, no dropout), as its kernels choose them (``cpu_fwd_tiles``,
    ``cpu_bwd_tiles``) with ``l2_bytes`` (default: this machine's, ``cpu_l2_bytes``) and
    ``threads`` (default torch.get_num_threads()). ``params`` as in ``explain``."""
    op = _as_op(op_or_spec)
    nk = seqlen_q if seqlen_k is None else seqlen_k
    _check_sizes(seqlen_q, nk, head_dim, batch, heads, heads)
    given = _given_params(op.spec, params)
    values = _spec_params(op.spec, given, batch, heads, seqlen_q, nk)
    geo = _mask_geometry(op.spec, seqlen_q, nk, batch, heads, values, given)
    return _cpu_tiles(op.spec, geo, batch, heads, seqlen_q, nk, head_dim,
                      cpu_l2_bytes() if l2_bytes is None else l2_bytes,
                      torch.get_num_threads() if threads is None else threads)


# ---------------------------------------------------------------- registers (ptxas, from a cached library)


def resource_usage(lib: Path) -> dict[str, int]:
    """{mangled kernel name: registers per thread} of a compiled library (flashgen.tune's
    ``cuobjdump -res-usage`` report). Raises OSError when cuobjdump is missing or fails."""
    from .tune import resources

    res = resources.resource_usage(lib)
    if res is None:
        raise OSError("cuobjdump not found or failed (CUDA toolkit bin/ not on PATH)")
    return {name: r.regs for name, r in res.items()}


def _library_path(inst) -> Path | None:
    """lib.so of ``inst`` in the cache (or an ahead-of-time directory), if already built."""
    from . import env

    entry = env.cache_dir() / inst.name / "lib.so"
    if entry.is_file():
        return entry
    dirs = env.aot_dirs() if hasattr(env, "aot_dirs") else []
    if dirs:
        try:
            from . import aot

            lib, _ = aot.find(inst, dirs)
            if lib is not None:
                return Path(lib.path)
        except Exception:  # noqa: BLE001 - an unreadable directory only means "no figure"
            return None
    return None


# ---------------------------------------------------------------- peaks


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


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# ---------------------------------------------------------------- traffic


@dataclass(frozen=True)
class _TensorParam:
    """A tensor parameter the kernels read: ``numel`` elements of ``elt`` bytes at its actual
    shape; ``per_pair``: indexed by both the query and the key position (read per visited
    element); ``grad_reads``: reads of it in the score when it gets an fp32 gradient (0 if not)."""

    name: str
    numel: int
    elt: int
    per_pair: bool
    grad_reads: int


def _tensor_params(spec: ir.Spec, values: dict) -> list[_TensorParam]:
    """The spec's tensor parameters that its mask or score reads (see the module docstring)."""
    from . import expr as X

    grads = {p.name for p in X.grad_params(spec)}
    out = []
    for p in spec.params:
        if not p.is_tensor:
            continue
        reads = [n for e in (spec.mask, spec.score) if e is not None for n in X.walk(e)
                 if isinstance(n, ir.Index) and n.base.id == p.name]
        if not reads:
            continue

        def pair(n: ir.Index) -> bool:
            uq = [X.uses(i, "q") and not X.uses(i, "kv") for i in n.indices]
            uk = [X.uses(i, "kv") and not X.uses(i, "q") for i in n.indices]
            return any(uq) and any(uk)

        value = values[p.name]
        numel = value.numel() if isinstance(value, torch.Tensor) else 1
        out.append(_TensorParam(p.name, numel, PARAM_BYTES[p.dtype], any(pair(n) for n in reads),
                                max(1, len(X.param_reads(spec, p))) if p.name in grads else 0))
    return out


def _param_terms(tparams: list[_TensorParam], elems: int, all_elems: int, backward: bool,
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


def _fwd_traffic(B, Hq, Hkv, nq, nk, d, e, pairs_total, v: _Visits, scale: int,
                 tparams: list[_TensorParam] = ()) -> Traffic:
    flops = 4 * d * pairs_total
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
    standard += _param_terms(tparams, v.fwd_elems * scale, B * Hq * nq * nk, False, terms, comp)
    return Traffic(flops, sum(terms.values()), standard, sum(comp.values()), terms, comp)


def _bwd_traffic(B, Hq, Hkv, nq, nk, d, e, pairs_total, v: _Visits, scale: int, kv_scale_num: int,
                 kv_scale_den: int, splits: int, tparams: list[_TensorParam] = ()) -> Traffic:
    flops = 10 * d * pairs_total  # 2.5 × the forward's 4 · d per pair
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
        "main: dQ atomics (read + write)": 2 * ACC_BYTES * d * v.bwd_q_rows * scale,
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
    standard += _param_terms(tparams, v.bwd_elems * scale, B * Hq * nq * nk, True, terms, comp)
    return Traffic(flops, sum(terms.values()), standard, sum(comp.values()), terms, comp)


def _gqa_splits(num_n_tiles: int, hkv: int, batch: int, group: int, sms: int) -> int:
    """The CUDA backward's GQA split (bwd.cuh launch_bwd_tiled, non-deterministic path)."""
    splits = 1
    items = num_n_tiles * hkv * batch
    if group > 1 and 2 * items <= sms:
        for s in range(2, group + 1):
            if group % s == 0 and items * s <= sms:
                splits = s
    return splits


def _nearest_known_arch(arch: str) -> str:
    """The architecture of flashgen.tiles.ARCHS whose figures tiles.arch_info uses for ``arch``
    (the nearest older one), with its part's name."""
    base = tiles.known_arch(arch)
    return f"{base} ({tiles.ARCHS[base].name})"


def _mask_geometry(spec: ir.Spec, nq: int, nk: int, batch: int, heads: int, values: dict, given: dict,
                   block_tiles=()) -> _Geometry:
    """_geometry, with a mask that indexes a parameter out of its bounds at these sizes (say a
    document-id mask [batch, seqlen_k] indexed by q with seqlen_q > seqlen_k) reported as a
    ValueError naming what to change: the parameter when it was given as a tensor, else
    seqlen_k (when it differs from seqlen_q) or params."""
    try:
        return _geometry(spec, nq, nk, batch, heads, values, block_tiles)
    except IndexError as err:
        name, _, detail = str(err).partition(": ")
        if isinstance(given.get(name), torch.Tensor) or nq == nk:
            what = f"params: {name}"
        else:
            what = f"seqlen_k: {nk} with seqlen_q = {nq}"
        raise ValueError(f"{what}: the mask of spec '{spec.name}' reads parameter {name} out of its bounds at these "
                         f"sizes ({detail})") from None


# ---------------------------------------------------------------- explain


def explain(op_or_spec, seqlen_q: int, seqlen_k: int | None = None, *, head_dim: int, batch: int = 1,
            heads: int = 1, kv_heads: int | None = None, dtype=None, arch: str | None = None,
            device=None, params=None, backward: bool = False, measure: bool = False, build: bool = False,
            reps: int = 10) -> Report:
    """Explain one call: q [batch, heads, seqlen_q, head_dim], k, v [batch, kv_heads, seqlen_k,
    head_dim] of ``dtype`` (see the module docstring for every count and its source).

    Args:
        op_or_spec: a compiled op, an ``ir.Spec``, a path to a ``.attn`` file or spec text.
        seqlen_q, seqlen_k: sequence lengths (seqlen_k defaults to seqlen_q); head_dim, batch,
            heads (query heads), kv_heads (default heads; must divide heads): sizes ≥ 1 (the
            sequence lengths ≤ 2^30, the kernels' limit).
        dtype: 'bf16', 'fp16' or 'fp32' (fp32: CPU family only), or the torch / flashgen dtype;
            None: bf16 when the spec allows it on the target's family, else the first dtype it
            allows there.
        arch: a CUDA architecture ('sm_90a', '90', ...): tiles and peaks from flashgen.tiles'
            tables (the live device's own figures, tuned and env tiles when it is that arch).
            None: the live GPU, else this CPU.
        device: 'cpu' or 'cuda[:N]' to pick the family / device explicitly.
        params: the spec's parameters, {name: value} or ['NAME=VALUE', ...] (--param syntax);
            missing ones get flashgen.params.example_params values (seed 0) — only those the
            mask reads: the others are counted from their shape alone.
        backward: count forward + backward (and time both with ``measure``).
        measure: run the call on random inputs on the device and time it (median of ``reps``,
            flashgen.bench.time_fn); builds the kernels if needed.
        build: compile the CUDA instantiation when it is not cached, so that registers come from
            ptxas (cuobjdump -res-usage) instead of the model.

    Returns:
        A Report (``as_dict()`` for JSON).

    Raises:
        ValueError: an argument out of range or unsupported (naming it: arch, head_dim, dtype,
            device, measure, kv_heads, params, ...), including sizes at which the mask indexes
            a parameter out of its bounds (naming seqlen_k or params).
        TypeError: a size that is not an int.
        SpecError / BuildError: the spec does not parse; a build (measure/build) failed.
    """
    op = _as_op(op_or_spec)
    spec = op.spec
    nq = seqlen_q
    nk = seqlen_q if seqlen_k is None else seqlen_k
    hkv = heads if kv_heads is None else kv_heads
    _check_sizes(nq, nk, head_dim, batch, heads, hkv)
    if measure and (isinstance(reps, bool) or not isinstance(reps, int) or reps < 1):
        raise ValueError(f"reps: {reps!r} is out of range (expected an int ≥ 1)")
    dt = None if dtype is None else as_dtype(dtype)
    target = _resolve(arch, device, measure)
    fam = target.family
    allowed = op.dtypes(fam)
    if not allowed:
        from . import families

        what = "arch" if arch is not None else "device" if device is not None else "dtype"
        declared = ", ".join(x.value for x in spec.dtypes or ())
        family = ", ".join(x.value for x in families.of(fam).dtypes)
        raise ValueError(f"{what}: spec '{spec.name}' has no {fam.upper()} dtype: it allows {declared} and the "
                         f"{fam.upper()} kernels run {family} (explain it on the CPU family: no --arch, "
                         "--device cpu)")
    if dt is None:
        dt = ir.DType.BF16 if ir.DType.BF16 in allowed else allowed[0]
    if dt not in allowed:
        raise ValueError(f"dtype: {dt.value} is not supported by spec '{spec.name}' on {fam.upper()} "
                         f"(expected one of {', '.join(x.value for x in allowed)})")
    if head_dim not in op.head_dims(fam):
        from .ops import ranges_text

        raise ValueError(f"head_dim: {head_dim} is not supported by spec '{spec.name}' on {fam.upper()} "
                         f"(expected one of {ranges_text(op.head_dims(fam))})")
    given = _given_params(spec, params)
    values = _spec_params(spec, given, batch, heads, nq, nk)
    e = ELEMENT_BYTES[dt]
    d = head_dim
    notes: list[str] = []
    score_mod = spec.score is not None

    # ---- tiles
    if fam == "cuda":
        info = target.info
        from . import env

        listed = op.auto_sparse and env.auto_block_mask()  # block lists per call (ops.auto_blocks)
        seqlen = None if listed else max(nq, nk)
        choice = tiles.choose(spec, target.arch, dt, d, seqlen, device_index=target.device_index,
                              fingerprint=op.fingerprint)
        fwd_t, bwd_t = choice.fwd, choice.bwd
        regs_f, regs_b, regs_src = _registers(op, target, dt, d, choice, listed, build, notes)
        tile_rep = {
            "fwd": TileReport(fwd_t.block_m, fwd_t.block_n, fwd_t.warps, choice.fwd_origin, fwd_t.smem_bytes(d),
                              regs_f if regs_f is not None else fwd_t.regs_estimate(d, score_mod),
                              regs_src if regs_f is not None else "estimate (tiles.FwdTile.regs_estimate)",
                              str(fwd_t), choice.tuned_seqlen[0]),
            "bwd": TileReport(bwd_t.block_m, bwd_t.block_n, bwd_t.warps, choice.bwd_origin, bwd_t.smem_bytes(d),
                              regs_b if regs_b is not None else bwd_t.regs_estimate(d, score_mod),
                              regs_src if regs_b is not None else "estimate (tiles.BwdTile.regs_estimate)",
                              str(bwd_t), choice.tuned_seqlen[1]),
        }
        df, db = tiles.derived(info, d, score_mod)
        br, bc = tiles.paper_tiles(info.smem_optin, d)
        reference_tiles = {"derived_fwd": str(df), "derived_bwd": str(db), "paper_br_bc": [br, bc],
                           "smem_optin": info.smem_optin}
        fwd_mn = (fwd_t.block_m, fwd_t.block_n)
        bwd_mn = (bwd_t.block_m, bwd_t.block_n)
        if fwd_t.smem_bytes(d) > info.smem_optin:
            fix = " (set a smaller FLASHGEN_CUDA_FWD_TILE)" if choice.fwd_origin == "env" else ""
            notes.append(f"the forward tile {fwd_t} ({choice.fwd_origin}) needs {fwd_t.smem_bytes(d):,} B of shared "
                         f"memory per block, over this GPU's {info.smem_optin:,} B: the forward kernel cannot "
                         f"launch with it{fix}")
        if bwd_t.smem_bytes(d) > info.smem_optin:
            notes.append("the backward tile exceeds this GPU's shared memory: the kernels take the deterministic "
                         "path (dQ kernel), which the backward byte model does not describe")
        geo = _mask_geometry(spec, nq, nk, batch, heads, values, given, (fwd_mn, bwd_mn) if listed else ())
        splits = _gqa_splits(-(-nk // bwd_mn[1]), hkv, batch, heads // hkv, info.sms)
        peak, bw = info.peak_tflops, info.hbm_gbps
        if target.device_index is not None:
            peaks_source = "datasheet, by the device's name (flashgen.tiles)"
        elif target.arch in tiles.ARCHS:
            peaks_source = f"datasheet of the representative part {info.name} (flashgen.tiles.ARCHS)"
        else:
            peaks_source = (f"datasheet of {_nearest_known_arch(target.arch)}, the nearest older architecture in "
                            "flashgen.tiles.ARCHS")
        gpu_name, l2, threads = info.name, info.l2_bytes, None
        model = ("block lists: key tiles holding a kept pair, loaded whole" if listed
                 else "key ranges: each query tile loads the hull of its kept keys")
    else:
        listed = False
        geo = _mask_geometry(spec, nq, nk, batch, heads, values, given)
        l2 = cpu_l2_bytes()
        threads = torch.get_num_threads()
        (qb, kvb), (bqb, bkvb) = _cpu_tiles(spec, geo, batch, heads, nq, nk, d, l2, threads)
        origin = "derived (L2 cache)"
        tile_rep = {
            "fwd": TileReport(qb, kvb, None, origin, None, None, "n/a (CPU family)", f"{qb}x{kvb}"),
            "bwd": TileReport(bqb, bkvb, None, origin, None, None, "n/a (CPU family)", f"{bqb}x{bkvb}"),
        }
        reference_tiles = {"l2_bytes": l2, "threads": threads}
        fwd_mn, bwd_mn = (qb, kvb), (bqb, bkvb)
        splits = 1
        peak, bw = cpu_peaks()
        peaks_source = "measured on this machine (fp32 matmul, memory copy)"
        gpu_name = f"CPU: {_cpu_name()}"
        model = "key ranges: each query tile loads the hull of its kept keys (the CUDA kernels' model, CPU tiles)"
        notes.append("CPU family: bytes follow the same tile model with the CPU kernel's tiles; 'hbm' means DRAM")

    # ---- counts
    # The kept pairs, as reference.visible_pairs counts them (from the geometry: the closed form
    # or the chunked evaluation of the mask alone, never an Nq × Nk tensor).
    pairs_total = geo.pairs * batch * heads // (geo.bp * geo.hp)
    visits = _visits(geo, nq, nk, fwd_mn, bwd_mn if backward else None, listed, batch, heads, hkv)
    scale = batch * heads // (geo.bp * geo.hp)
    tparams = _tensor_params(spec, values)
    fwd_tr = _fwd_traffic(batch, heads, hkv, nq, nk, d, e, pairs_total, visits, scale, tparams)
    bwd_tr = None
    if backward:
        bwd_tr = _bwd_traffic(batch, heads, hkv, nq, nk, d, e, pairs_total, visits, scale,
                              batch * hkv * splits, geo.bp * geo.hp, splits, tparams)
        if splits > 1:
            notes.append(f"backward: GQA group split over {splits} CTAs per key tile (dK/dV by fp32 atomics)")
    flops = fwd_tr.flops + (bwd_tr.flops if bwd_tr else 0)
    hbm = fwd_tr.hbm_bytes + (bwd_tr.hbm_bytes if bwd_tr else 0)
    std = fwd_tr.standard_hbm_bytes + (bwd_tr.standard_hbm_bytes if bwd_tr else 0)
    comp = fwd_tr.compulsory_bytes + (bwd_tr.compulsory_bytes if bwd_tr else 0)
    t_compute = flops / (peak * 1e12) * 1e3
    t_memory = hbm / (bw * 1e9) * 1e3
    floor_ms = max(t_compute, t_memory)
    compulsory_floor_ms = max(t_compute, comp / (bw * 1e9) * 1e3)
    rereads = fwd_tr.terms["K, V reads"] - fwd_tr.compulsory_terms["K, V reads"]
    if bwd_tr is not None:
        rereads += bwd_tr.terms["main: K, V reads"] - bwd_tr.compulsory_terms["K, V reads"]
    if fam == "cuda" and rereads > 0:
        notes.append(f"K/V re-reads ({_fmt_bytes(rereads)} over reading each K/V row once) mostly hit L2 "
                     f"({_fmt_bytes(l2)}): DRAM bytes lie between compulsory_bytes and hbm_bytes")
    pair_params = [tp.name for tp in tparams if tp.per_pair]
    if pair_params:
        notes.append(f"tensor parameter(s) {', '.join(pair_params)} indexed by (q, kv): read per visited element "
                     "and work item (an upper bound where a tile's mask is partial: score() sees kept elements "
                     "only)")
    if backward and any(tp.grad_reads for tp in tparams):
        names = ", ".join(tp.name for tp in tparams if tp.grad_reads)
        notes.append(f"backward: counted with the gradient of {names} requested (fp32 atomics per visited element)")
    if listed:
        notes.append("no closed-form key range: counted from the block lists the kernels build per call "
                     "(the classifier's own traffic is not counted)")

    shown = {n: (list(x.shape) if isinstance(x, torch.Tensor) else x) for n, x in values.items()}
    rep = Report(
        spec=spec.name, family=fam, arch=target.arch, gpu=gpu_name, direction="fwd+bwd" if backward else "fwd",
        batch=batch, heads=heads, kv_heads=hkv, seqlen_q=nq, seqlen_k=nk, head_dim=d, dtype=dt.value,
        params=shown, visible_pairs=pairs_total / (batch * heads), density=pairs_total / (batch * heads * nq * nk),
        flops=flops, hbm_bytes=hbm, standard_hbm_bytes=std, compulsory_bytes=comp, fwd=fwd_tr, bwd=bwd_tr,
        tiles=tile_rep, reference_tiles=reference_tiles, model=model, peak_tflops=peak, hbm_gbps=bw,
        peaks_source=peaks_source, arithmetic_intensity=flops / hbm if hbm else math.inf, floor_ms=floor_ms,
        compulsory_floor_ms=compulsory_floor_ms, bound="compute" if t_compute >= t_memory else "memory",
        l2_bytes=l2, threads=threads, notes=notes)
    if measure:
        values = _materialize(spec, values, given, batch, heads, nq, nk)
        ms = _measure(op, target, dt, batch, heads, hkv, nq, nk, d, values, backward, reps)
        rep.measured_ms = ms
        rep.tflops = flops / ms / 1e9
        rep.fraction_of_floor = floor_ms / ms
    return rep


def _registers(op, target: _Target, dt, d, choice, listed: bool, build: bool, notes: list) -> tuple:
    """(fwd regs, bwd regs, source) from the compiled library in the cache (built first with
    ``build``), or (None, None, '') when it is not there or cannot be read."""
    from . import build as build_mod
    from . import families

    inst = families.for_arch("cuda", target.arch).instantiation(op.spec, target.arch, dt, d, sparse=listed,
                                                                tiles=choice.config())
    path = _library_path(inst)
    if path is None and build:
        from .ops import announce

        try:
            build_mod.load(inst, announce=announce)
        except (OSError, build_mod.BuildError):
            pass  # built but not loadable here (no GPU of that arch): the entry may still exist
        path = _library_path(inst)
        if path is None:
            raise ValueError(f"build: could not build {inst.name} for {target.arch}")
    if path is None:
        notes.append("registers: model estimates (the library is not in the cache; --build compiles it)")
        return None, None, ""
    try:
        regs = resource_usage(path)
    except OSError as err:
        notes.append(f"registers: model estimates ({err})")
        return None, None, ""
    fwd = [r for n, r in regs.items() if "fwd_kernel" in n]
    bwd = [r for n, r in regs.items() if "bwd_kernel" in n]
    src = f"ptxas (cuobjdump -res-usage {path})"
    return (max(fwd) if fwd else None), (max(bwd) if bwd else None), src


def _measure(op, target: _Target, dt, batch, heads, hkv, nq, nk, d, values, backward: bool, reps: int) -> float:
    """Median milliseconds of the call (forward, or forward + backward) on random inputs."""
    from .bench import time_fn
    from .ops import TORCH_DTYPE

    device = target.device
    tdt = TORCH_DTYPE[dt]
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(batch, heads, nq, d, device=device, dtype=tdt, generator=gen)
    k = torch.randn(batch, hkv, nk, d, device=device, dtype=tdt, generator=gen)
    v = torch.randn(batch, hkv, nk, d, device=device, dtype=tdt, generator=gen)
    p = {n: (x.to(device) if isinstance(x, torch.Tensor) else x) for n, x in values.items()}
    if backward:
        dout = torch.randn(batch, heads, nq, d, device=device, dtype=tdt, generator=gen)
        q, k, v = (t.requires_grad_() for t in (q, k, v))

        def step():
            torch.autograd.grad(op(q, k, v, **p), (q, k, v), dout)

        step()
        return time_fn(step, device, reps=reps)
    with torch.no_grad():
        op(q, k, v, **p)
        return time_fn(lambda: op(q, k, v, **p), device, reps=reps)


# ---------------------------------------------------------------- presentation


def _fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, f in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= f:
            return f"{n / f:.2f} {unit}"
    return f"{int(n)} B"


def _fmt_flops(n: float) -> str:
    for unit, f in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if n >= f:
            return f"{n / f:.3f} {unit}"
    return f"{int(n)} FLOP"


def to_json(rep: Report) -> str:
    """The report as one JSON object (non-finite floats as null)."""
    def clean(x):
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, list | tuple):
            return [clean(v) for v in x]
        return x

    return json.dumps(clean(rep.as_dict()), indent=1)


def render(rep: Report, console=None) -> None:
    """Print the report readably (rich)."""
    from rich.console import Console
    from rich.table import Table

    con = console or Console()
    where = ((rep.gpu if rep.arch in rep.gpu else f"{rep.gpu} ({rep.arch})") if rep.family == "cuda"
             else f"{rep.gpu} ({rep.arch}, {rep.threads} threads, L2 {_fmt_bytes(rep.l2_bytes)})")
    con.print(f"[bold]{rep.spec}[/bold] {rep.direction}: B={rep.batch} Hq={rep.heads} Hkv={rep.kv_heads} "
              f"Nq={rep.seqlen_q} Nk={rep.seqlen_k} d={rep.head_dim} {rep.dtype}"
              + (f"  params: {rep.params}" if rep.params else ""))
    con.print(f"target: {where}; peaks {rep.peak_tflops:.1f} TFLOP/s, {rep.hbm_gbps:.0f} GB/s ({rep.peaks_source})")

    t = Table(title="tiles", title_justify="left")
    for c in ("kernel", "tile", "queries x keys", "origin", "smem / block", "regs / thread"):
        t.add_column(c)
    for name, tr in rep.tiles.items():
        regs = "-" if tr.regs is None else (f"{tr.regs} (ptxas)" if tr.regs_source.startswith("ptxas")
                                            else f"~{tr.regs} (estimate)")
        origin = tr.origin + (f" at N={tr.tuned_seqlen}" if tr.tuned_seqlen else "")
        t.add_row({"fwd": "forward", "bwd": "backward"}[name], tr.shape, f"{tr.block_m} x {tr.block_n}", origin,
                  "-" if tr.smem_bytes is None else f"{tr.smem_bytes:,} B", regs)
    con.print(t)
    r = rep.reference_tiles
    if "paper_br_bc" in r:
        con.print(f"  for reference: derived tiles fwd {r['derived_fwd']}, bwd {r['derived_bwd']}; the paper's "
                  f"(Br, Bc) = ({r['paper_br_bc'][0]}, {r['paper_br_bc'][1]}) for M = {r['smem_optin']:,} B")

    con.print(f"visible pairs: {rep.visible_pairs:,.0f} per (batch, head) ({100 * rep.density:.1f}% of Nq·Nk)")
    m = Table(title="work and memory traffic", title_justify="left")
    for c in ("", "FLOPs", "ours (Thm 2, real tiles)", "standard attention", "compulsory"):
        m.add_column(c, justify="right")
    for name, tr in (("forward", rep.fwd), ("backward", rep.bwd)):
        if tr is not None:
            m.add_row(name, _fmt_flops(tr.flops), _fmt_bytes(tr.hbm_bytes), _fmt_bytes(tr.standard_hbm_bytes),
                      _fmt_bytes(tr.compulsory_bytes))
    if rep.bwd is not None:
        m.add_row("total", _fmt_flops(rep.flops), _fmt_bytes(rep.hbm_bytes), _fmt_bytes(rep.standard_hbm_bytes),
                  _fmt_bytes(rep.compulsory_bytes))
    con.print(m)
    con.print(f"  tile visits: {rep.model}")
    con.print(f"roofline: {rep.arithmetic_intensity:.1f} FLOP/B; floor {rep.floor_ms:.4g} ms ({rep.bound}-bound); "
              f"with compulsory bytes only {rep.compulsory_floor_ms:.4g} ms")
    if rep.measured_ms is not None:
        rate = f"{rep.tflops:.1f} TFLOP/s" if rep.family == "cuda" else f"{rep.tflops * 1e3:.1f} GFLOP/s"
        con.print(f"measured: {rep.measured_ms:.4g} ms, {rate}, {100 * rep.fraction_of_floor:.1f}% of the floor")
    for n in rep.notes:
        con.print(f"  note: {n}")
