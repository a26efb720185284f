"""The intermediate representation: frozen dataclasses with source spans.

Spans are excluded from equality and from the fingerprint, so reformatting a spec or editing
its comments changes neither (the cache key is built from the fingerprint).
"""

from __future__ import annotations

import enum
import functools
import hashlib
import json
from dataclasses import dataclass, field, fields, is_dataclass


@dataclass(frozen=True)
class Span:
    """Where a node came from: 1-based line and column in ``file``."""

    file: str
    line: int
    column: int


def _span() -> Span | None:
    return field(default=None, compare=False, repr=False)


# ---------------------------------------------------------------- expressions


@dataclass(frozen=True)
class Num:
    value: float | int
    span: Span | None = _span()


@dataclass(frozen=True)
class Name:
    id: str
    span: Span | None = _span()


@dataclass(frozen=True)
class Unary:
    op: str  # '-' or 'not'
    operand: Expr
    span: Span | None = _span()


@dataclass(frozen=True)
class BinOp:
    op: str  # + - * / % < <= > >= == != and or
    lhs: Expr
    rhs: Expr
    span: Span | None = _span()


@dataclass(frozen=True)
class Call:
    fn: str
    args: tuple[Expr, ...]
    span: Span | None = _span()


@dataclass(frozen=True)
class Index:
    base: Expr
    indices: tuple[Expr, ...]
    span: Span | None = _span()


Expr = Num | Name | Unary | BinOp | Call | Index


# ---------------------------------------------------------------- spec


class MaskKind(enum.Enum):
    """The structured masks that peers express natively (SDPA's is_causal), recognised in a
    spec's mask expression; anything else is ``OTHER``."""

    NONE = "none"
    CAUSAL = "causal"  # bottom-right aligned: kv <= q + seqlen_k - seqlen_q
    CAUSAL_TOP_LEFT = "causal_top_left"  # kv <= q
    OTHER = "other"


class DType(enum.Enum):
    FP16 = "fp16"
    BF16 = "bf16"
    FP32 = "fp32"


# Element types a tensor parameter may declare; the value is the expression type it reads as.
TENSOR_DTYPES = {"f32": "float", "i32": "int", "i64": "int", "bool": "bool"}
SCALAR_KINDS = ("int", "float")


@dataclass(frozen=True)
class Dim:
    """One dimension of a tensor parameter: an integer expression over batch, heads (query
    heads), seqlen_q, seqlen_k, integer literals and integer scalar parameters. ``broadcast``:
    declared ``dim|1``, so a size of 1 is accepted too (broadcast over that dimension)."""

    size: Expr
    broadcast: bool = False
    span: Span | None = _span()


@dataclass(frozen=True)
class Param:
    """A call-time parameter: ``kind`` 'int' or 'float' (a scalar kernel argument), or 'tensor'
    with ``dtype`` one of TENSOR_DTYPES and a ``shape``."""

    name: str
    kind: str
    dtype: str | None = None
    shape: tuple[Dim, ...] = ()
    span: Span | None = _span()

    @property
    def is_tensor(self) -> bool:
        return self.kind == "tensor"


def _causal(top_left: bool = False) -> Expr:
    rhs = Name("q") if top_left else BinOp("+", Name("q"), BinOp("-", Name("seqlen_k"), Name("seqlen_q")))
    return BinOp("<=", Name("kv"), rhs)


@dataclass(frozen=True)
class Spec:
    """A validated attention variant.

    ``mask`` is a bool expression over b, h, q, kv, seqlen_q, seqlen_k and parameters (built-ins
    already expanded), None for no mask; ``score`` a float expression over ``score`` (the scaled
    score) and the same names, None for the identity. ``head_dims`` / ``dtypes`` are None when the
    spec does not restrict them. ``scale`` is None for the default 1/sqrt(head_dim).
    ``dropout``: the spec declares ``dropout``, so the op accepts ``dropout_p`` (the kernels
    apply the keep mask to P after the softmax statistics; FlashAttention, Alg. 2 and 4).
    """

    name: str
    mask: Expr | None = None
    score: Expr | None = None
    params: tuple[Param, ...] = ()
    scale: Expr | None = None
    head_dims: tuple[int, ...] | None = None
    dtypes: tuple[DType, ...] | None = None
    dropout: bool = False
    # Int parameters a built-in needs to be ≥ 1 (chunked(n)): the op, the reference and explain
    # raise for a smaller value, and the key range relies on it. Left out of the canonical form
    # when empty, so specs without one keep their fingerprints.
    positive: tuple[str, ...] = field(default=(), metadata={"canonical_omit_empty": True})
    span: Span | None = _span()
    mask_span: Span | None = _span()
    score_span: Span | None = _span()

    def fingerprint(self) -> str:
        """sha256 (hex) of the canonical dump; independent of formatting, comments and spans.
        Computed once per Spec object (it is immutable; the dump costs ~0.5 ms, and a block mask
        binds to it at every build)."""
        return self._fingerprint

    @functools.cached_property
    def _fingerprint(self) -> str:  # cached_property writes the instance dict: fine on a frozen dataclass
        return hashlib.sha256(canonical_json(self).encode()).hexdigest()

    @property
    def mask_kind(self) -> MaskKind:
        if self.mask is None:
            return MaskKind.NONE
        if self.mask == _causal():
            return MaskKind.CAUSAL
        if self.mask == _causal(top_left=True):
            return MaskKind.CAUSAL_TOP_LEFT
        return MaskKind.OTHER

    def param(self, name: str) -> Param | None:
        return next((p for p in self.params if p.name == name), None)


def canonical(node):
    """A JSON-able canonical form of an IR node, spans dropped (fields with compare=False)."""
    if is_dataclass(node):
        out = {"node": type(node).__name__}
        for f in fields(node):
            value = getattr(node, f.name)
            if f.compare and not (f.metadata.get("canonical_omit_empty") and not value):
                out[f.name] = canonical(value)
        return out
    if isinstance(node, enum.Enum):
        return node.value
    if isinstance(node, tuple | list):
        return [canonical(x) for x in node]
    return node


def canonical_json(node) -> str:
    return json.dumps(canonical(node), sort_keys=True, separators=(",", ":"))
