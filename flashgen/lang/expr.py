"""Mask and score expressions: types, built-ins, C++ emission, derivatives and key ranges.

Everything here works on ``ir`` expression nodes and is shared by the frontend (type checking,
built-in expansion), the code generator (C++ hook bodies) and the reference (which evaluates the
same nodes in PyTorch, see reference.py), so a spec means one thing everywhere.

Semantics (the same in the kernels and the reference):
- Types: int (64-bit), float (fp32 in the kernels), bool. b, h (query head), q, kv, seqlen_q,
  seqlen_k and int parameters are ints; score and float parameters are floats.
- ``/`` is true division (float); ``//`` and ``%`` are Python's floor division and modulo on ints.
- Mixed int/float arithmetic converts the int to float.
- Tensor parameters are read as ``name[i, j, ...]``; an index outside the parameter's shape is a
  spec bug: the reference raises IndexError, the kernels clamp it into range (never reading out of
  bounds).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..errors import did_you_mean
from . import ir

INT, FLOAT, BOOL = "int", "float", "bool"

# Names every expression sees (all ints); ``score`` only in score expressions.
POSITION_NAMES = ("b", "h", "q", "kv", "seqlen_q", "seqlen_k")
CONSTANTS = {"true": True, "false": False}
# Dimension names in parameter shapes, and the op-call quantity each stands for.
SHAPE_DIMS = ("batch", "heads", "seqlen_q", "seqlen_k")

# Math functions: name → arity. clamp(x, lo, hi) is expanded to min(max(x, lo), hi).
FUNCTIONS = {"abs": 1, "min": 2, "max": 2, "clamp": 3, "where": 3, "exp": 1, "log": 1, "tanh": 1,
             "sqrt": 1, "sign": 1}
FLOAT_FUNCTIONS = ("exp", "log", "tanh", "sqrt")

# Mask built-ins: name → arity (0: used as a bare name). δ = seqlen_k − seqlen_q.
MASK_BUILTINS = {
    "causal": 0,            # kv <= q + δ (bottom-right aligned, FlashAttention >= 2.1)
    "causal_top_left": 0,   # kv <= q
    "window": 2,            # window(left, right): q + δ − left <= kv <= q + δ + right
    "prefix_lm": 1,         # prefix_lm(n): kv < n or kv <= q + δ
    "document": 1,          # document(ids): ids[b, q] == ids[b, kv]
    "key_padding": 1,       # key_padding(n): kv < n
    "chunked": 1,           # chunked(n): (q + δ) // n == kv // n, n ≥ 1 (Llama 4's chunked local attention)
}  # fmt: skip


class ExprError(Exception):
    """A typing or naming problem at ``node`` (the frontend turns it into a positioned SpecError)."""

    def __init__(self, node, message: str, expected: str | None = None, hint: str | None = None):
        super().__init__(message)
        self.node, self.message, self.expected, self.hint = node, message, expected, hint


def _literal_int(e: ir.Expr) -> int | None:
    """The value of an integer literal, or of a negated one (``-1``); None for anything else."""
    if isinstance(e, ir.Unary) and e.op == "-":
        inner = _literal_int(e.operand)
        return None if inner is None else -inner
    return e.value if isinstance(e, ir.Num) and isinstance(e.value, int) and not isinstance(e.value, bool) else None


def _check_literal_index(p: ir.Param, d: int, index: ir.Expr, dim: ir.Dim) -> None:
    """ExprError for a literal index that is outside dimension ``d`` of ``p`` whatever the call's
    sizes: negative, or at least the dimension's literal size (the kernels would clamp it)."""
    value = _literal_int(index)
    if value is None:
        return
    size = _literal_int(dim.size)
    if value < 0:
        raise ExprError(index, f"index {value} is outside dimension {d} of '{p.name}' (indices start at 0)",
                        expected="an index of 0 or more",
                        hint="negative indices do not count from the end (the kernels would clamp this one to 0)")
    if size is not None and value >= size and not dim.broadcast:
        raise ExprError(index, f"index {value} is outside dimension {d} of '{p.name}', which has size {size}",
                        expected=f"an index from 0 to {size - 1}")


# ---------------------------------------------------------------- small constructors


