"""Block sparsity: ``flashgen.BlockMask`` and ``flashgen.block_mask`` (the ``block_mask=`` argument).

The paper's block-sparse FlashAttention (Dao et al. 2022, Sec. 3.3, Alg. 5) visits only the
(query block, key block) pairs a block mask keeps, so runtime follows the number of non-empty
blocks. A ``BlockMask`` classifies every pair of a [batch|1, heads|1, ⌈seqlen_q/block⌉,
⌈seqlen_k/block⌉] grid as empty (never loaded), partial (the element mask runs) or full (every
element kept), and holds the compact per-row lists the kernels walk, as FlexAttention's
``create_block_mask`` does:

- ``flashgen.block_mask(op, seqlen_q, seqlen_k, ...)`` (flashgen/runtime/masks.py) classifies the spec's own mask (evaluated
  on the device in row chunks, never as an N×N tensor; ``full`` blocks then let the kernels skip
  the mask arithmetic);
- ``BlockMask.from_pattern(pattern, block_size=128)`` takes a user's bool block pattern, which is
  combined with the spec's element mask (an element is kept iff its block is and the spec keeps
  it).

Kernels use their own tiles (which differ between the forward and the backward and between
families); ``tile_lists`` maps the block classification onto any tile size on the device (a tile
is empty iff every block it overlaps is, full iff every one is) and caches the result on the
mask, so repeated calls with one ``BlockMask`` do no extra work and never synchronise the host.
"""

from __future__ import annotations

import numbers
import weakref

import torch

from .lang import expr as X
from .lang import ir

EMPTY, PARTIAL, FULL = 0, 1, 2
MAX_BLOCK = 4096  # block sizes: positive multiples of 8 up to this


