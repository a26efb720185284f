"""The ``sm90`` family's model for explain: its forward tile (128 or 192 query rows in two
or three consumer warpgroups × the family's key tile, flashgen/families/sm90.py: the tuned winner
on a live device where one is stored, else the family default) and shared memory; everything
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
    chosen: list[sm90.Sm90Choice] = []

    def tile(listed: bool) -> tuple[int, int]:
        # block-sparse calls take the winner of the longest tuned length (op.library's seqlen None)
        seqlen = None if listed else max(call.nq, call.nk)
        chosen.append(sm90.choose(call.spec, call.target.arch, call.dtype, call.head_dim, seqlen, sparse=listed,
                                  device_index=call.target.device_index, fingerprint=call.op.fingerprint))
        return chosen[-1].tile.block_m, chosen[-1].tile.block_n

    part = sm80_model.describe(call, fwd_tile=tile)
    choice = chosen[-1]
    t = choice.tile
    bm, bn, stages, consumers = t.block_m, t.block_n, t.stages, t.consumers
    fwd = TileReport(bm, bn, 4 * (consumers + 1), choice.origin, t.smem_bytes(call.head_dim), None,
                     f"not modelled (setmaxnreg: {240 if consumers == 2 else 160} per consumer thread, "
                     "24 per producer thread)",
                     f"{bm}x{bn}, {stages} K/V stages, 1 producer + {consumers} consumer warpgroups"
                     f" (sm90 tile {t})", choice.tuned_seqlen)
    call.notes.append("forward: the sm90 family (wgmma, TMA); backward: the sm80 family")
    return replace(part, tiles={**part.tiles, "fwd": fwd}, fwd_mn=(bm, bn))