def _delta() -> ir.Expr:
    return ir.BinOp("-", ir.Name("seqlen_k"), ir.Name("seqlen_q"))


def _q_plus_delta() -> ir.Expr:
    return ir.BinOp("+", ir.Name("q"), _delta())


def expand_builtins(e: ir.Expr) -> ir.Expr:
    """Replace mask built-ins by the comparisons they stand for (spans kept on the result)."""
    if isinstance(e, ir.Name) and e.id in ("causal", "causal_top_left"):
        rhs = ir.Name("q") if e.id == "causal_top_left" else _q_plus_delta()
        return ir.BinOp("<=", ir.Name("kv"), rhs, e.span)
    if isinstance(e, ir.Call) and e.fn in MASK_BUILTINS:
        args = tuple(expand_builtins(a) for a in e.args)
        if len(args) != MASK_BUILTINS[e.fn]:
            raise ExprError(e, f"{e.fn}() takes {MASK_BUILTINS[e.fn]} argument(s), got {len(args)}")
        kv = ir.Name("kv")
        if e.fn == "window":
            left, right = args
            lo = ir.BinOp(">=", kv, ir.BinOp("-", _q_plus_delta(), left), e.span)
            hi = ir.BinOp("<=", kv, ir.BinOp("+", _q_plus_delta(), right), e.span)
            return ir.BinOp("and", lo, hi, e.span)
        if e.fn == "prefix_lm":
            return ir.BinOp("or", ir.BinOp("<", kv, args[0], e.span), ir.BinOp("<=", kv, _q_plus_delta()), e.span)
        if e.fn == "document":
            ids = args[0]
            if not isinstance(ids, ir.Name):
                raise ExprError(e, "document() takes the name of a tensor parameter")
            return ir.BinOp("==", ir.Index(ids, (ir.Name("b"), ir.Name("q")), e.span),
                            ir.Index(ids, (ir.Name("b"), kv), e.span), e.span)
        if e.fn == "key_padding":
            return ir.BinOp("<", kv, args[0], e.span)
        if e.fn == "chunked":
            # (q + δ) // n == kv // n, as the interval of chunk (q + δ) // n: for n ≥ 1 the two
            # agree, and the interval form gives the key range in closed form.
            (n,) = args
            _check_chunk_size(n)
            start = ir.BinOp("*", ir.BinOp("//", _q_plus_delta(), n), n)
            lo = ir.BinOp(">=", kv, start, e.span)
            hi = ir.BinOp("<", kv, ir.BinOp("+", start, n), e.span)
            return ir.BinOp("and", lo, hi, e.span)
    if isinstance(e, ir.Call) and e.fn == "clamp":
        args = tuple(expand_builtins(a) for a in e.args)
        if len(args) != 3:
            raise ExprError(e, f"clamp() takes 3 arguments, got {len(args)}")
        return ir.Call("min", (ir.Call("max", (args[0], args[1]), e.span), args[2]), e.span)
    return _map_children(e, expand_builtins)


def _check_chunk_size(n: ir.Expr) -> None:
    """chunked(n) takes a positive integer literal or the name of an int parameter (whose value
    the call checks, see ``positive_params``)."""
    if isinstance(n, ir.Num):
        if not isinstance(n.value, int) or n.value < 1:
            raise ExprError(n, f"chunked() needs a positive integer chunk size, got {n.value}")
        return
    if isinstance(n, ir.Unary) and n.op == "-" and isinstance(n.operand, ir.Num):
        raise ExprError(n, f"chunked() needs a positive integer chunk size, got -{n.operand.value}")
    if not isinstance(n, ir.Name):
        raise ExprError(n, "chunked() takes a positive integer literal or the name of an int parameter",
                        expected="chunked(4096) or chunked(NAME) with 'param NAME: int'")


