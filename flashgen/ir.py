"""The intermediate representation: frozen dataclasses with source spans.

Spans are excluded from equality and from the fingerprint, so reformatting a spec or editing
its comments changes neither (the cache key is built from the fingerprint).
"""

from __future__ import annotations

import enum
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
    """The masks this version lowers (more arrive as mask expressions)."""

    NONE = "none"
    CAUSAL = "causal"  # bottom-right aligned: kv <= q + seqlen_k - seqlen_q
    CAUSAL_TOP_LEFT = "causal_top_left"  # kv <= q


class DType(enum.Enum):
    FP16 = "fp16"
    BF16 = "bf16"
    FP32 = "fp32"


@dataclass(frozen=True)
class Spec:
    """A validated attention variant.

    ``head_dims`` / ``dtypes`` are None when the spec does not restrict them. ``scale`` is None
    for the default 1/sqrt(head_dim).
    """

    name: str
    mask: MaskKind = MaskKind.NONE
    scale: Expr | None = None
    head_dims: tuple[int, ...] | None = None
    dtypes: tuple[DType, ...] | None = None
    span: Span | None = _span()
    mask_span: Span | None = _span()

    def fingerprint(self) -> str:
        """sha256 (hex) of the canonical dump; independent of formatting, comments and spans."""
        return hashlib.sha256(canonical_json(self).encode()).hexdigest()


def canonical(node):
    """A JSON-able canonical form of an IR node, spans dropped (fields with compare=False)."""
    if is_dataclass(node):
        out = {"node": type(node).__name__}
        for f in fields(node):
            if f.compare:
                out[f.name] = canonical(getattr(node, f.name))
        return out
    if isinstance(node, enum.Enum):
        return node.value
    if isinstance(node, tuple | list):
        return [canonical(x) for x in node]
    return node


def canonical_json(node) -> str:
    return json.dumps(canonical(node), sort_keys=True, separators=(",", ":"))
