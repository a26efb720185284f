"""Random well-typed specs for the spec fuzzer (flashgen/tools/fuzz_check.py checks them).

``generate(seed)`` draws one spec from a typed grammar of the language: mask and score
expressions over every name (b, h, q, kv, seqlen_q, seqlen_k, score, true, false), operator,
function and mask built-in, int / float scalar and f32 / i32 / i64 / bool tensor parameters of
every kind of dimension (batch, heads, seqlen_q, seqlen_k, literals, int-parameter expressions,
``|1`` broadcast), and indices that may read other tensors (nested indexing). Everything drawn is
well typed and meaningful on the shapes the fuzzer calls it with:

- every tensor index is in range for those shapes (``%``, ``clamp``, the position of the dim's own
  axis, a literal below the size), so the reference never raises IndexError where the kernels
  would clamp;
- float functions get arguments in their domain (``log(1 + abs(x))``, ``sqrt(abs(x) + 0.5)``,
  ``exp`` of a bounded value, division by ``1.5 + abs(x)``): scores stay finite (non-finite
  scores are another rule's business, DESIGN.md "Non-finite values");
- integers stay far inside 64 bits and, where they meet floats, inside fp32's exact range.

The same seed gives the same spec (``random.Random(seed)``, nothing global). Each spec comes in
two spellings, ``text`` with the fewest parentheses the precedence allows and random layout
(``;`` or newlines, comments, spaces) and ``text_full`` with every subexpression parenthesised:
both must parse to the same fingerprint.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

# Printing precedence (higher binds tighter), as in flashgen/lang/grammar.lark.
_OR, _AND, _NOT, _CMP, _SUM, _PROD, _UNARY, _ATOM = range(1, 9)
MAX_SEQLEN = 48  # the longest sequence the fuzzer calls a spec with (document ids have this size)


@dataclass
class Param:
    """A declared parameter: ``kind`` int | float | tensor; tensors have ``dtype`` and ``dims``
    (each ("batch" | "heads" | "seqlen_q" | "seqlen_k" | "lit" | "pexpr", value, broadcast));
    int scalars a ``role``: "free" (any small value), "dim" (0..3, used in shapes), "chunk" (≥ 1)."""

    name: str
    kind: str
    dtype: str | None = None
    dims: list = field(default_factory=list)
    role: str = "free"
    doc: bool = False  # document ids: sorted small values


@dataclass
class Fuzzed:
    """One generated spec: its two spellings, its parameters and the seed that drew it."""

    seed: int
    name: str
    text: str
    text_full: str
    params: list
    has_score: bool
    dropout: bool


def _wrap(text: str, prec: int, need: int) -> str:
    return f"({text})" if prec < need else text


def show(node, full: bool = False) -> tuple[str, int]:
    """(text, precedence) of an expression tree; ``full`` parenthesises every operation."""
    kind = node[0]
    if kind in ("name", "num"):
        return node[1], _ATOM
    if kind in ("call", "index"):
        args = ", ".join(show(a, full)[0] for a in node[2])
        return (f"{node[1]}({args})" if kind == "call" else f"{node[1]}[{args}]"), _ATOM
    need_full = _ATOM if full else None
    if kind == "not":
        t, p = show(node[1], full)
        return "not " + _wrap(t, p, need_full or _NOT), _NOT
    if kind == "neg":
        t, p = show(node[1], full)
        return "-" + _wrap(t, p, need_full or _UNARY), _UNARY
    op, a, b = node[1], node[2], node[3]
    prec = {"or": _OR, "and": _AND}.get(op) or (_CMP if op in ("<", "<=", ">", ">=", "==", "!=") else
                                                _SUM if op in ("+", "-") else _PROD)
    ta, pa = show(a, full)
    tb, pb = show(b, full)
    left = need_full or (prec + 1 if prec == _CMP else prec)  # comparisons do not chain
    right = need_full or prec + 1
    return f"{_wrap(ta, pa, left)} {op} {_wrap(tb, pb, right)}", prec


def _num(v) -> tuple:
    return ("num", str(v))


class _Gen:
    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.seed = seed
        self.params: list[Param] = []
        self.max_params = self.rng.choice((0, 1, 2, 3, 4, 5))
        self.score_ctx = False

    # ------------------------------------------------------------ parameters

    def _new_name(self, prefix: str) -> str:
        return f"{prefix}{len(self.params)}"

    def scalar(self, kind: str, role: str = "free") -> str | None:
        fits = [p for p in self.params if p.kind == kind and (role == "free" or p.role == role)]
        if fits and (len(self.params) >= self.max_params or self.rng.random() < 0.6):
            return self.rng.choice(fits).name
        if len(self.params) >= self.max_params:
            return None
        p = Param(self._new_name({"int": "n", "float": "x"}[kind]), kind, role=role)
        self.params.append(p)
        return p.name

    def _dim(self):
        r = self.rng.random()
        if r < 0.15:
            return ("batch", None, self.rng.random() < 0.4)
        if r < 0.3:
            return ("heads", None, self.rng.random() < 0.4)
        if r < 0.45:
            return ("seqlen_q", None, self.rng.random() < 0.2)
        if r < 0.6:
            return ("seqlen_k", None, self.rng.random() < 0.2)
        if r < 0.72:
            n = self.scalar("int", "dim")
            if n is not None:
                a, c = self.rng.choice(((1, 1), (2, 1), (1, 2), (3, 2)))
                return ("pexpr", (n, a, c), self.rng.random() < 0.2)
        return ("lit", self.rng.randint(1, 7), self.rng.random() < 0.15)

    def tensor(self, dtype: str) -> Param | None:
        fits = [p for p in self.params if p.kind == "tensor" and p.dtype == dtype and not p.doc]
        if fits and (len(self.params) >= self.max_params or self.rng.random() < 0.5):
            return self.rng.choice(fits)
        if len(self.params) >= self.max_params:
            return None
        prefix = {"f32": "t", "i32": "u", "i64": "w", "bool": "m"}[dtype]
        dims = [self._dim() for _ in range(self.rng.choice((1, 1, 2, 2, 3)))]
        p = Param(self._new_name(prefix), "tensor", dtype, dims)
        self.params.append(p)
        return p

    def doc_ids(self) -> str | None:
        fits = [p for p in self.params if p.doc]
        if fits:
            return fits[0].name
        if len(self.params) >= self.max_params:
            return None
        p = Param(self._new_name("d"), "tensor", self.rng.choice(("i32", "i64")),
                  [("batch", None, False), ("lit", MAX_SEQLEN, False)], doc=True)
        self.params.append(p)
        return p.name

    # ------------------------------------------------------------ indices

    def index_for(self, dim, d: int) -> tuple:
        """An int expression within [0, size) of ``dim`` on every call shape."""
        what, value, _ = dim
        rng = self.rng
        r = rng.random()
        if r < 0.25 and what not in ("batch", "heads") and d >= 0:  # nested: an index read from a tensor
            inner = self.read(rng.choice(("i32", "i64")), d - 1)
            if inner is not None:
                size = _num(value) if what == "lit" else ("name", what) if what != "pexpr" else self._pexpr(*value)
                return ("bin", "%", inner, size)
        if what in ("batch", "heads"):
            pos = ("name", "b" if what == "batch" else "h")
            if r < 0.6:
                return pos
            if r < 0.75:
                return ("bin", "//", pos, _num(rng.randint(1, 3)))
            if r < 0.9:
                return ("call", "min", [pos, ("call", "abs", [self.int_(d - 1)])])
            return ("call", "where", [self.bool_(d - 1), pos, _num(0)])
        if what in ("seqlen_q", "seqlen_k"):
            pos = ("name", "q" if what == "seqlen_q" else "kv")
            size = ("name", what)
            if r < 0.4:
                return pos
            if r < 0.55:
                return ("bin", "%", self.int_(d - 1), size)
            if r < 0.7:
                return ("call", "clamp", [self.int_(d - 1), _num(0), ("bin", "-", size, _num(1))])
            if r < 0.8:
                return ("bin", "-", ("bin", "-", size, _num(1)), pos)
            if r < 0.9:
                return ("call", "min", [pos, ("call", "abs", [self.int_(d - 1)])])
            return ("call", "where", [self.bool_(d - 1), pos, _num(0)])
        if what == "lit":
            n = value
            if r < 0.35:
                return ("bin", "%", self.int_(d - 1), _num(n))
            if r < 0.6:
                return ("call", "clamp", [self.int_(d - 1), _num(0), _num(n - 1)])
            if r < 0.8:
                return _num(rng.randint(0, n - 1))
            return ("bin", "%", ("call", "abs", [self.int_(d - 1)]), _num(n))
        name, a, c = value
        size = self._pexpr(name, a, c)
        if r < 0.5:
            return ("bin", "%", self.int_(d - 1), size)
        return ("call", "clamp", [self.int_(d - 1), _num(0), ("bin", "-", size, _num(1))])

    @staticmethod
    def _pexpr(name: str, a: int, c: int) -> tuple:
        e = ("name", name) if a == 1 else ("bin", "*", _num(a), ("name", name))
        return ("bin", "+", e, _num(c))

    def read(self, dtype: str, d: int) -> tuple | None:
        p = self.tensor(dtype)
        if p is None:
            return None
        return ("index", p.name, [self.index_for(dim, d) for dim in p.dims])

    # ------------------------------------------------------------ typed expressions

    def int_(self, d: int, no_kv: bool = False) -> tuple:
        rng = self.rng
        if d <= 0 or rng.random() < 0.35:
            r = rng.random()
            if r < 0.55:
                names = ["b", "h", "q", "kv", "seqlen_q", "seqlen_k", "q", "kv"]
                if no_kv:
                    names = [n for n in names if n != "kv"]
                return ("name", rng.choice(names))
            if r < 0.7:
                n = self.scalar("int")
                if n is not None:
                    return ("name", n)
            if r < 0.8 and d > 0:
                e = self.read(rng.choice(("i32", "i64")), d - 1)
                if e is not None:
                    return e
            return _num(rng.randint(0, 9))
        r = rng.random()
        sub = lambda: self.int_(d - 1, no_kv)
        if r < 0.3:
            return ("bin", rng.choice("+-"), sub(), sub())
        if r < 0.4:  # products stay small: one side a literal or a small leaf
            return ("bin", "*", sub(), _num(rng.randint(-3, 4)) if rng.random() < 0.6 else self.int_(0, no_kv))
        if r < 0.5:
            div = _num(rng.randint(1, 5)) if rng.random() < 0.6 else self.int_(0, no_kv)
            if div == _num(0):  # a literal zero divisor is a spec error (an expression worth 0 is not)
                div = ("bin", "-", ("name", "q"), ("name", "q"))
            return ("bin", rng.choice(("//", "%")), sub(), div)
        if r < 0.55:
            return ("neg", sub())
        if r < 0.62:
            return ("call", "abs", [sub()])
        if r < 0.68:
            return ("call", "sign", [sub()])
        if r < 0.78:
            return ("call", rng.choice(("min", "max")), [sub(), sub()])
        if r < 0.84:
            return ("call", "clamp", [sub(), sub(), sub()])
        if r < 0.92:
            return ("call", "where", [self.bool_(d - 1, no_kv=no_kv), sub(), sub()])
        e = self.read(rng.choice(("i32", "i64")), d - 1)
        return e if e is not None else sub()

    def bounded(self, d: int) -> tuple:
        """A float expression of bounded magnitude (an argument for exp)."""
        e = self.float_(d)
        r = self.rng.random()
        if r < 0.4:
            return ("call", "tanh", [e])
        if r < 0.7:
            return ("call", "clamp", [e, _num(-4.0), _num(2.5)])
        if r < 0.85:
            return ("call", "sign", [e])
        return ("call", "min", [("call", "abs", [e]), _num(3)])

    def float_(self, d: int) -> tuple:
        rng = self.rng
        if d <= 0 or rng.random() < 0.3:
            r = rng.random()
            if self.score_ctx and r < 0.45:
                return ("name", "score")
            if r < 0.58:
                n = self.scalar("float")
                if n is not None:
                    return ("name", n)
            if r < 0.78 and d > 0:
                e = self.read("f32", d - 1)
                if e is not None:
                    return e
            if r < 0.85:
                return self.int_(min(d, 1))  # an int in a float context
            return _num(rng.choice(("0.5", "1.25", "2.0", "0.1", ".75", "3e-1", "1.", "2")))
        sub = lambda: self.float_(d - 1)
        r = rng.random()
        if r < 0.25:
            return ("bin", rng.choice("+-"), sub(), sub())
        if r < 0.35:
            return ("bin", "*", sub(), sub() if rng.random() < 0.5 else _num(rng.choice(("0.5", "2", "-1.5"))))
        if r < 0.42:
            den = ("bin", "+", _num("1.5"), ("call", "abs", [sub()])) if rng.random() < 0.7 else \
                _num(rng.choice(("2", "0.5", "-4.0", "3")))
            return ("bin", rng.choice(("/", "/", "//")), sub(), den)
        if r < 0.46:
            return ("neg", sub())
        if r < 0.52:
            return ("call", "abs", [sub()])
        if r < 0.58:
            return ("call", rng.choice(("min", "max")), [sub(), sub()])
        if r < 0.62:
            return ("call", "clamp", [sub(), _num(rng.choice(("-2", "-0.5"))), _num(rng.choice(("1", "3.5")))])
        if r < 0.7:
            return ("call", "where", [self.bool_(d - 1), sub(), sub()])
        if r < 0.76:
            return ("call", "tanh", [sub()])
        if r < 0.82:
            return ("call", "exp", [self.bounded(d - 1)])
        if r < 0.88:
            return ("call", "log", [("bin", "+", _num(1), ("call", "abs", [sub()]))])
        if r < 0.93:
            return ("call", "sqrt", [("bin", "+", ("call", "abs", [sub()]), _num("0.5"))])
        if r < 0.96:
            return ("call", "sign", [sub()])
        return ("bin", "+", sub(), self.int_(d - 1))

    def kv_term(self, d: int) -> tuple:
        """A term linear (or piecewise linear) in kv, the shapes the key-range logic reasons about."""
        rng = self.rng
        kv = ("name", "kv")
        r = rng.random()
        if r < 0.35:
            return kv
        if r < 0.5:
            return ("bin", rng.choice("+-"), kv, self.int_(d - 1, no_kv=True))
        if r < 0.62:
            c = _num(rng.choice((2, 3, -1, -2)))
            return ("bin", "*", c, kv) if rng.random() < 0.5 else ("bin", "*", kv, c)
        if r < 0.7:
            return ("neg", kv)
        if r < 0.8:
            return ("bin", "//", kv, _num(rng.randint(1, 4)))
        if r < 0.88:
            return ("bin", "-", kv, ("name", "q"))
        return ("bin", "%", kv, _num(rng.randint(2, 5)))

    def builtin(self, d: int) -> tuple | None:
        rng = self.rng
        r = rng.random()
        if r < 0.2:
            return ("name", "causal")
        if r < 0.3:
            return ("name", "causal_top_left")
        if r < 0.5:
            return ("call", "window", [self.int_(d - 1, no_kv=True), self.int_(d - 1, no_kv=True)])
        if r < 0.6:
            return ("call", "prefix_lm", [self.int_(d - 1, no_kv=True)])
        if r < 0.7:
            return ("call", "key_padding", [self.int_(d - 1, no_kv=True)])
        if r < 0.85:
            n = self.scalar("int", "chunk") if rng.random() < 0.5 else None
            return ("call", "chunked", [("name", n) if n else _num(rng.randint(1, 6))])
        ids = self.doc_ids()
        return ("call", "document", [("name", ids)]) if ids else None

    def bool_(self, d: int, mask: bool = False, no_kv: bool = False) -> tuple:
        rng = self.rng
        if d <= 0 or rng.random() < 0.2:
            r = rng.random()
            if mask and r < 0.45 and not no_kv:
                e = self.builtin(d)
                if e is not None:
                    return e
            if r < 0.55 and d > 0:
                e = self.read("bool", d - 1)
                if e is not None:
                    return e
            if r < 0.6:
                return ("name", rng.choice(("true", "false")))
            pos = rng.choice(("q", "q", "kv", "kv", "b", "h")) if not no_kv else rng.choice(("q", "q", "b", "h"))
            top = {"q": 20, "kv": 20, "b": 1, "h": 2}[pos]
            return ("bin", rng.choice(("<", "<=", ">", ">=", "==", "!=")), ("name", pos), _num(rng.randint(0, top)))
        r = rng.random()
        cmp = rng.choice(("<", "<=", ">", ">=", "==", "!="))
        sub = lambda: self.bool_(d - 1, mask, no_kv)
        if r < 0.28 and not no_kv:
            lhs, rhs = self.kv_term(d), (self.int_(d - 1, no_kv=True) if rng.random() < 0.8 else self.float_(d - 1))
            return ("bin", cmp, lhs, rhs) if rng.random() < 0.6 else ("bin", cmp, rhs, lhs)
        if r < 0.4:
            return ("bin", cmp, self.int_(d - 1, no_kv), self.int_(d - 1, no_kv))
        if r < 0.47:
            return ("bin", cmp, self.float_(d - 1) if not no_kv else self.int_(d - 1, no_kv), self.int_(d - 1, no_kv))
        if r < 0.65:
            return ("bin", "and", sub(), sub())
        if r < 0.8:
            return ("bin", "or", sub(), sub())
        if r < 0.88:
            return ("not", sub())
        if r < 0.93:
            return ("bin", rng.choice(("==", "!=")), sub(), sub())
        if r < 0.97:
            return ("call", "where", [sub(), sub(), sub()])
        if mask and not no_kv:
            e = self.builtin(d)
            if e is not None:
                return e
        return sub()

    # ------------------------------------------------------------ the spec

    def spec(self) -> Fuzzed:
        rng = self.rng
        name = f"fz{self.seed}"
        mask = score = None
        shape = rng.random()
        if shape < 0.8:
            mask = self.bool_(rng.randint(1, 4), mask=True)
        if shape > 0.35 or mask is None:
            self.score_ctx = True
            score = self.float_(rng.randint(1, 4)) if rng.random() < 0.93 else self.int_(rng.randint(1, 2))
            self.score_ctx = False
        dropout = rng.random() < 0.1
        self.extras = [rng.choice(("scale = 1 / sqrt(head_dim)", "scale = 0.3", "scale = 2 / head_dim"))
                       if rng.random() < 0.2 else None]
        self.extras += [x for x, pr in (("dtype fp32, bf16", 0.15), ("head_dim 8, 16, 24, 40", 0.1))
                        if rng.random() < pr]
        self.extras[0:1] = [x for x in self.extras[0:1] if x]
        return Fuzzed(self.seed, name, self._text(name, mask, score, dropout, False),
                      self._text(name, mask, score, dropout, True), list(self.params), score is not None, dropout)

    def _text(self, name: str, mask, score, dropout: bool, full: bool) -> str:
        rng = random.Random(self.seed * 7 + full)  # layout only: the same for every run of a seed
        lines = []
        for p in self.params:
            if p.kind != "tensor":
                lines.append(f"param {p.name}: {p.kind}")
                continue
            dims = []
            for what, value, broadcast in p.dims:
                if what == "lit":
                    t = str(value)
                elif what == "pexpr":
                    t = show(self._pexpr(*value), full)[0]
                else:
                    t = {"batch": "batch", "heads": "heads"}.get(what, what)
                dims.append(t + ("|1" if broadcast else ""))
            lines.append(f"param {p.name}: {p.dtype}[{', '.join(dims)}]")
        lines += self.extras[:1]
        if mask is not None:
            lines.append("mask = " + show(mask, full)[0])
        if score is not None:
            lines.append("score = " + show(score, full)[0])
        if dropout:
            lines.append("dropout")
        lines += self.extras[1:]
        tail = lines[len(self.params):]
        rng.shuffle(tail)  # statements after the params in any order
        lines = lines[:len(self.params)] + tail
        out = [f"# fuzzed spec, seed {self.seed}", f"attention {name} {{"]
        for line in lines:
            sep = rng.choice(("\n", "\n", "; ", "  # note\n", "\n\n"))
            out.append("    " + line + sep)
        return "".join(out[:1]) + "\n" + out[1] + "\n" + "".join(out[2:]) + "}\n"


def generate(seed: int) -> Fuzzed:
    """The spec drawn by ``seed`` (deterministic)."""
    return _Gen(seed).spec()