def check_block_size(block_size) -> tuple[int, int]:
    is_int = lambda x: isinstance(x, numbers.Integral) and not isinstance(x, bool)  # noqa: E731
    bs = (block_size, block_size) if is_int(block_size) \
        else tuple(block_size) if isinstance(block_size, tuple | list) else None
    if bs is None or len(bs) != 2 or not all(is_int(x) for x in bs):
        raise TypeError(f"block_size: expected an int or a pair of ints (query, key), got {block_size!r}")
    bs = tuple(int(x) for x in bs)
    for x in bs:
        if not (8 <= x <= MAX_BLOCK and x % 8 == 0):
            raise ValueError(f"block_size: {x} is not a multiple of 8 in [8, {MAX_BLOCK}]")
    return bs


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockMask:
    """Which (query block, key block) pairs attention visits: empty, partial or full.

    Build one with ``flashgen.block_mask`` (from a spec's mask) or ``BlockMask.from_pattern``
    (from a bool pattern) and pass it as ``op(q, k, v, block_mask=...)``; reuse it across calls.

    Attributes:
        block_size: (query rows, key columns) per block.
        seqlen_q, seqlen_k: the sequence lengths it was made for (None when made from a pattern:
            any lengths with ⌈seqlen/block⌉ blocks fit), packed layout: max_seqlen_q/k.
        shape: (batch|1, heads|1, query blocks, key blocks); a dim of 1 is shared.
        full_kept: True when made from the spec's own mask (a full block keeps every element
            of it); False for a pattern (full only means the pattern keeps the block).
        kv_num_blocks, kv_indices: int32 [B, H, nQB] and [B, H, nQB, nKB]: per query block,
            the partial key blocks (the first kv_num_blocks entries of kv_indices are valid);
        full_kv_num_blocks, full_kv_indices: the same for full key blocks;
        q_num_blocks, q_indices, full_q_num_blocks, full_q_indices: the transpose (per key
            block, the query blocks that see it), as the backward's key-major loop walks them.
    """

    def __init__(self, state: torch.Tensor, block_size, seqlen_q: int | None = None,
                 seqlen_k: int | None = None, *, full_kept: bool = False, _check_values: bool = True):
        """Made by ``from_pattern`` and ``flashgen.block_mask``; ``state``: the classes, int
        [batch|1, heads|1, query blocks, key blocks] with values 0 (empty), 1 (partial), 2 (full)
        (checked here: one read on the host; ``_check_values=False`` for classes flashgen's own
        classifiers wrote, so that ``flashgen.block_mask`` makes no host read on CUDA)."""
        if not isinstance(state, torch.Tensor) or state.dim() != 4 or state.is_floating_point() \
                or state.is_complex() or state.device.type == "meta":
            raise ValueError("state: expected an integer tensor [batch|1, heads|1, query blocks, key blocks]")
        if _check_values and state.numel() and not bool(((state >= EMPTY) & (state <= FULL)).all()):
            raise ValueError("state: values must be 0 (empty), 1 (partial) or 2 (full)")
        self.block_size = check_block_size(block_size)
        self._state = state.to(torch.int8).contiguous()
        self.seqlen_q, self.seqlen_k = seqlen_q, seqlen_k
        self.full_kept = bool(full_kept)
        self._binding = None  # flashgen.block_mask: what the mask was made from (check_binding)
        self._depends = (False, False)  # flashgen.block_mask: the mask uses (b, h)
        self._cache: dict = {}

    # ------------------------------------------------------------ construction

    @classmethod
    def from_pattern(cls, pattern: torch.Tensor, block_size=128) -> BlockMask:
        """A block mask from a bool ``pattern`` [batch|1, heads|1, ⌈Nq/block⌉, ⌈Nk/block⌉]
        (True: the block is visited; dims of size 1 are shared; rank 2 or 3 are taken as
        [1, 1, ...] and [1, heads, ...]). ``block_size``: an int or (query, key) pair, multiples
        of 8. With a spec that has a mask, an element is kept iff its block is True and the spec
        keeps it (the paper's block-sparse FlashAttention is ``dense.attn`` with a pattern).

        Raises TypeError / ValueError naming the argument (bad dtype, rank, block size).
        """
        if not isinstance(pattern, torch.Tensor):
            raise TypeError(f"pattern: expected a bool tensor, got {type(pattern).__name__}")
        if pattern.dtype != torch.bool:
            raise ValueError(f"pattern: dtype {pattern.dtype}, expected torch.bool")
        if pattern.device.type == "meta":
            raise ValueError("pattern: on the meta device (its values decide which blocks are visited)")
        if not 2 <= pattern.dim() <= 4:
            raise ValueError(f"pattern: expected [batch|1, heads|1, query blocks, key blocks] (rank 2 to 4), "
                             f"got shape {tuple(pattern.shape)}")
        while pattern.dim() < 4:
            pattern = pattern.unsqueeze(0)
        return cls(pattern.to(torch.int8) * FULL, block_size, full_kept=False)

    def __getstate__(self) -> dict:
        """Copies and pickles keep the binding with each tensor's values instead of its identity
        (a weak reference cannot be pickled): such a mask compares a call's tensors by value
        (one host read per call)."""
        state = dict(self.__dict__)
        if self._binding is not None:
            fp, want, cus = self._binding

            def by_value(h):
                if not (isinstance(h, tuple) and h and callable(h[0])):
                    return h
                t = h[0]()
                return ("value", t.detach().cpu().clone()) if t is not None else ("dead",)

            state["_binding"] = (fp, [by_value(h) for h in want], tuple(by_value(h) for h in cus))
        state["_cache"] = {}
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    # ------------------------------------------------------------ views

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return tuple(self._state.shape)

    @property
    def device(self) -> torch.device:
        return self._state.device

    def to(self, device) -> BlockMask:
        """This mask on ``device`` (itself when already there); ValueError for a device torch
        does not know."""
        try:
            device = device if isinstance(device, torch.device) else torch.device(device)
        except (RuntimeError, TypeError, ValueError):
            raise ValueError(f"device: unknown device {device!r} (expected e.g. 'cpu', 'cuda' or 'cuda:0')") from None
        if device == self.device:
            return self
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"device: '{device.type}' is not supported (expected cpu or cuda)")
        out = BlockMask(self._state.to(device), self.block_size, self.seqlen_q, self.seqlen_k,
                        full_kept=self.full_kept, _check_values=False)  # checked when made
        out._binding, out._depends = self._binding, self._depends
        return out

    def density(self) -> float:
        """Fraction of non-empty blocks (reads the device: a host synchronisation)."""
        return float((self._state != EMPTY).float().mean()) if self._state.numel() else 0.0

    def to_dense(self) -> torch.Tensor:
        """A copy of the classification, int8 [B|1, H|1, nQB, nKB]: 0 empty, 1 partial, 2 full."""
        return self._state.clone()

    def _compact(self, transpose: bool, full: bool) -> tuple[torch.Tensor, torch.Tensor]:
        key = ("compact", transpose, full)
        if key not in self._cache:
            st = self._state.transpose(-1, -2) if transpose else self._state
            want = FULL if full else PARTIAL
            sel = st == want
            n = st.shape[-1]
            order = torch.argsort(torch.where(sel, 0, n) + torch.arange(n, device=st.device), dim=-1)
            self._cache[key] = (sel.sum(-1, dtype=torch.int32), order.to(torch.int32))
        return self._cache[key]

    kv_num_blocks = property(lambda self: self._compact(False, False)[0])
    kv_indices = property(lambda self: self._compact(False, False)[1])
    full_kv_num_blocks = property(lambda self: self._compact(False, True)[0])
    full_kv_indices = property(lambda self: self._compact(False, True)[1])
    q_num_blocks = property(lambda self: self._compact(True, False)[0])
    q_indices = property(lambda self: self._compact(True, False)[1])
    full_q_num_blocks = property(lambda self: self._compact(True, True)[0])
    full_q_indices = property(lambda self: self._compact(True, True)[1])

    def __repr__(self) -> str:
        return (f"BlockMask(shape={self.shape}, block_size={self.block_size}, seqlen_q={self.seqlen_q}, "
                f"seqlen_k={self.seqlen_k}, full_kept={self.full_kept}, device={self.device})")

    # ------------------------------------------------------------ kernel lists

    def check(self, batch: int, heads: int, seqlen_q: int, seqlen_k: int, device: torch.device) -> None:
        """Raise ValueError (naming ``block_mask``) unless this mask fits a call of these sizes."""
        B, H, nq, nk = self.shape
        bq, bk = self.block_size
        want = (cdiv(seqlen_q, bq), cdiv(seqlen_k, bk))
        if (nq, nk) != want:
            raise ValueError(f"block_mask: {nq} x {nk} blocks of {bq} x {bk}, but seqlen_q = {seqlen_q} and "
                             f"seqlen_k = {seqlen_k} need {want[0]} x {want[1]}")
        for name, have, n, per in (("batch", B, batch, self._depends[0]), ("heads", H, heads, self._depends[1])):
            if have not in (1, n) or (per and have != n):
                raise ValueError(f"block_mask: {name} dim is {have}, expected " + (f"{n} (the call's {name}: the "
                                 "mask depends on " + ("b" if name == "batch" else "h") + ")" if per else
                                 f"1 or {n} (the call's {name})"))
        if self.seqlen_q is not None and (self.seqlen_q, self.seqlen_k) != (seqlen_q, seqlen_k):
            raise ValueError(f"block_mask: made for seqlen_q = {self.seqlen_q}, seqlen_k = {self.seqlen_k}, "
                             f"called with {seqlen_q}, {seqlen_k}")
        if self.device != device:
            raise ValueError(f"block_mask: on {self.device} but q is on {device} (use block_mask.to(device))")

    def bind(self, fingerprint: str, values, cu_seqlens_q, cu_seqlens_k, depends: tuple[bool, bool]) -> None:
        """Record what ``flashgen.block_mask`` made this mask from (checked by ``check_binding``):
        the spec's fingerprint, the parameter values (tensors by identity), the packed layout's
        cu_seqlens, and whether the mask uses (b, h)."""
        pv = [_identity(v) if isinstance(v, torch.Tensor) else v for v in values]
        self._binding = (fingerprint, pv, (_identity(cu_seqlens_q), _identity(cu_seqlens_k)))
        self._depends = depends

    def check_binding(self, spec: ir.Spec, fingerprint: str, values, cu_seqlens_q=None, cu_seqlens_k=None,
                      read: frozenset[str] | None = None) -> None:
        """Raise ValueError (naming ``block_mask``) when this mask was made by
        ``flashgen.block_mask`` from another spec, other parameter values, another layout or
        other cu_seqlens tensors than the call's: its full blocks skip the element mask, so a
        mismatch would be silently wrong. Only the parameters the mask reads count. Tensors are
        compared by identity (the same tensor object, shape, strides and in-place version),
        which needs no host synchronisation; writes that bypass the version counter (``.data``,
        numpy views) go unseen, and under torch.compile only the spec, the scalar values and
        the layout are compared. Pattern masks bind to nothing (any spec may use them).
        ``fingerprint``: the op's ``spec.fingerprint()``, computed once; ``read``: the names its
        mask reads (``mask_names(spec)``), computed once by the op (a cached function called under
        torch.compile makes dynamo warn)."""
        if self._binding is None:
            return
        fp, want, (cq, ck) = self._binding
        if fp != fingerprint:
            raise ValueError("block_mask: made by flashgen.block_mask from another spec's mask (pass a mask of this "
                             "op's spec, or a BlockMask.from_pattern)")
        if (cq is None) != (cu_seqlens_q is None):
            raise ValueError("block_mask: made for the " + ("packed" if cq is not None else "padded") +
                             " layout, called with the " + ("packed" if cu_seqlens_q is not None else "padded") +
                             " one (build it with the call's cu_seqlens_q / cu_seqlens_k, or without them)")
        compiling = torch.compiler.is_compiling()
        names = [p.name for p in spec.params]
        read = mask_names(spec) if read is None else read
        for name, have, now in zip(names + ["cu_seqlens_q", "cu_seqlens_k"], list(want) + [cq, ck],
                                   list(values) + [cu_seqlens_q, cu_seqlens_k], strict=True):
            if name in names and name not in read:
                continue  # a parameter of the score only: the block classes do not depend on it
            if isinstance(have, tuple):  # a tensor's identity (or, for a copy, its values)
                if not compiling and not _same(have, now):
                    raise ValueError(f"block_mask: made with another {name} tensor than the call's (or it changed "
                                     "in place since): rebuild it with flashgen.block_mask and the call's values")
            elif have != now:
                raise ValueError(f"block_mask: made with {name} = {have!r}, called with {now!r}: rebuild it with "
                                 "flashgen.block_mask and the call's values")

    def tile_lists(self, block_r: int, block_c: int, seqlen_q: int, seqlen_k: int,
                   transpose: bool = False) -> torch.Tensor:
        """The kernels' lists (args.h, FgBlockLists) for tiles of block_r queries x block_c keys
        (``transpose``: block_r keys x block_c queries, a row per key tile): int32 [B|1, H|1,
        rows, 2 + cols], row = [n_partial, n_full, partial tiles..., full tiles..., unused].
        Computed on the mask's device once per tile size and cached."""
        key = ("tiles", block_r, block_c, seqlen_q, seqlen_k, transpose)
        hit = self._cache.get(key)  # no lock: two threads may both build it, harmlessly
        if hit is not None:
            return hit
        bq, bk = self.block_size
        st = self._state
        if transpose:  # keys become rows
            st, bq, bk, seqlen_q, seqlen_k = st.transpose(-1, -2), bk, bq, seqlen_k, seqlen_q
        tiles = _retile(st, bq, bk, seqlen_q, seqlen_k, block_r, block_c)
        lists = lists_of(tiles)
        self._cache[key] = lists
        return lists


