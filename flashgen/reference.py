"""Reference attention in plain PyTorch, from the same IR as the kernels.

Call semantics match the compiled op (``flashgen.compile(spec)(q, k, v, ...)``). It computes in
the dtype of its inputs: pass ``.double()`` tensors for the float64 oracle; with fp16/bf16
inputs it emulates the kernels' precision (scores and softmax in fp32, P cast to the input
dtype before the P·V product, fp32 accumulation), which is what test tolerances are set from.
It materialises the Nq×Nk score matrix: for checking, not for speed.
"""

from __future__ import annotations

import itertools
import math
import operator

import torch

from . import philox
from .lang import expr as X
from .lang import ir
from .lang.frontend import evaluate_scale, parse
from .sparsity import BlockMask


def evaluate(e: ir.Expr, spec: ir.Spec, env: dict, params: dict, fdtype: torch.dtype, *,
             check_bounds: bool = True, live: torch.Tensor | None = None) -> torch.Tensor:
    """Evaluate a mask or score expression in PyTorch, broadcasting over [B, H, Nq, Nk].

    ``env`` holds the position tensors (b, h, q, kv as broadcastable int64 aranges), seqlen_q,
    seqlen_k and, for score expressions, ``score``; ``params`` the call's parameters. Semantics
    as flashgen/lang/expr.py states (floor division and modulo on ints; an index outside a tensor
    parameter raises IndexError naming it, where the kernels would clamp; with ``check_bounds``
    False — inside traced code such as FlexAttention's mods — indices are clamped like the
    kernels do).

    ``live``: None, or a bool tensor broadcastable to the result, False where the value will not
    be used (keys the mask removes). Where an element is not live, and in the branch of a
    ``where`` that does not select it, sqrt, log and exp get 1, 1 and 0 and a divisor gets 1
    instead of their operands ("double where"), so their values and derivatives stay finite
    there: the selections that drop those elements then pass gradients of 0, never 0 · inf or
    0 · NaN. The values where elements are live, in selected branches, are unchanged.
    """
    decl = {p.name: p for p in spec.params}
    scope = X.Scope(decl, allow_score=True)
    dev = env["q"].device if isinstance(env["q"], torch.Tensor) else None
    # Values are Python numbers while they can be (constants, sizes, scalar parameters) and
    # tensors otherwise, so traced code (FlexAttention's mods) sees no tensor constants.
    is_t = lambda x: isinstance(x, torch.Tensor)  # noqa: E731
    fns_t = {"abs": torch.abs, "exp": torch.exp, "log": torch.log, "tanh": torch.tanh, "sqrt": torch.sqrt,
             "sign": torch.sign}

    safe_input = {"sqrt": 1.0, "log": 1.0, "exp": 0.0}

    def guard(x, live, safe: float):
        """x where ``live``, ``safe`` elsewhere (a tensor x of a float dtype only)."""
        if live is None or not is_t(x) or not x.is_floating_point():
            return x
        return torch.where(live, x, safe)

    def narrow(live, c):
        """The live elements of the branch a tensor condition ``c`` selects (None: all)."""
        return c if live is None else live & c

    def to_float(x):
        if is_t(x):
            return x.to(fdtype) if not x.is_floating_point() or x.dtype != fdtype else x
        return float(x)

    def ev(n: ir.Expr, live=None):
        t = X.type_of(n, scope)
        if isinstance(n, ir.Num):
            return float(n.value) if t == X.FLOAT else int(n.value)
        if isinstance(n, ir.Name):
            if n.id in X.CONSTANTS:
                return X.CONSTANTS[n.id]
            if n.id in env:
                return env[n.id]
            value = params[n.id]
            return float(value) if t == X.FLOAT else int(value)
        if isinstance(n, ir.Index):
            p = decl[n.base.id]
            tensor = params[p.name]
            idx = []
            for d, i in enumerate(n.indices):
                iv = ev(i, live)
                size = tensor.shape[d]
                if size == 1 and p.shape[d].broadcast:
                    iv = 0
                elif not check_bounds:
                    iv = iv.clamp(0, size - 1) if is_t(iv) else min(max(iv, 0), size - 1)
                else:
                    lo, hi = (int(iv.min()), int(iv.max())) if is_t(iv) and iv.numel() else (iv, iv)
                    if not is_t(iv) or iv.numel():
                        if lo < 0 or hi >= size:
                            raise IndexError(f"{p.name}: index {d} of {p.name}[...] reaches {lo if lo < 0 else hi}, "
                                             f"outside [0, {size}) (the kernels clamp such indices)")
                idx.append(iv.to(tensor.device) if is_t(iv) else iv)
            tensors = [i for i in idx if is_t(i)]
            if len(tensors) > 1:
                shaped = iter(torch.broadcast_tensors(*tensors))
                idx = [next(shaped) if is_t(i) else i for i in idx]
            out = tensor[tuple(idx)]
            if t == X.FLOAT:
                return out.to(fdtype)
            return out.to(torch.int64) if t == X.INT else out.to(torch.bool)
        if isinstance(n, ir.Unary):
            x = ev(n.operand, live)
            if n.op == "not":
                return torch.logical_not(x) if is_t(x) else not x
            return -x
        if isinstance(n, ir.BinOp):
            a, b = ev(n.lhs, live), ev(n.rhs, live)
            if n.op in ("and", "or"):
                if not is_t(a) and not is_t(b):
                    return (a and b) if n.op == "and" else (a or b)
                return (a & b) if n.op == "and" else (a | b)
            if t == X.FLOAT or n.op == "/":
                a, b = to_float(a), to_float(b)
            if n.op in ("//", "%"):
                if t == X.INT:  # x // 0 and x % 0 are 0 (what the kernels compute)
                    if not is_t(a) and not is_t(b):
                        return 0 if b == 0 else (a // b if n.op == "//" else a % b)
                    a, b = (x if is_t(x) else torch.as_tensor(x, device=dev) for x in (a, b))
                    zero = b == 0
                    safe = torch.where(zero, torch.ones_like(b), b)
                    r = torch.div(a, safe, rounding_mode="floor") if n.op == "//" else torch.remainder(a, safe)
                    return torch.where(zero, torch.zeros_like(r), r)
                if not is_t(a) and not is_t(b):  # float floor division: IEEE (±inf, nan by 0)
                    return math.floor(a / b) if b else (math.copysign(math.inf, a) if a else math.nan)
                return torch.floor(a / guard(b, live, 1.0))
            if n.op == "/" and not is_t(a) and not is_t(b) and b == 0:  # IEEE, as the kernels: ±inf, nan
                return math.copysign(math.inf, a) * math.copysign(1.0, b) if a and a == a else math.nan
            if n.op == "/":
                b = guard(b, live, 1.0)
            ops = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv,
                   "<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge,
                   "==": operator.eq, "!=": operator.ne}
            return ops[n.op](a, b)
        if isinstance(n, ir.Call):
            if n.fn == "where":  # each branch is live only where the condition selects it
                c = ev(n.args[0], live)
                if is_t(c) and live is not None:
                    branches = (ev(n.args[1], narrow(live, c)), ev(n.args[2], narrow(live, ~c)))
                else:
                    branches = (ev(n.args[1], live), ev(n.args[2], live))
                args = [c, *branches]
            else:
                args = [ev(x, live) for x in n.args]
            if t == X.FLOAT:
                args = [to_float(x) if not (is_t(x) and x.dtype == torch.bool) and not isinstance(x, bool) else x
                        for x in args]
            if n.fn == "where":
                c, a, b = args
                if not is_t(c):
                    return a if c else b
                return torch.where(c, a, b)
            if n.fn in ("min", "max"):
                a, b = args
                if not is_t(a) and not is_t(b):
                    return min(a, b) if n.fn == "min" else max(a, b)
                if not is_t(a) or not is_t(b):
                    tensor, scalar = (a, b) if is_t(a) else (b, a)
                    return tensor.clamp(max=scalar) if n.fn == "min" else tensor.clamp(min=scalar)
                return torch.minimum(a, b) if n.fn == "min" else torch.maximum(a, b)
            (x,) = args
            if not is_t(x):  # IEEE results (inf, nan) like the kernels, not Python's exceptions
                return float(fns_t[n.fn](torch.tensor(float(x), dtype=torch.float64))) if t == X.FLOAT else \
                    {"abs": abs, "sign": lambda v: (v > 0) - (v < 0)}[n.fn](x)
            if n.fn in safe_input:
                x = guard(x, live, safe_input[n.fn])
            return fns_t[n.fn](x)
        raise AssertionError(n)

    out = ev(e, live)
    if not is_t(out):
        t = X.type_of(e, scope)
        out = torch.tensor(out, dtype=fdtype if t == X.FLOAT else torch.int64 if t == X.INT else torch.bool,
                           device=dev)
    return out


