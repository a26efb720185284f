"""The ``sm90`` family: the Hopper forward (templates/include/flashgen/sm90) — TMA copies into
swizzled shared memory through an mbarrier pipeline, a producer warp and two consumer warpgroups
of 64 query rows with wgmma for S = QKᵀ and O += PV (FlashAttention-3's anatomy, Shah et al.
2024), on sm_90a only. It serves the forward of the padded layout for every spec (mask and score
hooks, tile classes, dropout with the sm80 family's Philox stream) at head dims up to 128; the
backward, packed batches, block lists and larger head dims run on ``sm80`` (a backward recomputes
from q, k, v, out and LSE, which both families define alike, so an sm90 forward pairs with the
sm80 backward)."""

from __future__ import annotations

from ..build import artifact
from ..lang import ir
from .base import Family

# Per head dim: key tile (fwd_block_n) and K/V stages. The query tile is 128 rows (two consumer
# warpgroups). Shared memory: Q 128·128 B per 64-column panel, 2 stages of K and V of
# block_n·128 B per panel each, and 128 rows of O staging (pitch d + 8) beside them where they
# fit (194 KiB at d = 128 with 128-key tiles), else overlaying the K/V rings.
SMEM_LIMIT = 227 * 1024


def smem_layout(head_dim: int, block_n: int, stages: int) -> tuple[int, bool]:
    """(dynamic shared memory in bytes, whether the O staging rows overlay the K/V rings) of
    the sm90 forward: sm90/fwd.cuh Sm90Fwd::kSmem and kOInRing."""
    kd = -(-head_dim // 16) * 16
    panels = -(-kd // 64)
    q = panels * 128 * 128
    ring = 2 * stages * panels * block_n * 128
    o = -(-(128 * (kd + 8) * 2) // 16) * 16
    bars = 8 * (3 + 4 * stages)
    in_ring = q + ring + o + bars + 1024 > SMEM_LIMIT
    if in_ring and ring < o:
        return q + ring + o + bars + 1024, False  # fits neither way: over the limit
    return q + ring + (0 if in_ring else o) + bars + 1024, in_ring


def smem_bytes(head_dim: int, block_n: int, stages: int) -> int:
    """Dynamic shared memory of the sm90 forward (bytes; sm90/fwd.cuh Sm90Fwd::kSmem)."""
    return smem_layout(head_dim, block_n, stages)[0]


TILE_KEYS = ("fwd_block_n", "fwd_stages", "fwd_overlap", "fwd_pingpong", "fwd_persistent")


def tiles_from_text(text: str) -> dict:
    """A tile config from 'keys x stages [x overlap [x ping-pong [x persistent]]]', e.g.
    '128x2x1x0x2048' (the TILE_KEYS in order; scripts/bench_sm90.py --tiles). ValueError for
    anything else (legality is check_tiles')."""
    try:
        values = [int(x) for x in text.split("x")]
    except ValueError:
        values = []
    if not 2 <= len(values) <= len(TILE_KEYS):
        raise ValueError(f"tiles: expected keys x stages [x overlap [x ping-pong [x persistent]]], got {text!r}")
    return dict(zip(TILE_KEYS, values))


def check_tiles(cfg: dict, head_dim: int | None) -> None:
    """ValueError naming the key when an sm90 tile config is illegal: fwd_block_n a multiple of
    16 in [16, 256], fwd_stages in [2, 4], fwd_overlap and fwd_pingpong 0 or 1 (ping-pong only
    with the overlap), fwd_persistent an int >= 0, and (at ``head_dim``) within shared memory."""
    bn, st = cfg.get("fwd_block_n", 128), cfg.get("fwd_stages", 2)
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
    if head_dim is not None and smem_bytes(head_dim, bn, st) > SMEM_LIMIT:
        raise ValueError(f"fwd_block_n: {bn} keys x {st} stages at head_dim {head_dim} need "
                         f"{smem_bytes(head_dim, bn, st):,} B of shared memory, over the sm90 forward's "
                         f"{SMEM_LIMIT:,} B")


def default_tiles(spec: ir.Spec, head_dim: int) -> dict:
    """The forward's tile config for ``spec`` at ``head_dim``: 128-key tiles, two stages, no
    ping-pong. For mask-free specs, the softmax of each tile overlaps the previous tile's PV
    GEMM (fwd_overlap) and calls with seqlen_k up to 4096 (d <= 64) or 2048 launch one CTA per
    multiprocessor (fwd_persistent). Measured on an H200 (docs/perf-notes.md, v3): overlap +8 to
    +15% dense d 128, +5 to +10% dense d 64, -5 to +5% causal; persistent +14 to +17% dense at
    1K, -4 to -7% dense d 128 from 4K, -35% causal at 16K (a static round-robin over items of
    unequal cost); 144- to 192-key tiles and ping-pong within noise of these."""
    dense = spec.mask is None
    return {"fwd_block_n": 128, "fwd_stages": 2, "fwd_overlap": 1 if dense else 0, "fwd_pingpong": 0,
            "fwd_persistent": (4096 if head_dim <= 64 else 2048) if dense else 0}


class Sm90Family(Family):
    name = "sm90"
    device = "cuda"
    dtypes = (ir.DType.FP16, ir.DType.BF16)
    head_dims = tuple(d for d in range(8, 129, 8) if smem_bytes(d, 128, 2) <= SMEM_LIMIT)
    features = frozenset({"dropout"})

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
        if packed or sparse:
            raise NotImplementedError("family sm90 has no packed (varlen) or block-sparse kernels")
        # Only this family's own keys: a tile config of another family (the sm80 tiles a caller
        # chose for the device) says nothing about these kernels.
        cfg = {k: v for k, v in (tiles or {}).items() if k in TILE_KEYS}
        if head_dim is not None:
            for k, v in default_tiles(spec, head_dim).items():
                cfg.setdefault(k, v)
        check_tiles(cfg, head_dim)
        cfg["fwd_only"] = 1
        return tuple(sorted(cfg.items()))


FAMILY = Sm90Family()
