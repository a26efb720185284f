"""IR → the spec's C++ variant: the Params struct's fields and every hook's body.

What ``templates/variant.h.jinja`` is rendered from (``variant_context``), and the Params layout
the runtime mirrors with ctypes (flashgen/runtime/launch.py). The hook expressions are emitted by
flashgen/lang/expr.py (``Cxx``) and the key-range bounds by flashgen/lang/keyrange.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..lang import expr, ir, keyrange
from ..version import __version__

# C++ element type of a tensor parameter (bool is read as one byte, torch's layout).
PARAM_CTYPE = {"f32": "float", "i32": "int32_t", "i64": "int64_t", "bool": "uint8_t"}


@dataclass(frozen=True)
class Field:
    """One member of a variant's Params struct (mirrored by flashgen/runtime/launch.py with ctypes)."""

    name: str
    ctype: str  # 'int64', 'float', 'ptr', 'gradptr', 'int64[N]'
    cxx: str  # the C++ declaration


def param_fields(spec: ir.Spec) -> list[Field]:
    """The Params struct of a spec, in order: per parameter, a scalar (int64_t / float), or for a
    tensor its element pointer, sizes, strides (in elements) and, when its gradient can be asked
    for, an fp32 gradient pointer (contiguous, the parameter's own shape; null when not needed)."""
    grads = {p.name for p in expr.grad_params(spec)}
    out = []
    for p in spec.params:
        if p.kind == "int":
            out.append(Field(p.name, "int64", f"int64_t {p.name};"))
        elif p.kind == "float":
            out.append(Field(p.name, "float", f"float {p.name};"))
        else:
            n = len(p.shape)
            out.append(Field(p.name, "ptr", f"const {PARAM_CTYPE[p.dtype]}* {p.name};"))
            out.append(Field(f"{p.name}_size", f"int64[{n}]", f"int64_t {p.name}_size[{n}];"))
            out.append(Field(f"{p.name}_stride", f"int64[{n}]", f"int64_t {p.name}_stride[{n}];"))
            if p.name in grads:
                out.append(Field(f"{p.name}_grad", "gradptr", f"float* {p.name}_grad;"))
    return out


def mask_without_row_range(spec: ir.Spec) -> bool:
    """Whether ``spec`` has a mask whose kept keys per query row have no closed-form range (e.g.
    document ids): the CUDA families then classify tiles per call (block lists) instead of
    bounding each row's keys, and the sm90 family defers its deterministic backward."""
    return spec.mask is not None and not keyrange.key_range(spec).exact


def hook_bodies(spec: ir.Spec) -> dict[str, str]:
    """C++ return expressions / statements of every hook (see include/flashgen/variant.h)."""
    cx = expr.Cxx(spec)
    rng = keyrange.key_range(spec)
    out = {
        "has_mask": spec.mask is not None,
        "has_score_mod": spec.score is not None,
        "has_param_grad": bool(expr.grad_params(spec)),
        "has_dropout": spec.dropout,
        "kv_lo": f"fg_clamp_kv({keyrange.tile_bound_cxx(spec, rng.lo, 'lo')}, seqlen_k)" if rng.lo else "0",
        "kv_hi": f"fg_clamp_kv({keyrange.tile_bound_cxx(spec, rng.hi, 'hi')}, seqlen_k)" if rng.hi else "seqlen_k",
        "tile_full": rng.full,
        "row_exact": rng.exact,
        "keep": cx(spec.mask) if spec.mask is not None else "true",
        "score": cx(spec.score, expr.FLOAT) if spec.score is not None else "s",
        "dscore": "1.f",
        "param_grad": [],
    }
    if spec.score is not None:
        scope = cx.scope
        d = expr.diff(spec.score, lambda n: n == ir.Name("score"), scope)
        out["dscore"] = cx(d, expr.FLOAT) if d is not None else "0.f"
        for p in expr.grad_params(spec):
            stmts = []
            for read in expr.param_reads(spec, p):
                d = expr.diff(spec.score, lambda n, r=read: n == r, scope)
                if d is None:
                    continue
                _, flat = cx.index_code(read)
                stmts.append(f"fg_atomic_add(p.{p.name}_grad + ({flat}), ds * ({cx(d, expr.FLOAT)}));")
            if stmts:
                out["param_grad"].append((f"p.{p.name}_grad", stmts))
    out["param_grad_enabled"] = " || ".join(f"{ptr} != nullptr" for ptr, _ in out["param_grad"]) or "false"
    return out


def variant_context(spec: ir.Spec) -> dict:
    """What variant.h.jinja needs: the spec's name, where mask/score came from, the hook bodies."""

    def origin(span):
        return f"{span.file}:{span.line}" if span else "not set"

    return {
        "spec": spec,
        "struct": f"Variant_{spec.name}",
        "mask_origin": origin(spec.mask_span),
        "score_origin": origin(spec.score_span),
        "fields": param_fields(spec),
        "hooks": hook_bodies(spec),
        "fingerprint": spec.fingerprint()[:12],
        "version": __version__,
    }
