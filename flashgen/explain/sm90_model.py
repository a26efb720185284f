"""The ``sm90`` family's model for explain: its forward tile (128 query rows in two consumer
warpgroups × the family's key tile, flashgen/families/sm90.py) and shared memory; everything
else — the mask geometry, the backward (which runs on sm80), the peaks — is the sm80 model's."""

from __future__ import annotations

from dataclasses import replace

import torch

from ..families import sm90
from . import sm80_model
from .geometry import closed_form_bounds
from .report import TileReport
from .target import FamilyPart, ModelCall


def describe(call: ModelCall) -> FamilyPart:
    """The sm80 model's part with the sm90 forward's tile in place of sm80's."""
    part = sm80_model.describe(call)
    if part.listed:
        # sm90 builds no block lists: a mask without an exact closed-form range (document ids)
        # visits every tile of the closed-form key range its kv_lo / kv_hi hooks give.
        geo = part.geo  # the sm80 model's: its extents and kept pairs stand, its hulls are replaced
        lo, hi = closed_form_bounds(call.spec, call.nq, call.nk, geo.bp, geo.hp, call.values)
        lo, hi = lo.clamp(0, call.nk).reshape(geo.bp * geo.hp, -1), hi.clamp(0, call.nk).reshape(geo.bp * geo.hp, -1)
        first = torch.where(hi > lo, lo, torch.full_like(lo, call.nk))
        last = torch.where(hi > lo, hi - 1, torch.full_like(hi, -1))
        geo = replace(geo, first=first, last=last, exact=False, source="closed-form key range (sm90 visits)", blocks={})
        part = replace(part, geo=geo, listed=False,
                       model="key ranges: each query tile loads its closed-form key range (no block lists on sm90)")
    cfg = dict(sm90.FAMILY.config(call.spec, call.target.arch, call.dtype, call.head_dim))
    bn, stages = cfg["fwd_block_n"], cfg["fwd_stages"]
    fwd = TileReport(128, bn, 12, "family default",
                     sm90.smem_bytes(call.head_dim, bn, stages), None,
                     "not modelled (setmaxnreg: 240 per consumer thread, 24 per producer thread)",
                     f"128x{bn}, {stages} K/V stages, 1 producer + 2 consumer warpgroups")
    call.notes.append("forward: the sm90 family (wgmma, TMA); backward: the sm80 family")
    return replace(part, tiles={**part.tiles, "fwd": fwd}, fwd_mn=(128, bn))
