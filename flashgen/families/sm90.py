"""The ``sm90`` family: the Hopper forward (templates/include/flashgen/sm90) — TMA copies into
swizzled shared memory through an mbarrier pipeline, a producer warp and two consumer warpgroups
of 64 query rows with wgmma for S = QKᵀ and O += PV (FlashAttention-3's anatomy, Shah et al.
2024), on sm_90a only. It serves the forward for every spec (mask and score hooks, tile classes,
dropout with the sm80 family's Philox stream, block lists: ``block_mask=`` and the lists the block
classifier makes per call) in the padded and the packed (varlen) layout at every head dim up to
256. Its backward (sm90/bwd.cuh) serves every spec (parameter gradients and dropout included),
GQA/MQA too, block lists too, at head dims 64 and 128 in the padded and the packed layout
(``backward_reason``);
deterministic (``deterministic=True``: each query tile's dQ adds ordered by a semaphore) or not,
though the automatic choice defers deterministic backwards of masks without a closed-form key
range (document ids) to sm80, whose deterministic pass takes the per-call block lists (``defers``);
every other backward (other head dims; block lists with ``deterministic=True``) runs on ``sm80``
(a backward recomputes from q, k, v, out and LSE, which both families define alike, so an sm90
forward pairs with the sm80 backward)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .. import env
from ..build import artifact
from ..codegen import variant
from ..lang import expr, ir
from ..tune import store as tune_store
from . import sm80, sm90_schedule
from .base import Call, Family, LaunchFields

# Per head dim: key tile (fwd_block_n) and K/V stages. The query tile is 128 rows (two consumer
# warpgroups). Shared memory: Q 128·128 B per 64-column panel, 2 stages of K and V of
# block_n·128 B per panel each, and 128 rows of O staging (pitch d + 8) beside them where they
# fit (194 KiB at d = 128 with 128-key tiles), else overlaying the K/V rings.
SMEM_LIMIT = 227 * 1024
HEAD_DIM_MAX = 256


def default_block_n(head_dim: int, sparse: bool = False) -> int:
    """The forward's key tile at ``head_dim``: 128 keys up to d = 128; beyond, the largest
    multiple of 16 whose two K/V stages fit beside Q (112 at d 136..192, 80 at d 200..256, as
    FlashAttention-3's 128 x 112 and 128 x 80 tiles). Block-sparse instantiations take a key
    tile that divides 128 (64 beyond d = 128), so that lists of 128 x 128 blocks nest."""
    if head_dim <= 128:
        return 128
    if sparse:
        return 64
    return max(bn for bn in range(16, 129, 16) if smem_bytes(head_dim, bn, 2) <= SMEM_LIMIT)


def smem_layout(head_dim: int, block_n: int, stages: int, block_m: int = 128, packed: bool = False) -> tuple[int, bool]:
    """(dynamic shared memory in bytes, whether the O staging rows overlay the K/V rings) of
    the sm90 forward with ``block_m`` query rows: sm90/fwd.cuh Sm90Fwd::kSmem and kOInRing
    (``packed``: with the dynamic schedule's 64-byte work ring, kWorkBytes)."""
    kd = -(-head_dim // 16) * 16
    panels = -(-kd // 64)
    q = panels * block_m * 128
    ring = 2 * stages * panels * block_n * 128
    o = -(-(block_m * (kd + 8) * 2) // 16) * 16
    bars = 8 * (3 + 4 * stages)
    if packed:  # the mbarriers rounded up to 16 bytes, then the 64-byte work ring
        bars = -(-bars // 16) * 16 + 64
    in_ring = q + ring + o + bars + 1024 > SMEM_LIMIT
    if in_ring and ring < o:
        return q + ring + o + bars + 1024, False  # fits neither way: over the limit
    return q + ring + (0 if in_ring else o) + bars + 1024, in_ring


def smem_bytes(head_dim: int, block_n: int, stages: int, block_m: int = 128, packed: bool = False) -> int:
    """Dynamic shared memory of the sm90 forward (bytes; sm90/fwd.cuh Sm90Fwd::kSmem). The
    packed instantiations' 72 more bytes never change legality (every legal padded
    layout leaves at least 872 bytes below the limit)."""
    return smem_layout(head_dim, block_n, stages, block_m, packed)[0]


TILE_KEYS = ("fwd_block_n", "fwd_stages", "fwd_overlap", "fwd_pingpong", "fwd_persistent", "fwd_consumers")


def tiles_from_text(text: str) -> dict:
    """A tile config from 'keys x stages [x overlap [x ping-pong [x persistent [x consumers]]]]',
    e.g. '128x2x1x0x2048' or '128x2x1x0x0x3' (the TILE_KEYS in order; scripts/bench_sm90.py
    --tiles). ValueError for anything else (legality is check_tiles')."""
    try:
        values = [int(x) for x in text.split("x")]
    except ValueError:
        values = []
    if not 2 <= len(values) <= len(TILE_KEYS):
        raise ValueError("tiles: expected keys x stages [x overlap [x ping-pong [x persistent [x consumers]]]], "
                         f"got {text!r}")
    return dict(zip(TILE_KEYS, values))


def check_tiles(cfg: dict, head_dim: int | None) -> None:
    """ValueError naming the key when an sm90 tile config is illegal: fwd_block_n a multiple of
    16 in [16, 256], fwd_stages in [2, 4], fwd_overlap and fwd_pingpong 0 or 1 (ping-pong only
    with the overlap and two consumer warpgroups), fwd_persistent an int >= 0, fwd_consumers 2
    or 3 (consumer warpgroups of 64 query rows: 128- or 192-row query tiles; 3 not with block
    lists, whose 128-row blocks must nest in the query tiles), and (at ``head_dim``) within
    shared memory."""
    bn, st, wgs = cfg.get("fwd_block_n", 128), cfg.get("fwd_stages", 2), cfg.get("fwd_consumers", 2)
    if wgs not in (2, 3):
        raise ValueError(f"fwd_consumers: expected 2 or 3 consumer warpgroups (128 or 192 query rows), got {wgs!r}")
    bm = 64 * wgs
    if wgs != 2 and cfg.get("sparse"):
        raise ValueError("fwd_consumers: block lists take 128-row query tiles (2 consumer warpgroups: blocks of 128 "
                         "nest in them), got 3")
    if wgs != 2 and cfg.get("fwd_pingpong", 0):
        raise ValueError("fwd_pingpong: ping-pong takes two consumer warpgroups (fwd_consumers=2)")
    if not (isinstance(bn, int) and 16 <= bn <= 256 and bn % 16 == 0):
        raise ValueError(f"fwd_block_n: expected a multiple of 16 in [16, 256] for the sm90 forward, got {bn!r}")
    if not (isinstance(st, int) and 2 <= st <= 4):
        raise ValueError(f"fwd_stages: expected 2, 3 or 4 for the sm90 forward, got {st!r}")
    if cfg.get("fwd_overlap", 1) not in (0, 1):
        raise ValueError(f"fwd_overlap: expected 0 or 1, got {cfg.get('fwd_overlap')!r}")
    if cfg.get("fwd_pingpong", 0) not in (0, 1):
        raise ValueError(f"fwd_pingpong: expected 0 or 1, got {cfg.get('fwd_pingpong')!r}")
    ps = cfg.get("fwd_persistent", 0)
    if not (isinstance(ps, int) and 0 <= ps < 2**31):
        raise ValueError(f"fwd_persistent: expected the largest seqlen_k launched persistent (an int >= 0, "
                         f"0: never), got {ps!r}")
    if cfg.get("fwd_pingpong", 0) and not cfg.get("fwd_overlap", 0):
        raise ValueError("fwd_pingpong: ping-pong between the consumer warpgroups needs fwd_overlap=1")
    if head_dim is not None and smem_bytes(head_dim, bn, st, bm) > SMEM_LIMIT:
        raise ValueError(f"fwd_block_n: {bm} queries x {bn} keys x {st} stages at head_dim {head_dim} need "
                         f"{smem_bytes(head_dim, bn, st, bm):,} B of shared memory, over the sm90 forward's "
                         f"{SMEM_LIMIT:,} B")


def valid_config(cfg: dict) -> bool:
    """Whether ``cfg`` is a well-formed sm90 forward tile config (the tuning store loads an sm90
    'fwd' entry by this): only TILE_KEYS, fwd_block_n and fwd_stages present, every value an
    int, and ``check_tiles`` accepting it at any head dim (shared memory is checked where a call
    uses it, at its head dim)."""
    if not isinstance(cfg, dict) or not {"fwd_block_n", "fwd_stages"} <= set(cfg) or not set(cfg) <= set(TILE_KEYS):
        return False
    if not all(type(v) is int for v in cfg.values()):
        return False
    try:
        check_tiles(cfg, None)
    except ValueError:
        return False
    return True


tune_store.register_kind("fwd", valid_config, family="sm90")


@dataclass(frozen=True, order=True)
class Sm90Tile:
    """One sm90 forward tile config: ``block_n`` keys per K/V tile (fwd_block_n), ``stages`` K/V
    stages, ``overlap`` and ``pingpong`` 0/1, ``persistent`` the largest seqlen_k launched
    persistent (0: never), ``consumers`` consumer warpgroups of 64 query rows (2 or 3). Written
    (``str``) as tiles_from_text reads it: 'keys x stages x overlap x ping-pong x persistent x
    consumers'."""

    block_n: int
    stages: int
    overlap: int
    pingpong: int
    persistent: int
    consumers: int = 2

    @property
    def block_m(self) -> int:
        """Query rows per CTA: 64 per consumer warpgroup."""
        return 64 * self.consumers

    @classmethod
    def from_config(cls, cfg: dict) -> Sm90Tile:
        """The tile of a config (every TILE_KEYS entry but fwd_consumers, which defaults to 2;
        KeyError when one is missing)."""
        return cls(cfg["fwd_block_n"], cfg["fwd_stages"], cfg["fwd_overlap"], cfg["fwd_pingpong"],
                   cfg["fwd_persistent"], cfg.get("fwd_consumers", 2))

    def config(self) -> dict[str, int]:
        """The config keys (TILE_KEYS); fwd_consumers only when 3, as ``default_tiles`` writes a
        two-warpgroup tile (so an explicit default tile is the same instantiation as none)."""
        cfg = dict(zip(TILE_KEYS[:5], (self.block_n, self.stages, self.overlap, self.pingpong, self.persistent),
                       strict=True))
        if self.consumers != 2:
            cfg["fwd_consumers"] = self.consumers
        return cfg

    def with_(self, **kw) -> Sm90Tile:
        return replace(self, **kw)

    def persistent_at(self, seqlen_k: int) -> bool:
        """Whether a call with ``seqlen_k`` keys launches the persistent grid with this tile."""
        return 0 < seqlen_k <= self.persistent

    def smem_bytes(self, head_dim: int) -> int:
        """Dynamic shared memory per CTA at ``head_dim`` (bytes, ``smem_bytes``)."""
        return smem_bytes(head_dim, self.block_n, self.stages, self.block_m)

    def __str__(self) -> str:
        return "x".join(str(v) for v in (self.block_n, self.stages, self.overlap, self.pingpong, self.persistent,
                                         self.consumers))


def spill_reason(spec: ir.Spec, head_dim: int, tile: Sm90Tile) -> str | None:
    """Why ``tile`` is known to spill registers for ``spec`` at ``head_dim`` (the measurements
    ``default_tiles`` follows, docs/perf-notes.md), or None: the overlap (and so ping-pong)
    where the mask or score loads a tensor parameter per score element, with dropout, or with a
    score expression above d = 64; three consumer warpgroups (160 registers each) above d = 64,
    with the overlap, a score expression, per-element tensor reads or dropout. ``check_tiles``
    accepts these (they build and run); the tuner does not propose them."""
    lean = not elementwise_reads(spec) and not spec.dropout and (spec.score is None or head_dim <= 64)
    if tile.overlap and not lean:
        return "the overlap spills with per-element tensor reads, dropout or a score expression above d 64"
    if tile.consumers == 3 and (head_dim > 64 or tile.overlap or not lean or spec.score is not None):
        return ("three consumer warpgroups spill above d 64, with the overlap, a score expression, per-element "
                "tensor reads or dropout")
    return None


def nests_in_blocks(tile: Sm90Tile) -> bool:
    """Whether block lists of 128 x 128 blocks nest in the tile (two consumer warpgroups, a key
    tile dividing 128): the block-sparse instantiations' requirement."""
    return tile.consumers == 2 and 128 % tile.block_n == 0


@dataclass(frozen=True)
class Sm90Choice:
    """The sm90 forward tile a call uses and where it came from: 'tuned' (flashgen.tune's stored
    winner, measured at ``tuned_seqlen``) or 'family default' (``default_tiles``)."""

    tile: Sm90Tile
    origin: str
    tuned_seqlen: int | None = None

    def config(self) -> dict[str, int]:
        return self.tile.config()


def choose(spec: ir.Spec, arch: str, dtype: ir.DType, head_dim: int, seqlen: int | None = None, *,
           sparse: bool = False, device_index: int | None = None, use_tuned: bool = True,
           fingerprint: str | None = None) -> Sm90Choice:
    """The sm90 forward tile of a call of ``spec`` at (dtype, head_dim) with max(seqlen_q,
    seqlen_k) = ``seqlen`` (None: the longest tuned length): the winner flashgen.tune stored for
    the sm90 family on CUDA device ``device_index`` nearest ``seqlen``, when one is stored, legal
    at ``head_dim`` (shared memory) and, for block-sparse instantiations (``sparse``), one that
    block lists nest in (``nests_in_blocks``); else ``default_tiles``. ``arch`` is the target
    ('sm_90a'; tuned winners need a live device). ValueError for a head dim the family does not
    take (``check_tiles``)."""
    if not 8 <= head_dim <= HEAD_DIM_MAX or head_dim % 8:
        raise ValueError(f"head_dim: {head_dim} is not an sm90 head dim (multiples of 8 up to {HEAD_DIM_MAX})")
    default = Sm90Tile.from_config(default_tiles(spec, head_dim, sparse))
    if use_tuned and device_index is not None:
        hit = tune_store.lookup(fingerprint or spec, device_index, dtype, head_dim, "fwd", seqlen, "sm90")
        if hit is not None:
            cfg, n = hit
            tile = Sm90Tile.from_config(cfg)
            try:
                check_tiles(tile.config() | ({"sparse": 1} if sparse else {}), head_dim)
                ok = not sparse or nests_in_blocks(tile)
            except ValueError:
                ok = False
            if ok:
                return Sm90Choice(tile, "tuned", n)
    return Sm90Choice(default, "family default")


def elementwise_reads(spec: ir.Spec) -> bool:
    """Whether the mask or score reads a tensor parameter at an index that varies with q or kv
    (a load per score element: document ids, a bias table), not once per tile (ALiBi slopes)."""
    for e in (spec.mask, spec.score):
        for n in expr.walk(e) if e is not None else ():
            if isinstance(n, ir.Index) and any(expr.uses(i, "q") or expr.uses(i, "kv") for i in n.indices):
                return True
    return False


def default_tiles(spec: ir.Spec, head_dim: int, sparse: bool = False, three: bool = True) -> dict:
    """The forward's tile config for ``spec`` at ``head_dim``: ``default_block_n`` keys, two
    stages, no ping-pong; the overlap (fwd_overlap: the softmax of each key tile under the
    previous tile's PV GEMM) and the persistent grid (fwd_persistent: calls with seqlen_k up to
    it launch one CTA per multiprocessor, taking the work items in serpentine rounds) where
    they measured faster on an H200 (docs/perf-notes.md, "sm90 forward v4", TFLOP/s):

    - mask-free, d <= 128: overlap, always persistent (d 128 N 16K: 688 against 621 with one CTA
      per item; N 1K-4K within +-3%);
    - mask-free, d > 128: 80-key tiles with the overlap (d 256 N 4K: 716-731 against 646
      without it, although ptxas spills a few registers there: S, P and the 64 x 256
      accumulator are live at once), persistent up to 2048;
    - masked: persistent up to seqlen_k 4096 (causal d 128 N 1K: 383-395 against 323; beyond,
      the serpentine resonates with the number of query tiles per head: 386 against 596 at
      16K), the overlap at 64 < d <= 128 for masks of positions and scalars only (causal d 128
      N 4K: 559 against 518; d 64 and d 256 lose 5-10% with it, and with tensor parameters,
      score expressions or dropout it spills: document d 128 176 B);
    - d <= 64 without a score expression, tensor reads, dropout or block lists: three consumer
      warpgroups (192-row query tiles, FlashAttention-3's d 64 tile) without the overlap
      (docs/perf-notes.md "sm90 forward v5": dense N 4K / 16K 479 / 496 against 429 / 431 with
      128 rows; causal 393 / 465 against 361 / 407; causal N 1K loses, 234 against 271);
    - for every spec, no overlap where the mask or score loads a tensor parameter per score
      element (``elementwise_reads``: relative_bias d 128 spills 124 B with it), with dropout,
      or with a score expression above d = 64 (softcap d 128: 68 B).
    """
    dense = spec.mask is None
    # The overlap where its registers fit: no tensor parameter loaded per score element, no
    # dropout, and score expressions only at d <= 64 (softcap d 128 spills 68 B with it).
    lean = not elementwise_reads(spec) and not spec.dropout and (spec.score is None or head_dim <= 64)
    block_n = default_block_n(head_dim, sparse)
    if dense:
        overlap, persistent = int(lean), (1 << 30 if head_dim <= 128 else 2048)
        if lean and head_dim > 128 and not sparse:
            block_n = 80
    else:
        overlap, persistent = int(lean and spec.score is None and 64 < head_dim <= 128), 4096
    cfg = {"fwd_block_n": block_n, "fwd_stages": 2, "fwd_overlap": overlap, "fwd_pingpong": 0,
           "fwd_persistent": persistent}
    if three and head_dim <= 64 and lean and spec.score is None and not sparse:
        # Three consumer warpgroups (192-row query tiles), without the overlap (160 registers
        # per consumer: with it, or with a score expression or tensor reads, ptxas spills).
        cfg.update(fwd_overlap=0, fwd_consumers=3)
    return cfg


# The backward (templates/include/flashgen/sm90/bwd.cuh): key/value-stationary CTAs of 128 keys
# (two consumer warpgroups of 64) walking the query tiles of BWD_BLOCK_M[head_dim] rows of the
# query heads of their kv head through a BWD_STAGES-deep TMA ring. It serves every spec at these
# head dims in the padded and packed layouts; every other backward call runs on sm80
# (``backward_reason``).
BWD_BLOCK_M = {64: 64, 128: 64}  # query rows per step by head dim, except where bwd_block_m says 128
BWD_STAGES = 2
BWD_BLOCK_N = 128  # keys per CTA


def bwd_block_m(spec: ir.Spec, head_dim: int) -> int:
    """Query rows per backward step for ``spec`` at ``head_dim``: 128 at d 64 for specs without a
    score expression, dropout or parameter gradients (S^T and dP^T of 64 fp32 each beside dK, dV
    and the dQ block: ptxas keeps them in 240 registers with a few spilled words, and the larger
    tile halves the steps per key tile), else BWD_BLOCK_M (64: ALiBi's hooks spill heavily at
    128 rows)."""
    if head_dim == 64 and spec.score is None and not spec.dropout and not expr.grad_params(spec):
        return 128
    return BWD_BLOCK_M[head_dim]


def bwd_smem_bytes(head_dim: int, stages: int = BWD_STAGES, block_m: int | None = None) -> int:
    """Dynamic shared memory of one sm90 backward CTA in bytes (sm90/bwd.cuh's layout): K and V
    of the key tile, the Q and dO rings, two dS buffers, the fp32 dQ staging of the dQ writer
    (one query tile, two at d 64 with 64-row tiles), the LSE and D rings, the mbarriers
    (5 + 2 · stages), the writer's 32-byte slot and 1024 bytes of alignment slack."""
    bm, panels = block_m or BWD_BLOCK_M[head_dim], head_dim // 64
    kv = 2 * panels * BWD_BLOCK_N * 128
    q_do = 2 * stages * panels * bm * 128
    ds = 2 * (BWD_BLOCK_N // 64) * bm * 128
    dq = (2 if bm == 64 and head_dim == 64 else 1) * bm * head_dim * 4
    return kv + q_do + ds + dq + 2 * stages * bm * 4 + 8 * (5 + 2 * stages) + 32 + 1024
BWD_KEYS = ("bwd90_block_m", "bwd90_stages")


def backward_reason(spec: ir.Spec, call) -> str | None:
    """Why the sm90 backward does not serve ``call`` (a families.Call of a backward pass that
    the family otherwise serves) of ``spec``, as a phrase naming the feature; None when it does:
    every spec (masks, score expressions, parameters and their gradients, dropout) at head dim 64
    or 128 in the padded and the packed (varlen) layout, dense or with block lists, GQA/MQA
    included, deterministic or not (except with block lists)."""
    if call.head_dim not in BWD_BLOCK_M:
        return (f"has no backward kernels at head_dim {call.head_dim} (its backward takes "
                f"{', '.join(map(str, BWD_BLOCK_M))})")
    if "sparse" in call.features and call.deterministic:
        return "has no deterministic backward kernels for block lists (block-sparse with deterministic=True)"
    return None


def serves_backward(spec: ir.Spec, head_dim: int | None, packed: bool = False, sparse: bool = False) -> bool:
    """Whether an instantiation of ``spec`` at ``head_dim`` (layout, sparsity) carries the
    backward unit: the spec and head dim ``backward_reason`` accepts, padded and dense-listed."""
    if head_dim is None:
        return False
    features = frozenset({"backward"} | ({"varlen"} if packed else set()) | ({"sparse"} if sparse else set()))
    return backward_reason(spec, Call("cuda", "sm_90a", ir.DType.BF16, head_dim, features)) is None


class Sm90Family(Family):
    name = "sm90"
    device = "cuda"
    dtypes = (ir.DType.FP16, ir.DType.BF16)
    head_dims = tuple(range(8, HEAD_DIM_MAX + 1, 8))
    features = frozenset({"dropout", "sparse", "varlen"})
    split_layouts = True  # padded / packed and dense / block-sparse calls are separate instantiations
    block_classifier = True  # the sm80 family's classifier kernel (``classifier``)
    tuned = True  # its forward tiles: ``tuning`` is an sm90_tuning.Sm90Tuning (set by the registry)
    tile_keys = TILE_KEYS

    def choose_tiles(self, spec: ir.Spec, arch: str, dtype: ir.DType, head_dim: int, seqlen: int | None = None, *,
                     sparse: bool = False, device_index: int | None = None, use_tuned: bool = True,
                     fingerprint: str | None = None) -> Sm90Choice:
        return choose(spec, arch, dtype, head_dim, seqlen, sparse=sparse, device_index=device_index,
                      use_tuned=use_tuned, fingerprint=fingerprint)

    def tiles_text(self, config: dict) -> str:
        if "fwd_block_n" not in config or "fwd_stages" not in config:
            return ""
        cfg = {k: v for k, v in config.items() if k in TILE_KEYS}
        try:
            return f"tiles fwd {Sm90Tile.from_config(cfg)} (sm90: keys x stages x overlap x ping-pong x persistent " \
                   "x consumers)"
        except KeyError:
            return ""

    def declines(self, spec: ir.Spec, call) -> str | None:
        # Forward calls: the features it declares. Backward calls: those the backward serves
        # (``backward_reason``); the rest go on to sm80.
        if "backward" not in call.features:
            return super().declines(spec, call)
        why = super().declines(spec, replace(call, features=call.features - {"backward"}))
        return why or backward_reason(spec, call)

    def defers(self, spec: ir.Spec, call) -> str | None:
        # A deterministic backward here walks every query tile of each key tile's range (its
        # ordered dQ takes no block lists), while sm80's deterministic backward takes the block
        # lists the classifier makes per call for masks without a closed-form key range per row
        # (document ids): on the H200, before the dQ writer, document d 128 at 4K ran 17 TFLOP/s
        # here against 65 there. No mask, or closed-form ranges (causal, windows), are not
        # deferred: with the dQ writer, dense and causal d 128 ran 1.0-1.9x sm80's deterministic
        # backward on an H100 (docs/perf-notes.md). Forced (use_family) it still runs.
        if "backward" in call.features and call.deterministic and env.auto_block_mask():
            if variant.mask_without_row_range(spec):
                return ("defers deterministic backwards of masks without a closed-form key range to sm80 "
                        "(its deterministic pass skips the tiles the block classifier rules out; this "
                        "family's ordered dQ walks them all)")
        return None

    def arch_reason(self, arch: str | None) -> str | None:
        if arch is None:
            return "needs a CUDA architecture"
        if arch not in ("sm_90a", "any"):
            return f"needs compute capability 9.0 (sm_90a: wgmma, TMA, setmaxnreg), not {arch}"
        return None

    def device_target(self, index: int | None) -> artifact.Target:
        return self.target(artifact.cuda_arch_of(index))

    def config(self, spec: ir.Spec, arch: str, dtype: ir.DType, head_dim: int | None, *, packed: bool = False,
               sparse: bool = False, tiles: dict | None = None) -> tuple[tuple[str, int], ...]:
        # Only this family's own keys: a tile config of another family (the sm80 tiles a caller
        # chose for the device) says nothing about these kernels.
        cfg = {k: v for k, v in (tiles or {}).items() if k in TILE_KEYS}
        if head_dim is not None:
            # An explicit tile config without fwd_consumers describes a two-warpgroup tile (the
            # 'keys x stages x overlap x ping-pong x persistent' form): its other keys are filled
            # from the two-warpgroup defaults.
            for k, v in default_tiles(spec, head_dim, sparse, three=not cfg or cfg.get("fwd_consumers") == 3).items():
                cfg.setdefault(k, v)
        if sparse:
            cfg["sparse"] = 1
        check_tiles(cfg, head_dim)
        if serves_backward(spec, head_dim, packed, sparse):
            cfg.update(bwd90_block_m=bwd_block_m(spec, head_dim), bwd90_stages=BWD_STAGES)
        else:
            cfg["fwd_only"] = 1
        if packed:
            cfg["varlen"] = 1
        return tuple(sorted(cfg.items()))

    def classifier(self, spec: ir.Spec, arch: str) -> artifact.Instantiation:
        """The block classifier of ``spec``: the sm80 family's (the same kernel and library; it
        classifies blocks of any size)."""
        return sm80.FAMILY.classifier(spec, arch)

    def launch_fields(self, spec: ir.Spec) -> DynamicSchedule:
        return DynamicSchedule(spec)

    def block_tiles(self, config, block_size: tuple[int, int]) -> tuple[int, int, int, int, int, int]:
        # The forward's 128-query tiles by its key tile; the backward's q lists per key tile of
        # BWD_BLOCK_N keys by query tiles of its bwd90_block_m rows where the instantiation
        # carries the sm90 backward (else the forward's, never used: a grad call's backward
        # lists are made for the backward's family, op.block_args); no dq lists (dq_lists).
        cfg = dict(config())
        bm, bn = 64 * cfg.get("fwd_consumers", 2), cfg.get("fwd_block_n", 128)
        if "bwd90_block_m" in cfg:
            return bm, bn, BWD_BLOCK_N, cfg["bwd90_block_m"], 128, bn
        return bm, bn, bn, 128, 128, bn


# Work-order tables a captured CUDA graph reads: kept for the life of the process (a replay may
# come after the layout left the validated-layout cache), by id.
_GRAPH_TABLES: dict[int, object] = {}


class DynamicSchedule(LaunchFields):
    """The sm90 forward's per-call decision on packed batches: its work queue (args.h
    FgWorkQueue, sm90/fwd.cuh ``dynamic``). The work-order table (``sm90_schedule.work_order``:
    the items longest first) is built once per layout, heads and tile and kept on the validated
    layout (``Packed.schedules``; vectorised over query tiles: ~5 ms on one CPU thread for 1000
    sequences of 1M tokens at 32 heads, ~1 ms for scripts/bench_varlen.py's batch); the counter
    is a fresh zeroed int32 per call, so concurrent calls and CUDA graph replays each start from
    0 (under capture its zero fill is a captured memset, replayed before each launch). No queue
    (the static schedule) with FLASHGEN_SM90_SCHEDULE=static, for a layout first seen during a
    graph capture (building a table copies it from the host) or past the kernel's int32 ranks."""

    orders_dq = True  # the sm90 backward's deterministic mode (sm90/bwd.cuh)

    def __init__(self, spec: ir.Spec) -> None:
        self.spec = spec
        self.key = spec.fingerprint()

    def bwd(self, args, values, config) -> None:
        # The sm90 backward's GQA split (FgBwdArgs.gqa_splits): sm80's rule over its 128-key
        # tiles; the backward splits a group only when its key tiles leave multiprocessors idle.
        hkv = args.heads_kv
        if args.deterministic or hkv <= 0:
            args.gqa_splits = 1
            return
        args.gqa_splits = sm80.gqa_splits(-(-args.seqlen_k // BWD_BLOCK_N), hkv, args.batch, args.heads_q // hkv,
                                          args.num_sms)

    def fwd_packed(self, args, packed, config):
        device = packed.cu_seqlens_q.device
        if device.type != "cuda" or packed.host_cu_q is None or not env.sm90_dynamic_schedule():
            return None
        cfg = dict(config)
        bm, bn = 64 * cfg.get("fwd_consumers", 2), cfg.get("fwd_block_n", 128)
        heads = int(args.heads_q)
        n = sm90_schedule.total_work(heads, packed.batch, packed.total_q, bm)
        if n == 0 or n >= 2**31 - 2**21:
            return None
        key = ("sm90-fwd", self.key, heads, bm, bn)
        order = packed.schedules.get(key)
        capturing = torch.cuda.is_current_stream_capturing()
        if order is None:
            if capturing:
                return None
            table = sm90_schedule.work_order(self.spec, packed.host_cu_q, packed.host_cu_k, heads, bm, bn)
            order = packed.schedules[key] = table.to(device)
        counter = torch.zeros(1, dtype=torch.int32, device=device)
        if capturing:
            _GRAPH_TABLES[id(order)] = order
        else:  # a later free of the table waits for this stream's launch
            order.record_stream(torch.cuda.current_stream(device))
        args.work.counter = counter.data_ptr()
        args.work.order = order.data_ptr()
        return counter, order


FAMILY = Sm90Family()
