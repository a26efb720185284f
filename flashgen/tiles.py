"""Tile sizes of the CUDA kernels: legal shapes, resource formulas, per-arch tables, derived
defaults, and the choice a call makes (environment override > tuned > table > derived).
The choice sits above the tuning store (flashgen.tune.store): it reads winners from it, and
tells it which configs are well formed (``valid_config``).

FlashAttention (Dao et al., 2022, Alg. 1 line 1) sizes its tiles from the on-chip memory M:
``Bc = ceil(M / 4d)``, ``Br = min(ceil(M / 4d), d)``. :func:`derived` applies that rule with M =
the device's opt-in shared memory per block (in elements of the input dtype), then caps the
result by the register file (the accumulators of the FA2 warp layout) and rounds it to the tile
shapes the kernel family allows. The per-arch tables hold configurations measured to be good
(docs/perf-notes.md); the autotuner (flashgen.tune) measures candidates and stores winners,
which then take precedence.

Tile fields (the instantiation's config keys, rendered into the CUDA templates):

- forward (``FwdTile``): ``fwd_block_m`` query rows per CTA (Br), ``fwd_block_n`` keys per K/V
  tile (Bc), ``fwd_warps`` warps (each owns 16 or 32 query rows);
- backward main kernel (``BwdTile``): ``bwd_block_m`` queries per inner step, ``bwd_warps``
  warps, ``bwd_warps_d`` warps sharing one 16-key slab's dK/dV (1 or 2), ``bwd_warps_mdq`` warps
  along the queries of the dQ product; keys per CTA = 16 · warps / warps_d;
- deterministic dQ kernel (``DqTile``): ``dq_warps`` warps × 16 query rows, ``dq_block_n`` keys.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from . import env
from .archs import cuda_arch
from .lang import ir
from .tune import store as tune_store

REG_LIMIT = 255  # registers per thread (sm_80 … sm_120)


def padded_head_dim(head_dim: int) -> int:
    """The head dim the CUDA kernels work in: rounded up to a multiple of 16 (kD)."""
    return (head_dim + 15) // 16 * 16


def _pitch(head_dim: int) -> int:
    return padded_head_dim(head_dim) + 8  # shared-memory row pitch (elements), bank-conflict pad


# ---------------------------------------------------------------- tile shapes


@dataclass(frozen=True, order=True)
class FwdTile:
    """Forward tile: ``block_m`` (Br) query rows × ``block_n`` (Bc) keys, ``warps`` warps."""

    block_m: int
    block_n: int
    warps: int

    # What ``legal`` requires, in the environment variable's terms (FLASHGEN_CUDA_FWD_TILE=BMxBNxW).
    RULE: ClassVar[str] = "BM/W must be 16 or 32 rows per warp, BN a multiple of 16 up to 256"

    def legal(self) -> bool:
        """Whether the forward kernel (templates/include/flashgen/cuda, FwdTile) takes this tile:
        1, 2, 4 or 8 warps of 16 or 32 query rows each, ``block_n`` a multiple of 16 in 16 … 256."""
        w, bm, bn = self.warps, self.block_m, self.block_n
        return (w in (1, 2, 4, 8) and bm % w == 0 and bm // w in (16, 32) and bn % 16 == 0
                and 16 <= bn <= 256)

    def config(self) -> dict[str, int]:
        return {"fwd_block_m": self.block_m, "fwd_block_n": self.block_n, "fwd_warps": self.warps}

    def smem_bytes(self, head_dim: int, elt: int = 2) -> int:
        """Dynamic shared memory per CTA: the Q tile and two-stage K and V rings
        (FwdKernel::smem_bytes)."""
        return (self.block_m + 2 * 2 * self.block_n) * _pitch(head_dim) * elt

    def regs_estimate(self, head_dim: int, score_mod: bool = False) -> int:
        """A model of registers per thread: the S and O accumulators of the warp's m16 atoms
        (Bc/2 + kD/2 fp32 each) plus ~60 for addresses, softmax state and fragments (+16 with a
        score mod). ptxas' report (flashgen.tune) is the real figure."""
        atoms = self.block_m // self.warps // 16
        return atoms * (self.block_n + padded_head_dim(head_dim)) // 2 + 60 + (16 if score_mod else 0)

    def __str__(self) -> str:
        return f"{self.block_m}x{self.block_n}x{self.warps}"