def positions(batch: int, heads: int, seqlen_q: int, seqlen_k: int, device=None, batch_offset: int = 0) -> dict:
    """The names every expression sees, as broadcastable int64 tensors over [B, H, Nq, Nk]
    (``b`` counting from ``batch_offset``: one sequence of a packed batch is batch element b)."""
    ar = lambda n: torch.arange(n, dtype=torch.int64, device=device)  # noqa: E731
    return {"b": (ar(batch) + batch_offset).view(-1, 1, 1, 1), "h": ar(heads).view(1, -1, 1, 1),
            "q": ar(seqlen_q).view(1, 1, -1, 1), "kv": ar(seqlen_k).view(1, 1, 1, -1),
            "seqlen_q": seqlen_q, "seqlen_k": seqlen_k}


def check_reads(spec: ir.Spec, batch: int, heads: int, seqlen_q: int, seqlen_k: int, **params) -> None:
    """Raise IndexError (as ``attention`` would) when the mask or score expression reads a tensor
    parameter outside its shape somewhere on the [batch, heads, seqlen_q, seqlen_k] grid. Only the
    reads are evaluated, each over the positions it depends on, so this costs far less than the
    attention: what ``flashgen run`` checks before a kernel is built for random parameters."""
    env = positions(batch, heads, seqlen_q, seqlen_k, params_device(params)) | {"score": 0.0}
    for e in (spec.mask, spec.score):
        if e is None:
            continue
        for n in X.walk(e):
            if isinstance(n, ir.Index):
                evaluate(n, spec, env, params, torch.float32)


