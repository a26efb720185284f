"""IR → C++ sources: lower a spec to hook bodies, render the Jinja2 templates strictly.

The kernel skeletons are hand-written headers (templates/include/flashgen/{cpu,cuda}); a spec
only becomes a small ``Variant`` struct (templates/variant.h.jinja) spliced into one translation
unit per instantiation (templates/cpu_fwd.cpp.jinja, templates/cuda_fwd.cu.jinja).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from . import expr, ir, keyrange
from .version import __version__
from .paths import templates_dir

# Element type spelled per family (tables, not if-chains).
CPU_ELEMENT = {ir.DType.FP32: "float", ir.DType.BF16: "c10::BFloat16", ir.DType.FP16: "c10::Half"}
CUDA_ELEMENT = {ir.DType.BF16: "__nv_bfloat16", ir.DType.FP16: "__half"}


# C++ element type of a tensor parameter (bool is read as one byte, torch's layout).
PARAM_CTYPE = {"f32": "float", "i32": "int32_t", "i64": "int64_t", "bool": "uint8_t"}


@dataclass(frozen=True)
class Field:
    """One member of a variant's Params struct (mirrored by ops.py with ctypes)."""

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


@functools.cache
def environment():
    """The one Jinja2 environment: strict undefined names, block whitespace trimmed."""
    import jinja2  # imported on first render only: a cached load never renders

    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir())),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )


def render(template: str, **context) -> str:
    """Render one template strictly; an undefined name raises, naming template and line."""
    import jinja2  # lazily, as in environment()

    try:
        return environment().get_template(template).render(**context)
    except jinja2.TemplateError as e:
        where = f"{getattr(e, 'filename', None) or template}:{getattr(e, 'lineno', '?')}"
        raise RuntimeError(f"template error in {where}: {e}") from e


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


def render_instantiation(spec: ir.Spec, backend: str, kind: str, dtype: ir.DType, head_dim: int | None,
                         symbol: str, config: dict) -> str:
    """One translation unit ('fwd' or 'bwd') of an instantiation: header comment, variant struct,
    entry points."""
    ctx = variant_context(spec) | {
        "symbol": symbol,
        "kind": kind,
        "dtype": dtype.value,
        "head_dim": head_dim,
        "config": config,
    }
    if backend == "cpu":
        return render(f"cpu_{kind}.cpp.jinja", element=CPU_ELEMENT[dtype], **ctx)
    return render(f"cuda_{kind}.cu.jinja", element=CUDA_ELEMENT[dtype], **ctx)