def positive_params(e: ir.Expr, scope: Scope) -> tuple[str, ...]:
    """The int parameters that chunked(...) calls in ``e`` (before built-in expansion) take as
    their chunk size: each must be ≥ 1 at call time (``check_positive``). Raises ExprError for
    a chunk size that is not an int literal ≥ 1 or an int parameter."""
    out: list[str] = []
    for n in walk(e):
        if isinstance(n, ir.Call) and n.fn == "chunked" and len(n.args) == 1:
            (arg,) = n.args
            _check_chunk_size(arg)
            if isinstance(arg, ir.Name):
                p = scope.params.get(arg.id)
                if p is None:
                    type_of(arg, scope)  # unknown name: its error, with the nearest name
                    raise ExprError(arg, f"chunked() needs an int parameter, '{arg.id}' is a built-in name")
                if p.kind != "int":
                    raise ExprError(arg, f"chunked() needs an int parameter, '{arg.id}' is "
                                    f"{'a ' + p.dtype + ' tensor' if p.is_tensor else 'a float'}")
                if arg.id not in out:
                    out.append(arg.id)
    return tuple(out)


def check_positive(spec: ir.Spec, values: dict) -> None:
    """Raise ValueError naming the parameter when an int parameter of ``spec.positive`` (a
    chunked(n) chunk size) is below 1 in ``values`` ({name: int}; absent names are skipped)."""
    for name in spec.positive:
        if name in values and values[name] < 1:
            raise ValueError(f"{name}: {values[name]} is out of range (chunked({name}) needs a chunk size ≥ 1)")


def _map_children(e: ir.Expr, fn: Callable[[ir.Expr], ir.Expr]) -> ir.Expr:
    if isinstance(e, ir.Unary):
        return ir.Unary(e.op, fn(e.operand), e.span)
    if isinstance(e, ir.BinOp):
        return ir.BinOp(e.op, fn(e.lhs), fn(e.rhs), e.span)
    if isinstance(e, ir.Call):
        return ir.Call(e.fn, tuple(fn(a) for a in e.args), e.span)
    if isinstance(e, ir.Index):
        return ir.Index(e.base, tuple(fn(a) for a in e.indices), e.span)
    return e


def _children(e: ir.Expr) -> tuple[ir.Expr, ...]:
    if isinstance(e, ir.Unary):
        return (e.operand,)
    if isinstance(e, ir.BinOp):
        return (e.lhs, e.rhs)
    if isinstance(e, ir.Call):
        return tuple(e.args)
    return ()


def walk(e: ir.Expr):
    """Every node of ``e``, parents first."""
    yield e
    if isinstance(e, ir.Unary):
        yield from walk(e.operand)
    elif isinstance(e, ir.BinOp):
        yield from walk(e.lhs)
        yield from walk(e.rhs)
    elif isinstance(e, ir.Call):
        for a in e.args:
            yield from walk(a)
    elif isinstance(e, ir.Index):
        yield e.base
        for a in e.indices:
            yield from walk(a)


def uses(e: ir.Expr | None, name: str) -> bool:
    return e is not None and any(isinstance(n, ir.Name) and n.id == name for n in walk(e))


# ---------------------------------------------------------------- types


@dataclass(frozen=True)
class Scope:
    """Names an expression may use and their types; ``params`` by name."""

    params: dict
    allow_score: bool

    def known(self) -> list[str]:
        names = list(POSITION_NAMES) + list(self.params) + list(CONSTANTS)
        return names + (["score"] if self.allow_score else [])


