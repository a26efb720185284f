"""IR → C++ sources: lower a spec to hook bodies, render the Jinja2 templates strictly.

The kernel skeletons are hand-written headers (templates/include/flashgen/{cpu,cuda}); a spec
only becomes a small ``Variant`` struct (templates/variant.h.jinja) spliced into one translation
unit per instantiation (templates/cpu_fwd.cpp.jinja, templates/cuda_fwd.cu.jinja).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from . import __version__, ir
from .paths import templates_dir

# Element type spelled per family (tables, not if-chains).
CPU_ELEMENT = {ir.DType.FP32: "float", ir.DType.BF16: "c10::BFloat16", ir.DType.FP16: "c10::Half"}
CUDA_ELEMENT = {ir.DType.BF16: "__nv_bfloat16", ir.DType.FP16: "__half"}


@dataclass(frozen=True)
class MaskHooks:
    """C++ bodies of the variant hooks for one mask (see templates/include/flashgen/variant.h)."""

    has_mask: bool
    kv_lo: str
    kv_hi: str
    tile_full: str
    keep: str


# Closed forms per structured mask: key range of a query tile, fully-kept test, element test.
MASK_HOOKS = {
    ir.MaskKind.NONE: MaskHooks(
        has_mask=False, kv_lo="0", kv_hi="seqlen_k", tile_full="true", keep="true"),
    ir.MaskKind.CAUSAL: MaskHooks(
        has_mask=True, kv_lo="0", kv_hi="q_hi + (seqlen_k - seqlen_q)",
        tile_full="kv_hi - 1 <= q_lo + (seqlen_k - seqlen_q)", keep="kv <= q + (seqlen_k - seqlen_q)"),
    ir.MaskKind.CAUSAL_TOP_LEFT: MaskHooks(
        has_mask=True, kv_lo="0", kv_hi="q_hi", tile_full="kv_hi - 1 <= q_lo", keep="kv <= q"),
}  # fmt: skip


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
    import jinja2

    try:
        return environment().get_template(template).render(**context)
    except jinja2.TemplateError as e:
        where = f"{getattr(e, 'filename', None) or template}:{getattr(e, 'lineno', '?')}"
        raise RuntimeError(f"template error in {where}: {e}") from e


def variant_context(spec: ir.Spec) -> dict:
    """What variant.h.jinja needs: the spec's name, where its mask came from, the hook bodies."""
    span = spec.mask_span
    return {
        "spec": spec,
        "struct": f"Variant_{spec.name}",
        "mask": spec.mask.value,
        "mask_origin": f"{span.file}:{span.line}" if span else "default (no mask line)",
        "hooks": MASK_HOOKS[spec.mask],
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