@dataclass(frozen=True, order=True)
class BwdTile:
    """Backward main-kernel tile: ``block_m`` queries per step over a key tile of
    ``block_n = 16 · warps / warps_d`` keys per CTA."""

    block_m: int
    warps: int
    warps_d: int
    warps_mdq: int

    # What ``legal`` requires, in the environment variable's terms (FLASHGEN_CUDA_BWD_TILE=BMxWxWDxWQ).
    RULE: ClassVar[str] = ("BM a multiple of 16 up to 128, W in 2/4/8, WD 1 or 2 dividing W, WQ dividing W with "
                           "BM/WQ 16 or 32")

    @property
    def block_n(self) -> int:
        return 16 * self.warps // self.warps_d

    def legal(self) -> bool:
        """Whether the backward main kernel (BwdTile in cuda/bwd.cuh) takes this tile: ``block_m``
        a multiple of 16 in 16 … 128, 2 / 4 / 8 warps, ``warps_d`` 1 or 2 dividing them, and
        ``warps_mdq`` dividing the warps with 16 or 32 queries each."""
        bm, w, wd, wq = self.block_m, self.warps, self.warps_d, self.warps_mdq
        return (bm % 16 == 0 and 16 <= bm <= 128 and w in (2, 4, 8) and wd in (1, 2) and w % wd == 0
                and wq >= 1 and w % wq == 0 and bm % (16 * wq) == 0 and bm // wq <= 32)

    def config(self) -> dict[str, int]:
        return {"bwd_block_m": self.block_m, "bwd_warps": self.warps, "bwd_warps_d": self.warps_d,
                "bwd_warps_mdq": self.warps_mdq}

    def smem_bytes(self, head_dim: int, elt: int = 2) -> int:
        """Dynamic shared memory of the main kernel with dQ atomics (BwdKernel::kSmem): K and V
        tiles, two-stage Q and dO rings, one dS^T buffer, LSE and D rings."""
        p = _pitch(head_dim)
        return (2 * self.block_n * p + 4 * self.block_m * p + self.block_n * (self.block_m + 8)) * elt \
            + 16 * self.block_m

    def regs_estimate(self, head_dim: int, score_mod: bool = False) -> int:
        """Model: dK and dV accumulators (kD / warps_d fp32) + S^T and dP^T (block_m fp32) + ~56
        (+24 with a score mod, whose gradient is evaluated per element)."""
        return padded_head_dim(head_dim) // self.warps_d + self.block_m + 56 + (24 if score_mod else 0)

    def __str__(self) -> str:
        return f"{self.block_m}x{self.warps}x{self.warps_d}x{self.warps_mdq}"


@dataclass(frozen=True, order=True)
class DqTile:
    """Deterministic dQ kernel tile: ``16 · warps`` queries × ``block_n`` keys."""

    warps: int
    block_n: int

    @property
    def block_m(self) -> int:
        return 16 * self.warps

    def legal(self) -> bool:
        return self.warps in (2, 4, 8) and self.block_n % 16 == 0 and 16 <= self.block_n <= 128

    def config(self) -> dict[str, int]:
        return {"dq_warps": self.warps, "dq_block_n": self.block_n}

    def smem_bytes(self, head_dim: int, elt: int = 2) -> int:
        return (2 * self.block_m + 4 * self.block_n) * _pitch(head_dim) * elt

    def __str__(self) -> str:
        return f"{self.warps}x{self.block_n}"


KIND_KEYS = {"fwd": ("fwd_block_m", "fwd_block_n", "fwd_warps"),
             "bwd": ("bwd_block_m", "bwd_warps", "bwd_warps_d", "bwd_warps_mdq"),
             "dq": ("dq_warps", "dq_block_n")}
TILE_KEYS = KIND_KEYS["fwd"] + KIND_KEYS["bwd"] + KIND_KEYS["dq"]
_KIND_TILE = {"fwd": FwdTile, "bwd": BwdTile, "dq": DqTile}


def tile_of(kind: str, config: dict):
    """The ``kind`` ('fwd', 'bwd', 'dq') tile named by a config's KIND_KEYS[kind] entries
    (KeyError when one is missing)."""
    return _KIND_TILE[kind](*(config[k] for k in KIND_KEYS[kind]))


def valid_config(kind: str, config: dict) -> bool:
    """Whether ``config`` names a legal ``kind`` ('fwd', 'bwd', 'dq') tile: every KIND_KEYS[kind]
    entry an int, and the tile ``legal()``. (The tuning store accepts an entry by this.)"""
    keys = KIND_KEYS.get(kind)
    if keys is None or not isinstance(config, dict) or not all(type(config.get(k)) is int for k in keys):
        return False
    return tile_of(kind, config).legal()


# The tuning store (flashgen.tune.store) holds forward and backward winners; it loads an entry
# only when these rules accept its config.
for _kind in ("fwd", "bwd"):
    tune_store.register_kind(_kind, functools.partial(valid_config, _kind))


def from_config(config: dict) -> tuple[FwdTile, BwdTile, DqTile]:
    """The three tiles named by an instantiation's config (every TILE_KEYS entry present)."""
    return tile_of("fwd", config), tile_of("bwd", config), tile_of("dq", config)


# The environment variables that force a kind's tile, and their parsers (flashgen.env).
FORCING_VARS = {"fwd": "FLASHGEN_CUDA_FWD_TILE", "bwd": "FLASHGEN_CUDA_BWD_TILE"}
_FORCING_PARSERS = {"fwd": env.cuda_fwd_tile, "bwd": env.cuda_bwd_tile}


def forced(kind: str) -> FwdTile | BwdTile | None:
    """The tile FLASHGEN_CUDA_FWD_TILE (``kind`` 'fwd') or FLASHGEN_CUDA_BWD_TILE ('bwd') forces,
    None when the variable is unset.

    Raises:
        ValueError: the value is malformed (flashgen.env's message) or names a tile the kernels do
            not take (FwdTile.legal / BwdTile.legal), naming the variable and the rule broken.
        KeyError: ``kind`` is not 'fwd' or 'bwd'.
    """
    pairs = _FORCING_PARSERS[kind]()
    if not pairs:
        return None
    tile = tile_of(kind, dict(pairs))
    if not tile.legal():
        raise ValueError(f"{FORCING_VARS[kind]}: {str(tile)!r} is not a valid tile ({tile.RULE})")
    return tile


# ---------------------------------------------------------------- architectures


@dataclass(frozen=True)
class ArchInfo:
    """One GPU's figures: ``smem_optin`` shared memory per block (bytes, the opt-in maximum),
    ``sms`` multiprocessors, ``peak_tflops`` dense bf16/fp16 tensor-core rate with fp32
    accumulation (TFLOP/s), ``hbm_gbps`` memory bandwidth (GB/s, 1e9 B/s), ``l2_bytes``. Peaks
    are vendor datasheet figures (upper bounds, not measurements)."""

    name: str
    arch: str
    smem_optin: int
    sms: int
    peak_tflops: float
    hbm_gbps: float
    l2_bytes: int


# A representative part per architecture (for `flashgen explain --arch` on a machine without
# that GPU), then named parts recognised on a live device. Datasheet figures.
ARCHS: dict[str, ArchInfo] = {
    "sm_80": ArchInfo("A100-SXM4-80GB", "sm_80", 166912, 108, 312.0, 2039.0, 40 << 20),
    "sm_86": ArchInfo("RTX A6000", "sm_86", 101376, 84, 154.8, 768.0, 6 << 20),
    "sm_89": ArchInfo("L40S", "sm_89", 101376, 142, 362.05, 864.0, 96 << 20),
    "sm_90a": ArchInfo("H100 SXM5", "sm_90a", 232448, 132, 989.4, 3350.0, 50 << 20),
    "sm_100": ArchInfo("B200", "sm_100", 232448, 148, 2250.0, 8000.0, 126 << 20),
    "sm_120": ArchInfo("RTX 5090", "sm_120", 101376, 170, 209.5, 1792.0, 96 << 20),
}
_PARTS = (  # (substring of the device name, peak TFLOP/s, HBM GB/s); first match wins
    ("H200", 989.4, 4800.0), ("H100 PCIe", 756.0, 2000.0), ("H100", 989.4, 3350.0),
    ("H800", 989.4, 3350.0), ("GH200", 989.4, 4000.0), ("A100-SXM4-40GB", 312.0, 1555.0),
    ("A100-PCIE-40GB", 312.0, 1555.0), ("A100", 312.0, 2039.0), ("A800", 312.0, 2039.0),
    ("A10G", 70.0, 600.0), ("A10", 125.0, 600.0), ("L40S", 362.05, 864.0), ("L4", 121.0, 300.0),
    ("B200", 2250.0, 8000.0), ("RTX 4090", 165.2, 1008.0), ("RTX 5090", 209.5, 1792.0),
)


def normalize_arch(arch: str) -> str:
    """'sm_90' / '90' / 'sm90' → 'sm_90a' (Hopper builds use the 'a' target); ValueError when
    the name is not an sm_XY architecture."""
    a = arch.strip().lower().removeprefix("sm_").removeprefix("sm")
    num = a.rstrip("a")
    if not num.isdigit() or len(num) not in (2, 3):
        raise ValueError(f"arch: expected an architecture such as sm_80 or sm_90a, got {arch!r}")
    if int(num) < 80:
        raise ValueError(f"arch: {arch!r} is older than sm_80, which the CUDA kernels need")
    return "sm_90a" if num == "90" else f"sm_{num}"


def known_arch(arch: str) -> str:
    """The ARCHS key whose figures stand for ``arch``: itself when listed, else the nearest older
    listed architecture."""
    arch = normalize_arch(arch)
    if arch in ARCHS:
        return arch
    num = lambda a: int(a.removeprefix("sm_").rstrip("a"))  # noqa: E731
    return max((k for k in ARCHS if num(k) <= num(arch)), key=num)


def arch_info(arch: str) -> ArchInfo:
    """The table's figures for ``arch`` (its representative part); for an architecture not in the
    table, the nearest older one's (``known_arch``)."""
    arch = normalize_arch(arch)
    if arch in ARCHS:
        return ARCHS[arch]
    base = ARCHS[known_arch(arch)]
    return ArchInfo(f"unknown {arch} (figures of {base.name})", arch, base.smem_optin, base.sms,
                    base.peak_tflops, base.hbm_gbps, base.l2_bytes)


@functools.cache
def device_info(index: int) -> ArchInfo:
    """A live CUDA device's figures: shared memory, SM count, L2 from the driver; peaks from the
    datasheet table by the device's name (else the architecture's representative part)."""
    props = torch.cuda.get_device_properties(index)
    arch = cuda_arch((props.major, props.minor))
    base = arch_info(arch)
    peak, bw = base.peak_tflops, base.hbm_gbps
    for part, p, b in _PARTS:
        if part in props.name:
            peak, bw = p, b
            break
    smem = int(getattr(props, "shared_memory_per_block_optin", 0) or base.smem_optin)
    l2 = int(getattr(props, "L2_cache_size", 0) or base.l2_bytes)
    return ArchInfo(props.name, arch, smem, props.multi_processor_count, peak, bw, l2)


# ---------------------------------------------------------------- per-arch tables (data)

# Measured configurations, per architecture family and mask class ("plain": no score
# expression; "score_mod": the kernels run score() per element, which needs more registers), as
# (largest padded head dim, tile) rows; the first row whose bound is >= kD applies. Sources:
# H200 measurements, bf16, B·N = 16K tokens (docs/perf-notes.md "Forward tiles", "Variants
# v2", "Backward"), and ptxas reports on sm_80 / sm_90a. On sm_8x the 128-head-dim forward takes
# fewer keys (ptxas needs a few more registers there for the same tile).
FWD_TABLE: dict[str, dict[str, tuple[tuple[int, FwdTile], ...]]] = {
    "sm_90": {
        "plain": ((64, FwdTile(128, 64, 4)), (112, FwdTile(128, 32, 4)), (128, FwdTile(128, 64, 4)),
                  (192, FwdTile(64, 64, 4)), (256, FwdTile(64, 32, 4))),
        "score_mod": ((32, FwdTile(128, 64, 4)), (64, FwdTile(128, 32, 4)), (112, FwdTile(64, 64, 4)),
                      (128, FwdTile(128, 64, 4)), (256, FwdTile(64, 32, 4))),
    },
    "sm_80": {
        "plain": ((64, FwdTile(128, 64, 4)), (112, FwdTile(128, 32, 4)), (128, FwdTile(128, 48, 4)),
                  (192, FwdTile(64, 64, 4)), (256, FwdTile(64, 32, 4))),
        "score_mod": ((32, FwdTile(128, 64, 4)), (64, FwdTile(128, 32, 4)), (112, FwdTile(64, 64, 4)),
                      (128, FwdTile(128, 32, 4)), (256, FwdTile(64, 32, 4))),
    },
}
_BWD_ROWS = {
    "plain": ((64, BwdTile(64, 8, 1, 2)), (128, BwdTile(64, 8, 1, 2)), (256, BwdTile(32, 8, 2, 2))),
    "score_mod": ((64, BwdTile(64, 8, 1, 2)), (128, BwdTile(32, 8, 1, 2)), (256, BwdTile(32, 8, 2, 2))),
}
BWD_TABLE: dict[str, dict[str, tuple[tuple[int, BwdTile], ...]]] = {"sm_90": _BWD_ROWS, "sm_80": _BWD_ROWS}
DQ_TABLE: tuple[tuple[int, DqTile], ...] = ((128, DqTile(4, 64)), (256, DqTile(4, 32)))

# Which table family an architecture uses (architectures not listed get derived tiles).
TABLE_FAMILY = {"sm_90a": "sm_90", "sm_90": "sm_90", "sm_80": "sm_80", "sm_86": "sm_80", "sm_87": "sm_80",
           "sm_89": "sm_80"}


def mask_class(spec: ir.Spec) -> str:
    """'score_mod' when the spec has a score expression, else 'plain' (the tables' classes)."""
    return "score_mod" if spec.score is not None else "plain"


def _row(rows, head_dim: int):
    kd = padded_head_dim(head_dim)
    return next((t for bound, t in rows if kd <= bound), None)


def table(arch: str, cls: str, head_dim: int) -> tuple[FwdTile | None, BwdTile | None]:
    """The tables' forward and backward tiles for (arch, mask class, head dim); None where the
    architecture has no table or the entry does not fit its shared memory."""
    fam = TABLE_FAMILY.get(normalize_arch(arch))
    if fam is None:
        return None, None
    smem = arch_info(arch).smem_optin
    f = _row(FWD_TABLE[fam][cls], head_dim)
    b = _row(BWD_TABLE[fam][cls], head_dim)
    f = f if f is not None and f.smem_bytes(head_dim) <= smem else None
    b = b if b is not None and b.smem_bytes(head_dim) <= smem else None
    return f, b


def dq_tile(arch: str, head_dim: int) -> DqTile:
    t = _row(DQ_TABLE, head_dim)
    smem = arch_info(arch).smem_optin
    while t.smem_bytes(head_dim) > smem and t.block_n > 16:
        t = DqTile(t.warps, t.block_n // 2)
    return t


# ---------------------------------------------------------------- derived (the paper's rule)


def paper_tiles(smem_bytes: int, head_dim: int, elt: int = 2) -> tuple[int, int]:
    """(Br, Bc) of FlashAttention Alg. 1 line 1 for M = ``smem_bytes`` / ``elt`` elements:
    Bc = ceil(M / 4d), Br = min(Bc, d)."""
    m = smem_bytes // elt
    bc = math.ceil(m / (4 * head_dim))
    return min(bc, head_dim), bc


def derived(arch_or_info: str | ArchInfo, head_dim: int, score_mod: bool = False,
            elt: int = 2) -> tuple[FwdTile, BwdTile]:
    """Tiles derived from the device's shared memory by the paper's rule (``paper_tiles``), capped
    by the register model (``regs_estimate`` ≤ 255) and by shared memory, rounded down to legal
    shapes: forward Br ∈ {64, 128} (4 warps × 16 or 32 rows), Bc a multiple of 16 up to 256;
    backward key tile 16 · warps / warps_d (8 warps), query step a multiple of 16."""
    info = arch_or_info if isinstance(arch_or_info, ArchInfo) else arch_info(arch_or_info)
    br, bc = paper_tiles(info.smem_optin, head_dim, elt)
    best_f = None
    for bm in (128, 64):
        if bm > max(br, 64):
            continue
        for bn in range(min(bc, 256) // 16 * 16, 15, -16):
            t = FwdTile(bm, bn, 4)
            if t.regs_estimate(head_dim, score_mod) <= REG_LIMIT and t.smem_bytes(head_dim, elt) <= info.smem_optin:
                best_f = t
                break
        if best_f is not None:
            break
    best_b = None
    for warps in (8, 4):  # key tile 16 * warps / warps_d: the widest that fits first
        for wd in (1, 2):
            for bm in range(max(16, min(br, 128) // 16 * 16), 15, -16):
                cands = [BwdTile(bm, warps, wd, wq) for wq in (2, 1, 4, 8)]
                cands = [t for t in cands if t.legal() and t.block_n <= max(bc, 16)]
                ok = [t for t in cands if t.regs_estimate(head_dim, score_mod) <= REG_LIMIT
                      and t.smem_bytes(head_dim, elt) <= info.smem_optin]
                if ok:
                    best_b = ok[0]
                    break
            if best_b is not None:
                break
        if best_b is not None:
            break
    if best_f is None or best_b is None:
        raise ValueError(f"head_dim {head_dim}: no CUDA tile fits {info.smem_optin} bytes of shared memory "
                         f"on {info.name}")
    return best_f, best_b


# ---------------------------------------------------------------- the choice


@dataclass(frozen=True)
class Choice:
    """The tiles an instantiation is built with and where each came from: 'env'
    (FLASHGEN_CUDA_FWD_TILE / _BWD_TILE), 'tuned' (flashgen.tune's stored winner, measured at
    ``tuned_seqlen``), 'table' (the per-arch table) or 'derived' (the paper's rule).

    ``fwd_family`` / ``bwd_family``: the kernel family whose tile each pass is. ``choose`` gives
    sm80's; ``AttentionOp.tiles`` reports the forward of the family that runs it, e.g. an
    sm90.Sm90Tile with origin 'tuned' or 'family default' on sm_90a."""

    fwd: FwdTile
    bwd: BwdTile
    dq: DqTile
    fwd_origin: str
    bwd_origin: str
    tuned_seqlen: tuple[int | None, int | None] = (None, None)
    fwd_family: str = "sm80"
    bwd_family: str = "sm80"

    def config(self) -> dict[str, int]:
        """The sm80 family's config keys of these tiles (an instantiation's ``tiles=``): every
        TILE_KEYS entry when the forward is sm80's; with another family's forward (``fwd_family``)
        only the backward and dq keys (that forward's own keys are ``fwd.config()``)."""
        fwd = self.fwd.config() if self.fwd_family == "sm80" else {}
        return fwd | self.bwd.config() | self.dq.config()


def default_choice(spec: ir.Spec, arch: str, head_dim: int, info: ArchInfo | None = None) -> Choice:
    """Table tiles where the table has them, else derived ones (no environment, no tuning)."""
    info = info or arch_info(arch)
    cls = mask_class(spec)
    tf, tb = table(arch, cls, head_dim)
    df, db = derived(info, head_dim, cls == "score_mod")
    return Choice(tf or df, tb or db, dq_tile(arch, head_dim), "table" if tf else "derived",
                  "table" if tb else "derived")


def choose(spec: ir.Spec, arch: str, dtype: ir.DType, head_dim: int, seqlen: int | None = None, *,
           device_index: int | None = None, use_tuned: bool = True, fingerprint: str | None = None) -> Choice:
    """The tiles a CUDA call of ``spec`` at (arch, dtype, head_dim) and max(seqlen_q, seqlen_k) =
    ``seqlen`` uses: FLASHGEN_CUDA_FWD_TILE / FLASHGEN_CUDA_BWD_TILE when set, else the tuned
    winner nearest ``seqlen`` (when tuning results for this GPU exist), else the table, else the
    derived tiles. ValueError for a malformed or illegal environment override (``forced``)."""
    if not 8 <= head_dim <= 256 or head_dim % 8:
        raise ValueError(f"head_dim: {head_dim} is not a CUDA head dim (multiples of 8 up to 256)")
    info = device_info(device_index) if device_index is not None else arch_info(arch)
    base = default_choice(spec, arch, head_dim, info)
    fwd, bwd, fo, bo = base.fwd, base.bwd, base.fwd_origin, base.bwd_origin
    tuned_n: list[int | None] = [None, None]
    if use_tuned and device_index is not None:
        for i, kind in enumerate(("fwd", "bwd")):
            hit = tune_store.lookup(fingerprint or spec, device_index, dtype, head_dim, kind, seqlen)
            if hit is not None:
                cfg, n = hit
                if kind == "fwd":
                    fwd, fo = tile_of("fwd", cfg), "tuned"
                else:
                    bwd, bo = tile_of("bwd", cfg), "tuned"
                tuned_n[i] = n
    ef, eb = forced("fwd"), forced("bwd")
    if ef is not None:
        fwd, fo, tuned_n[0] = ef, "env", None
    if eb is not None:
        bwd, bo, tuned_n[1] = eb, "env", None
    return Choice(fwd, bwd, base.dq, fo, bo, (tuned_n[0], tuned_n[1]))
