"""The ``sm90`` family's model for explain: its forward tile (128 or 192 query rows in two
or three consumer warpgroups × the family's key tile, flashgen/families/sm90.py: the tuned winner
on a live device where one is stored, else the family default) and shared memory; everything
else — the mask geometry, the peaks, the backward where it runs on sm80 — is the sm80 model's.
Where the sm90 backward serves the call (every spec at head dims 64 and 128 in the padded
layout, not deterministic: ``sm90.backward_reason``), its tile (128 keys in two consumer warpgroups × 64-row query tiles,
templates/include/flashgen/sm90/bwd.cuh) replaces sm80's."""

from __future__ import annotations

from dataclasses import replace

from .. import families
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
    bcall = families.Call("cuda", call.target.arch, call.dtype, call.head_dim, frozenset({"backward"}),
                          gqa=call.heads != call.hkv)
    if part.listed:
        bcall = replace(bcall, features=bcall.features | {"sparse"})
    why = sm90.FAMILY.declines(call.spec, bcall)
    if why is None:
        bbm, bbn = sm90.bwd_block_m(call.spec, call.head_dim), sm90.BWD_BLOCK_N
        bwd = TileReport(bbm, bbn, 12, "family default", sm90.bwd_smem_bytes(call.head_dim, block_m=bbm), None,
                         "not modelled (setmaxnreg: 240 per consumer thread, 24 per producer thread)",
                         f"{bbn} keys x {bbm}-row query tiles, {sm90.BWD_STAGES} Q/dO stages, 1 producer + 2 "
                         "consumer warpgroups (sm90 backward)")
        call.notes.append("forward: the sm90 family (wgmma, TMA); backward: the sm90 family (wgmma, TMA)")
        # At d 64 (64-row query tiles) each consumer warpgroup adds dS K over its own 64 keys: two dQ
        # partials per visit (sm90/bwd.cuh kDqKeySplit); at d 128 each adds one column half.
        dq_adds = 2 if bbm == 64 and call.head_dim == 64 else 1
        return replace(part, tiles={**part.tiles, "fwd": fwd, "bwd": bwd}, fwd_mn=(bm, bn), bwd_mn=(bbm, bbn),
                       dq_adds=dq_adds)
    call.notes.append(f"forward: the sm90 family (wgmma, TMA); backward: the sm80 family (sm90 {why})")
    return replace(part, tiles={**part.tiles, "fwd": fwd}, fwd_mn=(bm, bn))