def type_of(e: ir.Expr, scope: Scope) -> str:
    """The type of ``e`` (INT, FLOAT or BOOL); raises ExprError for anything ill-typed."""
    if isinstance(e, ir.Num):
        return INT if isinstance(e.value, int) else FLOAT
    if isinstance(e, ir.Name):
        if e.id in POSITION_NAMES:
            return INT
        if e.id in CONSTANTS:
            return BOOL
        if e.id == "score":
            if not scope.allow_score:
                raise ExprError(e, "'score' can only be used in a score expression")
            return FLOAT
        p = scope.params.get(e.id)
        if p is None:
            if e.id in MASK_BUILTINS:
                raise ExprError(e, f"mask built-in '{e.id}' can only be used in a mask expression")
            raise ExprError(e, f"unknown name '{e.id}'", expected="one of " + ", ".join(scope.known()),
                            hint=did_you_mean(e.id, scope.known()))
        if p.is_tensor:
            raise ExprError(e, f"tensor parameter '{e.id}' must be indexed",
                            expected=f"{e.id}[{', '.join('…' for _ in p.shape)}] ({len(p.shape)} indices)")
        return INT if p.kind == "int" else FLOAT
    if isinstance(e, ir.Index):
        base = e.base
        p = scope.params.get(base.id) if isinstance(base, ir.Name) else None
        if p is None and isinstance(base, ir.Name) and base.id not in POSITION_NAMES + ("score",):
            raise ExprError(e, f"unknown name '{base.id}'", expected="a declared tensor parameter",
                            hint=did_you_mean(base.id, [q.name for q in scope.params.values() if q.is_tensor]))
        if p is None or not p.is_tensor:
            raise ExprError(e, "only tensor parameters can be indexed",
                            hint=did_you_mean(base.id, [q.name for q in scope.params.values() if q.is_tensor])
                            if isinstance(base, ir.Name) else None)
        if len(e.indices) != len(p.shape):
            raise ExprError(e, f"'{p.name}' has {len(p.shape)} dimension(s), indexed with {len(e.indices)}")
        for i in e.indices:
            if type_of(i, scope) != INT:
                raise ExprError(i, f"index into '{p.name}' must be an integer expression")
        for d, (i, dim) in enumerate(zip(e.indices, p.shape, strict=True)):
            _check_literal_index(p, d, i, dim)
        return ir.TENSOR_DTYPES[p.dtype]
    if isinstance(e, ir.Unary):
        t = type_of(e.operand, scope)
        if e.op == "not":
            if t != BOOL:
                raise ExprError(e, "'not' needs a boolean operand (a comparison)")
            return BOOL
        if t == BOOL:
            raise ExprError(e, "'-' needs a number, not a boolean")
        return t
    if isinstance(e, ir.BinOp):
        a, b = type_of(e.lhs, scope), type_of(e.rhs, scope)
        if e.op in ("and", "or"):
            for side, t in ((e.lhs, a), (e.rhs, b)):
                if t != BOOL:
                    raise ExprError(side, f"'{e.op}' needs boolean operands (comparisons)")
            return BOOL
        if e.op in ("==", "!="):
            if (a == BOOL) != (b == BOOL):
                raise ExprError(e, f"'{e.op}' compares a boolean with a number")
            return BOOL
        if BOOL in (a, b):
            raise ExprError(e, f"'{e.op}' needs numbers, not booleans")
        if e.op in ("<", "<=", ">", ">="):
            return BOOL
        if e.op == "/":
            return FLOAT
        if e.op == "%" and FLOAT in (a, b):
            raise ExprError(e, "'%' needs integers")
        return FLOAT if FLOAT in (a, b) else INT
    if isinstance(e, ir.Call):
        if e.fn not in FUNCTIONS:
            raise ExprError(e, f"unknown function '{e.fn}'", expected="one of " + ", ".join(FUNCTIONS),
                            hint=did_you_mean(e.fn, list(FUNCTIONS) + list(MASK_BUILTINS)))
        if len(e.args) != FUNCTIONS[e.fn]:
            raise ExprError(e, f"{e.fn}() takes {FUNCTIONS[e.fn]} argument(s), got {len(e.args)}")
        ts = [type_of(a, scope) for a in e.args]
        if e.fn == "where":
            if ts[0] != BOOL:
                raise ExprError(e.args[0], "where()'s first argument must be a condition")
            if (ts[1] == BOOL) != (ts[2] == BOOL):
                raise ExprError(e, "where() mixes a boolean and a number")
            return FLOAT if FLOAT in ts[1:] else ts[1]
        if BOOL in ts:
            raise ExprError(e, f"{e.fn}() needs numbers, not booleans")
        if e.fn in FLOAT_FUNCTIONS:
            return FLOAT
        return FLOAT if FLOAT in ts else INT
    raise ExprError(e, "unsupported expression")


# ---------------------------------------------------------------- C++ emission


# The kernels' limit on seqlen_q and seqlen_k (checked before launch): positions q, kv lie in
# [0, MAX_SEQLEN), so e.g. kv - q - (seqlen_k - seqlen_q) always fits in 32 bits.
MAX_SEQLEN = 1 << 30
_I32 = (1 << 31) - 1  # int32 holds [-_I32 - 1, _I32]
_POSITION_RANGES = {"b": (0, _I32), "h": (0, _I32), "q": (0, MAX_SEQLEN - 1), "kv": (0, MAX_SEQLEN - 1),
                    "seqlen_q": (0, MAX_SEQLEN), "seqlen_k": (0, MAX_SEQLEN)}
