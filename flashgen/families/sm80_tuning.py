"""The sm80 family's tuning candidates: which tiles the autotuner (flashgen.tune.tuner) compiles
and times for a (spec, architecture, head dim, kind), and the one-pass instantiation each is
built as. The tuner reaches this through the family (``families.get("sm80").tuning``, an Sm80Tuning); the tile
shapes, resource formulas and tables are flashgen/tiles.py's.
"""

from __future__ import annotations

import math

from .. import env, tiles
from ..build import artifact
from ..lang import ir
from .base import Family

KINDS = ("fwd", "bwd")


def check_kind(kind: str) -> None:
    """ValueError unless ``kind`` is 'fwd' or 'bwd'."""
    if kind not in KINDS:
        raise ValueError(f"kind: expected 'fwd' or 'bwd', got {kind!r}")


class Sm80Tuning:
    """Candidate generation for the FlashAttention-2 tiles (tiles.FwdTile, tiles.BwdTile).

    Attributes:
        fwd_limit / bwd_limit: candidates timed per forward / backward key, the default and the
            derived tile included.
        reg_slack: register-model estimates above tiles.REG_LIMIT + this are not compiled.
    """

    kinds = KINDS
    check_kind = staticmethod(check_kind)
    fwd_limit = 8
    bwd_limit = 6
    reg_slack = 40

    def reference_tiles(self, spec: ir.Spec, arch: str, head_dim: int, kind: str,
                        info: tiles.ArchInfo | None = None) -> dict:
        """{'default': tile, 'derived': tile, 'table': tile or None} of ``kind`` ('fwd' / 'bwd')
        for (arch, head dim): the untuned choice (tiles.default_choice), the paper's rule
        (tiles.derived) and the per-arch table's row (None where the arch has none or it does
        not fit). ``info``: the device's figures (default the arch's table figures). ValueError
        for an unknown kind or architecture."""
        check_kind(kind)
        info = info or tiles.arch_info(arch)
        cls = tiles.mask_class(spec)
        default = tiles.default_choice(spec, arch, head_dim, info)
        derived = tiles.derived(info, head_dim, cls == "score_mod")
        table = tiles.table(arch, cls, head_dim)
        i = 0 if kind == "fwd" else 1
        return {"default": default.fwd if kind == "fwd" else default.bwd, "derived": derived[i], "table": table[i]}

    def forced(self, kind: str) -> bool:
        """Whether FLASHGEN_CUDA_FWD_TILE ('fwd') / FLASHGEN_CUDA_BWD_TILE ('bwd') forces the
        tile of ``kind`` (then it is not tuned: the override wins anyway)."""
        return bool((env.cuda_fwd_tile if kind == "fwd" else env.cuda_bwd_tile)())

    def candidates(self, spec: ir.Spec, arch: str, head_dim: int, kind: str, info: tiles.ArchInfo | None = None,
                   limit: int | None = None, *, seqlens=None) -> list:
        """The tiles the tuner compiles for ``kind`` ('fwd': tiles.FwdTile, 'bwd': tiles.BwdTile)
        at (arch, head dim), in a deterministic order: the default first, then the derived tile,
        the per-arch tables' rows at this and the neighbouring head-dim bounds (both mask
        classes), then a grid of legal shapes nearest the default first (forward: Br 64 / 128
        with 4 warps and 128 with 8 warps, Bc 32 … 128; backward: queries per step 32 / 64 / 128,
        4 / 8 warps, 1 / 2 warps per key slab, every legal dQ split). Kept: legal tiles whose
        shared memory (bytes) fits ``info.smem_optin`` (``info``: a tiles.ArchInfo, default the
        arch's table figures) and whose register estimate is at most REG_LIMIT + reg_slack; at
        most ``limit`` (default fwd_limit / bwd_limit) — the default and the derived tile are
        always kept. ``seqlens`` (the tuned lengths) changes nothing here: no sm80 tile key
        acts per call length. ValueError for an unknown kind or architecture."""
        check_kind(kind)
        arch = tiles.normalize_arch(arch)
        info = info or tiles.arch_info(arch)
        refs = self.reference_tiles(spec, arch, head_dim, kind, info)
        score_mod = tiles.mask_class(spec) == "score_mod"
        limit = (self.fwd_limit if kind == "fwd" else self.bwd_limit) if limit is None else limit
        table_rows = table_neighbours(arch, head_dim, kind)
        if kind == "fwd":
            grid = [tiles.FwdTile(bm, bn, w) for bm, w in ((64, 4), (128, 4), (128, 8))
                    for bn in (32, 48, 64, 96, 128)]
        else:
            grid = [tiles.BwdTile(bm, w, wd, wq) for bm in (32, 64, 128) for w in (4, 8) for wd in (1, 2)
                    for wq in (1, 2, 4, 8)]
        d = refs["default"]
        grid.sort(key=lambda t: (distance(t, d), t.regs_estimate(head_dim, score_mod), t))

        def fits(t) -> bool:
            return t.legal() and t.smem_bytes(head_dim) <= info.smem_optin

        keep = [refs["default"]]
        if fits(refs["derived"]):
            keep.append(refs["derived"])
        keep = list(dict.fromkeys(keep))
        for t in [*table_rows, *grid]:
            if len(keep) >= limit:
                break
            if t in keep or not fits(t) or t.regs_estimate(head_dim, score_mod) > tiles.REG_LIMIT + self.reg_slack:
                continue
            keep.append(t)
        return keep

    def __init__(self, family: Family) -> None:
        self.family = family  # whose instantiations the candidates are

    def instantiation(self, spec: ir.Spec, arch: str, dtype: ir.DType, head_dim: int, tile, kind: str,
                      info: tiles.ArchInfo | None = None) -> artifact.Instantiation:
        """The family's artifact.Instantiation for ``arch`` that compiles only ``kind``'s
        translation unit (config ``<kind>_only``) with ``tile``; the other tile keys are the
        default choice's (``info``: the device's figures, default the arch's table figures)."""
        cfg = tiles.default_choice(spec, arch, head_dim, info).config()
        cfg.update(tile.config())
        return self.family.instantiation(spec, arch, dtype, head_dim, tiles=cfg, extra={f"{kind}_only": 1})


def table_neighbours(arch: str, head_dim: int, kind: str) -> list:
    """The tables' tiles (both mask classes) at head dim's row and the rows either side of it;
    [] for an architecture without tables."""
    fam = tiles.TABLE_FAMILY.get(arch)
    if fam is None:
        return []
    tables = tiles.FWD_TABLE if kind == "fwd" else tiles.BWD_TABLE
    kd = tiles.padded_head_dim(head_dim)
    out = []
    for cls in ("plain", "score_mod"):
        rows = tables[fam][cls]
        i = next((j for j, (bound, _) in enumerate(rows) if kd <= bound), len(rows) - 1)
        out += [rows[j][1] for j in (i, i - 1, i + 1) if 0 <= j < len(rows)]
    return list(dict.fromkeys(out))


def distance(t, d) -> float:
    """How far tile ``t`` is from the default ``d`` of the same kind (log2 steps per field, 1 per
    other knob)."""
    if isinstance(t, tiles.BwdTile):
        return (abs(math.log2(t.block_m / d.block_m)) + abs(math.log2(t.warps / d.warps))
                + abs(t.warps_d - d.warps_d) + abs(math.log2(t.warps_mdq / d.warps_mdq)))
    return (abs(math.log2(t.block_m / d.block_m)) + abs(math.log2(t.block_n / d.block_n))
            + (0 if t.warps == d.warps else 1))
