"""Block lists of a CUDA call: from a ``block_mask`` (``block_args``: the lists for the
forward's tiles and, for a call that records grad, the backward's, each for the family that runs
that pass) or, for masks without a closed-form key range, classified per call by the family's
block classifier kernel (``auto_blocks``). The op's methods of the same names call these."""

from __future__ import annotations

from .. import env, families
from ..sparsity import lists_of, mask_has_float
from .checks import IR_DTYPE, Blocks, Packed, dims
from .launch import classify


def block_args(op, block_mask, q, k, packed: bool, cu_seqlens_q, max_seqlen_q, max_seqlen_k,
               grad: bool, values=(), cu_seqlens_k=None, dropout: bool = False,
               deterministic: bool = False) -> dict:
    """The op's block-sparsity arguments for ``block_mask``: its lists for the forward's
    tiles (and, with ``grad``, the backward's, for the family the backward of a call with
    this GQA shape and ``deterministic`` runs on), plus their tile sizes. Checks the mask's
    shape and device against the call first, and that a mask made from a spec's mask
    (flashgen.block_mask) was made from this spec with the call's parameters and layout
    (ValueError naming block_mask)."""
    block_mask.check_binding(op.spec, op.fingerprint, values, cu_seqlens_q if packed else None,
                             cu_seqlens_k if packed else None, read=op.mask_reads)
    if packed:
        B, Hq, d = cu_seqlens_q.shape[0] - 1, q.shape[1], q.shape[2]
        Nq = max_seqlen_q if max_seqlen_q is not None else block_mask.seqlen_q
        Nk = max_seqlen_k if max_seqlen_k is not None else block_mask.seqlen_k
        if Nq is None or Nk is None:
            raise ValueError("block_mask: with cu_seqlens_q, pass max_seqlen_q and max_seqlen_k (the block "
                             "grid counts tiles up to them)")
    else:
        B, Hq, Nq, d = q.shape
        Nk = k.shape[2]
    block_mask.check(B, Hq, Nq, Nk, q.device)
    bq, bk = block_mask.block_size
    fam, bfam, (fr, fc, br, bc, dr, dc) = list_tiles(op, q.device, q.dtype, d, packed, (bq, bk), grad, dropout,
                                                     q.shape[1] != k.shape[1], deterministic)
    used = ((bq, fr), (bk, fc)) + (((bk, br), (bq, bc), (bq, dr), (bk, dc)) if grad or bfam is fam else ())
    if not block_mask.full_kept and any(x % t for x, t in used):
        # A kernel tile that straddled a kept and an empty block could not honour the
        # pattern inside it (the element mask is the spec's); tiles must nest in blocks.
        names = fam.name if bfam is fam else f"{fam.name} forward and {bfam.name} backward"
        raise ValueError(f"block_mask: a pattern's block size {bq} x {bk} must be a multiple of the {names} "
                         f"kernels' tiles at head_dim {d} (forward {fr} x {fc}, backward {bc} x {br} "
                         f"and {dr} x {dc}, queries x keys); block_size=128 fits every default tile")
    out = {"block_kv": block_mask.tile_lists(fr, fc, Nq, Nk),
           "block_meta": [fr, fc, br, bc, dr, dc, int(block_mask.full_kept)]}
    if grad:
        out["block_q"] = block_mask.tile_lists(br, bc, Nq, Nk, transpose=True)
        if bfam.dq_lists:
            out["block_dq"] = block_mask.tile_lists(dr, dc, Nq, Nk)
    return out


def list_tiles(op, device, dtype, d: int, packed: bool, block_size: tuple[int, int], grad: bool, dropout: bool,
               gqa: bool, deterministic: bool) -> tuple[families.Family, families.Family, tuple[int, ...]]:
    """The families of a block-sparse call's forward and (with ``grad``) backward, and the tiles
    their lists are made for: (forward rows, cols, backward rows, cols, dq rows, cols), the
    backward's from the backward's family (dq lists only where it has ``dq_lists``). ``dtype``: a
    torch dtype. May load the libraries (their configs hold the tiles)."""
    ir_dtype = IR_DTYPE[dtype]
    fam = op.choose_family(device, ir_dtype, d, packed, True, dropout).family

    def tiles_of(f):
        return f.block_tiles(
            lambda: dict(op.library(f, device, ir_dtype, d, packed, sparse=True).instantiation.config), block_size)

    fr, fc, br, bc, dr, dc = tiles_of(fam)
    bfam = fam
    if grad:
        bfam = op.choose_family(device, ir_dtype, d, packed, True, dropout, backward=True, gqa=gqa,
                                deterministic=deterministic).family
        if bfam is not fam:
            br, bc, dr, dc = tiles_of(bfam)[2:]
    return fam, bfam, (fr, fc, br, bc, dr, dc)


def auto_blocks(op, fam: families.Family, kind: str, q, k, values, packed: Packed | None) -> Blocks | None:
    """Block lists for a call without a block_mask on a family with a block classifier, at
    the kernels' own tiles (``kind`` 'fwd' or 'bwd'), or None when not used (see
    ``auto_sparse``)."""
    if not fam.block_classifier or not op.auto_sparse or not env.auto_block_mask():
        return None
    B, Hq, _, Nq, Nk, d = dims(q, k, packed)
    if Nq == 0 or Nk == 0:
        return None
    lib = op.library(fam, q.device, IR_DTYPE[q.dtype], d, packed is not None, sparse=True)
    fr, fc, br, bc, dr, dc = fam.block_tiles(lambda: dict(lib.instantiation.config), (0, 0))
    per_b, per_h = op.mask_extents
    block = op.params_block(values)
    cu = {}
    if packed is not None:
        per_b = True
        cu = {"cu_seqlens_q": packed.cu_seqlens_q, "cu_seqlens_k": packed.cu_seqlens_k}
    ext = (B if per_b else 1, Hq if per_h else 1)
    meta = (fr, fc, br, bc, dr, dc, 0 if mask_has_float(op.spec) else 1)  # as flashgen.block_mask
    mask_lib = op.mask_library(fam, q.device)
    if kind == "fwd":
        return Blocks(lists_of(classify(mask_lib, block, *ext, Nq, Nk, fr, fc, q.device, **cu)), None,
                      None, meta)
    qst = classify(mask_lib, block, *ext, Nq, Nk, bc, br, q.device, **cu).transpose(-1, -2)
    dq = lists_of(classify(mask_lib, block, *ext, Nq, Nk, dr, dc, q.device, **cu)) if fam.dq_lists else None
    return Blocks(None, lists_of(qst), dq, meta)