NARROW = "i32"  # emission type of an int computed in 32 bits (type_of still says INT)


class Cxx:
    """Emit C++ for expressions inside a generated Variant (params as ``p.<name>``).

    ``names`` maps a position name to the C++ that stands for it (default: the hook's ``int``
    argument; ``score`` → ``s``). Floats are ``float``, bools ``bool``. Ints are exact: an int
    subexpression whose value and operands provably fit in 32 bits (interval analysis over the
    positions' ranges, see MAX_SEQLEN, literals and i32/bool tensor reads) is computed in ``int``
    — cheaper on the GPU, notably the int → float conversion —, anything else in ``fg_int``
    (64-bit; int scalar parameters and i64 reads have unknown range). With ``names`` given every
    int is 64-bit.
    """

    def __init__(self, spec: ir.Spec, names: dict[str, str] | None = None):
        self.spec = spec
        self.params = {p.name: p for p in spec.params}
        self.scope = Scope(self.params, allow_score=True)
        self.names = names or {}
        self.narrow_ok = not names

    def type(self, e: ir.Expr) -> str:
        return type_of(e, self.scope)

    def __call__(self, e: ir.Expr, want: str | None = None) -> str:
        code, t = self.emit(e)
        if want == FLOAT and t in (INT, NARROW):
            return f"(float)({code})"
        if want == INT and t == NARROW:
            return f"(fg_int)({code})"
        return code

    def int_range(self, e: ir.Expr) -> tuple[int, int] | None:
        """Bounds [lo, hi] of an int expression's value, or None when unknown."""
        if isinstance(e, ir.Num):
            return (int(e.value), int(e.value))
        if isinstance(e, ir.Name):
            return _POSITION_RANGES.get(e.id)  # int params: unknown
        if isinstance(e, ir.Index):
            dt = self.params[e.base.id].dtype
            return {"i32": (-_I32 - 1, _I32), "bool": (0, 1)}.get(dt)
        if isinstance(e, ir.Unary) and e.op == "-":
            r = self.int_range(e.operand)
            return None if r is None else (-r[1], -r[0])
        if isinstance(e, ir.BinOp) and e.op in ("+", "-", "*", "//", "%"):
            a, b = self.int_range(e.lhs), self.int_range(e.rhs)
            if a is None or b is None:
                return None
            if e.op == "+":
                return (a[0] + b[0], a[1] + b[1])
            if e.op == "-":
                return (a[0] - b[1], a[1] - b[0])
            if e.op == "*":
                c = [x * y for x in a for y in b]
                return (min(c), max(c))
            if e.op == "//":  # |a // b| <= |a| (and x // 0 = 0)
                m = max(abs(a[0]), abs(a[1]))
                return (-m, m)
            m = max(abs(b[0]), abs(b[1]))  # |a % b| < |b|
            return (-m, m)
        if isinstance(e, ir.Call) and e.fn in ("abs", "min", "max", "sign", "where"):
            if e.fn == "sign":
                return (-1, 1)
            args = e.args[1:] if e.fn == "where" else e.args
            rs = [self.int_range(a) for a in args]
            if any(r is None for r in rs):
                return None
            if e.fn == "abs":
                (lo, hi), = rs
                return (0 if lo <= 0 <= hi else min(abs(lo), abs(hi)), max(abs(lo), abs(hi)))
            if e.fn == "min":
                return (min(r[0] for r in rs), min(r[1] for r in rs))
            if e.fn == "max":
                return (max(r[0] for r in rs), max(r[1] for r in rs))
            return (min(r[0] for r in rs), max(r[1] for r in rs))
        return None

    def narrow(self, e: ir.Expr) -> bool:
        """Whether the int expression ``e`` is computed in 32 bits: its value and every int
        operand's value fit (so no intermediate overflows)."""
        if not self.narrow_ok or self.type(e) != INT:
            return False
        r = self.int_range(e)
        if r is None or r[0] < -_I32 - 1 or r[1] > _I32:
            return False
        if isinstance(e, ir.BinOp) and e.op == "%" and self.int_range(e.lhs)[0] < -_I32:
            return False  # INT_MIN % -1 is undefined in C++ (its value, 0, would fit)
        if isinstance(e, ir.Index):
            return True  # the read value; indices are 64-bit offsets regardless
        if isinstance(e, ir.Call) and e.fn == "where":
            return all(self.narrow(a) for a in e.args[1:])
        kids = [k for k in _children(e) if self.type(k) == INT]
        return all(self.narrow(k) for k in kids)

    def index_code(self, e: ir.Index) -> tuple[str, str]:
        """(element offset with the tensor's strides, flat offset in a contiguous buffer)."""
        p = self.params[e.base.id]
        idx = [f"fg_index({self(i)}, p.{p.name}_size[{d}])" for d, i in enumerate(e.indices)]
        strided = " + ".join(f"{ix} * p.{p.name}_stride[{d}]" for d, ix in enumerate(idx))
        flat = idx[0]
        for d in range(1, len(idx)):
            flat = f"({flat}) * p.{p.name}_size[{d}] + {idx[d]}"
        return strided, flat

    def emit(self, e: ir.Expr) -> tuple[str, str]:
        t = self.type(e)
        if t == INT and self.narrow(e):
            return self._emit(e, NARROW, NARROW), NARROW
        return self._emit(e, t, INT), t

    def _emit(self, e: ir.Expr, t: str, iw: str) -> str:
        """C++ for ``e`` of type ``t``; int operands of an int node are emitted as ``iw``
        (NARROW: they are all narrow; INT: widened to fg_int)."""
        if isinstance(e, ir.Num):
            if t == NARROW:
                return str(int(e.value))
            if t == INT:
                return f"(fg_int){e.value}"
            return f"{float(e.value)!r}f".replace("inff", "INFINITY")
        if isinstance(e, ir.Name):
            if e.id in CONSTANTS:
                return "true" if CONSTANTS[e.id] else "false"
            if e.id == "score":
                return self.names.get("score", "s")
            if e.id in POSITION_NAMES:
                return e.id if t == NARROW else self.names.get(e.id, f"(fg_int){e.id}")
            # int parameters are int64_t fields: as fg_int (long long), or the int / fg_int
            # overloads of fg_absi, fg_mini, ... are ambiguous for them where int64_t is long
            return f"(fg_int)p.{e.id}" if t == INT else f"p.{e.id}"
        if isinstance(e, ir.Index):
            p = self.params[e.base.id]
            strided, _ = self.index_code(e)
            load = f"p.{p.name}[{strided}]"
            if p.dtype == "bool":
                return f"({load} != 0)"
            if t == INT:
                return f"(fg_int){load}"
            return load
        if isinstance(e, ir.Unary):
            if e.op == "not":
                return f"(!{self(e.operand)})"
            return f"(-{self(e.operand, FLOAT if t == FLOAT else iw)})"
        if isinstance(e, ir.BinOp):
            if e.op in ("and", "or"):
                return f"({self(e.lhs)} {'&&' if e.op == 'and' else '||'} {self(e.rhs)})"
            lt, rt = self.type(e.lhs), self.type(e.rhs)
            if FLOAT in (lt, rt) or e.op == "/":
                want = FLOAT
            elif t == BOOL:  # comparison of ints: 32-bit when both sides are
                want = NARROW if self.narrow(e.lhs) and self.narrow(e.rhs) else INT
            else:
                want = iw
            a, b = self(e.lhs, want), self(e.rhs, want)
            if e.op == "//":
                return f"fg_floordiv({a}, {b})" if t != FLOAT else f"floorf({a} / {b})"
            if e.op == "%":
                return f"fg_mod({a}, {b})"
            return f"({a} {e.op} {b})"
        if isinstance(e, ir.Call):
            want = FLOAT if t == FLOAT else iw
            if e.fn == "where":
                return f"({self(e.args[0])} ? {self(e.args[1], want)} : {self(e.args[2], want)})"
            if t != FLOAT:
                fn = {"abs": "fg_absi", "min": "fg_mini", "max": "fg_maxi", "sign": "fg_signi"}[e.fn]
            else:
                fn = {"abs": "fabsf", "min": "fminf", "max": "fmaxf", "exp": "expf", "log": "logf",
                      "tanh": "fg_tanh", "sqrt": "sqrtf", "sign": "fg_sign"}[e.fn]
            return f"{fn}({', '.join(self(a, want) for a in e.args)})"
        raise AssertionError(e)


