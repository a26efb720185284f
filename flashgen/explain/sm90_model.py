"""The ``sm90`` family's model for explain: its forward tile (128 or 192 query rows in two
or three consumer warpgroups × the family's key tile, flashgen/families/sm90.py) and shared memory; everything
else — the mask geometry, the backward (which runs on sm80), the peaks — is the sm80 model's."""

from __future__ import annotations

from dataclasses import replace

from ..families import sm90
from . import sm80_model
from .report import TileReport
from .target import FamilyPart, ModelCall


def describe(call: ModelCall) -> FamilyPart:
    """The sm80 model's part with the sm90 forward's tile in place of sm80's; where the call
    builds block lists (a mask without an exact closed-form key range, e.g. document ids), the
    block occupancy is counted at the sm90 forward's tiles too (the classifier makes its lists
    for them: runtime/blocks.py)."""
    cfg = {}

    def tile(listed: bool) -> tuple[int, int]:
        cfg.update(sm90.FAMILY.config(call.spec, call.target.arch, call.dtype, call.head_dim, sparse=listed))
        return 64 * cfg.get("fwd_consumers", 2), cfg["fwd_block_n"]

    part = sm80_model.describe(call, fwd_tile=tile)
    bm, bn, stages = 64 * cfg.get("fwd_consumers", 2), cfg["fwd_block_n"], cfg["fwd_stages"]
    consumers = bm // 64
    fwd = TileReport(bm, bn, 4 * (consumers + 1), "family default",
                     sm90.smem_bytes(call.head_dim, bn, stages, bm), None,
                     f"not modelled (setmaxnreg: {240 if consumers == 2 else 160} per consumer thread, "
                     "24 per producer thread)",
                     f"{bm}x{bn}, {stages} K/V stages, 1 producer + {consumers} consumer warpgroups")
    call.notes.append("forward: the sm90 family (wgmma, TMA); backward: the sm80 family")
    return replace(part, tiles={**part.tiles, "fwd": fwd}, fwd_mn=(bm, bn))