def params_device(params: dict):
    """The device of the first tensor among ``params`` (None without one)."""
    return next((x.device for x in params.values() if isinstance(x, torch.Tensor)), None)


def keep_mask(spec: ir.Spec, seqlen_q: int, seqlen_k: int, device=None, *, batch: int = 1, heads: int = 1,
              **params) -> torch.Tensor | None:
    """Bool [batch, heads, seqlen_q, seqlen_k] (dims the mask does not use are 1): True where
    query i may see key j in (batch b, query head h); None when the spec has no mask."""
    return _keep_mask(spec, seqlen_q, seqlen_k, device, batch, heads, params)


def _keep_mask(spec: ir.Spec, seqlen_q: int, seqlen_k: int, device, batch: int, heads: int, params: dict,
               batch_offset: int = 0) -> torch.Tensor | None:
    if spec.mask is None:
        return None
    env = positions(batch, heads, seqlen_q, seqlen_k, device, batch_offset)
    m = evaluate(spec.mask, spec, env, params, torch.float64)
    return torch.broadcast_to(m, torch.broadcast_shapes(m.shape, (1, 1, seqlen_q, seqlen_k)))


def default_scale(spec: ir.Spec, head_dim: int) -> float:
    """The spec's softmax scale for ``head_dim`` (1/sqrt(head_dim) unless the spec sets one)."""
    return 1.0 / math.sqrt(head_dim) if spec.scale is None else evaluate_scale(spec.scale, head_dim)


