"""``flashgen.block_mask(op, seqlen_q, seqlen_k, ...)``: the block mask of a spec's own mask
(FlexAttention's ``create_block_mask``), classified by the family's generated classifier kernel
where it has one, else on the CPU by evaluating the mask in chunks of query rows
(flashgen.reference). The mask type itself is flashgen/sparsity.py's ``BlockMask``.
"""

from __future__ import annotations

import numbers

import torch

from ..lang import expr as X
from ..lang import ir
from ..reference import evaluate, positions
from ..sparsity import EMPTY, FULL, PARTIAL, BlockMask, cdiv, check_block_size, mask_extents, mask_has_float, mask_names
from .checks import PARAM_TORCH_DTYPE, as_device, dim_text, eval_dim
from .launch import classify
from .op import AttentionOp
from .op import compile as compile_spec

_CHUNK_ELEMS = 1 << 25  # mask elements evaluated at once


def classifier_library(op: AttentionOp, device: torch.device):
    """The loaded block classifier that ``block_mask`` runs for ``op`` on ``device`` (built at its
    first use), or None where the device's family has none (the CPU: classes on the host)."""
    if device.type == "cpu":
        return None
    fam = op.family_for(device, None, 128, sparse=True).family
    return op.mask_library(fam, device) if fam.block_classifier else None