# ---------------------------------------------------------------- derivatives


def _num(v) -> ir.Num:
    return ir.Num(float(v))


def _add(a, b):
    if a is None:
        return b
    if b is None:
        return a
    return ir.BinOp("+", a, b)


def _mul(a, b):
    if a is None or b is None:
        return None
    if a == ir.Num(1.0):
        return b
    if b == ir.Num(1.0):
        return a
    return ir.BinOp("*", a, b)


def negate(a):
    """-a, folded for a number."""
    return None if a is None else ir.Unary("-", a)


def diff(e: ir.Expr, is_var: Callable[[ir.Expr], bool], scope: Scope) -> ir.Expr | None:
    """d e / d x where x is every node for which ``is_var`` holds (None means exactly 0).

    Rules: the usual calculus; integer and boolean subexpressions are constant; where(c, a, b)
    differentiates a and b (c is piecewise constant); min/max pick the branch they select (the
    first on ties), abs' = sign.
    """
    if is_var(e):
        return _num(1.0)
    if type_of(e, scope) != FLOAT:
        return None
    if isinstance(e, ir.Num | ir.Name | ir.Index):
        return None
    if isinstance(e, ir.Unary):
        return negate(diff(e.operand, is_var, scope))
    if isinstance(e, ir.BinOp):
        da, db = diff(e.lhs, is_var, scope), diff(e.rhs, is_var, scope)
        if e.op == "+":
            return _add(da, db)
        if e.op == "-":
            return _add(da, negate(db))
        if e.op == "*":
            return _add(_mul(da, e.rhs), _mul(e.lhs, db))
        if e.op == "/":  # (a/b)' = a'/b − a b'/b²
            t1 = None if da is None else ir.BinOp("/", da, e.rhs)
            t2 = None if db is None else ir.BinOp("/", ir.BinOp("*", e.lhs, db), ir.BinOp("*", e.rhs, e.rhs))
            return _add(t1, negate(t2))
        if e.op == "//":
            return None
        raise AssertionError(e.op)
    if isinstance(e, ir.Call):
        args = e.args
        ds = [diff(a, is_var, scope) for a in args]
        if e.fn == "where":
            if ds[1] is None and ds[2] is None:
                return None
            return ir.Call("where", (args[0], ds[1] or _num(0.0), ds[2] or _num(0.0)))
        if e.fn in ("min", "max"):
            if ds[0] is None and ds[1] is None:
                return None
            cond = ir.BinOp("<=" if e.fn == "min" else ">=", args[0], args[1])
            return ir.Call("where", (cond, ds[0] or _num(0.0), ds[1] or _num(0.0)))
        (u,), (du,) = args, ds
        if du is None:
            return None
        if e.fn == "abs":
            return _mul(ir.Call("sign", (u,)), du)
        if e.fn == "sign":
            return None
        if e.fn == "exp":
            return _mul(e, du)
        if e.fn == "log":
            return ir.BinOp("/", du, u)
        if e.fn == "tanh":
            return _mul(ir.BinOp("-", _num(1.0), ir.BinOp("*", e, e)), du)
        if e.fn == "sqrt":
            return ir.BinOp("/", du, ir.BinOp("*", _num(2.0), e))
        raise AssertionError(e.fn)
    raise AssertionError(e)


def grad_params(spec: ir.Spec) -> list[ir.Param]:
    """Float tensor parameters that enter the score (their gradient can be requested)."""
    return [p for p in spec.params if p.is_tensor and p.dtype == "f32" and uses(spec.score, p.name)]


def param_reads(spec: ir.Spec, p: ir.Param) -> list[ir.Index]:
    """Distinct reads ``p[...]`` in the score expression, in order of appearance."""
    out: list[ir.Index] = []
    for n in walk(spec.score):
        if isinstance(n, ir.Index) and n.base.id == p.name and n not in out:
            out.append(n)
    return out