def _identity(t) -> tuple | None:
    """What check_binding compares a tensor by: a weak reference to the object itself (so a new
    tensor at a freed tensor's address is not taken for it), its shape, strides and in-place
    version (None for inference tensors, which have no version counter)."""
    if not isinstance(t, torch.Tensor):
        return None
    try:
        version = t._version
    except RuntimeError:
        version = None
    return (weakref.ref(t), tuple(t.shape), tuple(t.stride()), version)


def _same(have: tuple | None, now) -> bool:
    if have is None or not isinstance(now, torch.Tensor):
        return have is None and now is None
    if have[0] == "value":  # a copied or unpickled mask (__getstate__)
        return tuple(now.shape) == tuple(have[1].shape) and torch.equal(now.detach().cpu(), have[1])
    if have[0] == "dead":
        return False
    ref, *rest = have
    return ref() is now and tuple(rest) == _identity(now)[1:]


def _per_spec(spec: ir.Spec, name: str, compute):
    """A fact about ``spec`` computed once per Spec object and kept in its instance dict (the spec
    is immutable; a functools cache would hash it, walking it whole, at every lookup)."""
    facts = spec.__dict__
    hit = facts.get(name)
    if hit is None:
        hit = facts[name] = compute(spec)
    return hit


def mask_names(spec: ir.Spec) -> frozenset[str]:
    """Names the spec's mask reads (positions and parameters); cached (every bound call asks)."""
    return _per_spec(spec, "_mask_names", lambda s: frozenset(n.id for n in X.walk(s.mask) if isinstance(n, ir.Name))
                     if s.mask is not None else frozenset())