def block_mask(op, seqlen_q: int, seqlen_k: int, batch: int | None = None, heads: int | None = None, *,
               block_size=128, device=None, cu_seqlens_q: torch.Tensor | None = None,
               cu_seqlens_k: torch.Tensor | None = None, **params) -> BlockMask:
    """The block mask of ``op``'s own mask (FlexAttention's ``create_block_mask``).

    Args:
        op: a ``flashgen.compile``d op (or its spec).
        seqlen_q, seqlen_k: the call's lengths (packed layout: max_seqlen_q / max_seqlen_k).
        batch, heads: the call's batch size and query heads; None: 1 unless a tensor parameter
            has a ``batch`` / ``heads`` dim, whose size is then used. The mask gets a dim of 1
            where the mask does not depend on b / h.
        block_size: an int or (query, key) pair, multiples of 8 (default 128).
        device: where to build it; default the tensor parameters' device, else cpu.
        cu_seqlens_q, cu_seqlens_k: for the packed (varlen) layout: each sequence's blocks are
            classified with its own lengths (its cu_seqlens values are read on the host once).
        **params: the spec's parameters, as the call will pass them (the mask must be built
            with the same values the call uses: a full block skips the element mask); those the
            mask does not read (ALiBi's slopes) may be left out.

    Returns a BlockMask with ``full_kept`` True. On CUDA a generated kernel classifies the blocks
    (cuda/classify.cuh: closed-form key ranges first, then keep() on the blocks they leave open;
    built once per spec, a few seconds); on the CPU the mask is evaluated in chunks of query rows
    (memory O(chunk × seqlen_k), never seqlen_q × seqlen_k at once).

    Raises TypeError / ValueError naming the argument.
    """
    spec = op.spec if isinstance(op, AttentionOp) else op
    if not isinstance(spec, ir.Spec):
        raise TypeError(f"op: expected a flashgen op (flashgen.compile), got {type(op).__name__}")
    if isinstance(block_size, numbers.Integral) and not isinstance(block_size, bool):
        block_size = int(block_size)
    elif isinstance(block_size, tuple | list):
        block_size = tuple(int(x) if isinstance(x, numbers.Integral) and not isinstance(x, bool) else x
                           for x in block_size)
    bq, bk = check_block_size(block_size)

    def as_int(name, v, lo, hi, optional=False):
        if v is None and optional:
            return None
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            raise TypeError(f"{name}: expected an int, got {type(v).__name__}")
        if not lo <= int(v) <= hi:
            raise ValueError(f"{name}: {int(v)} is out of range (expected {lo} <= {name} <= {hi})")
        return int(v)

    seqlen_q = as_int("seqlen_q", seqlen_q, 0, X.MAX_SEQLEN)
    seqlen_k = as_int("seqlen_k", seqlen_k, 0, X.MAX_SEQLEN)
    batch = as_int("batch", batch, 1, 2**31 - 1, optional=True)
    heads = as_int("heads", heads, 1, 2**31 - 1, optional=True)
    tensors = {k: v for k, v in params.items() if isinstance(v, torch.Tensor)}
    if device is None:
        device = next((t.device for t in tensors.values()), torch.device("cpu"))
    device = as_device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: CUDA is not available in this torch build or machine")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device: '{device.type}' is not supported (expected cpu or cuda)")
    inferred = {}  # batch / heads from a tensor parameter's (non-broadcast) dim of that name
    for p in spec.params:
        if p.is_tensor and p.name in tensors:
            for i, d in enumerate(p.shape):
                name = dim_text(d.size)
                if name in ("batch", "heads") and i < tensors[p.name].dim() and \
                        (not d.broadcast or tensors[p.name].shape[i] > 1):
                    inferred[name] = tensors[p.name].shape[i]
    packed = cu_seqlens_q is not None or cu_seqlens_k is not None
    if packed:
        for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name}: expected an int32 tensor [batch + 1], got {type(t).__name__}")
            if t.dtype != torch.int32 or t.dim() != 1 or t.shape[0] < 2:
                raise ValueError(f"{name}: expected an int32 tensor [batch + 1] (at least 2 entries), got "
                                 f"{t.dtype} {tuple(t.shape)}")
        if cu_seqlens_q.shape != cu_seqlens_k.shape:
            raise ValueError("cu_seqlens_k: expected as many entries as cu_seqlens_q")
        cq, ck = (t.to("cpu", torch.int64) for t in (cu_seqlens_q, cu_seqlens_k))
        lens_q, lens_k = (cq[1:] - cq[:-1]).tolist(), (ck[1:] - ck[:-1]).tolist()
        for name, cu, lens, limit, lname in (("cu_seqlens_q", cq, lens_q, seqlen_q, "seqlen_q"),
                                             ("cu_seqlens_k", ck, lens_k, seqlen_k, "seqlen_k")):
            if int(cu[0]) != 0 or min(lens) < 0:
                raise ValueError(f"{name}: expected non-decreasing boundaries starting at 0")
            if max(lens) > limit:
                raise ValueError(f"{lname}: {limit} is less than the longest sequence in {name} ({max(lens)}); pass "
                                 "the call's max_seqlen")
        if batch is not None and batch != len(lens_q):
            raise ValueError(f"batch: {batch}, but cu_seqlens_q holds {len(lens_q)} sequences")
        batch = len(lens_q)
    per_b, per_h = mask_extents(spec)
    for name, v, per in (("batch", batch, per_b), ("heads", heads, per_h)):
        if v is None and per and name not in inferred:
            raise ValueError(f"{name}: the mask of spec '{spec.name}' depends on {'b' if name == 'batch' else 'h'}: "
                             f"pass {name}= (the call's {'batch size' if name == 'batch' else 'query heads'})")
    batch = batch if batch is not None else inferred.get("batch", 1)
    heads = heads if heads is not None else inferred.get("heads", 1)
    if not isinstance(op, AttentionOp):
        op = compile_spec(spec)

    def bound(bm: BlockMask) -> BlockMask:
        bm.bind(spec.fingerprint(), values, cu_seqlens_q if packed else None, cu_seqlens_k if packed else None,
                (per_b or packed, per_h))
        if mask_has_float(spec):
            bm.full_kept = False  # the classifier's rounding may differ from the kernels': keep their mask
        return bm

    dummy_q = torch.empty((batch, heads, 0, 8), device=device)
    sizes = {"batch": batch, "heads": heads, "seqlen_q": seqlen_q, "seqlen_k": seqlen_k}
    values = op.check_params(dummy_q, dummy_q, _score_only_placeholders(spec, params, sizes, device), sizes)
    pvals = {p.name: v for p, v in zip(spec.params, values, strict=True)}
    nqb, nkb = cdiv(seqlen_q, bq), cdiv(seqlen_k, bk)
    if spec.mask is None:
        return bound(BlockMask(torch.full((1, 1, nqb, nkb), FULL, dtype=torch.int8, device=device), (bq, bk),
                               seqlen_q, seqlen_k, full_kept=True,
                               _check_values=False))
    lib = classifier_library(op, device)
    if lib is not None:  # the generated classifier kernel
        block = op.params_block(values)
        cu = {}
        if packed:
            cu = {"cu_seqlens_q": cu_seqlens_q.to(device, torch.int32).contiguous(),
                  "cu_seqlens_k": cu_seqlens_k.to(device, torch.int32).contiguous()}
        st = classify(lib, block, batch if per_b or packed else 1, heads if per_h else 1, seqlen_q, seqlen_k,
                           bq, bk, device, **cu)
        return bound(BlockMask(st, (bq, bk), seqlen_q, seqlen_k, full_kept=True,
                               _check_values=False))
    if not packed:
        st = classify_on_host(spec, pvals, batch, heads, seqlen_q, seqlen_k, bq, bk, device, 0)
        return bound(BlockMask(st, (bq, bk), seqlen_q, seqlen_k, full_kept=True,
                               _check_values=False))
    parts = []
    for b, (lq, lk) in enumerate(zip(lens_q, lens_k, strict=True)):
        st = classify_on_host(spec, pvals, 1, heads, lq, lk, bq, bk, device, b)
        parts.append(torch.nn.functional.pad(st, (0, nkb - st.shape[-1], 0, nqb - st.shape[-2])))
    hmax = max(p.shape[1] for p in parts)
    return bound(BlockMask(torch.cat([p.expand(1, hmax, nqb, nkb) for p in parts]), (bq, bk), seqlen_q, seqlen_k,
                           full_kept=True))