def attention(spec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None,
              return_lse: bool = False, lowp_matmuls: bool = False, dropout_p: float = 0.0,
              dropout_seed: int | None = None, dropout_offset: int = 0, cu_seqlens_q: torch.Tensor | None = None,
              cu_seqlens_k: torch.Tensor | None = None, max_seqlen_q: int | None = None,
              max_seqlen_k: int | None = None, block_mask=None, **params):
    """Exact attention of ``spec`` (an ``ir.Spec``, spec text, a path or a compiled op).

    Args:
        q: [B, Hq, Nq, d]; k, v: [B, Hkv, Nk, d] with Hq a multiple of Hkv (GQA: query head h
           reads kv head h // (Hq // Hkv)). Any floating dtype, any device.
        scale: softmax scale; default the spec's (1/sqrt(d) unless the spec sets one).
        return_lse: also return the log-sum-exp (natural log, fp32 or float64, [B, Hq, Nq]).
        lowp_matmuls: with fp16/bf16 inputs, run the two products (and so their gradients) in
           the input dtype, as FlashAttention's own test reference does; softmax stays fp32.
        dropout_p, dropout_seed, dropout_offset: dropout on the probabilities, P̃ = P ∘ keep / (1 − p)
           (the paper's fused dropout; the LSE is that of P), with the keep mask regenerated
           exactly from the Philox4x32-10 stream keyed by (seed, offset, b, h, q, kv) that the
           kernels use (flashgen/philox.py); dropout_seed is required when dropout_p > 0.
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k: the packed (varlen) layout, as
           the op takes it: q [total_q, Hq, d], k, v [total_k, Hkv, d] and int tensors
           [batch + 1] of sequence boundaries (both or neither). Each sequence b is computed on
           its own, as batch element b of lengths cu_seqlens_*[b + 1] − cu_seqlens_*[b]
           (positions from its start, its own seqlen_q / seqlen_k, the dropout mask keyed by b);
           max_seqlen_q / max_seqlen_k are accepted for symmetry with the op and only checked
           against the lengths.
        block_mask: a ``flashgen.BlockMask``: an element is kept only if its block is non-empty
           (and the spec keeps it), as the kernels' block lists decide (packed layout: sequence
           b's blocks count from its start).
        **params: the spec's parameters (tensors on q's device, any float dtype for float
           tensors: pass float64 ones with requires_grad for gradients to them).

    Returns:
        out [B, Hq, Nq, d] in q's dtype, or (out, lse). Rows that see no key: out 0, lse -inf.
        Packed layout: out [total_q, Hq, d], lse [Hq, total_q].

    Raises:
        ValueError: Hq not a multiple of Hkv; an inconsistent packed layout (naming the
           argument); dropout_p > 0 without dropout_seed; a chunked(n) chunk size n < 1.
        IndexError: the spec reads a tensor parameter outside its shape.
    """
    spec = _as_spec(spec)
    X.check_positive(spec, params)
    if cu_seqlens_q is None and cu_seqlens_k is None:
        for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
            if value is not None:
                raise ValueError(f"{name}: given without cu_seqlens_q and cu_seqlens_k")
        blk = _block_keep(block_mask, None, q.shape[2], k.shape[2], q.device)
        out, lse = _attention(spec, q, k, v, scale, lowp_matmuls, dropout_p, dropout_seed, dropout_offset, params,
                              block_keep=blk)
        return (out, lse) if return_lse else out
    cq, ck = _cu_seqlens(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    Hq = q.shape[1]
    outs, lses = [], []
    for b in range(len(cq) - 1):
        if cq[b + 1] == cq[b]:
            continue
        qs, ks, vs = (t[cu[b]:cu[b + 1]].transpose(0, 1).unsqueeze(0) for t, cu in ((q, cq), (k, ck), (v, ck)))
        blk = _block_keep(block_mask, b, qs.shape[2], ks.shape[2], q.device)
        o, lse = _attention(spec, qs, ks, vs, scale, lowp_matmuls, dropout_p, dropout_seed, dropout_offset, params,
                            batch_offset=b, block_keep=blk)
        outs.append(o[0].transpose(0, 1))
        lses.append(lse[0])
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    if outs:
        out, lse = torch.cat(outs, 0), torch.cat(lses, 1)
    else:  # no sequence has a query: empty results, still attached to the inputs (zero gradients)
        tie = sum((t.sum() * 0 for t in (q, k, v) if t.is_floating_point()), q.new_zeros(()))
        out = q.new_zeros(q.shape) + tie
        lse = torch.zeros((Hq, 0), dtype=acc, device=q.device) + tie.to(acc)
    return (out, lse) if return_lse else out


def _cu_seqlens(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> tuple[list[int], list[int]]:
    """The packed layout's boundaries as lists, checked against q and k (ValueError naming the
    argument)."""
    for name, t in (("q", q), ("k", k)):
        if t.dim() != 3:
            raise ValueError(f"{name}: expected 3 dims [total, heads, head_dim] in the packed layout, "
                             f"got shape {tuple(t.shape)}")
    out = []
    for name, cu, total, mname, given in (("cu_seqlens_q", cu_seqlens_q, q.shape[0], "max_seqlen_q", max_seqlen_q),
                                          ("cu_seqlens_k", cu_seqlens_k, k.shape[0], "max_seqlen_k", max_seqlen_k)):
        if cu is None:
            raise ValueError(f"{name}: required in the packed layout (pass cu_seqlens_q and cu_seqlens_k)")
        vals = [int(x) for x in (cu.tolist() if isinstance(cu, torch.Tensor) else cu)]
        lengths = [b - a for a, b in itertools.pairwise(vals)]
        if len(vals) < 2 or vals[0] != 0 or vals[-1] != total or min(lengths) < 0:
            raise ValueError(f"{name}: expected [batch + 1] non-decreasing boundaries from 0 to {total}, got {vals}")
        if given is not None and given < max(lengths):
            raise ValueError(f"{mname}: {given} is less than the longest sequence ({max(lengths)})")
        out.append(vals)
    if len(out[0]) != len(out[1]):
        raise ValueError(f"cu_seqlens_k: {len(out[1])} entries but cu_seqlens_q has {len(out[0])}")
    return out[0], out[1]


def _block_keep(block_mask, b: int | None, nq: int, nk: int, device) -> torch.Tensor | None:
    """Bool [B|1, H|1, nq, nk]: the elements of non-empty blocks (None without a block mask);
    ``b``: in the packed layout, the sequence (its row of the mask); None: the padded batch."""
    if block_mask is None:
        return None
    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask: expected a flashgen.BlockMask, got {type(block_mask).__name__}")
    bq, bk = block_mask.block_size
    need = (-(-nq // bq), -(-nk // bk))
    have = block_mask.shape[2:]
    if (have != need) if b is None else (have[0] < need[0] or have[1] < need[1]):
        raise ValueError(f"block_mask: {have[0]} x {have[1]} blocks of {bq} x {bk} do not cover seqlen_q = {nq}, "
                         f"seqlen_k = {nk} ({need[0]} x {need[1]})")
    st = block_mask.to_dense().to(device) != 0
    if b is not None and st.shape[0] > 1:
        st = st[b:b + 1]
    return st.repeat_interleave(bq, dim=2)[:, :, :nq].repeat_interleave(bk, dim=3)[..., :nk]


def _attention(spec: ir.Spec, q, k, v, scale, lowp_matmuls, dropout_p, dropout_seed, dropout_offset, params,
               batch_offset: int = 0, block_keep: torch.Tensor | None = None):
    """(out, lse) of the padded layout; ``batch_offset``: the index of q's first batch element
    (positions, parameters and the dropout mask see b + batch_offset)."""
    B, Hq, Nq, d = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    if (Hkv == 0 and Hq != 0) or (Hkv != 0 and Hq % Hkv):
        raise ValueError(f"k: {Hkv} kv heads do not divide {Hq} query heads")
    if Hq == 0:  # no heads: empty out and lse, as the op returns them
        return q.new_zeros((B, 0, Nq, v.shape[-1])), q.new_zeros((B, 0, Nq), dtype=torch.float64 if q.dtype ==
                                                                   torch.float64 else torch.float32)
    if Hkv != Hq:
        k = k.repeat_interleave(Hq // Hkv, dim=1)
        v = v.repeat_interleave(Hq // Hkv, dim=1)
    scale = default_scale(spec, d) if scale is None else scale
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    mm = q.dtype if lowp_matmuls else acc
    s = torch.matmul(q.to(mm), k.to(mm).transpose(-1, -2)).to(acc)
    if q.dtype != acc:  # the kernels' dQ = dS·K and dK = dSᵀ·Q take dS in the input dtype
        s = _RoundGrad.apply(s, q.dtype)
    s = s * scale
    env = positions(B, Hq, Nq, Nk, q.device, batch_offset)
    keep = _keep_mask(spec, Nq, Nk, q.device, B, Hq, params, batch_offset)
    if keep is None:
        keep = torch.ones(1, 1, Nq, Nk, dtype=torch.bool, device=q.device)
    if block_keep is not None:
        keep = keep & block_keep
    if spec.score is not None:  # safe operands where the mask removes the key (evaluate's ``live``), so
        # a score expression non-finite there (sqrt(q - kv) above the diagonal) leaves no NaN gradient
        s = evaluate(spec.score, spec, env | {"score": s}, params, acc, live=keep).to(acc).expand(s.shape)
    # A score of −inf (a score expression can make one) counts as masked, as in the kernels.
    keep = keep.expand(s.shape) & ~torch.isneginf(s).detach()
    # Masking by selection ("double where") and a max-subtracted softmax: rows with no visible key
    # get LSE −inf and P = 0, values *and* autograd gradients stay finite there, and rows whose
    # scores are all huge (|s| ~ 1e30) keep their exact probabilities.
    row_any = keep.any(-1)
    s = torch.where(keep, s, float("-inf"))
    row_max = s.amax(-1) if s.shape[-1] else torch.zeros(s.shape[:-1], dtype=s.dtype, device=s.device)
    m = torch.where(row_any, row_max, torch.zeros_like(row_max)).detach()
    e = torch.where(keep, torch.exp(s - m.unsqueeze(-1)), torch.zeros_like(s))
    total = e.sum(-1)
    safe_total = torch.where(row_any, total, torch.ones_like(total))
    lse = torch.where(row_any, m + torch.log(safe_total), float("-inf"))
    p = e / safe_total.unsqueeze(-1)
    if dropout_p:
        if dropout_seed is None:
            raise ValueError("dropout_seed: the reference needs the seed (and offset) the kernel used")
        kept = _dropout_keep(dropout_seed, dropout_offset, B, Hq, Nq, Nk, dropout_p, q.device, batch_offset)
        p = torch.where(kept, p / (1.0 - dropout_p), torch.zeros_like(p))
    out = torch.matmul(p.to(q.dtype).to(mm), v.to(mm)).to(q.dtype)
    return out, lse


def _dropout_keep(seed: int, offset: int, batch: int, heads: int, seqlen_q: int, seqlen_k: int, dropout_p: float,
                  device, batch_offset: int = 0) -> torch.Tensor:
    """flashgen.philox.keep_mask for batch elements batch_offset .. batch_offset + batch - 1."""
    return philox.keep_mask(seed, offset, batch, heads, seqlen_q, seqlen_k, dropout_p, device, batch_offset)


class _RoundGrad(torch.autograd.Function):
    """Identity forward; rounds the incoming gradient to ``dtype`` (a low-precision matmul input)."""

    @staticmethod
    def forward(ctx, x, dtype):
        ctx.dtype = dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g.to(ctx.dtype).to(g.dtype), None


def _as_spec(spec) -> ir.Spec:
    if isinstance(spec, ir.Spec):
        return spec
    if hasattr(spec, "spec") and isinstance(spec.spec, ir.Spec):
        return spec.spec
    return parse(spec)


def visible_pairs(spec: ir.Spec, seqlen_q: int, seqlen_k: int, *, batch: int = 1, heads: int = 1,
                  **params) -> float:
    """Kept (query, key) pairs per (batch, head), averaged over them: the FLOP count's basis."""
    kind = spec.mask_kind
    device = next((x.device for x in params.values() if isinstance(x, torch.Tensor)), None)
    if kind in (ir.MaskKind.CAUSAL, ir.MaskKind.CAUSAL_TOP_LEFT):  # closed form, no N×N mask
        i = torch.arange(seqlen_q, dtype=torch.int64)
        last = i + (seqlen_k - seqlen_q) if kind is ir.MaskKind.CAUSAL else i
        return int((last + 1).clamp(0, seqlen_k).sum())
    keep = keep_mask(spec, seqlen_q, seqlen_k, device, batch=batch, heads=heads, **params)
    if keep is None:
        return seqlen_q * seqlen_k
    return float(keep.sum()) / (keep.shape[0] * keep.shape[1])
