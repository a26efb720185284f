"""The sm90 family's tuning candidates: which forward tiles (sm90.Sm90Tile) the autotuner
(flashgen.tune.tuner) compiles and times for a (spec, head dim), and the one-pass instantiation
each is built as. The tuner reaches this through the family (``families.get("sm90").tuning``, an
Sm90Tuning). The family tunes only the pass it runs, the forward: a call's backward runs on sm80,
whose tiles sm80's tuning (sm80_tuning.py) covers. Legality is sm90.py's (``check_tiles``: tile
shapes and shared memory; ``spill_reason``: the configurations measured to spill registers).
"""

from __future__ import annotations

from dataclasses import replace

from .. import tiles
from ..build import artifact
from ..lang import ir
from . import sm90
from .base import Family

KINDS = ("fwd",)


def check_kind(kind: str) -> None:
    """ValueError naming ``kind`` unless it is 'fwd' (the sm90 backward has one fixed tile; the
    backward calls it does not serve run on sm80, tuned as sm80's)."""
    if kind not in KINDS:
        raise ValueError(f"kind: the sm90 family tunes only its forward ('fwd'; its backward has one fixed tile), "
                         f"got {kind!r}")


class Sm90Tuning:
    """Candidate generation for the sm90 forward's tiles.

    Attributes:
        fwd_limit: candidates timed per forward key, the default included.
        key_tiles / sparse_key_tiles: the key tiles (fwd_block_n) proposed besides the default's,
            nearest it first (block-sparse instantiations: those dividing 128).
        persistent_caps: the fwd_persistent values proposed (0: never; 2^30: every seqlen_k).
    """

    kinds = KINDS
    check_kind = staticmethod(check_kind)
    fwd_limit = 8
    key_tiles = (64, 80, 96, 112, 128, 144, 160, 176, 192)
    sparse_key_tiles = (32, 64, 128)
    persistent_caps = (1 << 30, 4096, 2048, 0)

    def __init__(self, family: Family) -> None:
        self.family = family  # whose instantiations the candidates are

    def forced(self, kind: str) -> bool:
        """Whether the environment forces ``kind``'s tile (never for sm90: FLASHGEN_CUDA_FWD_TILE
        is the sm80 forward's)."""
        return False

    def reference_tiles(self, spec: ir.Spec, arch: str, head_dim: int, kind: str,
                        info: tiles.ArchInfo | None = None, *, sparse: bool = False) -> dict:
        """{'default': the family's untuned forward tile (sm90.default_tiles)} at ``head_dim``
        (block-sparse with ``sparse``). ValueError for a kind other than 'fwd'."""
        check_kind(kind)
        return {"default": sm90.Sm90Tile.from_config(sm90.default_tiles(spec, head_dim, sparse))}

    def why_not(self, spec: ir.Spec, head_dim: int, tile: sm90.Sm90Tile, *, sparse: bool = False,
                info: tiles.ArchInfo | None = None) -> str | None:
        """Why ``tile`` is no candidate at ``head_dim`` (None: it is one): ``check_tiles``
        rejects it (shapes, shared memory at head_dim; ``sparse``: block lists need two consumer
        warpgroups), it needs more shared memory than ``info.smem_optin`` (bytes), block lists
        of 128 x 128 blocks do not nest in it (``sparse``), or it is known to spill
        (``sm90.spill_reason``)."""
        try:
            sm90.check_tiles(tile.config() | ({"sparse": 1} if sparse else {}), head_dim)
        except ValueError as e:
            return str(e)
        if info is not None and tile.smem_bytes(head_dim) > info.smem_optin:
            return f"needs {tile.smem_bytes(head_dim):,} B of shared memory, over the device's {info.smem_optin:,} B"
        if sparse and not sm90.nests_in_blocks(tile):
            return "block lists of 128 x 128 blocks do not nest in it"
        return sm90.spill_reason(spec, head_dim, tile)

    def behaviour(self, tile: sm90.Sm90Tile, seqlens) -> tuple:
        """What a launch with ``tile`` does at the tuned lengths ``seqlens`` (seqlen_k = N): the
        kernel's shape and, per length, whether the grid is persistent; two tiles alike here time
        the same (e.g. fwd_persistent 4096 and 2^30 at N <= 4096). Without seqlens: the tile."""
        if not seqlens:
            return (tile,)
        return (tile.block_n, tile.stages, tile.overlap, tile.pingpong, tile.consumers,
                tuple(tile.persistent_at(n) for n in seqlens))

    def candidates(self, spec: ir.Spec, arch: str, head_dim: int, kind: str, info: tiles.ArchInfo | None = None,
                   limit: int | None = None, *, seqlens=None, sparse: bool = False) -> list[sm90.Sm90Tile]:
        """The forward tiles (sm90.Sm90Tile) the tuner compiles at ``head_dim``, in a
        deterministic order: the family's default first, then one knob changed at a time —
        fwd_stages 2 <-> 3, the overlap off/on, consumers 3 <-> 2 (d <= 64), ping-pong, key
        tiles nearest the default's (``key_tiles``; ``sparse_key_tiles`` for block-sparse
        instantiations), persistent caps (``persistent_caps``) — then stages and key tiles
        combined. Kept: tiles ``why_not`` accepts (legal for sm90.check_tiles at head_dim and
        within ``info.smem_optin``, nesting 128-blocks with ``sparse``, not known to spill),
        each launch behaviour once at the tuned lengths ``seqlens`` (max(seqlen_q, seqlen_k) of
        the timed calls: ``behaviour``), at most ``limit`` (default fwd_limit; the default is
        always kept). ``arch``: the target, 'sm_90a'. ValueError for a kind other than 'fwd',
        or an architecture the family does not run on."""
        check_kind(kind)
        arch = tiles.normalize_arch(arch)
        why = self.family.arch_reason(arch)
        if why:
            raise ValueError(f"arch: the sm90 family {why}")
        limit = self.fwd_limit if limit is None else limit
        seqlens = sorted({int(n) for n in seqlens}) if seqlens else None
        d = self.reference_tiles(spec, arch, head_dim, kind, info, sparse=sparse)["default"]
        stages = 3 if d.stages == 2 else 2
        if d.consumers == 3:
            consumers = sm90.Sm90Tile.from_config(sm90.default_tiles(spec, head_dim, sparse, three=False))
        else:
            consumers = d.with_(consumers=3, overlap=0, pingpong=0)
        keys = sorted((bn for bn in (self.sparse_key_tiles if sparse else self.key_tiles) if bn != d.block_n),
                      key=lambda bn: (abs(bn - d.block_n), -bn))
        caps = [d.with_(persistent=p) for p in self.persistent_caps if p != d.persistent]
        by_key = [d.with_(block_n=bn) for bn in keys]
        order = [d.with_(stages=stages), d.with_(overlap=1 - d.overlap, pingpong=0), consumers,
                 d.with_(overlap=1, pingpong=1, consumers=2)]
        for i in range(max(len(by_key), len(caps))):  # key tiles and persistent caps in turn
            order += by_key[i:i + 1] + caps[i:i + 1]
        order += [t.with_(stages=stages) for t in by_key]
        keep = [d]
        seen = {self.behaviour(d, seqlens)}
        for t in order:
            if len(keep) >= limit:
                break
            b = self.behaviour(t, seqlens)
            if b in seen or self.why_not(spec, head_dim, t, sparse=sparse, info=info) is not None:
                continue
            seen.add(b)
            keep.append(t)
        return keep

    def instantiation(self, spec: ir.Spec, arch: str, dtype: ir.DType, head_dim: int, tile: sm90.Sm90Tile,
                      kind: str, info: tiles.ArchInfo | None = None, *,
                      sparse: bool = False) -> artifact.Instantiation:
        """The family's artifact.Instantiation of the forward (its only pass: config fwd_only)
        with ``tile`` at (arch, dtype, head_dim), padded layout (block-sparse with ``sparse``).
        ValueError for a kind other than 'fwd' or a tile check_tiles rejects."""
        check_kind(kind)
        inst = self.family.instantiation(spec, arch, dtype, head_dim, sparse=sparse, tiles=tile.config())
        cfg = {k: v for k, v in inst.config if k not in sm90.BWD_KEYS}  # the forward alone (never the backward)
        cfg["fwd_only"] = 1
        return replace(inst, config=tuple(sorted(cfg.items())))