def _score_only_placeholders(spec: ir.Spec, params: dict, sizes: dict, device: torch.device) -> dict:
    """``params`` with a placeholder for each parameter the mask does not read and the caller left
    out (ALiBi's slopes: the blocks do not depend on it, and the mask is not bound to it): 1 for an
    int, 0.0 for a float, zeros of the declared dtype and full shape for a tensor. A parameter
    whose shape cannot be sized here stays missing (check_params then names it)."""
    read = mask_names(spec)
    out, ints = dict(params), dict(sizes)
    for p in spec.params:
        if p.name in out:
            if p.kind == "int" and isinstance(out[p.name], int):
                ints[p.name] = out[p.name]
            continue
        if p.name in read:
            continue
        if p.kind == "int":
            out[p.name] = ints[p.name] = 1
        elif p.kind == "float":
            out[p.name] = 0.0
        else:
            shape = [1 if d.broadcast else eval_dim(d.size, ints) for d in p.shape]
            if all(isinstance(n, int) and n >= 1 for n in shape):
                out[p.name] = torch.zeros(shape, dtype=PARAM_TORCH_DTYPE[p.dtype], device=device)
    return out


def classify_on_host(spec: ir.Spec, params: dict, batch: int, heads: int, nq: int, nk: int, bq: int, bk: int,
              device: torch.device, batch_offset: int) -> torch.Tensor:
    """int8 [B|1, H|1, ⌈nq/bq⌉, ⌈nk/bk⌉] classification of the spec's mask (in-bounds elements
    only: the kernels bound-check the edges themselves), evaluated in chunks of query blocks."""
    nqb, nkb = cdiv(nq, bq), cdiv(nk, bk)
    if nqb == 0 or nkb == 0:
        return torch.zeros((1, 1, nqb, nkb), dtype=torch.int8, device=device)
    rows = bq * max(1, _CHUNK_ELEMS // (batch * heads * nkb * bk * bq))
    out = []
    pos = positions(batch, heads, nq, nk, device, batch_offset)
    for r0 in range(0, nq, rows):
        r1 = min(r0 + rows, nq)
        env = pos | {"q": pos["q"][:, :, r0:r1]}
        m = evaluate(spec.mask, spec, env, params, torch.float32)
        m = torch.broadcast_to(m, torch.broadcast_shapes(m.shape, (1, 1, r1 - r0, nk)))
        B, H = m.shape[:2]
        n_rows = cdiv(r1 - r0, bq)
        pad = (0, nkb * bk - nk, 0, n_rows * bq - (r1 - r0))
        # out-of-bounds elements count neither for "any kept" nor against "all kept"
        anyk = torch.nn.functional.pad(m.to(torch.uint8), pad, value=0).view(B, H, n_rows, bq, nkb, bk)
        allk = torch.nn.functional.pad(m.to(torch.uint8), pad, value=1).view(B, H, n_rows, bq, nkb, bk)
        a = anyk.amax(dim=(3, 5)) > 0
        f = allk.amin(dim=(3, 5)) > 0
        out.append(torch.where(f, FULL, torch.where(a, PARTIAL, EMPTY)).to(torch.int8))
    shapes = {o.shape[:2] for o in out}
    if len(shapes) > 1:
        B, H = max(s[0] for s in shapes), max(s[1] for s in shapes)
        out = [o.expand(B, H, *o.shape[2:]) for o in out]
    return torch.cat(out, dim=2).contiguous()

