"""Exact value ranges of tensor-parameter indices that read no tensor data, for the call-time
check that every such read stays inside the parameter's shape (flashgen/runtime/checks.py).

An index like ``t[h + 1]``, ``t[100]`` or ``rel[h, clamp(kv - q, -m, m) + m]`` depends only on
positions (b, h, q, kv over the call's grid), sizes (seqlen_q, seqlen_k) and int parameters, so
its range is known on the host before a launch. Interval arithmetic gives that range exactly
when every position name occurs at most once in the index (each then ranges independently);
``reads`` keeps only such indices, and ``interval`` returns None for anything it does not cover
(reads of tensor data, float operands, a divisor that is not one value), where the kernels'
clamping stays the only guard (README, "An index outside a tensor parameter's shape").
"""

from __future__ import annotations

from dataclasses import dataclass

from . import expr as X
from . import ir

POSITIONS = ("b", "h", "q", "kv")


@dataclass(frozen=True)
class Read:
    """Index ``d`` of a read of tensor parameter ``name``: its expression (not a bare position,
    which checks.check_params checks by size alone)."""

    name: str
    dim: int
    index: ir.Expr


def reads(spec: ir.Spec) -> tuple[Read, ...]:
    """The spec's tensor-parameter indices whose range ``interval`` computes exactly: no
    tensor read inside, each position name at most once, and not a bare position."""
    out = []
    for e in (spec.mask, spec.score):
        if e is None:
            continue
        for n in X.walk(e):
            if not isinstance(n, ir.Index):
                continue
            for d, i in enumerate(n.indices):
                if isinstance(i, ir.Name) and i.id in POSITIONS:
                    continue
                nodes = list(X.walk(i))
                if any(isinstance(m, ir.Index) for m in nodes):
                    continue
                names = [m.id for m in nodes if isinstance(m, ir.Name)]
                if any(names.count(p) > 1 for p in POSITIONS):
                    continue
                out.append(Read(n.base.id, d, i))
    return tuple(dict.fromkeys(out))


def interval(e: ir.Expr, env: dict[str, tuple[int, int]]) -> tuple[int, int] | None:
    """[lo, hi] of the int expression ``e`` with each name ranging over ``env``'s interval
    (positions) or point (sizes, int parameters); the DSL's semantics: floor division and a
    remainder with the divisor's sign, x // 0 = x % 0 = 0. None where not covered."""
    if isinstance(e, ir.Num):
        return (e.value, e.value) if isinstance(e.value, int) and not isinstance(e.value, bool) else None
    if isinstance(e, ir.Name):
        return env.get(e.id)
    if isinstance(e, ir.Unary):
        r = interval(e.operand, env) if e.op == "-" else None
        return None if r is None else (-r[1], -r[0])
    if isinstance(e, ir.BinOp) and e.op in ("+", "-", "*", "//", "%"):
        a, b = interval(e.lhs, env), interval(e.rhs, env)
        if a is None or b is None:
            return None
        if e.op == "+":
            return (a[0] + b[0], a[1] + b[1])
        if e.op == "-":
            return (a[0] - b[1], a[1] - b[0])
        if e.op == "*":
            c = [x * y for x in a for y in b]
            return (min(c), max(c))
        if b[0] != b[1]:
            return None
        c = b[0]
        if c == 0:
            return (0, 0)
        if e.op == "//":  # monotone in the dividend
            lo, hi = a[0] // c, a[1] // c
            return (min(lo, hi), max(lo, hi))
        if c < 0:
            return None
        if a[1] - a[0] + 1 >= c or a[0] % c > a[1] % c:
            return (0, c - 1)
        return (a[0] % c, a[1] % c)
    if isinstance(e, ir.Call) and e.fn in ("min", "max", "clamp", "abs", "sign"):
        rs = [interval(x, env) for x in e.args]
        if any(r is None for r in rs):
            return None
        if e.fn == "min":
            return (min(r[0] for r in rs), min(r[1] for r in rs))
        if e.fn == "max":
            return (max(r[0] for r in rs), max(r[1] for r in rs))
        if e.fn == "clamp":
            (x0, x1), (l0, l1), (h0, h1) = rs
            return (min(max(x0, l0), h0), min(max(x1, l1), h1))
        (lo, hi), = rs
        if e.fn == "abs":
            return (0 if lo <= 0 <= hi else min(abs(lo), abs(hi)), max(abs(lo), abs(hi)))
        return ((lo > 0) - (lo < 0), (hi > 0) - (hi < 0))
    return None
