"""Closed-form key ranges of a query tile: which keys a mask can keep for each query row,
as symbolic bounds (``RowBound``, ``SwitchBound``, ``JoinBound`` over q, seqlen_q, seqlen_k and
the spec's parameters) that codegen prints as C++ (the kernels skip key tiles outside them) and
explain evaluates over every row (flashgen/explain/geometry.py); ``monotonicity`` and
``linear_in_kv`` decide when a mask has such a range.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass

from . import expr as X
from . import ir

class Mono(enum.Enum):
    CONST = 0
    INC = 1
    DEC = 2


def _combine(a, b):
    if a is None or b is None:
        return None
    if a is Mono.CONST:
        return b
    if b is Mono.CONST or a is b:
        return a
    return None


def _flip(m):
    return {Mono.INC: Mono.DEC, Mono.DEC: Mono.INC}.get(m, m)


def monotonicity(e: ir.Expr, positive: frozenset[str] = frozenset()) -> Mono | None:
    """How ``e`` (free of kv) varies with q: CONST, INC (non-decreasing), DEC, or None.
    ``positive``: int parameters known to be ≥ 1 (checked at call time), which multiply and
    floor-divide like a positive literal."""
    mono = lambda x: monotonicity(x, positive)  # noqa: E731
    is_pos = lambda x: (isinstance(x, ir.Num) and x.value > 0) or (isinstance(x, ir.Name) and x.id in positive)  # noqa: E731
    if isinstance(e, ir.Num):
        return Mono.CONST
    if isinstance(e, ir.Name):
        return Mono.INC if e.id == "q" else Mono.CONST
    if isinstance(e, ir.Index):
        return Mono.CONST if all(mono(i) is Mono.CONST for i in e.indices) else None
    if isinstance(e, ir.Unary):
        return _flip(mono(e.operand)) if e.op == "-" else None
    if isinstance(e, ir.BinOp):
        a, b = mono(e.lhs), mono(e.rhs)
        if e.op == "+":
            return _combine(a, b)
        if e.op == "-":
            return _combine(a, _flip(b))
        if a is Mono.CONST and b is Mono.CONST:
            return Mono.CONST
        if e.op == "*":
            for m, other in ((a, e.rhs), (b, e.lhs)):
                if is_pos(other):
                    return m
                if isinstance(other, ir.Num):
                    return _flip(m) if other.value < 0 else Mono.CONST
            return None
        if e.op == "//" and is_pos(e.rhs):
            return a
        return None
    if isinstance(e, ir.Call):
        ms = [mono(x) for x in e.args]
        if all(m is Mono.CONST for m in ms):
            return Mono.CONST
        if e.fn in ("min", "max"):
            return _combine(ms[0], ms[1])
        return None
    return None


def linear_in_kv(e: ir.Expr):
    """(c, rest) with e == c·kv + rest and rest free of kv (rest None means 0), or None."""
    if not X.uses(e, "kv"):
        return 0, e
    if isinstance(e, ir.Name) and e.id == "kv":
        return 1, None
    if isinstance(e, ir.Unary) and e.op == "-":
        r = linear_in_kv(e.operand)
        return None if r is None else (-r[0], X.negate(r[1]))
    if isinstance(e, ir.BinOp) and e.op in "+-":
        a, b = linear_in_kv(e.lhs), linear_in_kv(e.rhs)
        if a is None or b is None:
            return None
        if e.op == "+":
            return a[0] + b[0], (ir.BinOp("+", a[1], b[1]) if a[1] and b[1] else a[1] or b[1])
        rb = X.negate(b[1])
        return a[0] - b[0], (ir.BinOp("-", a[1], b[1]) if a[1] and b[1] else a[1] or rb)
    if isinstance(e, ir.BinOp) and e.op == "*":
        for lin, k in ((e.lhs, e.rhs), (e.rhs, e.lhs)):
            if isinstance(k, ir.Num) and isinstance(k.value, int):
                r = linear_in_kv(lin)
                if r is not None:
                    return r[0] * k.value, (ir.BinOp("*", r[1], k) if r[1] else None)
    return None


_FLIP_CMP = {"<": ">", "<=": ">=", ">": "<", ">=": "<=", "==": "==", "!=": "!="}
_NEG_CMP = {"<": ">=", "<=": ">", ">": "<=", ">=": "<", "==": "!=", "!=": "=="}


@dataclass(frozen=True)
class RowBound:
    """The key bound ``f + offset`` of one query row: ``f`` an int expression free of kv (over
    q, seqlen_q, seqlen_k, b, h and parameters) that varies with q as ``mono``."""

    f: ir.Expr
    offset: int
    mono: Mono


@dataclass(frozen=True)
class SwitchBound:
    """``seqlen_k`` where ``cond`` holds, else 0 (``cond`` free of q and kv: a whole row, or a
    whole (batch, head), is kept or not)."""

    cond: ir.Expr


@dataclass(frozen=True)
class JoinBound:
    """The ``op`` ('max' or 'min') of two bounds (an intersection or a union of key ranges)."""

    op: str
    a: Bound
    b: Bound


Bound = RowBound | SwitchBound | JoinBound


def bound_expr(bound: Bound) -> ir.Expr:
    """The bound as an int expression tree for one query row (``q`` the row), to evaluate with
    flashgen.reference.evaluate: max/min for joins, where(cond, seqlen_k, 0) for a switch."""
    if isinstance(bound, RowBound):
        return bound.f if not bound.offset else ir.BinOp("+", bound.f, ir.Num(bound.offset))
    if isinstance(bound, SwitchBound):
        return ir.Call("where", (bound.cond, ir.Name("seqlen_k"), ir.Num(0)))
    return ir.Call(bound.op, (bound_expr(bound.a), bound_expr(bound.b)))


def fold_tile_bound(bound: Bound, side: str, row, switch, join):
    """``bound`` over a query tile [q_lo, q_hi), folded: with ``side`` 'lo' a value at most the
    bound of every row of the tile, with 'hi' at least it (each row bound taken at the tile end
    where its monotonicity puts the extreme; joins of extremes bound the extreme of a join, so
    the result is sound for the tile). ``row(f, offset, end)`` gives a RowBound's value, f taken
    at the tile row ``end`` ('first': q_lo, 'last': q_hi - 1); ``switch(cond)`` a SwitchBound's;
    ``join(op, a, b)`` a JoinBound's from its two folded sides. The one rule for both users:
    ``tile_bound_cxx`` prints it as C++ (the kernels' kv_lo / kv_hi hooks) and the CPU family
    evaluates it for its tile choice (flashgen/families/cpu_tiles.py)."""

    def go(b: Bound):
        if isinstance(b, RowBound):
            # the tile's smallest value of f sits at q_lo when f increases with q, at q_hi - 1 when
            # it decreases; its largest at the other end
            if side == "lo":
                end = "last" if b.mono is Mono.DEC else "first"
            else:
                end = "first" if b.mono is Mono.DEC else "last"
            return row(b.f, b.offset, end)
        if isinstance(b, SwitchBound):
            return switch(b.cond)
        return join(b.op, go(b.a), go(b.b))

    return go(bound)


def tile_bound_cxx(spec: ir.Spec, bound: Bound, side: str) -> str:
    """C++ (fg_int) of ``bound`` over the query tile [q_lo, q_hi) on ``side`` ('lo' or 'hi'), as
    ``fold_tile_bound`` folds it."""
    at = {"first": X.Cxx(spec, {"q": "(fg_int)q_lo"}), "last": X.Cxx(spec, {"q": "((fg_int)q_hi - 1)"})}

    def row(f: ir.Expr, offset: int, end: str) -> str:
        code = at[end](f)
        return f"({code} + {offset})" if offset else code

    return fold_tile_bound(bound, side, row, lambda cond: f"({X.Cxx(spec)(cond)} ? (fg_int)seqlen_k : (fg_int)0)",
                           lambda op, a, b: f"fg_{op}i({a}, {b})")


@dataclass(frozen=True)
class KeyRange:
    """The mask's key range in closed form: for query row q the kept keys lie in [lo(q), hi(q))
    ∩ [0, seqlen_k) (``lo`` / ``hi`` are Bound trees, None: unbounded on that side, i.e. 0 /
    seqlen_k); ``full`` is C++ that is true only if every (q, kv) of the tile
    [q_lo,q_hi)×[kv_lo,kv_hi) is kept (fg_int arithmetic). ``exact``: the kept keys of a row are
    exactly [lo(q), hi(q)) ∩ [0, seqlen_k) — the mask keeps an interval of keys per row (causal,
    windows, chunks, prefix-LM, key padding), so kernels may test the two bounds instead of
    evaluating the mask per element, and explain counts from them. Not ``exact`` means no closed
    form: the bounds, where given, are still sound (no kept key outside them)."""

    lo: Bound | None
    hi: Bound | None
    full: str
    exact: bool = False

    def row_lo(self) -> ir.Expr | None:
        """The lower bound (inclusive) of row q as an expression tree (None: 0)."""
        return None if self.lo is None else bound_expr(self.lo)

    def row_hi(self) -> ir.Expr | None:
        """The upper bound (exclusive) of row q as an expression tree (None: seqlen_k)."""
        return None if self.hi is None else bound_expr(self.hi)


_UNBOUNDED = KeyRange(None, None, "false")


def _and(a: KeyRange, b: KeyRange) -> KeyRange:
    lo = a.lo if b.lo is None else b.lo if a.lo is None else JoinBound("max", a.lo, b.lo)
    hi = a.hi if b.hi is None else b.hi if a.hi is None else JoinBound("min", a.hi, b.hi)
    full = "false" if "false" in (a.full, b.full) else f"({a.full} && {b.full})"
    return KeyRange(lo, hi, full, a.exact and b.exact)  # intervals intersect into an interval


def _or(a: KeyRange, b: KeyRange) -> KeyRange:
    lo = None if a.lo is None or b.lo is None else JoinBound("min", a.lo, b.lo)
    hi = None if a.hi is None or b.hi is None else JoinBound("max", a.hi, b.hi)
    full = a.full if b.full == "false" else b.full if a.full == "false" else f"({a.full} || {b.full})"
    # A union of intervals is the interval [min lo, max hi) when both start at 0 or both end
    # at seqlen_k (each may be empty); otherwise there may be a gap.
    exact = a.exact and b.exact and ((a.lo is None and b.lo is None) or (a.hi is None and b.hi is None))
    return KeyRange(lo, hi, full, exact)


def key_range(spec: ir.Spec) -> KeyRange:
    """Closed-form key range and full-tile test of the spec's mask, by interval reasoning over
    its and/or/not structure: comparisons linear in kv (coefficient ±1) against an integer
    expression monotone in q bound the range; comparisons free of q and kv (parameters indexed
    by b, h) switch the whole tile on or off; anything else keeps every key (the per-element
    mask still decides). Sound by construction: no kept key ever lies outside [lo, hi).
    Monotonicity trusts ``spec.positive`` (int parameters checked ≥ 1 at call time)."""
    if spec.mask is None:
        return KeyRange(None, None, "true", True)
    at_hi = X.Cxx(spec, {"q": "((fg_int)q_hi - 1)"})
    at_lo = X.Cxx(spec, {"q": "(fg_int)q_lo"})
    plain = X.Cxx(spec)
    positive = frozenset(spec.positive)

    def atom_without_kv(e: ir.Expr) -> KeyRange:
        if X.uses(e, "q"):
            return _UNBOUNDED
        return KeyRange(None, SwitchBound(e), plain(e), True)

    def go(e: ir.Expr, negate: bool) -> KeyRange:
        if isinstance(e, ir.Unary) and e.op == "not":
            return go(e.operand, not negate)
        if isinstance(e, ir.BinOp) and e.op in ("and", "or"):
            a, b = go(e.lhs, negate), go(e.rhs, negate)
            return _and(a, b) if (e.op == "and") != negate else _or(a, b)
        if not X.uses(e, "kv"):
            return atom_without_kv(ir.Unary("not", e) if negate else e)
        if not (isinstance(e, ir.BinOp) and e.op in _FLIP_CMP):
            return _UNBOUNDED
        if X.type_of(e.lhs, plain.scope) != X.INT or X.type_of(e.rhs, plain.scope) != X.INT:
            return _UNBOUNDED
        op = _NEG_CMP[e.op] if negate else e.op
        lhs, rhs = linear_in_kv(e.lhs), linear_in_kv(e.rhs)
        if lhs is None or rhs is None:
            return _UNBOUNDED
        c = lhs[0] - rhs[0]
        # c·kv op rest_r − rest_l
        f = rhs[1] if lhs[1] is None else (ir.BinOp("-", rhs[1], lhs[1]) if rhs[1] else X.negate(lhs[1]))
        f = f or ir.Num(0)
        if c == -1:
            op, f = _FLIP_CMP[op], X.negate(f)
        elif c != 1:
            return _UNBOUNDED
        mono = monotonicity(f, positive)
        if mono is None:
            return _UNBOUNDED
        # f_max / f_min over q in [q_lo, q_hi)
        fmax = (at_lo if mono is Mono.DEC else at_hi)(f)
        fmin = (at_hi if mono is Mono.DEC else at_lo)(f)
        if op == "<=":
            return KeyRange(None, RowBound(f, 1, mono), f"((fg_int)kv_hi - 1 <= {fmin})", True)
        if op == "<":
            return KeyRange(None, RowBound(f, 0, mono), f"((fg_int)kv_hi - 1 < {fmin})", True)
        if op == ">=":
            return KeyRange(RowBound(f, 0, mono), None, f"((fg_int)kv_lo >= {fmax})", True)
        if op == ">":
            return KeyRange(RowBound(f, 1, mono), None, f"((fg_int)kv_lo > {fmax})", True)
        if op == "==":
            return KeyRange(RowBound(f, 0, mono), RowBound(f, 1, mono), "false", True)
        return _UNBOUNDED  # !=

    return go(spec.mask, False)


def _linear(e: ir.Expr) -> dict[str | None, int] | None:
    """``e`` as an integer linear form {name: coefficient, None: constant} over plain names (q,
    seqlen_q, seqlen_k, b, h, int parameters), or None when it is not one (an index, a call, a
    product of two names, a float)."""
    if isinstance(e, ir.Num):
        return {None: e.value} if isinstance(e.value, int) and not isinstance(e.value, bool) else None
    if isinstance(e, ir.Name):
        return {e.id: 1}
    if isinstance(e, ir.Unary) and e.op == "-":
        a = _linear(e.operand)
        return None if a is None else {k: -c for k, c in a.items()}
    if isinstance(e, ir.BinOp) and e.op in ("+", "-"):
        a, b = _linear(e.lhs), _linear(e.rhs)
        if a is None or b is None:
            return None
        sign = 1 if e.op == "+" else -1
        out = dict(a)
        for k, c in b.items():
            out[k] = out.get(k, 0) + sign * c
        return out
    if isinstance(e, ir.BinOp) and e.op == "*":
        for lin, k in ((e.lhs, e.rhs), (e.rhs, e.lhs)):
            if isinstance(k, ir.Num) and isinstance(k.value, int) and not isinstance(k.value, bool):
                a = _linear(lin)
                if a is not None:
                    return {n: c * k.value for n, c in a.items()}
    return None


_ROW_NAMES = frozenset({"q", "kv", "seqlen_q", "seqlen_k", "b", "h"})


def _slides(form: dict[str | None, int] | None) -> bool:
    """Whether a bound's linear form is q + (terms free of q, b and h): it moves one key per row
    and is the same for every batch row and head."""
    return form is not None and form.get("q") == 1 and not form.get("b") and not form.get("h")


@functools.lru_cache(maxsize=256)
def row_width(spec: ir.Spec) -> tuple[dict[str | None, int], ...]:
    """Bounds on the number of keys a query row can keep, as linear forms over the spec's int
    parameters ({name: coefficient, None: constant}; the width is at most the smallest of their
    values), from the closed-form range: hi(q) − lo(q) for an upper bound of hi and a lower bound
    of lo (a min of bounds is below each, a max above each), both of the form q + (terms free of
    q, b and h), whose difference is free of the sequence lengths too (a sliding window:
    ``window``; window(left, right): left + right + 1). Such a range slides one key per row and is
    the same for every head, so the rows at n consecutive positions, in any heads, keep at most
    width + n − 1 keys in all (what decode's key_span takes). Empty when there is none (no lower
    bound, as causal; a bound that moves with the lengths, by 2q, or with b or h). Sound: a row
    keeps no key outside [lo(q), hi(q)) (key_range). Cached per spec (decode calls read it per
    call); callers must not change the forms."""
    rng = key_range(spec)

    def sides(bound, op: str) -> list[RowBound]:
        if bound is None:
            return []
        if isinstance(bound, RowBound):
            return [bound]
        if isinstance(bound, JoinBound) and bound.op == op:
            return sides(bound.a, op) + sides(bound.b, op)
        return []  # a switch, or a join that does not bound this side

    out = []
    for h in sides(rng.hi, "min"):
        for lo in sides(rng.lo, "max"):
            a, b = _linear(h.f), _linear(lo.f)
            if not (_slides(a) and _slides(b)):
                continue
            diff = dict(a)
            for k, c in b.items():
                diff[k] = diff.get(k, 0) - c
            diff[None] = diff.get(None, 0) + h.offset - lo.offset
            diff = {k: c for k, c in diff.items() if c}
            if not any(k in _ROW_NAMES for k in diff):
                out.append(diff)
    return tuple(out)