def mask_has_float(spec: ir.Spec) -> bool:
    """Whether the mask computes with floats somewhere (its rounding may then differ between the
    CPU's torch classification and the kernels' own arithmetic at a block's boundary); once per
    spec object."""
    return _per_spec(spec, "_mask_has_float", _mask_has_float)


def _mask_has_float(spec: ir.Spec) -> bool:
    if spec.mask is None:
        return False
    scope = X.Scope({p.name: p for p in spec.params}, allow_score=True)
    try:
        return any(X.type_of(n, scope) == X.FLOAT for n in X.walk(spec.mask) if not isinstance(n, ir.Name)
                   or n.id not in {p.name for p in spec.params if p.is_tensor})
    except Exception:  # noqa: BLE001 - a node type_of does not take: assume floats
        return True


def _retile(st: torch.Tensor, bq: int, bk: int, nq: int, nk: int, tr: int, tc: int) -> torch.Tensor:
    """Block classification [B, H, ⌈nq/bq⌉, ⌈nk/bk⌉] → tile classification [B, H, ⌈nq/tr⌉,
    ⌈nk/tc⌉]: a tile is empty iff every block it overlaps is, full iff every one is (2-D prefix
    sums over the blocks, then one rectangle sum per tile)."""
    if (bq, bk) == (tr, tc):
        return st
    dev = st.device

    def ranges(n, b, t):
        lo = torch.arange(0, cdiv(n, t), device=dev) * t
        hi = torch.clamp(lo + t, max=n)
        return lo // b, (hi + b - 1) // b

    r_lo, r_hi = ranges(nq, bq, tr)
    c_lo, c_hi = ranges(nk, bk, tc)

    def rect(x):
        p = torch.nn.functional.pad(x.to(torch.int32).cumsum(-1).cumsum(-2), (1, 0, 1, 0))
        g = lambda r, c: p[:, :, r][:, :, :, c]  # noqa: E731
        return g(r_hi, c_hi) - g(r_lo, c_hi) - g(r_hi, c_lo) + g(r_lo, c_lo)

    area = (r_hi - r_lo).view(-1, 1) * (c_hi - c_lo).view(1, -1)
    nonempty, full = rect(st != EMPTY), rect(st == FULL)
    return torch.where(nonempty == 0, EMPTY, torch.where(full == area, FULL, PARTIAL)).to(torch.int8)


def lists_of(tiles: torch.Tensor) -> torch.Tensor:
    """Per tile row: [n_partial, n_full, partial tile indices (descending), full ones
    (descending), unused], int32."""
    n = tiles.shape[-1]
    desc = torch.arange(n - 1, -1, -1, device=tiles.device)
    key = torch.where(tiles == PARTIAL, desc, torch.where(tiles == FULL, n + desc, 2 * n))
    order = torch.argsort(key, dim=-1)
    out = torch.empty((*tiles.shape[:-1], n + 2), dtype=torch.int32, device=tiles.device)
    out[..., 0] = (tiles == PARTIAL).sum(-1)
    out[..., 1] = (tiles == FULL).sum(-1)
    out[..., 2:] = order
    return out


# ------------------------------------------------------------ the CUDA classifier


def mask_extents(spec: ir.Spec) -> tuple[bool, bool]:
    """Whether the spec's mask depends on the batch index b and on the query head h (a tensor
    parameter can only vary with them through an index that names them); once per spec object."""
    return _per_spec(spec, "_mask_extents", lambda s: (False, False) if s.mask is None else
                     (X.uses(s.mask, "b"), X.uses(s.mask, "h")))
